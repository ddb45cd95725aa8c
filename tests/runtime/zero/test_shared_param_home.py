"""Stage 3's parameters shared in memory by the ranks of one host (zero/shared_param_home.py,
issue 27 item 2): training, edits and checkpoints give the very bits the copying gathers
give, and a peer that dies or never arrives fails the wait naming it instead of hanging."""

import datetime
import os
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

import shardwise
from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed import shared_memory, shared_region
from shardwise.runtime.distributed.collectives import CollectiveError
from shardwise.runtime.zero import shared_param_home
from shardwise.runtime.zero.layout import make_unit
from shardwise.tools.testing import run_distributed
from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from tests.runtime.zero.workers import (
    Case,
    assert_matches_reference,
    build_model,
    global_batch,
    train_parallel,
    train_reference,
)

COPYING = {shared_param_home.ENABLE_VARIABLE: "0"}
PARTITION_EVERYTHING = {"stage3_param_persistence_threshold": 0}
PER_BLOCK = {"leaf_module": {"classes": ["Block"]}, "stage3_max_reuse_distance": 0}
needs_compiler = pytest.mark.skipif(shared_memory.library() is None, reason="no C compiler for shared memory")


def train_noting_home(rank: int, world_size: int, case: Case) -> dict:
    """`train_parallel`, noting whether the engine's parameters went into shared memory."""
    from shardwise.runtime.zero import sharded_params

    made, homes = sharded_params.shared_param_home, []

    def noting(*arguments, **options):
        home = made(*arguments, **options)
        homes.append(home is not None)
        return home

    sharded_params.shared_param_home = noting
    try:
        result = train_parallel(rank, world_size, case)
    finally:
        sharded_params.shared_param_home = made
    return {**result, "shared": homes}


def assert_same_bits(shared: dict, copying: dict) -> None:
    assert shared["losses"] == copying["losses"]
    for name, tensor in copying["params"].items():
        assert torch.equal(shared["params"][name], tensor), name
    assert shared["memory"] == copying["memory"]  # the ledger counts what each rank uses, either way
    assert shared["comm"] == copying["comm"]  # and the ring model's bytes


@needs_compiler
@pytest.mark.parametrize(("dtype", "gathering"), [("fp32", "per module"), ("fp32", "per block"),
                                                  ("bf16", "per block")])
def test_trains_bit_for_bit_like_the_copying_gathers(dtype, gathering):
    extra = {**PARTITION_EVERYTHING, **(PER_BLOCK if gathering == "per block" else {})}
    lr = 1e-2 if dtype == "fp32" else 1e-3
    case = Case(stage=3, dtype=dtype, accumulation=2, lr=lr, extra_config={"zero_optimization": extra})
    shared = run_distributed(train_noting_home, 2, case)
    copying = run_distributed(train_noting_home, 2, case, env=COPYING)
    expected = train_reference(Case(accumulation=2, lr=lr), 2)
    for with_sharing, without in zip(shared, copying):
        assert with_sharing["shared"] == [True] and without["shared"] == [False]
        assert_same_bits(with_sharing, without)
        assert_matches_reference(with_sharing, expected, 1e-5 if dtype == "fp32" else 2e-2)


def edit_save_and_load(rank: int, world_size: int, directory: str) -> dict:
    """An edit by rank 0 (`modifier_rank`), writes outside the pass that must stay private,
    a step, and a checkpoint round trip into a second engine."""
    model = build_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **PARTITION_EVERYTHING}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    weight = model.blocks[0].mlp.fc.weight
    with shardwise.gathered_parameters(weight), torch.no_grad():
        weight.fill_(7.0)  # no modifier: discarded, on every rank
    with shardwise.gathered_parameters(weight, modifier_rank=0), torch.no_grad():
        if rank == 0:
            weight[0].fill_(0.5)
        else:
            weight[1].fill_(9.0)  # not the modifier: discarded
    with shardwise.gathered_parameters(weight):
        edited = weight.detach().clone()
    x, y = global_batch(0, 2 * world_size)
    rows = slice(2 * rank, 2 * rank + 2)
    losses = []
    for _ in range(2):
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(directory, tag="shared")
    with shardwise.gathered_parameters(list(model.parameters())):
        trained = [p.detach().clone() for p in model.parameters()]
    other = build_model("gpt")
    restored = shardwise.initialize(other, config, optimizer=torch.optim.AdamW(other.parameters(), lr=1e-2))
    restored.load_checkpoint(directory, tag="shared")
    with shardwise.gathered_parameters(list(other.parameters())):
        loaded = [p.detach().clone() for p in other.parameters()]
    next_losses = [engine(x[rows], y[rows]).item(), restored(x[rows], y[rows]).item()]
    return {"edited": edited, "losses": losses, "trained": trained, "loaded": loaded, "next": next_losses}


