"""`ShardwiseTrainer`: Hugging Face's `Trainer`, training through a shardwise engine (C27).

    from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer

    trainer = ShardwiseTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                               shardwise_config="ds_config.json")   # or TrainingArguments(deepspeed=...)
    trainer.train()

Everything else is the Trainer's own: its loop, logging, evaluation, callbacks, progress
bar, `save_strategy`, `resume_from_checkpoint`, `push_to_hub`. Only what DeepSpeed changes
in the Trainer is changed here, in the same places:

- the engine is built where the Trainer prepares the model (`_prepare_for_training`),
  with the Trainer's optimizer and scheduler unless the config has its own, and the
  config's "auto" entries filled from `TrainingArguments` (trainer_config.py);
- backward, clipping and the optimizer/scheduler steps go to the engine
  (trainer_engine.py); accelerate adds no autocast or grad scaler (the engine does fp16 /
  bf16 from the config);
- checkpoints: the engine's sharded checkpoint goes into each `checkpoint-N` folder
  beside the Trainer's files, and resuming loads it at any world size; `save_model`
  gathers ZeRO-3 shards into whole weights when
  `zero_optimization.stage3_gather_16bit_weights_on_model_save` is on (the default when
  it says "auto", as with DeepSpeed);
- evaluation runs through the engine, so ZeRO-3 gathers and dtype casts happen there too.
"""

from __future__ import annotations

from shardwise.frontends.hf_trainer.versions import check_versions

check_versions()

# Imported after the check, so that an unsupported release fails with its message, not inside transformers.
import logging
import os
from typing import Any

import torch
from transformers import Trainer

import shardwise
from shardwise.frontends.deepspeed.engine import ConfiguredEngine
from shardwise.frontends.hf_trainer.trainer_config import (
    auto_values,
    check_config,
    complete_batch_keys,
    read_config,
    trainer_values,
)
from shardwise.frontends.hf_trainer.trainer_engine import (
    EngineAccelerator,
    EngineOptimizer,
    EngineScheduler,
    EngineStepper,
    full_state_dict,
)

log = logging.getLogger("shardwise")

ENGINE_CHECKPOINT_MARK = "latest"  # the file engine.save_checkpoint writes beside its tags


