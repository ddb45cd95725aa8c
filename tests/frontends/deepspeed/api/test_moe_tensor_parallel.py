"""`MoE(enable_expert_tensor_parallelism=True)` under tensor parallelism: each expert (two
nn.Linear layers) split over the tensor group as a Megatron MLP
(shardwise/runtime/parallel/expert/tensor_split.py). tp=2 x ep=2 on 4 ranks trains like
the every-expert model in one process on the same global batch (fp32, losses, gradient
norms and the replicated weights < 1e-5 relative, the norm clipped: the second Linear's
bias, whole on every tensor rank, counted once); experts it cannot split are refused.

Top-2 routing is a discontinuous choice: the comparison is 3 steps of a tiny model with a
capacity no token exceeds, whose routing margins are far above last-bit differences.
"""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.frontends.deepspeed.api.moe.layer import MoE
from shardwise.frontends.deepspeed.api.moe.utils import split_params_into_different_moe_groups_for_optimizer
from shardwise.tools.testing import DistributedTestError, run_distributed

ROWS, STEPS, AUX, LR, EPS, CLIP = 8, 3, 0.01, 1e-2, 1e-4, 0.05  # eps >= 1e-4: tests/runtime/zero/workers.py ADAM_EPS
TOLERANCE = 1e-5


class TensorMoeNet(nn.Module):
    """Dense layers around one top-2 MoE layer whose experts are two-layer MLPs (copies of
    one expert, as DeepSpeed builds them, so a rank holding E/P of them holds the same
    starting weights as the every-expert model's)."""

    def __init__(self, ep_size: int = 1, split: bool = False):
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(6, 12)
        expert = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 12))
        self.moe = MoE(12, expert, num_experts=4, ep_size=ep_size, k=2, capacity_factor=4.0, min_capacity=0,
                       enable_expert_tensor_parallelism=split, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, aux, _ = self.moe(torch.relu(self.inp(x)))
        return nn.functional.cross_entropy(self.out(hidden), y) + AUX * aux


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(70 + step)
    return torch.randn(rows, 6, generator=generator), torch.randint(0, 4, (rows,), generator=generator)


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    return torch.optim.AdamW(groups, lr=LR, eps=EPS)


def config(tensor: int) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 1}, "gradient_clipping": CLIP,
            "tensor_parallel": {"size": tensor, "plan": {"out": "colwise_gather"}}}


def train_steps(engine, steps: range, norms: list[float] | None = None) -> list[float]:
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    losses = []
    for step in steps:
        x, y = batch(step, ROWS * data_size)
        loss = engine(x[data_rank * ROWS:(data_rank + 1) * ROWS], y[data_rank * ROWS:(data_rank + 1) * ROWS])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if norms is not None:
            norms.append(engine.last_grad_norm)
    return losses


def train_parallel(rank: int, world_size: int) -> dict:
    model = TensorMoeNet(ep_size=2, split=True)
    engine = shardwise.initialize(model, config(2), optimizer=optimizer_of(model))
    norms: list[float] = []
    losses = train_steps(engine, range(STEPS), norms)
    data_rank = engine.mesh.data_rank
    expert = model.moe.deepspeed_moe.experts.local[0]
    replicated = {name: param.detach().clone() for name, param in model.named_parameters()
                  if name.startswith(("inp.", "moe.deepspeed_moe.gate."))}
    return {"losses": losses, "norms": norms, "data_rank": data_rank, "replicated": replicated,
            "expert_local_shapes": [tuple(expert[0].weight.shape), tuple(expert[2].weight.shape)]}


def train_reference(data_size: int) -> dict:
    """Every expert in one process; each data rank's rows routed on their own (capacity and
    the auxiliary loss are per rank), the ranks' losses averaged."""
    model = TensorMoeNet()
    optimizer = optimizer_of(model)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, ROWS * data_size)
        per_rank = [model(x[d * ROWS:(d + 1) * ROWS], y[d * ROWS:(d + 1) * ROWS]) for d in range(data_size)]
        (sum(per_rank) / data_size).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "norms": norms,
            "params": {name: param.detach().clone() for name, param in model.named_parameters()}}


def test_tp2_ep2_with_expert_tensor_parallelism_matches_every_expert_model():
    results = run_distributed(train_parallel, 4, timeout=240)
    want = train_reference(2)
    assert min(want["norms"]) > CLIP  # every step clipped: the norm decides the update
    for result in results:
        for got, expected in zip(result["norms"], want["norms"]):
            assert abs(got - expected) < TOLERANCE * expected, (result["norms"], want["norms"])
        assert result["expert_local_shapes"] == [(8, 12), (12, 8)]  # each expert's width 16 split over 2
        for step, got in enumerate(result["losses"]):
            expected = want["losses"][step][result["data_rank"]]
            assert abs(got - expected) < TOLERANCE * abs(expected), (step, result["losses"], expected)
        for name, got in result["replicated"].items():
            error = ((got - want["params"][name]).norm() / want["params"][name].norm()).item()
            assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


def _initialize_with(rank: int, world_size: int, expert: nn.Module) -> None:
    model = TensorMoeNet(ep_size=2, split=True)
    model.moe = MoE(12, expert, num_experts=4, ep_size=2, enable_expert_tensor_parallelism=True)
    shardwise.initialize(model, config(2), optimizer=optimizer_of(model))


@pytest.mark.parametrize("expert, message", [
    (nn.Linear(12, 12), r"splits an expert made of two nn.Linear layers .* this expert \(Linear\) has 1"),
    (nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 8), nn.Linear(8, 12)), r"this expert \(Sequential\) has 3"),
], ids=["one-linear", "three-linears"])
def test_experts_it_cannot_split_are_refused(expert, message):
    with pytest.raises(DistributedTestError, match=message):
        run_distributed(_initialize_with, 4, expert)


def resume_at_ep1(rank: int, world_size: int, directory: str) -> dict:
    """2 steps at tp=2 x ep=2, a checkpoint; a fresh engine at tp=2 x ep=1 (every expert
    among the dense parameters, still split by the tensor group) loads it and takes the
    last step."""
    model = TensorMoeNet(ep_size=2, split=True)
    engine = shardwise.initialize(model, config(2), optimizer=optimizer_of(model))
    train_steps(engine, range(STEPS - 1))
    engine.save_checkpoint(directory)
    model = TensorMoeNet(ep_size=1, split=True)
    engine = shardwise.initialize(model, config(2), optimizer=optimizer_of(model))
    engine.load_checkpoint(directory)
    return {"losses": train_steps(engine, range(STEPS - 1, STEPS)), "data_rank": engine.mesh.data_rank}


@pytest.mark.slow
def test_tensor_split_experts_checkpoint_resumes_at_another_expert_parallel_size(tmp_path):
    """Each rank's tensor block of its experts is stored as the runs of the whole expert
    (the experts' checkpoint pieces follow the tensor placement), so ep=1 reads them."""
    want = train_reference(2)
    for result in run_distributed(resume_at_ep1, 4, str(tmp_path / "checkpoint"), timeout=240):
        expected = want["losses"][STEPS - 1][result["data_rank"]]
        assert abs(result["losses"][0] - expected) < TOLERANCE * abs(expected), (result["losses"], expected)
