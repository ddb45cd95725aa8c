"""ShardwiseFabricStrategy: a Lightning Fabric training loop on a shardwise engine.

In the shape of Fabric's DeepSpeedStrategy: a DeepSpeed config (dict or JSON path, or
`stage=`), the names "shardwise" and "shardwise_stage_1/2/3" for `Fabric(strategy=...)`,
`fabric.setup(model, optimizer)` returning the engine in Fabric's wrappers, and
`fabric.save`/`fabric.load` writing a folder whose model and optimizer are the engine's
checkpoint (each rank its shard).

Why the loop written for Fabric's DDP strategy runs unchanged: the engine is built with
`gradient_accumulation_steps` 1, so every `optimizer.step()` is an update and the loss is
divided by nothing; the loop accumulates as under DDP (backward several times, divide the
loss itself, step at the window's end), and `fabric.no_backward_sync` maps to the engine's
`no_sync` at stages 0-1 (stages 2-3 reduce every backward into their partition, where the
micro-batches add up just the same). The learning-rate scheduler stays the loop's: the
engine keeps training the caller's optimizer object (re-pointed at its partition), so a
scheduler built on it schedules the engine.
"""

from __future__ import annotations

from shardwise.frontends.lightning.versions import check_fabric_versions

check_fabric_versions()

import os  # noqa: E402
from contextlib import AbstractContextManager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from lightning.fabric.plugins.precision import Precision  # noqa: E402
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy  # noqa: E402
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading  # noqa: E402
from lightning.fabric.utilities.cloud_io import _load as load_file  # noqa: E402
from lightning.fabric.utilities.types import _PATH, _Stateful  # noqa: E402
from torch.nn import Module  # noqa: E402
from torch.optim import Optimizer  # noqa: E402

from shardwise.frontends.deepspeed.api import initialize  # noqa: E402
from shardwise.frontends.lightning.config import register_shortcuts, strategy_config  # noqa: E402
from shardwise.runtime.engine import Engine  # noqa: E402

CHECKPOINT_TAG = "checkpoint"
FABRIC_STATE = "fabric_state.pt"  # the loop's own state (counters, schedulers, ...), rank 0


