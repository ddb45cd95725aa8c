"""Training runs for the tensor-parallel checkpoint tests: train, save at one tensor ×
data-parallel shape, then resume at another and finish the run.

The global batch of every step has the same rows whatever the shape (`ROWS`, split over
the data-parallel ranks), so an interrupted run that resumes at another shape must end
where the uninterrupted single-process run ends.
"""

from __future__ import annotations

from pathlib import Path

import torch

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.runtime.parallel.workers import build_model, make_optimizer
from tests.runtime.zero.workers import Case, global_batch, model_loss

ROWS = 4  # rows of every step's global batch


def case_for(model: str, stage: int, tensor: int, data: int, lr: float = 0.05) -> Case:
    return Case(stage=stage, model=model, micro_batch=ROWS // data, lr=lr,
                extra_config={"tensor_parallel": {"size": tensor}})


def train_reference(model_kind: str, steps: int, lr: float = 0.05) -> dict:
    """Plain PyTorch, one process, all `steps` without interruption."""
    model = build_model(model_kind)
    optimizer = make_optimizer(model, lr)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, ROWS)
        loss = model_loss(model, model_kind, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), Case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def train_phase(rank: int, world_size: int, case: Case, tensor: int, directory: str, load: bool,
                steps: int) -> dict:
    """Build the engine at `tensor` × (world_size / tensor); resume from `directory` when
    `load`; train `steps` steps; save to `directory` when not `load`. Returns the losses
    (averaged over data-parallel ranks) and the full weights."""
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    assert engine.mesh["tensor"].size == tensor
    if load:
        engine.load_checkpoint(directory)
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    losses = []
    for step in range(engine.global_steps, engine.global_steps + steps):
        x, y = global_batch(step, ROWS)
        rows = ROWS // data_size
        loss = model_loss(engine, case.model, x[data_rank * rows : (data_rank + 1) * rows],
                          y[data_rank * rows : (data_rank + 1) * rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / engine.comm.size
    if not load:
        engine.save_checkpoint(directory)
    comm = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: gather_full(p.detach().float(), tensor_shard(p), comm).cpu()
                  for name, p in model.named_parameters()}
    meta = (Path(directory) / "latest").read_text().strip() if rank == 0 and not load else None
    return {"losses": losses.tolist(), "params": params, "tag": meta}
