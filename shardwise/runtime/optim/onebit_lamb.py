"""1-bit LAMB (Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale
Large-Batch Training with LAMB's Convergence Speed"), with DeepSpeed's `OneBitLamb`
parameters (C18).

Warm-up (steps 1 .. freeze_step): LAMB on the all-reduced gradient (optim/lamb.py's
arithmetic: update u = m / (√v + eps) + weight_decay · w, trust ratio
r = clamp(||w|| / ||u||, min_coeff, max_coeff), w <- w − step_size · r · u), and per
parameter an exponential average of the trust ratios, c <- coeff_beta · c + (1 − coeff_beta) · r.

Compression (later steps): the momentum is exchanged as in 1-bit Adam (optim/onebit.py),
v is frozen, and a trust ratio cannot be computed from the compressed momentum alone, so
the paper scales the frozen average c by a factor that tracks how the variance would
have moved: the average gradient is reconstructed from two consecutive momenta,
ĝ = (m_t − β1·m_{t−1}) / (1 − β1), feeds a fresh variance v' (a copy of v at the freeze),
and

    factor = max over the parameter's elements of (√v + eps) / (√v' + eps)

(with weight decay, mixed with 1 in the proportion ||m/(√v+eps)|| / ||u||), clamped to
[factor_min, factor_max] and to within ±factor_threshold of the previous step's factor;
then w <- w − step_size · c · factor · u. step_size as in optim/onebit_adam.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from shardwise.formulas.memory import onebit_state_terms
from shardwise.runtime.optim.closure import closure_loss
from shardwise.runtime.optim.lamb import MAIN_JOB_LR
from shardwise.runtime.optim import native
from shardwise.runtime.optim.onebit import ZERO_STAGES, OneBitCodec, OneBitOptimizer, main_job_params, native_takes
from shardwise.runtime.optim.onebit_exchange import GatheredSigns
from shardwise.runtime.optim.onebit_adam import (OneBitAdamParams, adam_step_size, adam_update_, refuse_unsupported,
                                                 variance_denominator, warm_up_moments)
from shardwise.runtime.optim.params import param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer


class OneBitLamb(OneBitOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ):
        refuse_unsupported(amsgrad, max_grad_norm)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(f"need 0 < factor_min <= factor_max, got {factor_min} and {factor_max}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff, amsgrad=amsgrad, coeff_beta=coeff_beta,
                        factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold)
        super().__init__(params, defaults, freeze_step, cuda_aware, comm_backend_name)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        super()._init_state(param, state)
        state["lamb_coeff_freeze"] = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        step = self._advance()
        if step > self.freeze_step:
            self._compressed_step(step)
        else:
            self._warm_up_step(step)
        self._finish_step(step)
        return loss

    def _warm_up_step(self, step: int) -> None:
        warm_up_moments(self)
        updates = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                update = adam_update_(state["exp_avg"], group, state["exp_avg_sq"])
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                updates.append((param, update, group))
        norms = self._whole_norms([(p, p) for p, _, _ in updates], [(p, u) for p, u, _ in updates]).tolist()
        for param, update, group in updates:
            index = self.shard_of(param).index
            ratio = _trust_ratio(norms[index][0], norms[index][1], group)
            state = self.state[param]
            state["lamb_coeff_freeze"] = group["coeff_beta"] * state["lamb_coeff_freeze"] + (
                1 - group["coeff_beta"]) * ratio
            param.add_(update, alpha=-adam_step_size(group, step, self.freeze_step) * ratio)

    def _compressed_step(self, step: int) -> None:
        """Two passes over the trained tensors: the statistics of each parameter's factor
        (its elements' maximum and, with weight decay, two norms), completed over the
        ranks holding other pieces of it in one reduction each; then the update. Where
        the exchange fuses (optim/onebit.py `fold_and_exchange_signs`) and every tensor is
        a whole parameter (stage 0), both passes run tensor by tensor on the gathered
        signs (`_decode_step_by_tensor`)."""
        for param in self._params():
            state = self.state[param]
            if "exp_avg_sq_fresh" not in state:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
                state["last_factor"] = 1.0
        if self.fuses_exchange() and self._whole_tensors() and native_takes(*self._params(), *(
                self.state[param][key] for param in self._params() for key in ("exp_avg_sq", "exp_avg_sq_fresh"))):
            known = self.momentum_signs()  # the previous momentum, where the last step left it decoded
            gathered = self.fold_and_exchange_signs()
            self._decode_step_by_tensor(gathered, known, step)
            self.remember_momentum_signs(gathered)
            return
        # per parameter: the largest variance factor, and (with weight decay) ||m / d||² and ||u||²
        statistics = torch.zeros(self.parameter_count, 3, dtype=torch.float64, device=self._params()[0].device)
        self._statistics(statistics)
        maxima = statistics[:, 0].contiguous()
        if self._partitions is not None:  # pieces of one parameter on several ranks
            self._communicator.control_all_reduce(maxima, "1-bit LAMB variance factors (maxima)", op=dist.ReduceOp.MAX)
        maxima = maxima.tolist()  # with the norms, the step's reads of the device, whatever the parameter count
        norms = self.sum_over_shards(statistics[:, 1:].contiguous()).sqrt().tolist()
        scales = {}
        for group in self.param_groups:
            step_size = adam_step_size(group, step, self.freeze_step)
            for param in group["params"]:
                index = self.shard_of(param).index
                scales[param] = _update_scale(self.state[param], group, step_size, maxima[index], norms[index])
        for group in self.param_groups:
            for param in group["params"]:
                state, scale = self.state[param], scales[param]
                if native_takes(param, state["exp_avg"], state["exp_avg_sq"]):  # the update in one pass
                    native.library().lamb_apply(param.data_ptr(), state["exp_avg"].data_ptr(),
                                                state["exp_avg_sq"].data_ptr(), param.numel(), scale, group["eps"],
                                                group["weight_decay"], group["eps_inside_sqrt"], native.threads())
                    continue
                update = adam_update_(state["exp_avg"], group, state["exp_avg_sq"])
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=scale)

    def _whole_tensors(self) -> bool:
        """Whether each trained tensor is a whole parameter of its own (no ZeRO pieces), so
        that its variance factor needs no other tensor's statistics."""
        params = self._params()
        shards = [self.shard_of(param) for param in params]
        return len({shard.index for shard in shards}) == len(params) and all(
            shard.start == 0 and shard.stop == math.prod(shard.shape) for shard in shards)

    def _decode_step_by_tensor(self, gathered: GatheredSigns, known: GatheredSigns | None, step: int) -> None:
        """Both passes tensor by tensor, in one native call (`onebit_lamb_decode_steps`,
        no call per tensor from Python): the statistics pass on the gathered signs, the
        factor, then the update's pass, which finds the tensor's variance in the cache the
        first pass left it in (the largest GPT tensors' arrays are a few MB), where two
        passes over every tensor read it from memory twice. The statistics pass reads the
        previous momentum from `known` where the last step left it their decode
        (optim/onebit.py `momentum_signs`). Each tensor's `last_factor` comes back in the
        settings' third column."""
        layout = self.momentum_layout()
        sizes = {id(group): adam_step_size(group, step, self.freeze_step) for group in self.param_groups}
        table = torch.tensor([[start, param.numel(), param.data_ptr(), state["exp_avg_sq"].data_ptr(),
                               state["exp_avg_sq_fresh"].data_ptr(), int(group["eps_inside_sqrt"])]
                              for param, group, start, state in layout], dtype=torch.int64)
        settings = torch.tensor([[sizes[id(group)], state["lamb_coeff_freeze"], state["last_factor"], *group["betas"],
                                  group["eps"], group["weight_decay"], group["factor_min"], group["factor_max"],
                                  group["factor_threshold"]] for _, group, _, state in layout], dtype=torch.float64)
        native.library().onebit_lamb_decode_steps(
            gathered.packed.data_ptr(), gathered.packed.shape[1], gathered.scales.data_ptr(), gathered.chunk,
            self.momentum_flat().data_ptr(), None if known is None else known.packed.data_ptr(),
            None if known is None else known.scales.data_ptr(), len(layout), table.data_ptr(), settings.data_ptr())
        for (_, _, _, state), factor in zip(layout, settings[:, 2].tolist()):
            state["last_factor"] = factor
        self.decode_untrained_(gathered)

    def _statistics(self, statistics: torch.Tensor) -> None:
        """The statistics pass after the exchange, from a copy of the previous momentum."""
        own, _ = self.own_momentum()
        previous = own.clone()  # m_{t-1}: the gradient is reconstructed from it
        self.fold_and_exchange()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                state = self.state[param]
                momentum, variance, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
                offset = (momentum.data_ptr() - own.data_ptr()) // momentum.element_size()
                last = previous[offset : offset + param.numel()].view_as(param)
                index = self.shard_of(param).index
                if native_takes(param, momentum, last, variance, fresh):  # one pass (optim/native.py)
                    native.library().onebit_lamb_statistics(
                        param.data_ptr(), momentum.data_ptr(), last.data_ptr(), variance.data_ptr(), fresh.data_ptr(),
                        param.numel(), beta1, 1 - beta1, beta2, 1 - beta2, group["eps"], group["eps_inside_sqrt"],
                        group["weight_decay"], statistics.data_ptr() + statistics.element_size() * 3 * index)
                    continue
                gradient = (momentum - beta1 * last) / (1 - beta1)
                fresh.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
                denominator = variance_denominator(group, variance)
                ratio = (denominator / variance_denominator(group, fresh)).max().double()
                statistics[index, 0] = torch.maximum(statistics[index, 0], ratio)
                if group["weight_decay"]:
                    preliminary = momentum / denominator
                    update = preliminary.add(param, alpha=group["weight_decay"])
                    statistics[index, 1] += torch.linalg.vector_norm(preliminary).double().square()
                    statistics[index, 2] += torch.linalg.vector_norm(update).double().square()

    def _whole_norms(self, *columns: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """As `parameter_norms`, from each piece's fp32 norm (a float64 norm is about 25x
        slower on a CPU): the squares of the pieces' norms, summed in float64 over the
        pieces and the ranks holding them. A whole parameter's norm is its fp32 norm."""
        device = next((value.device for column in columns for _, value in column), torch.device("cpu"))
        squares = torch.zeros(self.parameter_count, len(columns), dtype=torch.float64, device=device)
        for k, column in enumerate(columns):
            for param, value in column:
                squares[self.shard_of(param).index, k] += torch.linalg.vector_norm(value).double().square()
        return self.sum_over_shards(squares).sqrt()


def _trust_ratio(weight_norm: float, update_norm: float, group: dict) -> float:
    """||w|| / ||u|| clamped to [min_coeff, max_coeff]; 1 when either norm is zero."""
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    return min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])


