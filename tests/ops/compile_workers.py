"""Ranks for the compile-slot tests: train through the engine, report what Dynamo did.

Same model, batches and optimizer as tests/zero/workers.py, so the single-process eager
reference there (`train_reference`) is the expected result. Dynamo's counters are read
after the first step and at the end: unique graphs that appear after step 1 would be
recompilations, graph breaks anywhere would split a block.
"""

from __future__ import annotations

import torch
import torch._dynamo.utils as dynamo_utils

import shardwise
from shardwise.ops.kernel import kernel_fusion
from tests.zero.workers import Case, build_model, global_batch, make_optimizer, model_loss


def train_counting_graphs(rank: int, world_size: int, case: Case, eager_kernels: bool = False) -> dict:
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = build_model(case.model)
    if case.model == "llama":
        model.config.use_cache = False  # a KV cache per layer index would give each layer its own graph
    with kernel_fusion(not eager_kernels):
        engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
        losses, graphs_after_first_step = [], None
        for step in range(case.steps):
            x, y = global_batch(step, world_size * case.micro_batch)
            rows = slice(rank * case.micro_batch, (rank + 1) * case.micro_batch)
            loss = model_loss(engine, case.model, x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if step == 0:
                graphs_after_first_step = dynamo_utils.counters["stats"]["unique_graphs"]
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / world_size
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses.tolist(),
        "params": params,
        "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
        "graphs_after_first_step": graphs_after_first_step,
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
        "modules": sorted({type(m).__name__ for m in model.modules()}),
    }
