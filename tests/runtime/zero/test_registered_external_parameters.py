"""`register_external_parameters` (C4): a forward that projects through another module's
weight without calling it (a fused loss head, as TRL's) trains at stage 3 as in one
process; unregistered, it reads the weight's empty placeholder and fails."""

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.runtime.zero.external_parameters import register_external_parameters
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import VOCAB, global_batch, relative_error

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}
STEPS = 3


class FusedHeadNet(nn.Module):
    """The loss reads `head.weight` directly; `head` itself never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.body(self.embed(x)))
        return F.cross_entropy(F.linear(hidden, self.head.weight).reshape(-1, VOCAB), y.reshape(-1))


def _worker(rank: int, world_size: int, register: bool) -> dict:
    model = FusedHeadNet()
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": STAGE3},
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    if register:
        register_external_parameters(model, [model.head.weight])
    losses = []
    try:
        for step in range(STEPS):
            x, y = global_batch(step, 2 * world_size)
            loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except RuntimeError as error:
        return {"error": str(error)}
    with shardwise.gathered_parameters(list(model.parameters())):
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _reference(world_size: int) -> dict:
    model = FusedHeadNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    for step in range(STEPS):
        x, y = global_batch(step, 2 * world_size)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_registered_external_weight_trains_as_in_one_process():
    results = run_distributed(_worker, 2, True)
    expected = _reference(2)
    for result in results:
        assert "error" not in result, result.get("error")
        for name, want in expected.items():
            assert relative_error(result["params"][name], want) < 1e-5, name


def test_unregistered_external_weight_is_an_empty_placeholder():
    results = run_distributed(_worker, 2, False)
    for result in results:
        assert "size mismatch" in result.get("error", ""), result  # F.linear on the empty placeholder