def _update_scale(state: dict[str, Any], group: dict, step_size: float, maximum: float,
                  norms: tuple[float, float]) -> float:
    """The multiplier of m / d(v) (+ weight decay) in a parameter's update, from its
    largest variance factor and (with weight decay) its ||m / d|| and ||u||; its
    `last_factor` advanced."""
    share = 1.0
    if group["weight_decay"]:
        share = min(1.0, norms[0] / norms[1]) if norms[1] else 1.0
    factor = _bounded_factor(maximum, share, state["last_factor"], group)
    state["last_factor"] = factor
    return -step_size * state["lamb_coeff_freeze"] * factor


def _bounded_factor(factor: float, share: float, last: float, group: dict) -> float:
    """The paper's limits on the variance factor: weight decay's share of the update is not
    rescaled (`share` = ||m/(√v+eps)|| / ||u||, 1 without weight decay), the factor stays
    within [factor_min, factor_max], and moves by at most factor_threshold (relative) per step."""
    factor = factor * share + (1 - share)
    factor = min(max(factor, group["factor_min"]), group["factor_max"])
    threshold = group["factor_threshold"]
    return min(max(factor, last * (1 - threshold)), last * (1 + threshold))


@dataclass(frozen=True)
class OneBitLambParams(OneBitAdamParams):
    """1-bit LAMB with DeepSpeed's `OneBitLamb` parameters and defaults: LAMB's trust-ratio
    bounds, and the limits on the variance factor that replaces the trust ratio after the
    warm-up."""

    max_coeff: float = param(10.0, ge=0)
    min_coeff: float = param(0.01, ge=0)
    coeff_beta: float = param(0.9, ge=0, lt=1)
    factor_max: float = param(4.0, gt=0)
    factor_min: float = param(0.5, gt=0)
    factor_threshold: float = param(0.1, ge=0)

    def __post_init__(self) -> None:
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff {self.min_coeff} is above max_coeff {self.max_coeff}")
        if self.factor_min > self.factor_max:
            raise ValueError(f"factor_min {self.factor_min} is above factor_max {self.factor_max}")


# K after the warm-up: 1-bit Adam's, and the fresh variance.
register_optimizer(OptimizerSpec(
    "OneBitLamb", OneBitLambParams, lambda groups, params: OneBitLamb(groups, **params),
    fp32_states=lambda params: 4, codec=OneBitCodec(), per_parameter=True, zero_stages=ZERO_STAGES, offload=False,
    state_terms=lambda stage, dtype, grad_dtype=None: onebit_state_terms(stage, dtype, lamb=True,
                                                                   grad_dtype=grad_dtype),
    main_job_params=lambda adamw, steps: {**main_job_params(adamw, steps), "lr": MAIN_JOB_LR},
))
