"""1-bit Adam and 1-bit LAMB in the engine (ZeRO stage 0): equal to the single-process
simulation of the same algorithm with N workers (tests/optim/onebit_reference.py), with
gradients reduced by the engine only during the warm-up, the compressed exchange counted
to the byte, and the optimizer state equal to its formula."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.planner.comm_formulas import onebit_exchange_bytes
from shardwise.planner.formulas import onebit_state_bytes
from shardwise.testing import run_distributed
from tests.optim.onebit_reference import OneBitSettings, Simulation
from tests.zero.workers import build_model, global_batch, model_loss, relative_error

STEPS = 5  # freeze_step 2: two full-precision steps, three compressed


def config(settings: OneBitSettings, stage: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": settings.rows, "gradient_clipping": settings.clipping,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
            "optimizer": settings.optimizer_block()}


def train_engine(rank: int, world_size: int, settings: OneBitSettings, steps: range = range(STEPS),
                 load_dir: str | None = None, save_dir: str | None = None) -> dict:
    engine = shardwise.initialize(build_model("gpt"), config(settings))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    losses, volumes, frozen = [], [], {}
    for step in steps:
        x, y = global_batch(step, settings.rows * world_size)
        rows = slice(rank * settings.rows, (rank + 1) * settings.rows)
        engine.reset_comm_volume()
        loss = model_loss(engine, "gpt", x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        volumes.append(engine.comm_volume())
        losses.append(loss.detach())
        if step + 1 == settings.freeze_step:
            frozen = _state_by_name(engine)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / world_size
    optimizer = engine.optimizer.optimizer
    return {
        "losses": losses.tolist(),
        "params": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
        "order": [optimizer.shard_of(segment.master).name for segment in engine.optimizer.segments],
        "units": [(unit.padded_numel, [(slot.name, slot.offset) for slot in unit.slots]) for unit in engine.units],
        "volumes": volumes,
        "at_freeze": frozen,
        "final": _state_by_name(engine),
        "optimizer_states": engine.memory_breakdown()["optimizer_states"],
        "numel": engine.num_parameters(),
    }


def _state_by_name(engine: shardwise.Engine) -> dict:
    """Weights and optimizer state by parameter name (stage 0: whole parameters)."""
    optimizer = engine.optimizer.optimizer
    state = {}
    for segment in engine.optimizer.segments:
        name = optimizer.shard_of(segment.master).name
        state[name] = {key: value.clone() if torch.is_tensor(value) else value
                       for key, value in optimizer.state[segment.master].items()}
        state[name]["weight"] = segment.master.detach().clone()
    return state


def assert_equal_to(result: dict, losses: list[float], params: dict[str, torch.Tensor]) -> None:
    for step, (got, want) in enumerate(zip(result["losses"], losses)):
        assert abs(got - want) / want < 1e-5, f"step {step}: loss {got} vs simulated {want}"
    for name, want in params.items():
        error = relative_error(result["params"][name], want)
        assert error < 1e-5, f"{name}: relative error {error:.2e} from the simulation"


@pytest.mark.parametrize(("algorithm", "ranks"), [("adam", 2), ("lamb", 2), ("adam", 4), ("lamb", 4)])
def test_equals_simulation_of_n_workers(algorithm, ranks):
    """Losses and weights equal the simulation's; after the warm-up no gradient is
    all-reduced and the exchange sends exactly the formula's bytes, at most 1/16 of an
    fp32 all-reduce plus the scales; the optimizer state equals its formula."""
    settings = OneBitSettings(algorithm, weight_decay=0.01, clipping=0.05)
    results = run_distributed(train_engine, ranks, settings)
    simulation = Simulation(settings, ranks, results[0]["order"], results[0]["units"])
    losses = simulation.train(range(settings.freeze_step))
    # gloo sums 4 ranks' gradients in an order of its own: the warm-up agrees to rounding,
    # then the compressed phase starts from the engine's state, where it must agree exactly
    # (a sign compressor turns a last-bit difference into a flip)
    simulation.adopt(results[0]["at_freeze"], tolerance=1e-5)
    losses += simulation.train(range(settings.freeze_step, STEPS))
    numel = results[0]["numel"]
    fp32_all_reduce = 2 * 4 * numel * (ranks - 1) // ranks
    exchange = onebit_exchange_bytes(numel, ranks)
    for result in results:
        assert_equal_to(result, losses, simulation.weights())
        for step, volume in enumerate(result["volumes"]):
            if step < settings.freeze_step:
                assert volume["all_reduce"] == fp32_all_reduce and volume["all_to_all"] == 0, step
                continue
            assert volume["all_reduce"] == 0, f"step {step}: gradients were all-reduced after the warm-up"
            assert volume["all_to_all"] == exchange["all_to_all"] and volume["all_gather"] == exchange["all_gather"]
            scales = 2 * 4 * ranks * (ranks - 1) // ranks
            assert volume["all_to_all"] + volume["all_gather"] <= fp32_all_reduce / 16 + scales
        assert result["optimizer_states"] == onebit_state_bytes(numel, ranks, lamb=algorithm == "lamb")


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
