"""`shardwise_trainer(TrainerClass)`: any `transformers.Trainer` subclass (TRL's
`SFTTrainer`, `DPOTrainer`, `RewardTrainer`, `GRPOTrainer`, ...) training through a
shardwise engine.

    from trl import DPOConfig, DPOTrainer
    from shardwise.frontends.trl.trainers import shardwise_trainer

    trainer = shardwise_trainer(DPOTrainer)(model=model, ref_model=ref_model, args=DPOConfig(...),
                                            train_dataset=pairs, processing_class=tokenizer,
                                            shardwise_config="ds_config.json")
    trainer.train()

The class made is `(ShardwiseTrainerMixin, TrainerClass)`, and
`ShardwiseTrainerMixin` is a `ShardwiseTrainer`: the
trainer's own `__init__`, data preparation, `compute_loss` and logging run unchanged, and
`ShardwiseTrainer` (shardwise/frontends/hf_trainer) sits between it and `Trainer`, so the
Trainer methods it replaces (model preparation, backward, checkpoints) are the engine's.
One factory rather than a class per trainer: a trainer TRL adds tomorrow gets the engine
the same way, and what differs between trainers is only which frozen models they keep
beside the trained one, which `ShardwiseTrainerMixin` handles by attribute name, and
whether they generate from the policy (GRPO), which TRL routes through one attribute,
`_dist` (generation.py).
"""

from __future__ import annotations

from shardwise.frontends.trl.versions import check_versions

check_versions()

# Imported after the check, so that an unsupported release fails with its message, not inside TRL.
import copy
import functools
import inspect
import os
from typing import Any

import torch
from transformers import Trainer
from trl.distributed import DistributedBackend

import shardwise
from shardwise.frontends.deepspeed.engine import ConfiguredEngine
from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer
from shardwise.frontends.hf_trainer.trainer_config import auto_values, trainer_values
from shardwise.frontends.trl.generation import EngineGenerationBackend
from shardwise.runtime.zero.external_parameters import register_external_parameters

# The frozen models TRL trainers keep beside the trained one, and prepare for DeepSpeed
# with `prepare_deepspeed` (DPOTrainer: ref_model; GRPOTrainer: ref_model when beta > 0).
FROZEN_MODELS = ("ref_model",)
# Arguments whose behaviour reads or writes the frozen models' whole weights outside a
# forward pass; with their parameters partitioned by ZeRO that would be wrong, not slow.
REFUSED_ARGUMENTS = {
    "sync_ref_model": "it copies the trained weights into the reference model with whole-tensor arithmetic, which "
                      "ZeRO-partitioned parameters do not allow; keep the reference fixed (sync_ref_model=False)",
    "use_vllm": "TRL copies the trained weights into vLLM through DeepSpeed's or FSDP's gather, which does not see "
                "shardwise's partitions; generate with the trained model itself (use_vllm=False)",
}
# TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head, used by GRPO and DPO)
# replaces the model's forward by one that projects through the output embedding's weight
# without calling the head module. It copies the model's forward's name (functools.wraps),
# so the code object says which function it is.
FUSED_HEAD_FORWARD = "add_fused_lm_head.<locals>._fused_forward"
# What an engine config that trains has and a forward-only one must not.
TRAINING_BLOCKS = ("optimizer", "scheduler")


class ShardwiseTrainerMixin(ShardwiseTrainer):
    """`ShardwiseTrainer` placed before a Trainer subclass in the bases (`shardwise_trainer`
    makes the class): the subclass's own `__init__` runs with its own parameter order, and
    every frozen model it keeps (`FROZEN_MODELS`) becomes a forward-only shardwise engine
    with the trained model's config, as TRL's `prepare_deepspeed` makes it a DeepSpeed
    engine: at ZeRO-3 its parameters are partitioned too and gathered layer by layer in
    each forward, so the reference costs 1/world of its weights."""

    def __init__(self, *args: Any, shardwise_config: dict | str | os.PathLike | None = None, **kwargs: Any):
        # TRL's trainers order their parameters differently from Trainer (DPOTrainer takes
        # ref_model second), so the trainer's own signature says which argument is `args`.
        trainer_init = super(ShardwiseTrainer, self).__init__
        training_args = inspect.signature(trainer_init).bind_partial(*args, **kwargs).arguments.get("args")
        for name, reason in REFUSED_ARGUMENTS.items():
            if getattr(training_args, name, False):
                raise ValueError(f"{name}=True is not supported by the shardwise TRL trainers: {reason}")
        self._adopt_config(training_args, shardwise_config)
        self._check_generation(training_args)
        trainer_init(*args, **kwargs)  # the TRL trainer's own __init__, then Trainer's
        self._check_setup()
        for name in FROZEN_MODELS:
            model = getattr(self, name, None)
            if isinstance(model, torch.nn.Module) and not isinstance(model, ConfiguredEngine):
                setattr(self, name, self._forward_only_engine(model))
        if isinstance(getattr(self, "_dist", None), DistributedBackend):  # a trainer that generates (GRPO)
            self._dist = EngineGenerationBackend(self)

    def _check_generation(self, training_args: Any) -> None:
        stage = self.shardwise_config.get("zero_optimization", {}).get("stage", 0)
        if stage == 3 and getattr(training_args, "ds3_gather_for_generation", True) is False:
            raise ValueError("ds3_gather_for_generation=False is not supported by the shardwise TRL trainers: "
                             "without the gather, every forward of generation gathers the layers again, a "
                             "collective that needs every rank to run the same number of forwards, while each "
                             "rank stops generating when its own sequences end; keep "
                             "ds3_gather_for_generation=True (the policy is gathered once per generation)")

    def _build_engine(self, max_steps: int) -> ConfiguredEngine:
        engine = super()._build_engine(max_steps)
        _gather_fused_head_in_forward(engine.module)
        return engine

    def _forward_only_engine(self, model: torch.nn.Module) -> ConfiguredEngine:
        config = {key: copy.deepcopy(value) for key, value in self.shardwise_config.items()
                  if key not in TRAINING_BLOCKS}
        model.requires_grad_(False)
        engine = shardwise.initialize(model, config, auto_values=auto_values(trainer_values(self.args)))
        engine.eval()
        _gather_fused_head_in_forward(engine.module)
        return engine


def _gather_fused_head_in_forward(model: torch.nn.Module) -> None:
    """At stage 3, TRL's fused LM head reads the output embedding's weight, which only the
    head's own forward would gather: gather it for the model's whole forward instead."""
    code = getattr(getattr(vars(model).get("forward"), "__func__", None), "__code__", None)
    if getattr(code, "co_qualname", None) == FUSED_HEAD_FORWARD and model.get_output_embeddings() is not None:
        register_external_parameters(model, model.get_output_embeddings().parameters())


@functools.cache
def shardwise_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a `transformers.Trainer` subclass) training through a shardwise
    engine: same arguments, plus `shardwise_config` (a DeepSpeed-style config, dict or JSON
    path), or the config given as `TrainingArguments(deepspeed=...)`. The same class is
    returned for the same `trainer_class`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"shardwise_trainer expects a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ShardwiseTrainer):
        raise TypeError(f"{trainer_class.__name__} already trains through shardwise; pass the trainer it was made from")
    return type(f"Shardwise{trainer_class.__name__}", (ShardwiseTrainerMixin, trainer_class),
                {"__module__": __name__, "__doc__": f"{trainer_class.__name__} on a shardwise engine "
                                                    "(made by shardwise_trainer)."})
