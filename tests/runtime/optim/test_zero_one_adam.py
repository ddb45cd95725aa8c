"""0/1 Adam (DeepSpeed's ZeroOneAdam) in the engine at ZeRO stage 0, on 2 gloo ranks.

Every step of a run through the variance-update, freeze and local-step phases is compared,
from the engine's own state before it (weights, moments, accumulated update, both ranks'
error-feedback buffers and gradients), with DeepSpeed's rule written out below in float64
(deepspeed/runtime/fp16/onebit/zoadam.py as DeepSpeed last shipped it: 0.19.8 no longer
has its 1-bit optimizers, so it cannot be run here; see docs/optimizers.md). Step by step,
not as a trajectory: the 1-bit sign turns a last-bit difference into a flip. The same run's
bytes per step equal formulas/communication.py's schedule to the byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import shardwise
from shardwise.formulas.communication import zero_one_adam_step_bytes, zero_one_adam_step_kinds
from shardwise.formulas.memory import zero_one_adam_state_bytes
from shardwise.runtime.optim import ZeroOneAdam
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.planner import Hardware, ModelShape, estimate
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.runtime.zero.workers import build_model, global_batch, model_loss

RANKS = 2


@dataclass(frozen=True)
class Settings:
    """Small intervals, so 16 steps cover every phase: step 1 (set-up), variance steps at
    intervals 1 and 2 with 1-bit gradient steps between them, the freeze after step 7,
    then synchronisations at local-step intervals 1, 2 and 4 with local steps between."""

    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-4  # >= 1e-4: tests/runtime/zero/workers.py ADAM_EPS
    weight_decay: float = 0.01
    var_freeze_step: int = 6
    var_update_scaler: int = 2
    local_step_scaler: int = 2
    local_step_clipper: int = 4
    steps: int = 16
    rows: int = 2  # per rank

    def optimizer_block(self) -> dict:
        return {"type": "ZeroOneAdam", "params": {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
            "bias_correction": False, "var_freeze_step": self.var_freeze_step,
            "var_update_scaler": self.var_update_scaler, "local_step_scaler": self.local_step_scaler,
            "local_step_clipper": self.local_step_clipper, "cuda_aware": False, "comm_backend_name": "nccl"}}

    def kinds(self) -> list[str]:
        return zero_one_adam_step_kinds(self.steps, var_freeze_step=self.var_freeze_step,
                                        var_update_scaler=self.var_update_scaler,
                                        local_step_scaler=self.local_step_scaler,
                                        local_step_clipper=self.local_step_clipper)


def _snapshot(optimizer: ZeroOneAdam, with_grads: bool) -> dict:
    params = optimizer._params()
    state = [optimizer.state.get(p, {}) for p in params]

    def copy(key: str) -> list[torch.Tensor]:
        return [s[key].detach().double().clone() if key in s else torch.zeros_like(p, dtype=torch.float64)
                for s, p in zip(state, params)]

    snapshot = {"params": [p.detach().double().clone() for p in params], "m": copy("exp_avg"),
                "v": copy("exp_avg_sq"), "u": copy("momentum_accumulator"),
                "lrs": state[0].get("lrs", 0.0), "lr": optimizer.param_groups[0]["lr"],
                "var_interval": state[0].get("var_interval", 1),
                "local_step_interval": state[0].get("local_step_interval", 1)}
    if with_grads:
        snapshot["grads"] = [p.grad.detach().double().clone() for p in params]
        exchange = optimizer._exchange
        snapshot["errors"] = None if exchange is None else (exchange.worker_error.double().clone(),
                                                            exchange.server_error.double().clone())
    return snapshot


def train_recording(rank: int, world_size: int, settings: Settings, steps: range | None = None,
                    load_dir: str | None = None, save_dir: str | None = None) -> dict:
    """Train through shardwise.initialize from the DeepSpeed config (optionally loading
    first and saving after); record every optimizer step's state before and after, and the
    bytes each step sent."""
    config = {"train_micro_batch_size_per_gpu": settings.rows, "optimizer": settings.optimizer_block(),
              "zero_optimization": {"stage": 0}}
    engine = shardwise.initialize(build_model("gpt"), config)
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    optimizer = engine.optimizer.optimizer
    records, volumes, step = [], [], optimizer.step

    def recording_step(*args, **kwargs):
        before = _snapshot(optimizer, with_grads=True)
        result = step(*args, **kwargs)
        records.append((before, _snapshot(optimizer, with_grads=False)))
        return result

    optimizer.step = recording_step
    for index in range(settings.steps) if steps is None else steps:
        x, y = global_batch(index, settings.rows * world_size)
        rows = slice(rank * settings.rows, (rank + 1) * settings.rows)
        engine.reset_comm_volume()
        engine.backward(model_loss(engine, "gpt", x[rows], y[rows]))
        engine.step()
        volumes.append(engine.comm_volume())
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return {"records": records, "volumes": volumes, "numel": engine.num_parameters(),
            "optimizer_states": engine.memory_breakdown()["optimizer_states"]}


# -- DeepSpeed's rule, written out (float64) -------------------------------------------------
def compress(rows: torch.Tensor) -> torch.Tensor:
    """Each row as sign × ||row|| / √len (sign of 0: +)."""
    scale = rows.norm(dim=-1, keepdim=True) / math.sqrt(rows.shape[-1])
    return torch.where(rows >= 0, scale, -scale)


def exchange(vectors: list[torch.Tensor], errors: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """The 1-bit average of the ranks' flat vectors with error feedback: each worker
    compresses its N chunks, server j averages chunk j and compresses it again."""
    n, length = len(vectors), vectors[0].numel()
    chunk = length // n
    worker_errors = [torch.zeros(length, dtype=torch.float64) if e is None else e[0] for e in errors]
    server_errors = [torch.zeros(chunk, dtype=torch.float64) if e is None else e[1] for e in errors]
    sent = [compress((worker_errors[i] + vectors[i]).view(n, chunk)) for i in range(n)]
    pieces = []
    for j in range(n):
        average = sum(sent[i][j] for i in range(n)) / n
        pieces.append(compress((server_errors[j] + average).view(1, chunk)).view(-1))
    return torch.cat(pieces)


def flat(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.float64)
    joined = torch.cat([t.reshape(-1) for t in tensors])
    out[: joined.numel()] = joined
    return out


def unflat(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for tensor in like:
        out.append(vector[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return out


def reference_step(t: int, before: list[dict], s: Settings) -> list[dict]:
    """Every rank's weights, m, v and u after DeepSpeed's step t from `before` (per rank)."""
    beta1, beta2 = s.betas
    numel = sum(p.numel() for p in before[0]["params"])
    length = math.ceil(numel / (8 * RANKS)) * 8 * RANKS
    after = [{key: [x.clone() for x in b[key]] for key in ("params", "m", "v", "u")} for b in before]
    if t == 1:  # DeepSpeed's first step sets up its buffers and updates nothing
        return after
    lr = before[0]["lr"]
    denominators = [[v.sqrt() + s.eps for v in a["v"]] for a in after]
    if t <= s.var_freeze_step + 1:
        if t % before[0]["var_interval"] == 0:  # the engine all-reduced the gradient
            for a, b in zip(after, before):
                a["v"] = [beta2 * v + (1 - beta2) * g * g for v, g in zip(a["v"], b["grads"])]
                a["m"] = [beta1 * m + (1 - beta1) * g for m, g in zip(a["m"], b["grads"])]
            denominators = [[v.sqrt() + s.eps for v in a["v"]] for a in after]
        else:
            average = exchange([flat(b["grads"], length) for b in before], [b["errors"] for b in before])
            for a in after:
                a["m"] = [beta1 * m + (1 - beta1) * g for m, g in zip(a["m"], unflat(average, a["m"]))]
        for a, d in zip(after, denominators):
            a["params"] = [p - lr * (m / dk + s.weight_decay * p) for p, m, dk in zip(a["params"], a["m"], d)]
        return after
    for a, b, d in zip(after, before, denominators):
        a["m"] = [beta1 * m + (1 - beta1) * g for m, g in zip(a["m"], b["grads"])]
        updates = [-lr * (m / dk + s.weight_decay * p) for p, m, dk in zip(a["params"], a["m"], d)]
        a["params"] = [p + update for p, update in zip(a["params"], updates)]
        a["u"] = [u + update for u, update in zip(a["u"], updates)]
    if t % before[0]["local_step_interval"] == 0:
        lrs = before[0]["lrs"] + lr
        average = exchange([flat([u * dk for u, dk in zip(a["u"], d)], length) for a, d in zip(after, denominators)],
                           [b["errors"] for b in before])
        for a, d in zip(after, denominators):
            synced = unflat(average, a["u"])
            a["m"] = [-u_bar / lrs for u_bar in synced]
            a["params"] = [p - u + u_bar / dk for p, u, u_bar, dk in zip(a["params"], a["u"], synced, d)]
            a["u"] = [torch.zeros_like(u) for u in a["u"]]
    return after


def relative(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    a, e = torch.cat([x.reshape(-1) for x in actual]), torch.cat([x.reshape(-1) for x in expected])
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item() if e.norm() > 0 else a.norm().item()


def assert_steps_follow_the_rule(results: list[dict], settings: Settings, first: int) -> None:
    """Each recorded step (numbered from `first`), from the engine's state before it, equals
    the written-out rule within 1e-5 (float32 against float64), on every rank."""
    kinds = settings.kinds()
    for index in range(len(results[0]["records"])):
        t = first + index
        before = [result["records"][index][0] for result in results]
        expected = reference_step(t, before, settings)
        for rank, result in enumerate(results):
            got = result["records"][index][1]
            for key in ("params", "m", "v", "u"):
                error = relative(got[key], expected[rank][key])
                assert error < 1e-5, f"step {t} ({kinds[t - 1]}), rank {rank}: {key} off by {error:.2e}"


def test_each_step_equals_deepspeeds_rule_and_its_bytes_the_formula():
    """Steps 1-16 on 2 ranks through every phase: each step, from the engine's state
    before it, equals the written-out rule (relative 1e-5, float32 against float64); the
    ranks agree on the weights after every step; each step sends exactly the formula's
    bytes (gradients all-reduced at variance steps only, nothing at step 1 and at local
    steps); the optimizer state equals its formula."""
    settings = Settings()
    kinds = settings.kinds()
    assert kinds == ["setup", "variance", "variance", "variance", "onebit_gradient", "variance", "onebit_gradient",
                     "sync", "sync", "sync", "local", "sync", "local", "local", "local", "sync"]
    results = run_distributed(train_recording, RANKS, settings)
    assert_steps_follow_the_rule(results, settings, first=1)
    for t in range(1, settings.steps + 1):
        ours, theirs = (result["records"][t - 1][1]["params"] for result in results)
        if kinds[t - 1] in ("sync", "setup", "variance", "onebit_gradient"):  # (local steps differ by design)
            # bit-equal until the freeze; a synchronisation undoes each rank's own local steps
            # (w − u), which rounds differently on each rank, as in DeepSpeed
            assert relative(ours, theirs) < (1e-6 if kinds[t - 1] == "sync" else 1e-300), f"step {t}: ranks differ"
    numel = results[0]["numel"]
    for result in results:
        for t, (kind, volume) in enumerate(zip(kinds, result["volumes"]), start=1):
            want = zero_one_adam_step_bytes(kind, numel, RANKS)
            assert {key: volume[key] for key in want} == want, f"step {t} ({kind})"
        assert result["optimizer_states"] == zero_one_adam_state_bytes(numel, RANKS)


def test_schedule_and_bytes_formulas_to_the_byte():
    """DeepSpeed's counters by hand: variance steps 2-17 at interval 1 (scaler 16), then
    every second step; local steps after var_freeze_step + 1. Bytes: an fp32 all-reduce
    2·4Ψ(N−1)/N at variance steps, (L/8 + 4N)(N−1)/N each way for 1-bit steps."""
    kinds = zero_one_adam_step_kinds(24, var_freeze_step=21)
    assert kinds[0] == "setup" and kinds[1:17] == ["variance"] * 16
    assert kinds[17:22] == ["variance", "onebit_gradient", "variance", "onebit_gradient", "variance"]
    assert kinds[22:] == ["sync", "sync"]  # local_step_interval 1 until 32678 local steps
    psi, n = 8_000_000, 4
    assert zero_one_adam_step_bytes("variance", psi, n) == {"all_reduce": 48_000_000, "all_to_all": 0, "all_gather": 0}
    framed = psi // 8 + 4 * n
    for kind in ("onebit_gradient", "sync"):
        assert zero_one_adam_step_bytes(kind, psi, n) == {"all_reduce": 0, "all_to_all": framed * 3 // 4,
                                                          "all_gather": framed * 3 // 4}
    for kind in ("setup", "local"):
        assert zero_one_adam_step_bytes(kind, psi, n) == {"all_reduce": 0, "all_to_all": 0, "all_gather": 0}
    # local_step_interval 1 (steps 3-4), 2 (steps 5-6), then 4, the clipper (steps t % 4 = 0)
    assert zero_one_adam_step_kinds(20, var_freeze_step=1, local_step_scaler=2, local_step_clipper=4)[2:] == [
        "sync", "sync", "local", "sync", "local", "sync", "local", "local", "local", "sync", "local", "local",
        "local", "sync", "local", "local", "local", "sync"]
    # one rank: a padded flat buffer for u, no error buffers
    assert zero_one_adam_state_bytes(10, 1) == 4 * (30 + 6)
    assert zero_one_adam_state_bytes(100, 4) == 4 * (300 + 28 + 128 + 32)


def test_one_process_keeps_the_gradient_exact():
    """One rank: nothing to exchange. Step 1 leaves the weights; at the 1-bit gradient
    steps the momentum takes the exact gradient, and a synchronisation restores the
    weights the local steps reached."""
    model = build_model("gpt")
    optimizer = ZeroOneAdam(model.parameters(), lr=1e-2, eps=1e-4, var_freeze_step=3, var_update_scaler=1)
    params = list(model.parameters())
    for step in range(1, 7):
        x, y = global_batch(step, 2)
        model_loss(model, "gpt", x, y).backward()
        before = [p.detach().clone() for p in params]
        momentum = [optimizer.state[p]["exp_avg"].clone() if optimizer.state[p] else None for p in params]
        optimizer.step()
        if step == 1:
            assert all(torch.equal(p, b) for p, b in zip(params, before))
        if step == 3:  # var_interval 2 after step 2: a 1-bit gradient step
            for p, m in zip(params, momentum):
                assert torch.allclose(optimizer.state[p]["exp_avg"], 0.9 * m + 0.1 * p.grad, rtol=1e-6, atol=1e-9)
        if step >= 5:  # synchronised every step: w − lr·m/d, m re-estimated from u·d
            for p, b in zip(params, before):
                state = optimizer.state[p]
                expected = b - 1e-2 * state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-4)
                assert torch.allclose(p, expected, rtol=1e-5, atol=1e-7)
                assert not state["momentum_accumulator"].any()
        optimizer.zero_grad()


def _passed_at_stage_1(rank: int, world_size: int) -> None:
    model = build_model("gpt")
    shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}},
                         optimizer=ZeroOneAdam(model.parameters(), var_freeze_step=2))


def test_a_passed_optimizer_is_refused_under_zero():
    with pytest.raises(DistributedTestError, match="ZeroOneAdam runs at zero_optimization.stage 0 only"):
        run_distributed(_passed_at_stage_1, 2)


def test_constructor_and_k():
    params = [torch.nn.Parameter(torch.zeros(8))]
    with pytest.raises(ValueError, match="eps_inside_sqrt true"):
        ZeroOneAdam(params, eps_inside_sqrt=True)
    with pytest.raises(ValueError, match="local_step_clipper must be >= 1"):
        ZeroOneAdam(params, local_step_clipper=0)
    with pytest.raises(ValueError, match="amsgrad true"):
        ZeroOneAdam(params, amsgrad=True)
    assert optimizer_spec("ZeroOneAdam").state_bytes_per_param({}, "fp32") == 12  # m, v, u
    assert optimizer_spec("ZeroOneAdam").zero_stages == (0,)


def test_resume_between_synchronisations(tmp_path):
    """Saved after a local step (t = 11: u and Σlr non-zero), resumed at 2 ranks: every rank
    starts from the saved moments, accumulated update, counters and weights (stage 0 saves
    rank 0's copy: its local steps become every rank's), the error buffers restart from
    zero, and steps 12-16 follow the rule and the formula's bytes."""
    settings, saved_at = Settings(), 11
    saved = run_distributed(train_recording, RANKS, settings, range(saved_at), None, str(tmp_path))
    resumed = run_distributed(train_recording, RANKS, settings, range(saved_at, settings.steps), str(tmp_path))
    last = saved[0]["records"][-1][1]
    assert last["lrs"] > 0 and any(u.any() for u in last["u"])
    for result in resumed:
        first = result["records"][0][0]
        assert first["errors"] is None
        assert (first["lrs"], first["var_interval"], first["local_step_interval"]) == (
            last["lrs"], last["var_interval"], last["local_step_interval"])
        for key in ("params", "m", "v", "u"):
            assert all(torch.equal(a, b) for a, b in zip(first[key], last[key])), key
    assert_steps_follow_the_rule(resumed, settings, first=saved_at + 1)
    numel = resumed[0]["numel"]
    for t, volume in enumerate(resumed[0]["volumes"], start=saved_at + 1):
        want = zero_one_adam_step_bytes(settings.kinds()[t - 1], numel, RANKS)
        assert {key: volume[key] for key in want} == want, f"step {t}"


def test_estimator_offers_stage_0_with_its_state_formula():
    """`shardwise estimate --optimizer zerooneadam`: stage 0 only, without offload; bf16
    model states 2Ψ + 2Ψ + (4 + 16)Ψ + 4Ψ/N (master, m, v, u, worker error; server error)."""
    psi, gpus = 1_500_000_000, 8
    result = estimate(ModelShape("1.5B", psi), Hardware(num_gpus=gpus), optimizer="zerooneadam")
    assert [(option.stage, option.offload.label) for option in result.options] == [(0, "none")]
    assert result.options[0].per_rank["gpu"] == {"params": 2 * psi, "grads": 2 * psi,
                                                 "optimizer_states": 20 * psi + 4 * psi // gpus}
