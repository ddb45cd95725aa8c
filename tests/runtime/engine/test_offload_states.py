"""`engine.offload_states()` / `reload_states()` (zero/parked_states.py): training states
leave their storages and come back byte for byte.

On 2 gloo ranks at every ZeRO stage (fp32, and bf16 with fp32 masters at stages 2-3):
two steps, every state offloaded, then two more steps; the losses and the weights equal
(bit for bit) the same run without the offload, and while the states are away every
tensor of each moved kind holds no memory. An RLHF loop's partial offload (optimizer
states, masters, gradient buckets: OpenRLHF's set) leaves forward running, with the
same output as before it, and backward refusing until the reload. On a CPU engine the
"device" is host memory: the storages are freed and their bytes kept in a host copy, the
same moves that free GPU memory on a CUDA engine."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.runtime.zero.parked_states import StateKind
from shardwise.runtime.zero.shared_param_home import ENABLE_VARIABLE as SHARED_PARAMETERS
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch, make_optimizer, model_loss

MICRO = 2
STEPS = 4
RLHF_SET = [StateKind.OPTIMIZER_STATES, StateKind.MASTER_PARAMETERS, StateKind.GRADIENT_BUCKETS]


def _config(stage: int, bf16: bool = False, **zero: object) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                                    "stage3_param_persistence_threshold": 0, **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _held(tensors: list[torch.Tensor]) -> int:
    """Bytes the storages of `tensors` hold now (each storage once)."""
    return sum({tensor.untyped_storage()._cdata: tensor.untyped_storage().nbytes() for tensor in tensors}.values())


def _train(rank: int, world_size: int, config: dict, offload: list[StateKind] | None, offload_after: int,
           kind: str = "adamw") -> dict:
    """`kind`: tests/runtime/zero/workers.py's optimizer, or "config" (the config's own block)."""
    model = build_model("gpt")
    optimizer = None if kind == "config" else make_optimizer(model, 1e-2, kind)
    engine = shardwise.initialize(model, config, optimizer=optimizer)
    losses, checks = [], {}
    try:
        for step in range(STEPS):
            if offload is not None and step == offload_after:
                x, _ = global_batch(99, world_size * MICRO)
                with torch.no_grad():
                    before = engine(x[rank * MICRO:(rank + 1) * MICRO]).float()
                by_kind = engine.zero.state_tensors(engine.module)
                checks["moved"] = engine.offload_states(include=offload)
                checks["offloaded"] = sorted(kind.value for kind in engine.offloaded_states)
                checks["held"] = {kind.value: _held(by_kind[kind]) for kind in offload}
                if StateKind.PARAMETERS in engine.offloaded_states:
                    with pytest.raises(RuntimeError, match=r"forward\(\) needs states .*lp_params"):
                        engine(x[:MICRO])
                else:  # generation between phases: forward on the parameters left in place
                    with torch.no_grad():
                        after = engine(x[rank * MICRO:(rank + 1) * MICRO]).float()
                    checks["forward_equal"] = torch.equal(before, after)
                with pytest.raises(RuntimeError, match=r"step\(\) needs states that offload_states\(\) moved off"):
                    engine.step()
                with pytest.raises(RuntimeError, match="reload_states"):
                    engine.save_checkpoint("/nonexistent")
                engine.reload_states()
                checks["reloaded"] = sorted(kind.value for kind in engine.offloaded_states)
            for micro in range(2):
                x, y = global_batch(step * 2 + micro, world_size * MICRO)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = model_loss(engine, "gpt", x[rows], y[rows])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        with shardwise.gathered_parameters(list(model.parameters())):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        return {"losses": losses, "params": params, **checks}
    finally:
        engine.destroy()


def _both(config: dict, offload: list[StateKind] | None, offload_after: int = 2,
          kind: str = "adamw") -> tuple[list[dict], list[dict]]:
    moved = run_distributed(_train, 2, config, offload, offload_after, kind)
    plain = run_distributed(_train, 2, config, None, offload_after, kind)
    return moved, plain


def _assert_same_training(moved: list[dict], plain: list[dict]) -> None:
    for rank_moved, rank_plain in zip(moved, plain):
        assert rank_moved["losses"] == rank_plain["losses"]
        for name, value in rank_plain["params"].items():
            assert torch.equal(rank_moved["params"][name], value), name


@pytest.mark.parametrize("stage,bf16", [(0, False), pytest.param(1, False, marks=pytest.mark.slow), (2, True),
                                        (3, False), pytest.param(2, False, marks=pytest.mark.slow), (3, True)])
def test_every_state_offloaded_and_reloaded_trains_as_if_never_moved(stage: int, bf16: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 with copying gathers: with one host's ranks sharing their parameter shards
    (the next test) those stay in host-shared memory."""
    monkeypatch.setenv(SHARED_PARAMETERS, "0")
    moved, plain = _both(_config(stage, bf16), list(StateKind))
    _assert_same_training(moved, plain)
    for result in moved:
        assert result["offloaded"] == sorted(kind.value for kind in StateKind)
        assert result["reloaded"] == []
        assert all(held == 0 for held in result["held"].values()), result["held"]
        # at least the parameters (this rank's share at stage 3) and Adam's two moments
        numel = sum(p.numel() for p in result["params"].values())
        share = numel / 2 if stage >= 1 else numel
        param_bytes = numel * (2 if bf16 else 4) / (2 if stage == 3 else 1)
        assert result["moved"] >= param_bytes + 8 * share * 0.99


