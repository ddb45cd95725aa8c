"""`gathered_for_generation` (C4, C32): a stage-3 model gathered once, inside which each
rank runs as many gradient-free forwards as it needs (generation stops at different
lengths on different ranks) with no collective; training goes on unchanged after it."""

import torch

import shardwise
from shardwise.runtime.zero.gathered import gathered_for_generation
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch, relative_error

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}


def _worker(rank: int, world_size: int) -> dict:
    model = build_model("gpt")
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": STAGE3},
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0, 2 * world_size)
    rows = slice(2 * rank, 2 * rank + 2)
    engine.backward(engine(x[rows], y[rows]))  # a step first, so the hooks hold a trace
    engine.step()
    engine.reset_comm_volume()
    logits = []
    with torch.no_grad(), gathered_for_generation(model.parameters()):
        for length in range(2, 4 + 2 * rank):  # rank 0: 2 forwards, rank 1: 4
            logits.append(model(x[0:1, :length]).clone())
    volume = engine.comm_volume()
    with_grad = None
    with gathered_for_generation(model.parameters()):
        try:
            model(x[0:1, :2])
        except RuntimeError as error:
            with_grad = str(error)
    engine.backward(engine(x[rows], y[rows]))
    engine.step()
    padded = engine.num_parameters() + engine.padding_elements()
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"logits": logits, "all_gather": volume["all_gather"], "padded": padded, "with_grad": with_grad,
            "params": params}


def _reference(world_size: int) -> tuple[list[torch.Tensor], dict]:
    model = build_model("gpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batch(0, 2 * world_size)
    logits = []
    for step in range(2):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            with torch.no_grad():
                logits = [model(x[0:1, :length]) for length in range(2, 6)]
    return logits, {name: param.detach() for name, param in model.named_parameters()}


def test_ranks_run_different_numbers_of_forwards_on_one_gather():
    results = run_distributed(_worker, 2)
    logits, params = _reference(2)
    for rank, result in enumerate(results):
        assert len(result["logits"]) == 2 + 2 * rank
        for got, want in zip(result["logits"], logits):
            assert relative_error(got, want) < 1e-5
        # one all-gather of every partitioned unit, (Ψ−P)p(S−1)/S with P = 0, however many forwards
        assert result["all_gather"] == result["padded"] * 4 // 2
        assert "ran a forward with gradients" in result["with_grad"] and "torch.no_grad()" in result["with_grad"]
        for name, want in params.items():
            assert relative_error(result["params"][name], want) < 1e-5, name
