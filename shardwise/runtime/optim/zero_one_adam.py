"""0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for Large-scale Training
via 0/1 Adam"), with DeepSpeed's `ZeroOneAdam` parameters and update rule (C18).

1-bit Adam (optim/onebit_adam.py) needs a full-precision warm-up to estimate the variance,
and then still exchanges the momentum every step. 0/1 Adam removes both costs: the
variance is updated only at exponentially spaced steps, and after it freezes the ranks take
local steps and exchange their accumulated update at growing intervals. Step t (counted
from 1; g the gradient, lr the step's learning rate, d = √v + eps):

- t = 1 updates nothing (DeepSpeed's first step only sets up its buffers), so the step
  counts below are DeepSpeed's.
- 2 ≤ t ≤ var_freeze_step + 1: at variance steps (t % var_interval = 0) g is the
  all-reduced gradient and v <- β2·v + (1 − β2)·g², m <- β1·m + (1 − β1)·g; at the others
  each rank's own g crosses the 1-bit exchange (distributed/compressed.py, error feedback
  on both sides) and m <- β1·m + (1 − β1)·ĝ, v unchanged. var_interval starts at 1 and
  doubles after every `var_update_scaler` variance steps. Then w <- w − lr·(m/d + wd·w).
- Later steps (v frozen; the error buffers restart from zero first): each rank on its own
  gradient, m <- β1·m + (1 − β1)·g, w <- w − lr·(m/d + wd·w), the update accumulated in u
  (u <- u − lr·(m/d + wd·w)) and the step's lr in Σlr. At t % local_step_interval = 0 the
  ranks synchronise: w <- w − u, ū = 1-bit average over ranks of u·d, m <- −ū/Σlr,
  w <- w + ū/d, u and Σlr back to 0. local_step_interval starts at 1 and doubles (up to
  `local_step_clipper`) after every `local_step_scaler` of these steps.

The engine reduces gradients only before variance steps (the reducer's switch, as for the
1-bit optimizers: optim/onebit.py); every other step moves at most one 1-bit exchange, and
local steps nothing (formulas/communication.py `zero_one_adam_step_kinds`). With one rank
there is nothing to exchange: ĝ = g and ū = u·d. Learning-rate schedules act through
group["lr"] at every step, as in DeepSpeed (Σlr sums the lrs the local steps used).

Where shardwise differs from DeepSpeed's arithmetic, and why:
- the exchange compresses one flat buffer of all parameters (param-group order, padded to
  whole bytes per rank), like shardwise's 1-bit optimizers, where DeepSpeed compresses
  each tensor with its own scale;
- a parameter without a gradient counts as a zero gradient (the exchange covers every
  parameter), where DeepSpeed skips it;
- one rank: ĝ = g (DeepSpeed leaves m unchanged at those steps with one rank).
`bias_correction` is accepted and, as in DeepSpeed, has no effect: 0/1 Adam's rule has no
correction (its momentum is re-estimated from each synchronised update).

ZeRO stage 0 only: DeepSpeed refuses ZeRO with 0/1 Adam ("0/1 Adam is not compatible with
ZeRO"), and so does shardwise (config/checks.py): every rank keeps the whole momentum,
variance, accumulated update and error buffer, and takes whole local steps. Checkpoints
keep the moments, u and the schedule's counters; the error-feedback buffers restart from
zero after a load, as the 1-bit optimizers' do. Stage 0 saves rank 0's copy, so after a
load between synchronisations every rank continues from rank 0's local steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch

from shardwise.formulas.memory import zero_one_adam_state_terms
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.compressed import padded_length
from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim.onebit import MAIN_JOB_WARM_UP, MomentumPartitions, OneBitCodec, OneBitOptimizer
from shardwise.runtime.optim.onebit_exchange import NativeCompressedAllReduce
from shardwise.runtime.optim.onebit_adam import _clip_elsewhere, _no_amsgrad, refuse_unsupported
from shardwise.runtime.optim.params import check_betas, param
from shardwise.runtime.optim.registry import OptimizerSpec, accepted_params, register_optimizer

ZERO_STAGES = (0,)  # DeepSpeed: "0/1 Adam is not compatible with ZeRO"
# The schedule's counters, one value for the whole optimizer, kept in every parameter's state
# (as DeepSpeed keeps them) so that a checkpoint carries them with `step`.
SCHEDULE = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")


class ZeroOneAdam(OneBitOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        """`var_freeze_step` is the last step that may update the variance (step
        var_freeze_step + 1 still runs that phase, as in DeepSpeed); it is the base class's
        `freeze_step`."""
        refuse_unsupported(amsgrad, max_grad_norm)
        if eps_inside_sqrt:
            raise ValueError("eps_inside_sqrt true: DeepSpeed's ZeroOneAdam accepts it and never applies it; "
                             "leave it false")
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, var_freeze_step, cuda_aware, comm_backend_name)
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    # -- the engine's side ------------------------------------------------------------------
    def attach_gradient_exchange(self, communicator: Communicator, use_local_gradients: Callable[[bool], None],
                                 partitions: MomentumPartitions | None = None) -> None:
        """The 1-bit optimizers' hook; ZeRO's partitions (stages 1-2) are refused."""
        if partitions is not None:
            raise ValueError("ZeroOneAdam runs at zero_optimization.stage 0 only (DeepSpeed: \"0/1 Adam is not "
                             "compatible with ZeRO\"): every rank takes whole local steps on the whole momentum, "
                             "variance and accumulated update")
        super().attach_gradient_exchange(communicator, use_local_gradients)

    def _compressing(self, step: int) -> bool:
        """Whether backward leaves step `step`'s gradients local (every step but the
        variance steps: step 1's gradient is not used, the others exchange themselves)."""
        if self.workers == 1:
            return False
        return step == 1 or self._frozen(step) or step % self._schedule("var_interval") != 0

    def _frozen(self, step: int) -> bool:
        return step > self.freeze_step + 1

    def _schedule(self, key: str) -> Any:
        state = self.state.get(self._params()[0])
        return state[key] if state else {"var_interval": 1}.get(key, 0)

    def _set_schedule(self, **values: Any) -> None:
        for param in self._params():
            self.state[param].update(values)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        super()._init_state(param, state)
        state.update(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)

    def exchange_state_bytes(self) -> int:
        """Error-feedback buffers and the padding of u's flat buffer."""
        padding = 0 if self._momentum is None else 4 * (self._momentum.numel() - self._trained_numel())
        return padding + (0 if self._exchange is None else self._exchange.state_bytes)

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        step = self._advance()
        accumulated = self._accumulated_update()
        if step > 1 and not self._frozen(step):
            self._variance_phase_step(step, accumulated)
        elif step > 1:
            self._local_step(step, accumulated)
        if step == self.freeze_step + 1:
            self._exchange = None  # error feedback restarts for the accumulated updates (as DeepSpeed's)
        self._use_local_gradients(self._compressing(step + 1))
        return loss

    def _variance_phase_step(self, step: int, accumulated: torch.Tensor) -> None:
        variance_step = step % self._schedule("var_interval") == 0
        if variance_step:
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for param in group["params"]:
                    state = self.state[param]
                    state["exp_avg_sq"].mul_(beta2)
                    state["exp_avg"].mul_(beta1)
                    if param.grad is not None:
                        state["exp_avg_sq"].addcmul_(param.grad, param.grad, value=1 - beta2)
                        state["exp_avg"].add_(param.grad, alpha=1 - beta1)
        else:  # each rank's gradient through the exchange, in u's (zero) flat buffer
            for param in self._params():
                if param.grad is not None:
                    self.state[param]["momentum_accumulator"].copy_(param.grad)
            self._average(accumulated, "gradient")
            for group in self.param_groups:
                beta1 = group["betas"][0]
                for param in group["params"]:
                    state = self.state[param]
                    state["exp_avg"].mul_(beta1).add_(state["momentum_accumulator"], alpha=1 - beta1)
            accumulated.zero_()
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(self._update(param, group), alpha=-group["lr"])
        if variance_step:
            counter, interval = self._schedule("var_counter") + 1, self._schedule("var_interval")
            if counter == self.var_update_scaler:
                counter, interval = 0, interval * 2
            self._set_schedule(var_counter=counter, var_interval=interval)

    def _local_step(self, step: int, accumulated: torch.Tensor) -> None:
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for param in group["params"]:
                state = self.state[param]
                if param.grad is not None:
                    state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
                else:
                    state["exp_avg"].mul_(beta1)
                state["lrs"] += group["lr"]
                update = self._update(param, group).mul_(-group["lr"])
                param.add_(update)
                state["momentum_accumulator"].add_(update)
        if step % self._schedule("local_step_interval") == 0:
            self._synchronise(accumulated)
        counter, interval = self._schedule("local_step_counter") + 1, self._schedule("local_step_interval")
        if counter == self.local_step_scaler:
            counter, interval = 0, min(self.local_step_clipper, interval * 2)
        self._set_schedule(local_step_counter=counter, local_step_interval=interval)

    def _synchronise(self, accumulated: torch.Tensor) -> None:
        """Undo the local steps, average u·d over the ranks, re-estimate m from it, apply it."""
        denominators = {}
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                param.sub_(state["momentum_accumulator"])
                denominators[param] = state["exp_avg_sq"].sqrt().add_(group["eps"])
                state["momentum_accumulator"].mul_(denominators[param])
        self._average(accumulated, "accumulated update")
        for param, denominator in denominators.items():
            state = self.state[param]
            average = state["momentum_accumulator"]
            if state["lrs"]:  # (all-zero learning rates leave m, where DeepSpeed's would divide 0 by 0)
                torch.div(average, -state["lrs"], out=state["exp_avg"])
            param.add_(average.div_(denominator))
            state["lrs"] = 0.0
        accumulated.zero_()

    def _update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """m / (√v + eps) + weight_decay · w, in one new tensor."""
        state = self.state[param]
        update = torch.div(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]))
        if group["weight_decay"] > 0:
            update.add_(param, alpha=group["weight_decay"])
        return update

    # -- u's flat buffer and the exchange ----------------------------------------------------
    def _accumulated_update(self) -> torch.Tensor:
        """u's flat buffer, padded to whole bytes per rank, each parameter's
        `momentum_accumulator` a view of it (built on first use and after a load)."""
        params = self._params()
        if self._momentum is None or "momentum_accumulator" not in self.state[params[0]]:
            self._exchange = None
            flat = torch.zeros(padded_length(self._trained_numel(), self.workers), dtype=torch.float32,
                               device=params[0].device)
            offset = 0
            for param in params:
                view = flat[offset : offset + param.numel()].view_as(param)
                if "momentum_accumulator" in self.state[param]:
                    view.copy_(self.state[param]["momentum_accumulator"])
                self.state[param]["momentum_accumulator"] = view
                offset += param.numel()
            self._momentum = flat
        return self._momentum

    def _average(self, flat: torch.Tensor, what: str) -> None:
        if self.workers == 1:
            return
        if self._exchange is None:
            self._exchange = NativeCompressedAllReduce(self._communicator, flat.numel(), flat.device)
        self._exchange.all_reduce_(flat, what)


