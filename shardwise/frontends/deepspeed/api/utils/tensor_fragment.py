"""DeepSpeed's `safe_*` helpers (`deepspeed.utils`): a parameter's fp32 master, gradient
and optimizer state read or written whole, or as this rank's fragment, wherever ZeRO put
them.

Under ZeRO a parameter's fp32 master, its reduced gradient and its optimizer state are
spread over the ranks (stage 1-3), and at stage 3 the parameter itself is empty outside a
gather, so code that inspects or edits training state (gradient surgery, logging norms,
resetting a moment) asks the engine for it. shardwise answers from the ranges of each
parameter this rank owns (`ZeroState.owned_ranges`, by parameter name and element range):

- `safe_get_full_*` return the whole tensor on every rank, in the parameter's shape: each
  rank places its own elements and the shard group sums them (a collective: every rank
  of the group calls it, for the same parameters in the same order, as in DeepSpeed);
- `safe_get_local_*` return this rank's elements only (1-D, in the parameter's flat
  order; empty where the rank owns none of it), with no communication;
- the `safe_set_*` twins write values back: `full` ones take the whole tensor (every rank
  passes the same) and keep their own elements, `local` ones this rank's elements.
  Writing an fp32 master also rewrites the parameter's (16-bit) training copy, so the
  next forward sees it.

The gradient is the reduced one the next `step()` applies (averaged over the data-parallel
ranks, still multiplied by the fp16 loss scale when there is one), valid from the end of
the backward at an accumulation boundary until that step. Parameters that are not trained
(frozen, or not held by a live engine) give None, as in DeepSpeed. At stage 0 the full
helpers work too (every rank owns every element); DeepSpeed's answer None there is for
its unwrapped fp32 optimizer only.

`fragment_address` is the record DeepSpeed pickles into its checkpoints for a parameter's
place in a partition (`numel`, `start`), under DeepSpeed's module path, so scripts can
allow-list it for `torch.load(weights_only=True)` as they do the loss scaler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from shardwise.runtime.zero.apply import ZeroState
from shardwise.runtime.zero.gathered import zero_of
from shardwise.runtime.zero.shard_view import OwnedRange

__all__ = [
    "fragment_address",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
]


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """Where a parameter's fragment sits in a flat partition."""

    numel: int
    start: int


fragment_address.__module__ = "deepspeed.utils.tensor_fragment"  # once built: dataclass reads its own module


def _trained(param: torch.Tensor) -> tuple[ZeroState, str, torch.Size] | None:
    """(ZeRO state, name, full shape) of a parameter a live engine trains, else None."""
    zero = zero_of(param)
    if zero is None or not param.requires_grad or zero.optimizer is None:
        return None
    unit = zero.unit_of_param.get(id(param))
    if unit is None:
        return None
    slot = next(slot for slot in unit.slots if slot.param is param)
    return zero, slot.name, slot.shape


def _owned(zero: ZeroState, name: str) -> Iterator[OwnedRange]:
    """This rank's ranges of `name`, each yielded while its optimizer sub-group is resident."""
    for ranges in zero.owned_ranges_by_sub_group():
        yield from (owned for owned in ranges if owned.name == name)


def _field(zero: ZeroState, owned: OwnedRange, what: str) -> torch.Tensor:
    """The view of `owned` for "master", "grad" or an optimizer state key."""
    if what == "master":
        return owned.master
    if what == "grad":
        return owned.grad
    state = zero.optimizer.optimizer.state.get(owned.segment.master, {})
    elements, _ = zero.codec.encode(state, owned.segment.numel) if state else ({}, {})
    if what not in elements:
        known = sorted(elements) or "none yet (the optimizer has not stepped)"
        raise ValueError(f"optimizer state {what!r} is not a per-element state of this optimizer; it has {known}")
    return owned.state_view(elements[what])


def _get_full(param: torch.Tensor, what: str) -> torch.Tensor | None:
    found = _trained(param)
    if found is None:
        return None
    zero, name, shape = found
    full = torch.zeros(shape.numel(), dtype=torch.float32)
    for owned in _owned(zero, name):
        full[owned.start:owned.stop] = _field(zero, owned, what).detach().float().cpu()
    zero.groups.shard.control_all_reduce(full, f"safe_get_full ({what}) of {name}")
    return full.view(shape).to(param.device)


def _set_full(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    found = _trained(param)
    if found is None:
        return
    zero, name, shape = found
    if value.numel() != shape.numel():
        raise ValueError(f"safe_set_full ({what}) of {name}: got {value.numel()} elements for a parameter of "
                         f"shape {tuple(shape)}")
    flat = value.detach().reshape(-1)
    for owned in _owned(zero, name):
        target = _field(zero, owned, what)
        target.copy_(flat[owned.start:owned.stop].to(target.device, target.dtype))
    if what == "master":
        _publish(zero)


def _get_local(param: torch.Tensor, what: str) -> torch.Tensor | None:
    found = _trained(param)
    if found is None:
        return None
    zero, name, _ = found
    pieces = [_field(zero, owned, what).detach().float().clone() for owned in _owned(zero, name)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32, device=param.device)


def _set_local(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    found = _trained(param)
    if found is None:
        return
    zero, name, _ = found
    flat, position = value.detach().reshape(-1), 0
    wanted = sum(owned.numel for owned in zero.owned_ranges() if owned.name == name)
    if flat.numel() != wanted:
        raise ValueError(f"safe_set_local ({what}) of {name}: this rank owns {wanted} elements, got {flat.numel()}")
    for owned in _owned(zero, name):
        target = _field(zero, owned, what)
        target.copy_(flat[position:position + owned.numel].to(target.device, target.dtype))
        position += owned.numel
    if what == "master":
        _publish(zero)


def _publish(zero: ZeroState) -> None:
    """Masters were written: the parameters' training copies follow, as after a step (without
    touching the gradients, which a write between backward and step must keep)."""
    zero.store.publish()
    zero.params.after_update()


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return _get_full(param, "master")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_full(param, value, "master")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return _get_full(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set_full(param, value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    return _get_full(param, "grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_full(param, value, "grad")


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return _get_local(param, "master")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_local(param, value, "master")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    return _get_local(param, "grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_local(param, value, "grad")


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return _get_local(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set_local(param, value, optim_state_key)


def safe_update_full_grad_vectorized(param_list: list[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's full gradient by `update_func(full gradient, parameter)`, as
    DeepSpeed calls it (once per parameter, the parameter passed so the function can look
    up what belongs to it). A parameter no engine trains but holding a `.grad` has that
    updated in place; one without a gradient is left alone."""
    for param in param_list:
        if _trained(param) is not None:
            old = safe_get_full_grad(param)
            if old is not None:
                safe_set_full_grad(param, update_func(old, param))
        elif param.grad is not None:
            param.grad.copy_(update_func(param.grad, param))
