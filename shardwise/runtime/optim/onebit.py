"""What 1-bit Adam and 1-bit LAMB share (C18): a full-precision warm-up, then a frozen
variance and a momentum that crosses the network at one bit per element.

For `freeze_step` steps the optimizer is its ordinary self on gradients reduced by ZeRO
(all-reduced at stage 0, reduce-scattered to the partition owners at stages 1-2), and it
estimates the variance. From then on the variance is frozen, which is what makes the
momentum safe to compress (Tang et al., 2021: Adam's variance becomes stable early, and
with it fixed the update is linear in the momentum, so error feedback works). Each rank
folds its own, unreduced gradient into the momentum of the whole model,
m_i = β1·m + (1 − β1)·g_i, and the compressed all-reduce (distributed/compressed.py)
averages the m_i with error feedback on both sides: every rank ends with the same m.

The optimizer owns that communication, so the engine must stop reducing gradients: the
reducer hands it the exchange group and a switch (`GradientReducer.
exchange_for_optimizer`) that, once on, makes backward only accumulate the rank's own
gradients. The switch goes on after step `freeze_step`, and again after a checkpoint load
past it.

Stage 0: every rank trains every element; the momentum of all parameters lives in one
flat buffer (each parameter's `exp_avg` a view of it, in param-group order), padded to
whole bytes per rank's chunk, and the ranks exchange it over the data-parallel group.

Stages 1-2: the momentum must still be whole on every rank (a worker's compressed
contribution covers every element), so it is the one state that is not partitioned, and
its layout (`MomentumPartitions`, which ZeRO provides: zero/onebit_momentum.py) makes each
rank the exchange's server for exactly its ZeRO partition: it averages and error-corrects
the momentum of the elements whose fp32 masters, frozen variance and server error it
holds, and updates those masters; the exchange's all-gather gives every rank the averaged
momentum, and ZeRO's parameter all-gather the updated weights. The warm-up keeps the
momentum partitioned like any ZeRO optimizer state; when it ends (or after a load) the
ranks all-gather it once, in fp32. The optimizer reads every unit's whole local gradient
from the reducer and the step's gradient scale from `step_on_local_gradients`.

Stage 3 is refused (config/checks.py): the exchange needs the whole momentum, the
worker's error and the whole local gradient on every rank (10 bytes per parameter with
16-bit gradients, more than stage 3 saves by partitioning the 2-byte parameters), and
stage 3 frees each module's gathered parameters when its gradients are reduced, which
this phase never does.

Checkpoints keep the momentum and the variances (each rank its partition; the codec
reshards them); the error-feedback buffers are per rank and restart from zero after a
load (as DeepSpeed's do), so a resume past `freeze_step` is not bit-exact.

After the warm-up, `gradient_clipping` sees the root mean square of the ranks' local
gradient norms: the average gradient is never formed.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.compressed import padded_length
from shardwise.runtime.optim import native
from shardwise.runtime.optim.onebit_exchange import GatheredSigns, MomentumFolds, NativeCompressedAllReduce
from shardwise.runtime.optim.sharded import ShardAwareOptimizer

PER_PARAMETER_SCALARS = ("lamb_coeff_freeze", "last_factor")  # 1-bit LAMB's, one value per parameter
COMM_BACKENDS = ("nccl", "gloo", "mpi", "hccl", "compressed")
ZERO_STAGES = (0, 1, 2)  # stage 3: see above
# `shardwise train --optimizer onebitadam / onebitlamb` warms up for this share of the
# steps (the papers: 15-25%).
MAIN_JOB_WARM_UP = 0.2


class MomentumPartitions(Protocol):
    """Stages 1-2: the whole momentum laid out over the ZeRO partitions, each rank's row the
    chunk it serves. ZeRO builds it from its flat units (zero/onebit_momentum.py)."""

    def allocate(self, device: torch.device) -> torch.Tensor:
        """The whole flat momentum, zeros."""

    def own_row(self, momentum: torch.Tensor) -> torch.Tensor:
        """This rank's row of `momentum`."""

    def own_view(self, momentum: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The momentum of the rank's master segment `master`, a view of its row."""

    def gather_rows_(self, momentum: torch.Tensor) -> None:
        """Every row from its owner, so the momentum is whole on every rank."""

    def fold_(self, momentum: torch.Tensor, beta1_of_group: Callable[[int], float], scale: float) -> None:
        """m <- β1·m + (1 − β1)·scale·g over every element, g the rank's local gradient."""

    def local_norm_squared(self) -> torch.Tensor:
        """This rank's share of the clipping norm²."""


def main_job_params(adamw: dict[str, Any], steps: int) -> dict[str, Any]:
    """AdamW's settings with the warm-up a short run needs (`MAIN_JOB_WARM_UP`)."""
    return {**adamw, "freeze_step": max(1, round(steps * MAIN_JOB_WARM_UP))}


class OneBitOptimizer(ShardAwareOptimizer):
    """Warm-up / compression phases, the flat momentum and the exchange."""

    def __init__(self, params: Any, defaults: dict[str, Any], freeze_step: int, cuda_aware: bool,
                 comm_backend_name: str):
        """`cuda_aware` and `comm_backend_name` are DeepSpeed's transport switches, accepted
        and kept: the exchange always runs on the data-parallel group's own backend."""
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the variance is estimated before it is frozen), "
                             f"got {freeze_step}")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"comm_backend_name {comm_backend_name!r} is not one of {', '.join(COMM_BACKENDS)}")
        super().__init__(params, {**defaults, "freeze_step": freeze_step, "cuda_aware": cuda_aware,
                                  "comm_backend_name": comm_backend_name})
        self.freeze_step = freeze_step
        self._communicator: Communicator | None = None
        self._use_local_gradients: Callable[[bool], None] = lambda on: None
        self._exchange: NativeCompressedAllReduce | None = None
        self._momentum: torch.Tensor | None = None
        self._first_view_ptr = -1
        self._layout: list[tuple[torch.Tensor, dict[str, Any], int, dict[str, Any]]] | None = None
        self._partitions: MomentumPartitions | None = None  # stages 1-2: the whole momentum's layout
        self._momentum_signs: tuple[GatheredSigns, int] | None = None  # see `momentum_signs`
        self._grad_scale = 1.0  # stages 1-2: the scale the local gradients are folded with

    # -- the engine's side ------------------------------------------------------------------
    def attach_gradient_exchange(self, communicator: Communicator, use_local_gradients: Callable[[bool], None],
                                 partitions: MomentumPartitions | None = None) -> None:
        """Called by ZeRO: the group the momentum is exchanged over, the reducer's switch to
        local gradients (which this optimizer turns on once its warm-up is over), and at
        stages 1-2 the whole momentum's layout over the partitions."""
        self._communicator = communicator
        self._use_local_gradients = use_local_gradients
        self._partitions = partitions
        self._use_local_gradients(self._compressing(self.steps_taken() + 1))

    def reads_local_gradients(self) -> bool:
        """Stages 1-2 after the warm-up: the next step folds every unit's whole local
        gradient (from the reducer), not the `.grad` of the trained pieces."""
        return self._partitions is not None and self._compressing(self.steps_taken() + 1)

    def step_on_local_gradients(self, grad_scale: float) -> None:
        """One step of the compressed phase at stages 1-2, the local gradients scaled by
        `grad_scale` (clip coefficient over loss scale) as they are folded."""
        self._grad_scale = grad_scale
        try:
            self.step()
        finally:
            self._grad_scale = 1.0

    def local_grad_norm_squared(self) -> torch.Tensor:
        """Stages 1-2 after the warm-up: this rank's share of the clipping norm² (see
        zero/onebit_momentum.py)."""
        return self._partitions.local_norm_squared()

    @property
    def workers(self) -> int:
        return 1 if self._communicator is None else self._communicator.size

    def exchange_state_bytes(self) -> int:
        """Error-feedback buffers and the momentum buffer beyond the trained elements' own
        views of it (counted with their state): stage 0 its padding, stages 1-2 the other
        ranks' partitions and the padding; and the last exchange's gathered signs while the
        next step reads the previous momentum from them (`momentum_signs`)."""
        if self._exchange is None or self._momentum is None:
            return 0
        kept = 0 if self._momentum_signs is None else sum(
            tensor.numel() * tensor.element_size() for tensor in (self._momentum_signs[0].packed,
                                                                  self._momentum_signs[0].scales))
        return self._exchange.state_bytes + 4 * (self._momentum.numel() - self._trained_numel()) + kept

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checkpointed momentum and variances; error feedback restarts from zero."""
        super().load_state_dict(state_dict)
        self._exchange = None
        self._momentum = None
        self._momentum_signs = None
        self._first_view_ptr = -1
        self._use_local_gradients(self._compressing(self.steps_taken() + 1))

    # -- the phases ------------------------------------------------------------------------------
    def _compressing(self, step: int) -> bool:
        """Whether step `step` (counted from 1) exchanges compressed momentum."""
        return step > self.freeze_step and self.workers > 1

    def steps_taken(self) -> int:
        for param in self._params():
            state = self.state.get(param)
            if state:
                return int(state["step"].item())
        return 0

    def _advance(self) -> int:
        """Count one step on every parameter (a step exchanges all of them); the new count."""
        counts = []
        for param in self._params():
            state = self.state[param]
            if not state:
                self._init_state(param, state)
            counts.append(state["step"])
        torch._foreach_add_(counts, 1)  # one call, not one per tensor
        return self.steps_taken()

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)

    def _finish_step(self, step: int) -> None:
        if step == self.freeze_step:
            self._use_local_gradients(self._compressing(step + 1))

    # -- the momentum exchange --------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _trained_numel(self) -> int:
        return sum(param.numel() for param in self._params())

    def momentum_flat(self) -> torch.Tensor:
        """The flat momentum buffer, each trained tensor's `exp_avg` a view of it (built on
        first use from the current `exp_avg`s: after the warm-up, a load, or new state)."""
        params = self._params()
        if self._momentum is None or self.state[params[0]]["exp_avg"].data_ptr() != self._first_view_ptr:
            self._exchange = None
            if self._partitions is not None:
                self._momentum = self._partitioned_momentum(params)
            else:
                self._momentum = self._stage0_momentum(params)
            self._first_view_ptr = self.state[params[0]]["exp_avg"].data_ptr()
            self._layout = None
            self._momentum_signs = None
        return self._momentum

    def _stage0_momentum(self, params: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(padded_length(self._trained_numel(), self.workers), dtype=torch.float32,
                           device=params[0].device)
        offset = 0
        for param in params:
            view = flat[offset : offset + param.numel()].view_as(param)
            view.copy_(self.state[param]["exp_avg"])
            self.state[param]["exp_avg"] = view
            offset += param.numel()
        return flat

    def _partitioned_momentum(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Own partition from the optimizer state, the other rows from their owners."""
        flat = self._partitions.allocate(params[0].device)
        for param in params:
            view = self._partitions.own_view(flat, param)
            view.copy_(self.state[param]["exp_avg"])
            self.state[param]["exp_avg"] = view
        self._partitions.gather_rows_(flat)
        return flat

    def own_momentum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the part of the flat momentum holding the trained tensors' views, the flat
        momentum): stage 0 all of it, stages 1-2 this rank's row."""
        momentum = self.momentum_flat()
        return (momentum if self._partitions is None else self._partitions.own_row(momentum)), momentum

    def fold_and_exchange(self) -> None:
        """m_i = β1·m + (1 − β1)·g_i for every element (no gradient: g_i = 0), then the
        compressed average over the exchange group: every rank's m is the result."""
        gathered = self.fold_and_exchange_signs()
        if gathered is not None:
            gathered.decode_(self.momentum_flat(), 0)

    def fold_and_exchange_signs(self) -> GatheredSigns | None:
        """As `fold_and_exchange`, but where the kernels take the whole exchange (stage 0,
        several workers, fp32 CPU tensors) the fold runs in the worker's first pass and the
        averaged signs come back undecoded: the caller decodes them, every element of the
        flat momentum (`decode_untrained_` for the padding), in its own pass over the
        momentum. None: the momentum is already the average."""
        momentum = self.momentum_flat()
        known, self._momentum_signs = self.momentum_signs(), None  # until the caller has decoded the new ones
        if self.fuses_exchange():
            folds = MomentumFolds.of([(start, param.numel(), param.grad, group["betas"][0])
                                      for param, group, start, _ in self.momentum_layout()])
            return self._exchange_of(momentum).exchange_(momentum, "momentum", folds, known)
        if self._partitions is not None:
            self._partitions.fold_(momentum, lambda group: self.param_groups[group]["betas"][0], self._grad_scale)
        else:
            for group in self.param_groups:
                beta1 = group["betas"][0]
                for param in group["params"]:  # (foreach's add with alpha is two passes on CPU)
                    exp_avg, grad = self.state[param]["exp_avg"], param.grad
                    if native_takes(exp_avg, grad):  # one pass (optim/native.py)
                        native.library().momentum_fold(exp_avg.data_ptr(), None if grad is None else grad.data_ptr(),
                                                       exp_avg.numel(), beta1, 1 - beta1)
                        continue
                    exp_avg.mul_(beta1)
                    if grad is not None:
                        exp_avg.add_(grad, alpha=1 - beta1)
        if self.workers > 1:
            self._exchange_of(momentum).all_reduce_(momentum, "momentum")
        return None

    def momentum_signs(self) -> GatheredSigns | None:
        """The gathered signs that the flat momentum is, element for element, the decode of
        (the last fused step's average), while nothing has written it since; then the next
        step reads the previous momentum from them (1/32 of its bytes). In-place torch
        operations on the momentum or its views advance its version counter, which is
        checked; the kernels' writes do not, so `fold_and_exchange_signs` forgets the signs
        before any of this step's writes, and a step remembers new ones
        (`remember_momentum_signs`) only once it has decoded them into every element."""
        if self._momentum_signs is None or self._momentum is None:
            return None
        signs, version = self._momentum_signs
        return signs if self._momentum._version == version else None

    def remember_momentum_signs(self, gathered: GatheredSigns) -> None:
        """Called once `gathered` is decoded into every element of the flat momentum."""
        self._momentum_signs = (gathered, self.momentum_flat()._version)

    def fuses_exchange(self) -> bool:
        """Whether `fold_and_exchange_signs` fuses (stage 0, several workers, the momentum
        and every gradient fp32 CPU tensors the kernels take)."""
        if self.workers == 1 or self._partitions is not None:
            return False
        momentum = self.momentum_flat()
        return self._exchange_of(momentum).takes(momentum) and native_takes(*(param.grad for param in self._params()))

    def decode_untrained_(self, gathered: GatheredSigns) -> None:
        """The flat momentum's elements that no trained tensor views (stage 0: the padding
        after them) become the average."""
        trained = self._trained_numel()
        gathered.decode_(self.momentum_flat()[trained:], trained)

    def momentum_layout(self) -> list[tuple[torch.Tensor, dict[str, Any], int, dict[str, Any]]]:
        """(trained tensor, its param group, the flat index of its first momentum element,
        its state) per trained tensor, kept while the flat momentum is."""
        momentum = self.momentum_flat()
        if self._layout is None:
            base = momentum.data_ptr()
            self._layout = [(param, group, (self.state[param]["exp_avg"].data_ptr() - base) // 4, self.state[param])
                            for group in self.param_groups for param in group["params"]]
        return self._layout

    def _exchange_of(self, momentum: torch.Tensor) -> NativeCompressedAllReduce:
        if self._exchange is None:
            self._exchange = NativeCompressedAllReduce(self._communicator, momentum.numel(), momentum.device)
        return self._exchange


def native_takes(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernels can take these tensors (None: absent): fp32, CPU, contiguous."""
    present = [tensor for tensor in tensors if tensor is not None]
    return all(tensor.dtype == torch.float32 for tensor in present) and native.enabled() and native.takes(*present)


class OneBitCodec:
    """Checkpoint form: the per-element moments; 1-bit LAMB's per-parameter scalars as
    constant per-element tensors (a checkpoint keeps one scalar state per param group);
    `step`. The flat momentum buffer is saved through its views."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        elements = {key: value.reshape(-1) for key, value in state.items()
                    if torch.is_tensor(value) and value.numel() == numel and value.dim() >= 1}
        for key in PER_PARAMETER_SCALARS:
            if key in state:
                elements[key] = torch.full((numel,), float(state[key]), dtype=torch.float32)
        return elements, {"step": state["step"]}

    def decode(self, elements: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
        state = {**scalars, **{key: value for key, value in elements.items() if key not in PER_PARAMETER_SCALARS}}
        for key in PER_PARAMETER_SCALARS:
            if key in elements:
                state[key] = float(elements[key][0].item())
        return state

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return sum(value.numel() * value.element_size() for value in state.values()
                   if torch.is_tensor(value) and value.numel() == numel and value.dim() >= 1)
