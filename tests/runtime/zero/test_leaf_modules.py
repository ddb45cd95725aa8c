"""Leaf modules at stage 3 (runtime/zero/leaf_modules.py): a mixture of experts whose
experts are modules of their own runs only the experts its tokens chose, so ranks with
different tokens enter different modules. Without a leaf the ranks' gathers disagree
and the step fails on every rank, naming the divergence; with the MoE block a leaf,
training equals one process on the whole batch."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime.reliability.errors import DivergentExecutionError
from shardwise.runtime.zero.leaf_modules import (
    LeafModulePolicy,
    leaf_modules,
    mark_gathered_whole,
    modules_under_granularity,
)
from shardwise.tools.testing import DistributedTestError, run_distributed

WIDTH, EXPERTS, ROWS_PER_RANK, STEPS = 8, 4, 4, 3


class TopOneExperts(nn.Module):
    """Each row goes to the expert its gate scores highest, scaled by that score."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
                                     for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)
        weight, choice = scores.max(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows, None])
        return out


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), TopOneExperts(), nn.Linear(WIDTH, 1))


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, 1, generator=generator)


CONFIG = {"train_micro_batch_size_per_gpu": ROWS_PER_RANK, "zero_optimization": {
    "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}


def train(rank: int, world_size: int, leaf: bool, config: dict = CONFIG,
          prepare: Callable[[nn.Module], None] | None = None) -> dict:
    """`leaf`: mark the MoE block gathered whole; `prepare`: what a script does to the
    model before `initialize` (DeepSpeed's leaf-module calls)."""
    model = build()
    if leaf:
        mark_gathered_whole(model[1])
    if prepare is not None:
        prepare(model)
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, ROWS_PER_RANK * world_size)
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "units": len(engine.units)}


def reference(world_size: int) -> dict:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, ROWS_PER_RANK * world_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def assert_trains_as_one_process(results: list[dict]) -> None:
    want = reference(2)
    for step in range(STEPS):
        mean = (results[0]["losses"][step] + results[1]["losses"][step]) / 2
        assert mean == pytest.approx(want["losses"][step], rel=1e-5)
    for name, expected in want["params"].items():
        for result in results:
            error = ((result["params"][name] - expected).norm() / expected.norm()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
    assert results[0]["units"] == 3  # one per outer Linear, one for the whole block


def test_a_leaf_moe_block_trains_as_one_process():
    assert_trains_as_one_process(run_distributed(train, 2, True))


def test_without_the_leaf_ranks_diverge_and_say_so():
    with pytest.raises(DistributedTestError, match="DivergentExecutionError"):
        run_distributed(train, 2, False)


def test_the_policy_picks_modules_by_class_name_and_suffix():
    model = build()
    assert leaf_modules(model, LeafModulePolicy(classes=("TopOneExperts",))) == {model[1]}
    qualified = f"{TopOneExperts.__module__}.TopOneExperts"
    assert leaf_modules(model, LeafModulePolicy(classes=(qualified,))) == {model[1]}
    assert leaf_modules(model, LeafModulePolicy(names=("1.experts.0",))) == {model[1].experts[0]}
    assert leaf_modules(model, LeafModulePolicy(name_suffixes=("experts",))) == {model[1].experts}
    assert leaf_modules(model, LeafModulePolicy()) == set()


# TopOneExperts: 1,156 parameters (the gate's 36, four experts' 280) over 10 counted
# modules (the gate, the experts' eight Linears, itself; Tanh holds none, and neither the
# experts' Sequentials nor the ModuleList count, being containers): 115 per module
EXPERT_BLOCK_GRANULARITY = 1156 // 10


@pytest.mark.parametrize(("threshold", "chosen"), [
    (EXPERT_BLOCK_GRANULARITY, {"1"}),
    (10**6, {"1"}),  # the root is a container and the Linears have no children: neither is ever chosen
    (EXPERT_BLOCK_GRANULARITY - 1, set()),  # nothing that fine: a warning, every module keeps its hooks
])
def test_the_granularity_threshold_picks_as_deepspeed_does(threshold, chosen, caplog):
    model = build()
    names = {module: name for name, module in model.named_modules()}
    assert {names[m] for m in modules_under_granularity(model, threshold)} == chosen
    assert {names[m] for m in leaf_modules(model, LeafModulePolicy(granularity_threshold=threshold))} == chosen
    assert ("raise the threshold to at least 115" in caplog.text) == (not chosen)


def test_a_block_chosen_by_granularity_trains_as_one_process():
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                              "stage3_module_granularity_threshold": EXPERT_BLOCK_GRANULARITY}}
    assert_trains_as_one_process(run_distributed(train, 2, False, config))
