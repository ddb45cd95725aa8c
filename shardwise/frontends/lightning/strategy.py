"""ShardwiseStrategy: Lightning's Trainer trains a LightningModule on a shardwise engine.

In the shape of Lightning's DeepSpeedStrategy: a DeepSpeed config (dict or JSON path, or
`stage=`), the names "shardwise" and "shardwise_stage_1/2/3" for `Trainer(strategy=...)`,
and checkpoints written by the engine (one folder per checkpoint, each rank its shard).
The engine is built by shardwise's DeepSpeed-compatible `initialize` from the module's
`configure_optimizers`, with the config's `gradient_accumulation_steps` and
`gradient_clipping` taken from the Trainer (`accumulate_grad_batches`,
`gradient_clip_val`), so a LightningModule written for DDP trains unchanged.

Why the loss is multiplied back by `accumulate_grad_batches` before the engine's
backward: Lightning's loop divides each micro-batch's loss by it, and the engine divides
again (as DeepSpeed does, so Lightning's DeepSpeedStrategy scales gradients by
1/accumulation twice); undoing Lightning's division makes the update equal DDP's.
"""

from __future__ import annotations

from shardwise.frontends.lightning.versions import check_versions

check_versions()

import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Mapping  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.cloud_io import _load as load_file  # noqa: E402
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from shardwise.frontends.deepspeed.api import initialize  # noqa: E402
from shardwise.frontends.lightning.config import register_shortcuts, strategy_config  # noqa: E402

CHECKPOINT_TAG = "checkpoint"
LIGHTNING_STATE = "lightning_state.pt"  # the Trainer's own state (loops, callbacks, hyperparameters), rank 0


class ShardwiseStrategy(DDPStrategy):
    """`Trainer(strategy=ShardwiseStrategy(config=...))`, or `strategy="shardwise_stage_3"`.

    `config`: a DeepSpeed config dict or the path of its JSON file (default: ZeRO at
    `stage`, nothing else); `stage` (1-3) overrides the config's ZeRO stage. The other
    keyword arguments are DDPStrategy's (process group backend, timeout, ...).
    """

    strategy_name = "shardwise"

    def __init__(self, config: dict | str | os.PathLike | None = None, *, stage: int | None = None,
                 **ddp_arguments: Any):
        super().__init__(**ddp_arguments)
        self.config = strategy_config(config, stage, "ShardwiseStrategy")

    # -- setup: the engine in place of DDP -------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "ShardwiseStrategy supports automatic optimization only: with manual optimization the module "
                "calls backward and step itself, which the engine must do; set automatic_optimization = True")
        if trainer.gradient_clip_algorithm == "value":
            raise MisconfigurationException("ShardwiseStrategy clips gradients by norm only (the engine clips the "
                                            "whole partitioned gradient); use gradient_clip_algorithm='norm'")
        self.optimizers, self.lr_scheduler_configs = [], []
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer)
        self.barrier()

    def _build_engine(self, trainer: pl.Trainer) -> None:
        config = dict(self.config)
        for key in ("gradient_accumulation_steps", "train_batch_size"):
            if key in config:
                raise MisconfigurationException(
                    f"ShardwiseStrategy: leave `{key}` out of the config; it follows the Trainer's "
                    "accumulate_grad_batches (and the data loader's batch size)")
        config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        config.setdefault("train_micro_batch_size_per_gpu", self._micro_batch_size(trainer))
        config.setdefault("gradient_clipping", trainer.gradient_clip_val or 0.0)
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise MisconfigurationException("ShardwiseStrategy: configure_optimizers must return one optimizer and "
                                            f"at most one scheduler (got {len(optimizers)} and {len(schedulers)})")
        scheduler_config = schedulers[0] if schedulers else None
        engine, optimizer, _, _ = initialize(
            model=self.lightning_module, optimizer=optimizers[0], config=config,
            lr_scheduler=scheduler_config.scheduler if scheduler_config else None)
        if scheduler_config is not None:  # Lightning steps it, at its interval, as for DeepSpeed
            scheduler_config.scheduler = engine.lr_scheduler
            engine.lr_scheduler = None
            self.lr_scheduler_configs = [scheduler_config]
        self.model = engine
        self.optimizers = [optimizer]

    @staticmethod
    def _micro_batch_size(trainer: pl.Trainer) -> int:
        source = trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        return getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or 1

    @property
    def engine(self):
        return self.model

    @property
    def handles_gradient_accumulation(self) -> bool:
        """The engine counts micro-batches: Lightning calls optimizer_step after each."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into its own partitions

    def model_to_device(self) -> None:
        """The engine placed the module's partitions when it was built."""

    # -- the training step ----------------------------------------------------------------
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.backward(closure_loss * self.lightning_module.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Lightning ends an accumulation window at each epoch's last batch, short or not;
        # the engine must know before the backward (stages 0-1 reduce in the window's last)
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        self.engine.set_gradient_accumulation_boundary(
            loop._accumulated_batches_reached() or loop._num_ready_batches_reached())
        result = closure()  # training_step and backward
        if result is None:
            raise MisconfigurationException("ShardwiseStrategy: training_step returned None (skipping a batch); every "
                                            "rank must run backward on every micro-batch for the engine's collectives")
        self.engine.step()
        return result

    # -- checkpoints through the engine -----------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine writes the weights, each rank its partition

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # the engine writes the optimizer state

    def save_checkpoint(self, checkpoint: dict, filepath: str | os.PathLike, storage_options: Any = None) -> None:
        """`filepath` becomes a folder: the engine's checkpoint (tag "checkpoint") and, from
        rank 0, the Trainer's own state beside it."""
        if storage_options is not None:
            raise TypeError("ShardwiseStrategy: Trainer.save_checkpoint(storage_options=...) is not supported; the "
                            "engine writes the checkpoint itself")
        filepath = self.broadcast(str(filepath))
        trainer_state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG)
        if self.is_global_zero:
            torch.save(trainer_state, Path(filepath) / LIGHTNING_STATE)
        self.barrier("ShardwiseStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not (path / LIGHTNING_STATE).is_file():
            raise FileNotFoundError(f"{path} is not a ShardwiseStrategy checkpoint (no {LIGHTNING_STATE} in it); "
                                    "resume from a folder the strategy saved")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self.engine.load_checkpoint(path, tag=CHECKPOINT_TAG, load_optimizer_states=fitting,
                                    load_lr_scheduler_states=False)
        return load_file(path / LIGHTNING_STATE, weights_only=False)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The engine loaded the weights in load_checkpoint."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded the optimizer state in load_checkpoint."""

    @classmethod
    def register_strategies(cls, strategy_registry: dict) -> None:
        register_shortcuts(strategy_registry, cls)


if "shardwise" not in StrategyRegistry:
    ShardwiseStrategy.register_strategies(StrategyRegistry)
