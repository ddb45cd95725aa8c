"""1-bit Adam against the paper's update rule (Tang et al., 2021, Algorithm 1), written out
below from the paper with plain float64 tensors, on a toy problem: a least-squares
objective split over 2 ranks, each holding its own data.

Why step by step: the rule sends signs, so a last-bit difference in a float32 sum (BLAS
kernels differ between CPUs) can flip the sign of an element near zero, and from then on
two runs of the same rule part ways (after ~300 steps here, on some machines and not on
others). So each step of the engine is checked against one step of the rule applied to
the engine's own state before that step, in float64. Where the rule's input to a sign is
within rounding of zero, either sign is the rule: the check then follows the engine's
choice (read back from what it kept as error feedback) and tests everything else exactly.
Convergence is checked apart, on the engine's final point.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.tools.testing import run_distributed

DIM, QUADRATIC_STEPS, WARM_UP, WORKERS = 64, 300, 10, 2
LR, BETA1, BETA2, EPS = 0.01, 0.9, 0.99, 1e-8
# an input to a sign closer to zero than this (relative to its chunk's scale) may go either
# way between float32 and float64; far above float32's rounding (6e-8), far below any
# sign the rule decides for real
AMBIGUOUS = 1e-4
TOLERANCE = 1e-5  # float32 engine against the float64 rule, one step from the same state


@pytest.fixture(scope="module")
def engine_states() -> list[list[dict[str, torch.Tensor]]]:
    """Per rank, the engine's state after every step of one 2-rank run."""
    return run_distributed(_quadratic_on_rank, WORKERS)


def test_paper_update_rule_step_by_step(engine_states):
    """Every step of 1-bit Adam at 2 ranks on f(x) = Σ_i ½||A_i x − b_i||² / 2 (rank i
    holds A_i, b_i) is Algorithm 1 of Tang et al. (2021) (no bias correction, as the
    paper): Adam on the averaged gradient for the warm-up, then frozen variance and the
    momentum exchanged at one bit per element with error feedback on both sides."""
    for step in range(1, QUADRATIC_STEPS + 1):
        before = [rank[step - 1] for rank in engine_states]
        after = [rank[step] for rank in engine_states]
        _check_step(step, before, after)


def test_one_bit_adam_closes_the_gap_to_the_optimum(engine_states):
    """The same run ends close to the least-squares optimum."""
    final = engine_states[0][-1]["x"].double()
    optimum, start = _quadratic_optimum(), _quadratic_loss(torch.zeros(DIM, dtype=torch.float64))
    assert _quadratic_loss(final) - optimum < 0.05 * (start - optimum)


def _quadratic_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(256, DIM, generator=generator) / 16, torch.randn(256, generator=generator)


class _Quadratic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(DIM))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 0.5 * (a @ self.x - b).square().sum()