ONEBIT = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}


@pytest.mark.parametrize("kind,stage", [("adam8bit", 2), ("adafactor", 1), ("lamb", 3), ("config", 0)],
                         ids=["adam8bit-stage2", "adafactor-stage1", "lamb-stage3", "onebit-adam-stage0"])
def test_other_optimizers_states_come_back(kind: str, stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized states with their scales, factored moments, per-parameter norms, and the
    1-bit optimizer's flat momentum with its error buffers, offloaded past its freeze step."""
    monkeypatch.setenv(SHARED_PARAMETERS, "0")
    config = _config(stage)
    if kind == "config":
        config["optimizer"] = ONEBIT
    moved, plain = _both(config, list(StateKind), offload_after=2, kind=kind)
    _assert_same_training(moved, plain)
    for result in moved:
        assert result["held"]["optim_states"] == 0 and result["moved"] > 0


@pytest.mark.parametrize("ranks", [2, 1], ids=["host-shared", "one-rank"])
def test_parameter_shards_in_memory_shardwise_maps_stay(ranks: int) -> None:
    """Stage 3's shards in a host-shared segment (2 ranks) or, with one rank, in one region
    handed out piece by piece (zero/sole_param_home.py): neither can be resized, so they
    stay, and the rest moves."""
    moved = run_distributed(_train, ranks, _config(3), list(StateKind), 2)
    plain = run_distributed(_train, ranks, _config(3), None, 2)
    _assert_same_training(moved, plain)
    for result in moved:
        assert result["held"]["lp_params"] > 0
        assert result["held"]["optim_states"] == result["held"]["lp_grads"] == 0


@pytest.mark.parametrize("stage,bf16", [(3, True), (2, True), (1, False)])
def test_rlhf_partial_offload_keeps_forward_and_refuses_backward(stage: int, bf16: bool) -> None:
    moved, plain = _both(_config(stage, bf16), RLHF_SET)
    _assert_same_training(moved, plain)
    for result in moved:
        assert result["forward_equal"]
        assert result["offloaded"] == sorted(kind.value for kind in RLHF_SET)
        assert result["held"]["optim_states"] == 0
        # bf16: separate fp32 masters, moved; fp32: the masters are the parameters forward reads
        assert (result["held"]["hp_params"] == 0) == bf16


def _offload_then(rank: int, world_size: int, config: dict, include: list[StateKind], then: str) -> dict:
    model = build_model("gpt")
    engine = shardwise.initialize(model, config, optimizer=make_optimizer(model, 1e-2))
    try:
        x, y = global_batch(0, MICRO)
        engine.backward(model_loss(engine, "gpt", x, y))
        engine.backward(model_loss(engine, "gpt", x, y))
        engine.step()
        by_kind = engine.zero.state_tensors(engine.module)
        moved = engine.offload_states(include=include)
        outcome = {"moved": moved, "offloaded": sorted(kind.value for kind in engine.offloaded_states),
                   "params_held": _held(by_kind[StateKind.PARAMETERS])}
        if then == "backward":
            loss = model_loss(engine, "gpt", x, y)
            with pytest.raises(RuntimeError, match=r"backward\(\) needs states .*contiguous_grad_buffer"):
                engine.backward(loss)
        engine.reload_states()
        return outcome
    finally:
        engine.destroy()


def test_fp32_masters_are_the_parameters_so_offloading_only_masters_moves_nothing() -> None:
    (result,) = run_distributed(_offload_then, 1, _config(0), [StateKind.MASTER_PARAMETERS], "")
    assert result["moved"] == 0 and result["params_held"] > 0


def test_backward_refuses_while_buckets_are_away() -> None:
    results = run_distributed(_offload_then, 2, _config(2), RLHF_SET, "backward")
    assert all(result["moved"] > 0 for result in results)


def test_an_offloaded_optimizer_keeps_its_states_where_they_are() -> None:
    config = _config(2, offload_optimizer={"device": "cpu"})
    (result,) = run_distributed(_offload_then, 1, config, RLHF_SET, "")
    assert result["offloaded"] == ["contiguous_grad_buffer"]


def _refused_with_offloaded_parameters(rank: int, world_size: int) -> str:
    model = build_model("gpt")
    engine = shardwise.initialize(model, _config(3, offload_param={"device": "cpu"}),
                                  optimizer=make_optimizer(model, 1e-2))
    try:
        with pytest.raises(ValueError, match="not supported for offloaded parameters") as refused:
            engine.offload_states()
        return str(refused.value)
    finally:
        engine.destroy()


def test_refused_with_offloaded_parameters() -> None:
    run_distributed(_refused_with_offloaded_parameters, 1)


def _destroyed_while_offloaded(rank: int, world_size: int) -> bool:
    model = build_model("gpt")
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine = shardwise.initialize(model, _config(2), optimizer=make_optimizer(model, 1e-2))
    engine.offload_states()
    engine.destroy()
    return all(torch.equal(param, before[name]) for name, param in model.named_parameters())


def test_destroy_gives_the_model_its_weights_back():
    assert run_distributed(_destroyed_while_offloaded, 1) == [True]