class ShardwiseFabricStrategy(DDPStrategy):
    """`Fabric(strategy=ShardwiseFabricStrategy(config=...))`, or `strategy="shardwise_stage_3"`.

    `config`: a DeepSpeed config dict or the path of its JSON file (default: ZeRO at
    `stage`, nothing else); `stage` (1-3) overrides the config's ZeRO stage. Gradient
    clipping is the config's `gradient_clipping` (the engine clips the partitioned
    gradient in `optimizer.step()`). The other keyword arguments are Fabric's DDPStrategy's.
    """

    def __init__(self, config: dict | str | os.PathLike | None = None, *, stage: int | None = None,
                 **ddp_arguments: Any):
        super().__init__(**ddp_arguments)
        self.config = strategy_config(config, stage, "ShardwiseFabricStrategy")
        steps = self.config.get("gradient_accumulation_steps", 1)
        if steps != 1:
            raise ValueError(
                f"ShardwiseFabricStrategy: gradient_accumulation_steps {steps!r} in the config; accumulate in the "
                "loop as under DDP (backward per micro-batch inside fabric.no_backward_sync, optimizer.step() at "
                "the window's end, the loss divided by the window's length) and leave the key out")
        self._backward_sync_control = _EngineBackwardSync()
        self._engines: dict[int, Engine] = {}  # id(optimizer) -> the engine it updates

    # -- setup: the engine in place of DDP -------------------------------------------------
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Engine, list[Optimizer], Any]:
        """One engine per model, trained by the one optimizer given; the scheduler is
        returned as it came (the loop steps it, as under DDP)."""
        if len(optimizers) != 1:
            raise ValueError(f"ShardwiseFabricStrategy: fabric.setup takes one optimizer per model (got "
                             f"{len(optimizers)}); the engine updates the model with one optimizer")
        engine, optimizer = self._initialize(module, optimizers[0])
        self._engines[id(optimizer)] = engine
        return engine, [optimizer], scheduler

    def setup_module(self, module: Module) -> Engine:
        """A model set up without an optimizer: a forward-only engine (its weights sharded
        as the config says), as Fabric's DeepSpeedStrategy makes for inference."""
        engine, _ = self._initialize(module, None)
        return engine

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise RuntimeError("ShardwiseFabricStrategy: set up the model and its optimizer together, "
                           "fabric.setup(model, optimizer): the engine partitions the optimizer with the model")

    def _initialize(self, module: Module, optimizer: Optimizer | None) -> tuple[Engine, Optimizer | None]:
        if type(self.precision) is not Precision:
            raise ValueError(f"ShardwiseFabricStrategy: Fabric(precision=...) gives {type(self.precision).__name__}; "
                             "leave Fabric's precision at its default (32-true) and set the config's bf16 or fp16 "
                             "block: the engine casts, keeps the fp32 master weights and scales the loss")
        config = dict(self.config, gradient_accumulation_steps=1)
        if "train_batch_size" not in config:
            config.setdefault("train_micro_batch_size_per_gpu", 1)  # as Fabric's DeepSpeedStrategy: only reported
        engine, optimizer, _, _ = initialize(model=module, optimizer=optimizer, config=config)
        return engine, optimizer

    def module_to_device(self, module: Module) -> None:
        """The engine places the module's partitions when it is built."""

    # -- the training step ----------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: Module | None, *args: Any, retain_graph: bool = False,
                 **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError("ShardwiseFabricStrategy: fabric.backward(loss) takes only retain_graph (the engine runs "
                            "the backward of a scalar loss; gradient inputs are not supported)")
        self._training_engine(module).backward(tensor, retain_graph=retain_graph)

    def _training_engine(self, module: Module | None) -> Engine:
        if isinstance(module, Engine):
            return module
        engines = set(map(id, self._engines.values()))
        if len(engines) != 1:
            raise RuntimeError(f"ShardwiseFabricStrategy: {len(engines)} models were set up with an optimizer; "
                               "name the one this loss trains: fabric.backward(loss, model=model)")
        return next(iter(self._engines.values()))

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError("ShardwiseFabricStrategy: optimizer.step() takes no closure; the engine steps once "
                            "after the backward passes")
        engine = self._engines.get(id(optimizer))
        if engine is None:
            raise RuntimeError("ShardwiseFabricStrategy: this optimizer was not set up with a model through "
                               "fabric.setup(model, optimizer)")
        engine.step()

    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        raise RuntimeError(_CLIPPING_IN_CONFIG)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise RuntimeError(_CLIPPING_IN_CONFIG)

    # -- checkpoints through the engine -----------------------------------------------------
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """`path` becomes a folder: the engine's checkpoint (model and optimizer, tag
        "checkpoint", each rank its shard) and, from rank 0, the rest of `state` beside it."""
        if storage_options is not None or filter is not None:
            raise TypeError("ShardwiseFabricStrategy: fabric.save(storage_options=... / filter=...) is not "
                            "supported; the engine writes the model and optimizer itself, whole")
        engine, engine_keys = self._engine_in(state, "save")
        path = Path(self.broadcast(str(path)))
        rest = {key: value for key, value in state.items() if key not in engine_keys}
        engine.save_checkpoint(path, tag=CHECKPOINT_TAG)
        if self.is_global_zero:
            torch.save(self._convert_stateful_objects_in_state(rest, filter={}), path / FABRIC_STATE)
        self.barrier("ShardwiseFabricStrategy.save_checkpoint")

    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restores the engine (and its optimizer, when `state` holds it) from the engine's
        checkpoint and the rest of `state` in place; returns what `state` did not ask for."""
        if not isinstance(state, dict) or not state:
            raise ValueError("ShardwiseFabricStrategy: fabric.load(path, state) needs the state to restore into, "
                             "holding the model set up by fabric.setup: fabric.load(path, {'model': model, ...})")
        path = Path(path)
        if not (path / FABRIC_STATE).is_file():
            raise FileNotFoundError(f"{path} is not a ShardwiseFabricStrategy checkpoint (no {FABRIC_STATE} in it); "
                                    "load a folder that fabric.save wrote under this strategy")
        engine, engine_keys = self._engine_in(state, "load")
        with_optimizer = any(state[key] is not engine for key in engine_keys)
        engine.load_checkpoint(path, tag=CHECKPOINT_TAG, load_optimizer_states=with_optimizer,
                               load_lr_scheduler_states=False, load_module_strict=strict)
        checkpoint = load_file(path / FABRIC_STATE, weights_only=False if weights_only is None else weights_only)
        wanted = [key for key in state if key not in engine_keys]
        _validate_keys_for_strict_loading(wanted, checkpoint.keys(), strict=strict)
        for key in wanted:
            if key not in checkpoint:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    def _engine_in(self, state: dict[str, Any], call: str) -> tuple[Engine, set[str]]:
        """The one engine in `state` and the keys it saves itself (its own and its optimizer's)."""
        engines = {key: value for key, value in state.items() if isinstance(value, Engine)}
        if len(engines) != 1:
            raise ValueError(f"ShardwiseFabricStrategy: fabric.{call} needs exactly one model set up by fabric.setup "
                             f"in the state (found {len(engines)}: {sorted(engines)}); save each model to its own path")
        (key, engine), = engines.items()
        optimizer = engine.optimizer.optimizer if engine.optimizer is not None else None
        keys = {key} | {name for name, value in state.items() if optimizer is not None and value is optimizer}
        return engine, keys

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_shortcuts(strategy_registry, cls)


class _EngineBackwardSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the engine's `no_sync` where it keeps whole
    gradients (stages 0-1); stages 2-3 must reduce every backward into their partition,
    which gives the same sum, so there it changes nothing."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not isinstance(module, Engine):
            raise TypeError(f"ShardwiseFabricStrategy: fabric.no_backward_sync needs a model set up by fabric.setup "
                            f"(got {type(module).__name__})")
        if enabled and module.policies.zero.keeps_full_gradients:
            return module.no_sync()
        return nullcontext()


_CLIPPING_IN_CONFIG = ("ShardwiseFabricStrategy: fabric.clip_gradients is not supported; the engine clips the "
                       "partitioned gradient by its global norm inside optimizer.step(): set `gradient_clipping` "
                       "(the max norm) in the config instead")


if "shardwise" not in STRATEGY_REGISTRY:
    ShardwiseFabricStrategy.register_strategies(STRATEGY_REGISTRY)