def _quadratic_on_rank(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """The engine's state after every step (index 0: before the first): x, the momentum m,
    the variance v, and this rank's worker and server error-feedback buffers."""
    params = {"lr": LR, "freeze_step": WARM_UP, "bias_correction": False, "betas": [BETA1, BETA2], "eps": EPS}
    engine = shardwise.initialize(_Quadratic(), {"train_micro_batch_size_per_gpu": 1,
                                                 "optimizer": {"type": "OneBitAdam", "params": params}})
    a, b = _quadratic_data(rank)
    states = [_state_of(engine)]
    for _ in range(QUADRATIC_STEPS):
        engine.backward(engine(a, b))
        engine.step()
        states.append(_state_of(engine))
    return states


def _state_of(engine) -> dict[str, torch.Tensor]:
    optimizer = engine.optimizer.optimizer
    (param,) = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state.get(param) or {}
    zeros = torch.zeros(DIM)
    exchange = optimizer._exchange  # created by the first compressed step
    return {
        "x": engine.module.x.detach().clone(),
        "m": state.get("exp_avg", zeros).detach().clone().reshape(-1),
        "v": state.get("exp_avg_sq", zeros).detach().clone().reshape(-1),
        "worker_error": zeros.clone() if exchange is None else exchange.worker_error[:DIM].clone(),
        "server_error": torch.zeros(DIM // WORKERS) if exchange is None else exchange.server_error.clone(),
    }


def _gradient(rank: int, x: torch.Tensor) -> torch.Tensor:
    a, b = (t.double() for t in _quadratic_data(rank))
    return a.T @ (a @ x - b)


def _check_step(step: int, before: list[dict], after: list[dict]) -> None:
    x, m, v = (before[0][key].double() for key in ("x", "m", "v"))
    gradients = [_gradient(i, x) for i in range(WORKERS)]
    if step <= WARM_UP:  # the original Adam on the averaged gradient (no bias correction)
        g = sum(gradients) / WORKERS
        m = BETA1 * m + (1 - BETA1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
        for rank in after:
            _assert_close(rank["m"], m, f"step {step}: momentum")
            _assert_close(rank["v"], v, f"step {step}: variance")
    else:  # v frozen; m_t^(i) = β1 m_{t−1} + (1 − β1) g_t^(i), compressed with error feedback
        sent = []
        for i in range(WORKERS):
            local = BETA1 * m + (1 - BETA1) * gradients[i] + before[i]["worker_error"].double()
            signs = _chosen_signs(local, after[i]["worker_error"].double(), f"step {step}: worker {i}")
            compressed = signs * _scales(local)
            _assert_close(after[i]["worker_error"], local - compressed, f"step {step}: worker {i}'s error")
            sent.append(compressed)
        averaged = sum(sent) / WORKERS
        chunk = DIM // WORKERS
        for j in range(WORKERS):  # rank j is the server of chunk j
            part = averaged[j * chunk:(j + 1) * chunk] + before[j]["server_error"].double()
            signs = _chosen_signs(part.view(1, -1), after[j]["server_error"].double().view(1, -1),
                                  f"step {step}: server {j}", chunks=1).view(-1)
            compressed = signs * _scales(part.view(1, -1), chunks=1).view(-1)
            _assert_close(after[j]["server_error"], part - compressed, f"step {step}: server {j}'s error")
            for rank in after:
                _assert_close(rank["m"][j * chunk:(j + 1) * chunk], compressed, f"step {step}: momentum chunk {j}")
        m = after[0]["m"].double()
    for rank in after:
        _assert_close(rank["x"], x - LR * m / (v.sqrt() + EPS), f"step {step}: x")


def _scales(vector: torch.Tensor, chunks: int = WORKERS) -> torch.Tensor:
    """C_ω's scale ||chunk||/√d for each element's chunk (one chunk per server)."""
    rows = vector.reshape(chunks, -1)
    return (torch.linalg.vector_norm(rows, dim=-1, keepdim=True) / rows.shape[-1] ** 0.5).expand_as(rows).reshape(-1)


def _chosen_signs(value: torch.Tensor, error_after: torch.Tensor, what: str, chunks: int = WORKERS) -> torch.Tensor:
    """The signs C_ω gave `value`: the rule's own (+1 for >= 0), except where `value` is
    within rounding of zero, where the engine's choice is read back from its error
    feedback (error = value − sign·scale, so value − error is ±scale, far from zero)."""
    flat = value.reshape(-1)
    rule = torch.where(flat >= 0, 1.0, -1.0).double()
    engine = torch.where(flat - error_after.reshape(-1) >= 0, 1.0, -1.0).double()
    ambiguous = flat.abs() < AMBIGUOUS * _scales(flat, chunks)
    disagree = (rule != engine) & ~ambiguous
    assert not disagree.any(), f"{what}: signs differ from the rule at {disagree.nonzero().flatten().tolist()}"
    return torch.where(ambiguous, engine, rule)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert error < TOLERANCE, f"{what}: relative error {error:.2e} from the paper's rule"


def _quadratic_loss(x: torch.Tensor) -> float:
    total = 0.0
    for rank in range(WORKERS):
        a, b = (t.double() for t in _quadratic_data(rank))
        total += 0.5 * (a @ x - b).square().sum().item()
    return total / WORKERS


def _quadratic_optimum() -> float:
    a = torch.cat([_quadratic_data(i)[0] for i in range(WORKERS)]).double()
    b = torch.cat([_quadratic_data(i)[1] for i in range(WORKERS)]).double()
    return _quadratic_loss(torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1))
