"""Rank functions for the fault tests: a run with an injected fault beside the run it must
equal (or the error it must raise).

A "plan" says, per step, what happens on which ranks: a normal step, a NaN loss, an
exception in forward (at block 1) or in backward, or the batch is skipped entirely (the
run that "never saw" a batch). Both runs of a comparison happen in the same processes,
one engine after the other, on identically seeded models.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

import shardwise
from shardwise.runtime.reliability.errors import DivergentExecutionError
from tests.runtime.zero.workers import Case, build_model, global_batch, make_optimizer, model_loss


class InjectedFault(RuntimeError):
    """What the tests raise inside forward or backward."""


@dataclass(frozen=True)
class Plan:
    case: Case
    steps: int = 4
    events: dict = field(default_factory=dict)  # (step, micro) -> (event, ranks or None for all)


def _raise_in_forward(module, args):
    raise InjectedFault("injected in forward")


def _raise_in_backward(module, grad_output):
    raise InjectedFault("injected in backward")


def _inject(model: torch.nn.Module, event: str):
    """A hook that raises in block 1's forward, or in block 0's backward (after the later
    blocks' gradients were computed and some of them reduced)."""
    if event == "forward":
        return model.blocks[1].register_forward_pre_hook(_raise_in_forward)
    if event == "backward":
        return model.blocks[0].register_full_backward_pre_hook(_raise_in_backward)
    return None


def run_plan(rank: int, world_size: int, plan: Plan) -> dict:
    """Train `plan.steps` global batches; returns losses seen, final weights, counters."""
    case = plan.case
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    rows = world_size * case.accumulation * case.micro_batch
    caught = 0
    for step in range(plan.steps):
        x, y = global_batch(step, rows)
        for micro in range(case.accumulation):
            event, ranks = plan.events.get((step, micro), ("normal", None))
            here = ranks is None or rank in ranks
            if event == "skip" and here:
                continue
            start = (micro * world_size + rank) * case.micro_batch
            inputs, targets = x[start:start + case.micro_batch], y[start:start + case.micro_batch]
            hook = _inject(model, event) if here else None
            try:
                loss = model_loss(engine, case.model, inputs, targets)
                if event == "nan" and here:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
            except InjectedFault:
                caught += 1
            finally:
                if hook is not None:
                    hook.remove()
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().to(torch.float32, copy=True) for n, p in model.named_parameters()}
    return {
        "params": params,
        "skipped_steps": engine.skipped_steps,
        "nonfinite_steps": engine.guard.nonfinite_steps,
        "global_steps": engine.global_steps,
        "caught": caught,
    }


def compare(rank: int, world_size: int, faulty: Plan, clean: Plan) -> tuple[dict, dict]:
    return run_plan(rank, world_size, faulty), run_plan(rank, world_size, clean)


def with_stage(case: Case, stage: int, dtype: str) -> Case:
    return dataclasses.replace(case, stage=stage, dtype=dtype)


class Branches(torch.nn.Module):
    """Three sub-layers registered in an order that may differ per rank, as a ModuleDict
    built from a set of names does under different hash seeds."""

    def __init__(self, order: list[str], width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleDict({name: torch.nn.Linear(width, width) for name in order})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in sorted(self.layers):
            x = self.layers[name](x)
        return x.square().mean()


def initialize_differently(rank: int, world_size: int, what: str) -> str:
    """Every rank builds an engine; `what` differs on rank 1. Returns "ok" if none raised."""
    order, width = ["a", "b", "c"], 8
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}}
    lr = 0.1
    if rank == 1:
        if what == "order":
            order = ["b", "a", "c"]
        elif what == "width":
            width = 16
        elif what == "stage":
            config["zero_optimization"]["stage"] = 1
        elif what == "bucket":
            config["zero_optimization"]["reduce_bucket_size"] = 200
        elif what == "lr":
            lr = 0.2
    model = Branches(order, width)
    shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    return "ok"


def save_on_one_rank(rank: int, world_size: int, directory: str, other: str) -> str:
    """Rank 0 saves; rank 1 trains on (`other` = "train") or loads (`other` = "load")."""
    case = Case(stage=2)
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    x, y = global_batch(0, 2 * world_size)
    engine.backward(model_loss(engine, case.model, x[:2], y[:2]))
    engine.step()
    if rank == 0:
        engine.save_checkpoint(directory)
    elif other == "load":
        engine.load_checkpoint(directory)
    else:
        engine.backward(model_loss(engine, case.model, x[:2], y[:2]))
        engine.step()
    return "finished"


def lose_a_peer(rank: int, world: int, store_path: str, report: str) -> None:
    """Process target (no harness, so the survivor lives to report): rank 1 exits right
    after initialize; rank 0 then runs a stage-2 step, whose reduce-scatter is a
    point-to-point exchange with rank 1 on gloo, and writes the error it gets."""
    import os
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["SHARDWISE_COLLECTIVE_TIMEOUT"] = "20"
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    case = Case(stage=2)
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world), optimizer=make_optimizer(model, case.lr))
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    x, y = global_batch(0, 4)
    try:
        engine.backward(model_loss(engine, case.model, x[:2], y[:2]))
        message = "no error"
    except Exception as error:  # the test reads the text
        message = f"{type(error).__name__}: {error}"
    with open(report, "w") as handle:
        handle.write(message)
    os._exit(0)


def save_into(rank: int, world_size: int, directory: str) -> str:
    """Every rank saves into `directory` after one step; returns the error it got."""
    case = Case(stage=2)
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    x, y = global_batch(0, 2 * world_size)
    engine.backward(model_loss(engine, case.model, x[:2], y[:2]))
    engine.step()
    try:
        engine.save_checkpoint(directory)
    except Exception as error:  # the test reads every rank's
        return f"{type(error).__name__}: {error}"
    return "saved"


def die_before_initialize(rank: int, world: int, store_path: str, report: str) -> None:
    """Process target (no harness, so the survivor lives to report): rank 1 exits after
    joining the process group, before initialize; rank 0's initialize writes its error."""
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["SHARDWISE_COLLECTIVE_TIMEOUT"] = "5"
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=5))
    # the group whole on both ranks first: gloo returns on one rank while the other may
    # still be connecting its pairs, and an exit then failed rank 0's init_process_group
    dist.barrier()
    if rank == 1:
        os._exit(3)
    case = Case(stage=2)
    model = build_model(case.model)
    try:
        shardwise.initialize(model, case.config(world), optimizer=make_optimizer(model, case.lr))
        message = "no error"
    except Exception as error:  # the test reads the text
        message = f"{type(error).__name__}: {error}"
    with open(report, "w") as handle:
        handle.write(message)
    os._exit(0)


def run_plan_until_divergence(rank: int, world_size: int, plan: Plan) -> dict:
    """`run_plan`, returning the DivergentExecutionError it ends with, and when (so the
    test sees every rank's, and that none waited for the collective timeout)."""
    started = time.monotonic()
    try:
        run_plan(rank, world_size, plan)
    except DivergentExecutionError as error:
        return {"error": f"{type(error).__name__}: {error}", "cause": repr(error.__cause__),
                "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}