@needs_compiler
def test_edits_and_checkpoints_give_what_the_copying_gathers_give(tmp_path):
    shared = run_distributed(edit_save_and_load, 2, str(tmp_path / "shared"))
    copying = run_distributed(edit_save_and_load, 2, str(tmp_path / "copying"), env=COPYING)
    for with_sharing, without in zip(shared, copying):
        edited = with_sharing["edited"]
        assert torch.equal(edited, without["edited"])
        assert (edited[0] == 0.5).all() and not (edited == 7.0).any() and not (edited[1] == 9.0).any()
        assert with_sharing["losses"] == without["losses"]
        for mine, theirs, loaded in zip(with_sharing["trained"], without["trained"], with_sharing["loaded"]):
            assert torch.equal(mine, theirs) and torch.equal(mine, loaded)
        assert with_sharing["next"][0] == with_sharing["next"][1] == without["next"][0]


def set_weights_late_between_steps(rank: int, world_size: int) -> list[float]:
    """A step, then DeepSpeed's `safe_set_full_fp32_param` between steps, rank 0 writing
    its chunk well after rank 1 has gone on to its next forward."""
    from shardwise.frontends.deepspeed.api.utils.tensor_fragment import safe_set_full_fp32_param

    model = build_model("gpt")
    set_params = list(model.blocks[0].mlp.parameters())
    shapes = [param.shape for param in set_params]
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **PARTITION_EVERYTHING}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))
    x, y = global_batch(0, 2 * world_size)
    rows = slice(2 * rank, 2 * rank + 2)
    losses = []
    for value in (0.25, -0.5):
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if rank == 0:
            time.sleep(0.5)
        for param, shape in zip(set_params, shapes):
            safe_set_full_fp32_param(param, torch.full(shape, value))
    losses.append(engine(x[rows], y[rows]).item())
    return losses


@needs_compiler
def test_a_write_between_steps_is_read_by_every_peer_s_next_pass():
    """Written shards are read by every peer's next forward, however late the writer: as
    with copying gathers, which receive a rank's shard only when that rank gathers too."""
    shared = run_distributed(set_weights_late_between_steps, 2)
    copying = run_distributed(set_weights_late_between_steps, 2, env=COPYING)
    assert shared == copying


def stall_before_a_load(rank: int, world_size: int) -> str:
    """Both ranks train a step; rank 1 then never arrives where a load meets the others."""
    model = build_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **PARTITION_EVERYTHING}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))
    x, y = global_batch(0, 2 * world_size)
    rows = slice(2 * rank, 2 * rank + 2)
    engine.backward(engine(x[rows], y[rows]))
    engine.step()
    if rank == 1:
        time.sleep(4)
        return "stalled"
    try:
        engine.zero.await_readers()
    except CollectiveError as error:
        return str(error)
    return "finished"


@needs_compiler
def test_a_rank_that_never_arrives_fails_the_wait_within_the_timeout():
    started = time.monotonic()
    message = run_distributed(stall_before_a_load, 2, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "2"})[0]
    assert message.startswith("rank 0: barrier of rewriting the shards: waiting for every rank's reads of the "
                              "shared parameters in the shard group (ranks 0-1) failed after"), message
    assert "rank 1 did not arrive within 2s (shared parameter memory)" in message
    assert time.monotonic() - started < 30


def meet_publish_and_exit(path: str, nbytes: int) -> None:
    """Member 1 of 2 of the region at `path`: meets, publishes, and exits."""
    mapping, _ = shared_region._map(path, nbytes, create=False)
    region = shared_region.SharedRegion(mapping, shared_memory.library(), rank=1, global_ranks=(0, 1),
                                        timeout=datetime.timedelta(seconds=30))
    region.meet()
    region.publish()


@needs_compiler
def test_a_peer_whose_process_exits_is_named_at_once():
    nbytes = shared_region.board_bytes(2) + 4096
    path = f"/dev/shm/shardwise-test-{uuid.uuid4().hex}"
    mapping, status = shared_region._map(path, nbytes, create=True)
    assert status == 0
    try:
        peer = preloaded_forkserver_context().Process(target=meet_publish_and_exit, args=(path, nbytes))
        peer.start()
        region = shared_region.SharedRegion(mapping, shared_memory.library(), rank=0, global_ranks=(0, 1),
                                            timeout=datetime.timedelta(seconds=60))
        region.meet()
        region.publish()
        region.wait_current()  # the peer's version of the first meeting
        peer.join(30)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1's process exited \(shared parameter memory\)"):
            region.meet()
        region.publish()
        with pytest.raises(RuntimeError, match=r"rank 1's process exited"):
            region.wait_current()
        assert time.monotonic() - started < 5  # not the 60 s timeout
    finally:
        os.unlink(path)


@pytest.mark.parametrize("variable", [shared_memory.ENABLE_VARIABLE, shared_param_home.ENABLE_VARIABLE])
def test_either_switch_keeps_the_copying_gathers(monkeypatch, variable):
    monkeypatch.setenv(variable, "0")
    unit = make_unit(0, [("w", torch.nn.Parameter(torch.zeros(8)), 0)], 2, 4, label="w")
    group = SimpleNamespace(point_to_point=True, control_group=object())  # asked nothing: the switch decides first
    assert shared_param_home.shared_param_home([unit], torch.float32, torch.device("cpu"), group,
                                               MemoryLedger()) is None
