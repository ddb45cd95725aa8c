"""The pieces through which the Trainer's own loop drives a shardwise engine.

The Trainer runs, per micro-batch: forward, `accelerator.backward(loss)`, and at the end
of an accumulation window `clip_grad_norm_`, `optimizer.step()`, `lr_scheduler.step()`,
`model.zero_grad()`. A shardwise engine instead wants `engine.backward(loss)` then
`engine.step()` after every micro-batch, and clips, updates, steps its scheduler and
zeroes its gradients itself at the window's end. So, as accelerate does for DeepSpeed:

- `EngineAccelerator.backward` calls `engine.backward` and `engine.step`;
- `clip_grad_norm_` returns the norm the engine measured (it clips by `gradient_clipping`);
- `no_sync` does nothing: the engine already accumulates locally at stages 0-1 and must
  reduce-scatter every micro-batch at stages 2-3;
- `EngineOptimizer.step` and `EngineScheduler.step` do nothing; the scheduler reports the
  learning rate the last update used, which is what the Trainer logs.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from accelerate import Accelerator

from shardwise.runtime.engine_protocol import EngineProtocol
from shardwise.runtime.zero.gathered import gathered_parameters


class EngineStepper:
    """Turns the Trainer's one backward per micro-batch into the engine's backward + step."""

    def __init__(self, engine: EngineProtocol, *, caller_ends_windows: bool = False):
        """`caller_ends_windows`: the config's managed_gradient_accumulation false, where
        every `step()` ends the window, so only the Trainer's window ends get one."""
        self.engine = engine
        self.caller_ends_windows = caller_ends_windows
        self.lr_of_last_update: list[float] | None = None

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        """`loss` comes from the Trainer already scaled for accumulation (divided by the
        window's micro-batch count, or normalised by the window's token count), and the
        engine divides by `gradient_accumulation_steps` again: multiplying first leaves
        exactly the Trainer's scaling. `sync`: the Trainer ends a window here."""
        engine = self.engine
        steps = engine.gradient_accumulation_steps
        if self.caller_ends_windows:
            engine.backward(loss * steps)
            if sync:
                self.lr_of_last_update = engine.get_lr()
                engine.step()
            return
        boundary = engine.is_gradient_accumulation_boundary()
        if sync and not boundary:
            # The epoch's micro-batches do not divide by the accumulation: the Trainer
            # updates after a short last window, so the engine's window ends here too.
            engine.micro_steps += steps - 1 - engine.micro_steps % steps
        elif boundary and not sync:
            raise RuntimeError(
                f"the engine ends an accumulation window of {steps} micro-batches here but the Trainer does "
                "not: gradient_accumulation_steps must be the same in the config and TrainingArguments"
            )
        engine.backward(loss * steps)
        if sync:
            self.lr_of_last_update = engine.get_lr()
        engine.step()


class EngineAccelerator(Accelerator):
    """The Trainer's accelerator, once `stepper` is set: backward, clipping and `no_sync`
    go to the engine; data loaders, gathers for metrics and the rest stay accelerate's.
    Before the engine exists (evaluation before training) it is accelerate's own."""

    stepper: EngineStepper | None = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.stepper is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise TypeError(f"ShardwiseTrainer's backward takes no extra arguments (got {sorted(kwargs)}): "
                            "optimizers that need them (LOMO, AdaLomo) do not work with ZeRO partitions")
        self.stepper.backward(loss, self.sync_gradients)
        return None

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        if self.stepper is None:
            with super().no_sync(model):
                yield
            return
        yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self.stepper is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self.stepper.engine.last_grad_norm

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        if self.stepper is not None and model is self.stepper.engine:
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


class EngineOptimizer:
    """What the Trainer holds as its optimizer: the engine's torch optimizer (over this
    rank's partitions; attributes such as `param_groups` are its), with `step` and
    `zero_grad` left to the engine."""

    def __init__(self, engine: EngineProtocol):
        self.engine = engine

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine.optimizer.optimizer, name)


class EngineScheduler:
    """What the Trainer holds as its lr scheduler: the engine's (the Trainer's own, or the
    config's), stepped by the engine after each applied update."""

    def __init__(self, stepper: EngineStepper):
        self.stepper = stepper

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        """The rates of the last update, as a torch scheduler reports them between
        `optimizer.step()` and its own `step()` (where the Trainer asks)."""
        if self.stepper.lr_of_last_update is not None:
            return list(self.stepper.lr_of_last_update)
        return self.stepper.engine.get_lr()

    def __getattr__(self, name: str) -> Any:
        stepper = self.__dict__.get("stepper")
        if stepper is None or stepper.engine.lr_scheduler is None:
            raise AttributeError(name)
        return getattr(stepper.engine.lr_scheduler, name)


def full_state_dict(engine: EngineProtocol) -> dict[str, torch.Tensor]:
    """The model's state_dict with every parameter whole, on CPU, on rank 0 (empty on the
    others). Collective: at ZeRO-3 the trained parameters are gathered one module at a
    time, so no rank ever holds more of the model on its device than one module. Tied
    parameters stay one tensor under each of their names, as in `model.state_dict()`."""
    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for prefix, module in engine.module.named_modules(remove_duplicate=False):
        trained = [param for param in module.parameters(recurse=False) if id(param) in engine.zero.unit_of_param]
        with gathered_parameters(trained) if trained else nullcontext():
            if engine.rank != 0:
                continue
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in copies:
                    copies[id(param)] = param.detach().to("cpu", copy=True)
                state[_key(prefix, name)] = copies[id(param)]
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    state[_key(prefix, name)] = buffer.detach().to("cpu", copy=True)
    return state


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
