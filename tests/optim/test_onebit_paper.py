"""1-bit Adam against the paper's update rule (Tang et al., 2021, Algorithm 1), written out
below from the paper with plain tensors, on a toy problem: a least-squares objective split
over 2 ranks, each holding its own data."""

from __future__ import annotations

import torch

import shardwise
from shardwise.testing import run_distributed
from tests.zero.workers import relative_error


def test_paper_update_rule_on_a_quadratic():
    """1-bit Adam at 2 ranks on f(x) = Σ_i ½||A_i x − b_i||² / 2 (rank i holds A_i, b_i)
    equals Algorithm 1 of Tang et al. (2021) written out below (no bias correction, as
    the paper), and closes most of the gap to the optimum."""
    results = run_distributed(_quadratic_on_rank, WORKERS)
    expected, paper_loss = _quadratic_by_the_paper(WORKERS)
    for result in results:
        error = relative_error(result["x"], expected)
        assert error < 1e-5, f"relative error {error:.2e} from the paper's rule"
    optimum, start = _quadratic_optimum(WORKERS), _quadratic_loss(torch.zeros(DIM), WORKERS)
    assert paper_loss - optimum < 0.05 * (start - optimum), (paper_loss, optimum, start)


DIM, QUADRATIC_STEPS, WARM_UP, WORKERS = 64, 300, 10, 2


def _quadratic_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(256, DIM, generator=generator) / 16, torch.randn(256, generator=generator)


class _Quadratic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(DIM))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 0.5 * (a @ self.x - b).square().sum()


def _quadratic_on_rank(rank: int, world_size: int, steps: int = QUADRATIC_STEPS) -> dict:
    params = {"lr": 0.01, "freeze_step": WARM_UP, "bias_correction": False, "betas": [0.9, 0.99]}
    engine = shardwise.initialize(_Quadratic(), {"train_micro_batch_size_per_gpu": 1,
                                                 "optimizer": {"type": "OneBitAdam", "params": params}})
    a, b = _quadratic_data(rank)
    for _ in range(steps):
        engine.backward(engine(a, b))
        engine.step()
    return {"x": engine.module.x.detach().clone()}


def _compress(x: torch.Tensor) -> torch.Tensor:
    """C_ω: sign × ||x||/√d, applied per block of d/n elements (one block per server)."""
    return torch.where(x >= 0, 1.0, -1.0) * torch.linalg.vector_norm(x, dim=-1, keepdim=True) / x.shape[-1] ** 0.5


def _quadratic_by_the_paper(n: int, steps: int = QUADRATIC_STEPS, lr: float = 0.01, beta1: float = 0.9,
                            beta2: float = 0.99, eps: float = 1e-8) -> tuple[torch.Tensor, float]:
    data = [_quadratic_data(i) for i in range(n)]
    x, m, v = torch.zeros(DIM), torch.zeros(DIM), torch.zeros(DIM)
    worker_error = [torch.zeros(DIM) for _ in range(n)]
    server_error = torch.zeros(DIM)

    def gradient(i: int) -> torch.Tensor:
        a, b = data[i]
        return a.T @ (a @ x - b)

    for t in range(1, steps + 1):
        if t <= WARM_UP:  # the original Adam on the averaged gradient (no bias correction)
            g = sum(gradient(i) for i in range(n)) / n
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
        else:  # v frozen; m_t^(i) = β1 m_{t−1} + (1 − β1) g_t^(i), compressed with error feedback
            sent = []
            for i in range(n):
                local = beta1 * m + (1 - beta1) * gradient(i) + worker_error[i]
                compressed = _compress(local.view(n, -1)).view(-1)
                worker_error[i] = local - compressed
                sent.append(compressed)
            averaged = sum(sent) / n + server_error
            m = _compress(averaged.view(n, -1)).view(-1)
            server_error = averaged - m
        x = x - lr * m / (v.sqrt() + eps)
    return x, _quadratic_loss(x, n)


def _quadratic_loss(x: torch.Tensor, n: int) -> float:
    return sum(0.5 * (a @ x - b).square().sum().item() for a, b in map(_quadratic_data, range(n))) / n


def _quadratic_optimum(n: int) -> float:
    a = torch.cat([_quadratic_data(i)[0] for i in range(n)])
    b = torch.cat([_quadratic_data(i)[1] for i in range(n)])
    return _quadratic_loss(torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1), n)