class ZeroOneAdamCodec(OneBitCodec):
    """The 1-bit codec (moments and u per element, `step`) with the schedule's counters as
    scalars, one value per param group like `step`."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        elements, scalars = super().encode(state, numel)
        return elements, {**scalars, **{key: state[key] for key in SCHEDULE}}


def _no_eps_inside_sqrt(enabled: bool) -> bool:
    if enabled:
        raise ValueError("eps_inside_sqrt true: DeepSpeed's ZeroOneAdam accepts it and never applies it; "
                         "leave it false")
    return enabled


@dataclass(frozen=True)
class ZeroOneAdamParams:
    """0/1 Adam with DeepSpeed's `ZeroOneAdam` parameters and defaults. `bias_correction` is
    accepted without effect, as in DeepSpeed (the rule has none); `cuda_aware` and
    `comm_backend_name` choose DeepSpeed's transport and are accepted without effect: the
    exchange runs on the data-parallel group's backend."""

    lr: float = param(1e-3, ge=0)
    bias_correction: bool = param(True, description="accepted without effect, as in DeepSpeed")
    betas: tuple[float, float] = param((0.9, 0.999), check=check_betas)
    eps: float = param(1e-8, gt=0)
    eps_inside_sqrt: bool = param(False, check=_no_eps_inside_sqrt, description="accepted as false only "
                                  "(DeepSpeed never applies it)")
    weight_decay: float = param(0.0, ge=0)
    max_grad_norm: float = param(0.0, check=_clip_elsewhere,
                                 description="accepted as 0 only: clip with gradient_clipping")
    var_freeze_step: int = param(100000, ge=1, description="the last step that may update the variance; "
                                 "from step var_freeze_step + 2 the ranks take local steps")
    var_update_scaler: int = param(16, ge=1, description="variance steps at each interval before it doubles")
    local_step_scaler: int = param(32678, ge=1, description="steps at each local-step interval before it doubles")
    local_step_clipper: int = param(16, ge=1, description="the longest local-step interval")
    amsgrad: bool = param(False, check=_no_amsgrad)
    cuda_aware: bool = False
    comm_backend_name: Literal["nccl", "gloo", "mpi", "hccl", "compressed"] = "nccl"


def main_job_params(adamw: dict[str, Any], steps: int) -> dict[str, Any]:
    """AdamW's settings, the variance frozen after the 1-bit optimizers' warm-up share."""
    return {**accepted_params(ZeroOneAdamParams, adamw), "var_freeze_step": max(1, round(steps * MAIN_JOB_WARM_UP))}


# K: momentum, variance and the accumulated update per element (the worker's error buffer,
# the server's and the flat buffer's padding are counted through the optimizer:
# shardwise/formulas/memory.py `zero_one_adam_state_bytes`).
register_optimizer(OptimizerSpec(
    "ZeroOneAdam", ZeroOneAdamParams, lambda groups, params: ZeroOneAdam(groups, **params),
    fp32_states=lambda params: 3, codec=ZeroOneAdamCodec(), per_parameter=True, zero_stages=ZERO_STAGES,
    offload=False, state_terms=zero_one_adam_state_terms,
    main_job_params=main_job_params,
))