class ShardwiseTrainer(Trainer):
    """`transformers.Trainer` with the same arguments, plus `shardwise_config`: a
    DeepSpeed-style config (dict or JSON path). Without it, `args.deepspeed` is used and
    taken off the arguments, so accelerate does not start DeepSpeed. After `train()`
    begins, `trainer.engine` is the shardwise engine (`memory_breakdown()`,
    `comm_volume()`)."""

    def __init__(self, model: Any = None, args: Any = None, *trainer_args: Any,
                 shardwise_config: dict | str | os.PathLike | None = None, **trainer_kwargs: Any):
        self._adopt_config(args, shardwise_config)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._check_setup()

    def _adopt_config(self, args: Any, shardwise_config: dict | str | os.PathLike | None) -> None:
        """Keep the config (`shardwise_config`, or `args.deepspeed` taken off `args`) for
        the engine; before the Trainer's own `__init__`, which builds the accelerator."""
        source = _take_deepspeed_config(args)
        if shardwise_config is not None and source is not None:
            raise ValueError("both shardwise_config and TrainingArguments.deepspeed are given; keep one of them")
        source = shardwise_config if shardwise_config is not None else source
        if source is None:
            raise ValueError(f"{type(self).__name__} needs a DeepSpeed-style config: pass shardwise_config= (a dict "
                             "or the path of a JSON file), or set TrainingArguments(deepspeed=...)")
        self.shardwise_config = complete_batch_keys(read_config(source))
        self.engine: ConfiguredEngine | None = None  # built when training starts (`_build_engine`)

    def _check_setup(self) -> None:
        """What can be refused before training starts, with the reason and the fix."""
        config, args = self.shardwise_config, self.args
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if args.world_size != processes:
            raise ValueError(
                f"this job has {processes} processes (WORLD_SIZE) but the Trainer sees {args.world_size}, so it "
                "would not split the data between them: on a machine without GPUs pass "
                "TrainingArguments(use_cpu=True), which is how accelerate runs several CPU processes")
        check_config(config, trainer_values(args))
        if args.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported by ShardwiseTrainer: it retries train() with "
                             "smaller batches on the same model, which the engine already owns; set "
                             "per_device_train_batch_size instead")
        if args.save_only_model and args.load_best_model_at_end:
            raise ValueError("save_only_model with load_best_model_at_end: the best model is reloaded from the "
                             "engine checkpoint, which save_only_model leaves out (DeepSpeed refuses this too)")
        for name, attribute in (("optimizer", self.optimizer), ("scheduler", self.lr_scheduler)):
            if attribute is not None and name in config:
                raise ValueError(f"an {name} was passed in Trainer(optimizers=...) and the config has an "
                                 f"'{name}' block; keep one of them")
        if "gradient_clipping" not in config and args.max_grad_norm > 0:
            log.warning("shardwise: the config has no gradient_clipping, so gradients are not clipped (as with "
                        "DeepSpeed) although TrainingArguments.max_grad_norm is %s; add \"gradient_clipping\": "
                        "\"auto\" to clip at max_grad_norm", args.max_grad_norm)

    # -- the accelerator -----------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """No autocast or grad scaler from accelerate: the engine trains in the config's
        dtype with fp32 master weights (and its own loss scaler for fp16)."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Same object and state, with backward / clipping / no_sync routed to the engine once it exists.
        self.accelerator.__class__ = EngineAccelerator

    # -- the engine ----------------------------------------------------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None):
        if self._created_lr_scheduler:  # made by an earlier train() for its own number of steps
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        engine = self._build_engine(max_steps)
        if resume_from_checkpoint is not None and _holds_engine_checkpoint(resume_from_checkpoint):
            engine.load_checkpoint(resume_from_checkpoint)
        for attribute in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attribute, getattr(self, attribute))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _build_engine(self, max_steps: int) -> ConfiguredEngine:
        if self.engine is not None:
            if self.engine.module is self.model:
                raise RuntimeError("train() was already called on this model, which the engine now owns; to train "
                                   "on, pass resume_from_checkpoint, or build a new ShardwiseTrainer")
            self.engine.destroy()  # model_init built a new model (hyper-parameter search)
        values = trainer_values(self.args, max_steps)
        config = self.shardwise_config
        check_config(config, values)
        optimizer = None if "optimizer" in config else self.create_optimizer()
        engine = shardwise.initialize(
            self.model, config, optimizer=optimizer,
            lr_scheduler=None if "scheduler" in config else self._scheduler_factory(max_steps),
            auto_values=auto_values(values),
        )
        stepper = EngineStepper(engine, caller_ends_windows=engine.policies.training.caller_ends_windows)
        self.engine = engine
        self.accelerator.stepper = stepper
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(stepper)
        self.model_wrapped = engine
        return engine

    def _scheduler_factory(self, max_steps: int):
        """The Trainer's scheduler (lr_scheduler_type, warm-up...), built on the optimizer
        the engine trains with, which exists only inside `initialize`."""

        def build(optimizer: torch.optim.Optimizer) -> Any:
            scheduler = self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError("lr_scheduler_type reduce_lr_on_plateau is not supported by ShardwiseTrainer: the "
                                 "engine steps its scheduler after every update, without metrics")
            return scheduler

        return build

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if self.engine is not None and model in (self.engine, self.engine.module):
            return self.engine
        return super()._wrap_model(model, training, dataloader)

    # -- saving and resuming -------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face weights (`from_pretrained`-ready). At ZeRO-3 they are gathered from
        the shards, module by module, when stage3_gather_16bit_weights_on_model_save is on;
        otherwise, as with DeepSpeed, a shardwise checkpoint is written instead."""
        engine = self.engine
        if engine is None or not engine.policies.zero.partitions_parameters:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if not engine.policies.zero.gather_16bit_weights_on_save:
            log.warning("shardwise: zero_optimization.stage3_gather_16bit_weights_on_model_save is off, so no "
                        "whole weights are written to %s; `shardwise convert %s OUT --hf` makes a Hugging Face "
                        "folder of its engine checkpoint", output_dir, output_dir)
            if not _internal_call:  # a checkpoint-N folder gets the engine checkpoint anyway
                engine.save_checkpoint(output_dir)
            return None
        self._save(output_dir, state_dict=full_state_dict(engine))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint: this rank's shards of weights and optimizer state, the
        scheduler, the loss scaler and the counters; reshardable to any world size."""
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Called before the engine exists; an engine checkpoint is loaded once it does
        (in `_prepare_for_training`), with its optimizer state. A folder without one
        (`save_only_model`) loads the Trainer's way: weights only."""
        if _holds_engine_checkpoint(resume_from_checkpoint):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        log.info("shardwise: loading the best checkpoint %s", self.state.best_model_checkpoint)
        self.engine.load_checkpoint(self.state.best_model_checkpoint)
        return None


def _holds_engine_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ENGINE_CHECKPOINT_MARK))


def _take_deepspeed_config(args: Any) -> Any:
    """`args.deepspeed`, removed from `args` with what TrainingArguments built for it (a
    DeepSpeed accelerate plugin and a device setup that started DeepSpeed), so that the
    Trainer's accelerator is a plain one. Such arguments exist only where DeepSpeed is
    installed: TrainingArguments imports it to read the config."""
    source = getattr(args, "deepspeed", None)
    if not source:
        return None
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    args.deepspeed = None
    args.deepspeed_plugin = None
    args.__dict__.pop("hf_deepspeed_config", None)
    unset_hf_deepspeed_config()
    args.__dict__.pop("_setup_devices", None)  # the cached device setup, which started DeepSpeed's process state
    args._setup_devices  # redone now, before the Trainer builds its accelerator on it
    return source
