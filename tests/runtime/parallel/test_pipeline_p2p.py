"""Pipeline point-to-point messages pair by order alone, as NCCL pairs them (it ignores
tags): at every step, a rank's batch of sends and receives with a peer is the mirror image
of the peer's batch with it, operation by operation, and every message arrives in a step
before the pass that needs it. Checked on the plans of every schedule without processes,
and on the batches two processes really issue (`dist.batch_isend_irecv` recorded), which
carry no tag: gloo, which would otherwise match by tag, then matches by order as NCCL
does, and interleaved 1F1B over two chunks with a tied embedding (several messages between
the same two ranks in one batch) still trains exactly like one process."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from shardwise.runtime.parallel.pipeline.plan import Message, MessagePlan
from shardwise.runtime.parallel.pipeline.schedules import Action, schedule_actions, timeline
from shardwise.runtime.parallel.pipeline.split import SharedParameters
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.pipeline_workers import PipeCase, train_pipeline
from tests.runtime.parallel.test_pipeline import VOCAB, WIDTH, assert_matches, assert_p2p_bytes

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]


def plans(schedule: str, size: int, m: int, virtual: int, shared: dict[int, SharedParameters] | None = None,
          train: bool = True) -> list[MessagePlan]:
    if train:
        queues = [schedule_actions(schedule, rank, size, m, virtual) for rank in range(size)]
    else:  # an evaluation: the runner's forwards only
        queues = [[Action("forward", chunk, i) for i in range(m) for chunk in range(virtual)]] * size
    steps = timeline(queues, virtual)
    return [MessagePlan(steps, rank, virtual, m, True, (shared or {}).get(rank)) for rank in range(size)]


def with_peer(plan: MessagePlan, messages: list[Message], peer: int) -> list[tuple[str, Message]]:
    """This rank's operations with `peer`, as (direction, message)."""
    ops = []
    for message in messages:
        source, target = plan.rank_of(message.source), plan.rank_of(message.target)
        if {source, target} == {plan.rank, peer}:
            ops.append(("send" if source == plan.rank else "receive", message))
    return ops


def mirror(ops: list[tuple[str, Message]]) -> list[tuple[str, Message]]:
    return [("receive" if direction == "send" else "send", message) for direction, message in ops]


def needs(plan: MessagePlan, step: int) -> list[Message]:
    """The messages this rank's pass at `step` uses."""
    action = plan.mine[step]
    size, last = plan.size, plan.last_stage
    stage, i = action.chunk * size + plan.rank, action.micro_batch
    if action.kind == "forward":
        return [Message("activation", stage - 1, stage, i)] if stage > 0 else []
    used = [Message("gradient", stage + 1, stage, i)] if stage < last else []
    final = step == max(s for s, a in enumerate(plan.mine) if a is not None and a.kind == "backward")
    if final and stage == 0:
        used.append(Message("tied gradient", last, 0))
    if final:
        used += [Message("shared gradients", user, plan.rank) for user, owners in plan.shared_gradients.items()
                 if plan.rank in owners]
    return used


def assert_pairs_and_arrives_in_time(all_plans: list[MessagePlan]) -> None:
    size = len(all_plans)
    for step in range(len(all_plans[0].mine)):
        for a in range(size):
            for b in range(size):
                if a != b:
                    ours = with_peer(all_plans[a], all_plans[a].at(step), b)
                    theirs = with_peer(all_plans[b], all_plans[b].at(step), a)
                    assert ours == mirror(theirs), f"step {step}, ranks {a} and {b}"
    for plan in all_plans:
        arrived: dict[Message, int] = {}
        for step in range(len(plan.mine)):
            for message in plan.at(step):
                if plan.rank_of(message.target) == plan.rank:
                    assert message not in arrived, f"{message} received twice"
                    arrived[message] = step
        for message in plan.prologue():
            if plan.rank_of(message.target) == plan.rank:
                arrived[message] = -1
        used = Counter()
        for step, action in enumerate(plan.mine):
            if action is None:
                continue
            for message in needs(plan, step):
                assert arrived.get(message, step) < step, f"rank {plan.rank} step {step}: {message} not there yet"
                used[message] += 1
        assert set(used) | {m for m in arrived if m.kind in ("tied weight", "shared weights")} == set(arrived)


@pytest.mark.parametrize("schedule,virtual", CASES)
@pytest.mark.parametrize("size,m", [(2, 4), (3, 6), (4, 4), (4, 8)])
def test_every_batch_mirrors_its_peers_batch_and_arrives_before_its_pass(schedule, virtual, size, m):
    assert_pairs_and_arrives_in_time(plans(schedule, size, m, virtual))


def test_shared_layers_and_forward_only_batches_pair_too():
    """Stage 0 owns a layer that stage 2 also uses (values out before the first pass, the
    gradient back after stage 2's last backward); and an evaluation's forwards only."""
    shared = {0: SharedParameters(sends={2: ["layers.0.weight"]}, requires_grad={2: True}),
              2: SharedParameters(receives={0: [("layers.3.weight", torch.Size([4]))]}, requires_grad={0: True})}
    for schedule in ("gpipe", "1f1b"):
        all_plans = plans(schedule, 3, 6, 1, shared)
        assert_pairs_and_arrives_in_time(all_plans)
        assert Message("shared gradients", 2, 0) in [m for s in range(len(all_plans[0].mine)) for m in
                                                     all_plans[0].at(s)]
    assert_pairs_and_arrives_in_time(plans("gpipe", 3, 4, 2, train=False))


def train_recording_batches(rank: int, world_size: int, case: PipeCase) -> dict:
    """`train_pipeline`, with every batch of point-to-point operations it issues recorded."""
    batches = []
    original = dist.batch_isend_irecv

    def recording(operations):
        batches.append([("send" if op.op is dist.isend else "receive", op.peer, tuple(op.tensor.shape),
                         op.tensor.dtype, op.tag) for op in operations])
        return original(operations)

    dist.batch_isend_irecv = recording
    try:
        result = train_pipeline(rank, world_size, case)
    finally:
        dist.batch_isend_irecv = original
    return {**result, "rank": rank, "batches": batches}


def test_interleaved_two_chunks_pairs_its_batches_without_tags_and_matches_one_process():
    case = PipeCase(schedule="interleaved", virtual=2, model="gpt4", steps=2)
    results = run_distributed(train_recording_batches, 2, case)
    assert_matches(results, case, 1)
    assert_p2p_bytes(results, case, tied_bytes=VOCAB * WIDTH * 4)
    first, second = sorted(results, key=lambda result: result["rank"])
    assert len(first["batches"]) == len(second["batches"]) > 0
    several = 0
    for ours, theirs in zip(first["batches"], second["batches"]):
        assert all(tag == 0 for *_, tag in ours + theirs)
        assert [(d, shape, dtype) for d, _, shape, dtype, _ in ours] == \
               [("receive" if d == "send" else "send", shape, dtype) for d, _, shape, dtype, _ in theirs]
        several += max(Counter(d for d, *_ in ours).values()) > 1
    assert several > 0  # batches with two messages to the same peer: only their order tells them apart
