"""Ranks for the compile-slot tests: train through the engine, report what Dynamo did.

Same model, batches and optimizer as tests/runtime/zero/workers.py (or, with tensor parallelism,
tests/runtime/parallel/workers.py: SGD, the batch split over data-parallel ranks only, weights
gathered over the tensor group), so the single-process eager references there are the
expected results. Dynamo's counters are read after the first step and at the end: unique
graphs that appear after step 1 would be recompilations, graph breaks anywhere would split
a block.
"""

from __future__ import annotations

import torch
import torch._dynamo.utils as dynamo_utils

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.ops.kernel import kernel_fusion
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.runtime.parallel import workers as parallel_workers
from tests.runtime.zero.workers import Case, build_model, global_batch, make_optimizer, model_loss


def train_counting_graphs(rank: int, world_size: int, case: Case, eager_kernels: bool = False,
                          tensor_parallel: bool = False) -> dict:
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    model = (parallel_workers.build_model if tensor_parallel else build_model)(case.model)
    if case.model == "llama":
        model.config.use_cache = False  # a KV cache per layer index would give each layer its own graph
    optimizer = parallel_workers.make_optimizer(model, case.lr) if tensor_parallel else make_optimizer(model, case.lr)
    with kernel_fusion(not eager_kernels):
        engine = shardwise.initialize(model, case.config(world_size), optimizer=optimizer)
        data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
        losses, graphs_after_first_step = [], None
        for step in range(case.steps):
            x, y = global_batch(step, data_size * case.micro_batch)
            rows = slice(data_rank * case.micro_batch, (data_rank + 1) * case.micro_batch)
            loss = model_loss(engine, case.model, x[rows].to(engine.device), y[rows].to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if step == 0:
                graphs_after_first_step = dynamo_utils.counters["stats"]["unique_graphs"]
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / engine.comm.size
    tensor = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {n: gather_full(p.detach(), tensor_shard(p), tensor).to("cpu", copy=True)
                  for n, p in model.named_parameters()}
    return {
        "losses": losses.tolist(),
        "params": params,
        "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
        "graphs_after_first_step": graphs_after_first_step,
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
        "modules": sorted({type(m).__name__ for m in model.modules()}),
    }
