"""1-bit Adam and 1-bit LAMB under ZeRO stages 1 and 2: equal to the single-process
simulation of N workers whose exchange chunks are the ZeRO partitions
(tests/runtime/optim/onebit_reference.py); after the warm-up no gradient is reduced, the exchange
and the parameter all-gather send exactly the formula's bytes, and the optimizer state
and gradient memory equal their formulas.

Tolerance: the warm-up reduce-scatters in gloo's summation order, so there the engine
agrees with the simulation to fp32 rounding (1e-5); the simulation then continues from the
engine's state at the freeze, and the compressed phase must agree within 1e-5 too, which
in practice means exactly: a sign compressor turns a last-bit difference into a flipped
sign, whose effect (a whole chunk scale on one element) is far above 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.formulas.communication import onebit_exchange_bytes
from shardwise.formulas.memory import onebit_model_state_bytes, onebit_partitioned_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.optim.onebit_reference import OneBitSettings, Simulation
from tests.runtime.optim.test_onebit import STEPS, assert_equal_to, torch_path, train_engine, whole_state
from tests.runtime.optim.test_onebit_checkpoint import SAVED_AT


def simulate(settings: OneBitSettings, ranks: int, results: list[dict]) -> tuple[Simulation, list[float]]:
    """The simulation after the whole run, and its losses (the compressed phase continued
    from the engine's state at the freeze)."""
    simulation = Simulation(settings, ranks, results[0]["order"], results[0]["units"])
    losses = simulation.train(range(settings.freeze_step))
    simulation.adopt(whole_state(results, "at_freeze"), tolerance=1e-5)
    return simulation, losses + simulation.train(range(settings.freeze_step, STEPS))


@pytest.mark.parametrize(("algorithm", "stage", "ranks", "accumulation"),
                         [("adam", 1, 2, 2), ("lamb", 2, 2, 1), ("adam", 2, 4, 2), ("lamb", 1, 4, 1)])
def test_equals_simulation_with_partitions_as_servers(algorithm, stage, ranks, accumulation, monkeypatch):
    """Losses and weights equal the simulation's, with clipping, weight decay and gradient
    accumulation; per step after the first compressed one, the bytes are the formula's:
    the momentum's all-to-all and all-gather at one bit per element plus scales, and
    ZeRO-1/2's all-gather of the updated (fp32) parameters; nothing is reduced. The state
    and the gradient memory equal their formulas (stage 2: partition + whole local buffer)."""
    torch_path(monkeypatch)
    settings = OneBitSettings(algorithm, weight_decay=0.01, clipping=0.05, accumulation=accumulation, stage=stage)
    results = run_distributed(train_engine, ranks, settings)
    simulation, losses = simulate(settings, ranks, results)
    padded = sum(padded for padded, _ in results[0]["units"])
    exchange = onebit_exchange_bytes(padded, ranks, stage=stage, param_bytes=4)
    for result in results:
        assert_equal_to(result, losses, simulation.weights())
        for step, volume in enumerate(result["volumes"][settings.freeze_step + 1 :], settings.freeze_step + 1):
            assert volume["all_reduce"] == volume["reduce_scatter"] == 0, f"step {step}: gradients were reduced"
            assert volume["all_to_all"] == exchange["all_to_all"], step
            assert volume["all_gather"] == exchange["all_gather"], step
        assert result["optimizer_states"] == onebit_partitioned_state_bytes(
            result["owned"], result["partition"], ranks, lamb=algorithm == "lamb")
        assert result["grads"] == 4 * padded * (1 if stage == 1 else 1 + 1 / ranks)
        # the Ψ-only formula (estimator, main job) agrees within the units' padding
        numel, variances = result["numel"], 2 if algorithm == "lamb" else 1
        formula = onebit_model_state_bytes(numel, ranks, stage, "fp32", lamb=algorithm == "lamb")
        pad = padded - numel
        assert abs(result["optimizer_states"] - formula["optimizer_states"]) <= 4 * (
            variances * pad + (2 * ranks + 1) * (pad // ranks + 8))


def test_bf16_stage_2():
    """bf16 at stage 2: the bf16 local gradients feed the fp32 momentum, exchanged as in
    fp32 (same bytes); every rank ends with the same weights; the state adds the masters."""
    settings = OneBitSettings("adam", bf16=True, stage=2)
    results = run_distributed(train_engine, 2, settings)
    padded = sum(padded for padded, _ in results[0]["units"])
    exchange = onebit_exchange_bytes(padded, 2, stage=2, param_bytes=2)
    for result in results:
        assert all(loss == loss for loss in result["losses"]) and result["losses"] == results[0]["losses"]
        assert result["volumes"][-1]["all_reduce"] == result["volumes"][-1]["reduce_scatter"] == 0
        assert result["volumes"][-1]["all_to_all"] == exchange["all_to_all"]
        assert result["volumes"][-1]["all_gather"] == exchange["all_gather"]
        assert result["optimizer_states"] == 4 * padded // 2 + onebit_partitioned_state_bytes(
            result["owned"], result["partition"], 2)
        assert result["grads"] == 2 * padded + 2 * padded // 2
    for name, weight in results[0]["params"].items():
        assert torch.equal(weight, results[1]["params"][name]), f"{name} differs between ranks"


def test_checkpoint_resharded_from_stage_2_to_stage_1_at_4_ranks(tmp_path):
    """1-bit LAMB saved at stage 2 on 2 ranks one step after the warm-up, resumed at stage 1
    on 4: the partitions of the momentum, the frozen and fresh variances and the
    per-parameter scalars are resharded; the resumed run gathers its whole momentum from
    them and equals a 4-worker simulation that takes over the saved state with its error
    buffers at zero (they are per rank and restart, as DeepSpeed's do)."""
    settings = OneBitSettings("lamb", weight_decay=0.01, stage=2)
    saved = run_distributed(train_engine, 2, settings, range(SAVED_AT), None, str(tmp_path))
    resumed_settings = dataclasses.replace(settings, stage=1)
    resumed = run_distributed(train_engine, 4, resumed_settings, range(SAVED_AT, STEPS), str(tmp_path))
    simulation = Simulation(resumed_settings, 4, resumed[0]["order"], resumed[0]["units"])
    simulation.adopt(whole_state(saved, "final"), tolerance=None)
    assert_equal_to(resumed[0], simulation.train(range(SAVED_AT, STEPS)), simulation.weights())
    partitions = 4 * 4 * resumed[0]["partition"] * 3 // 4  # the fp32 gather of the momentum, once
    assert resumed[0]["volumes"][0]["all_gather"] == onebit_exchange_bytes(
        sum(padded for padded, _ in resumed[0]["units"]), 4, stage=1, param_bytes=4)["all_gather"] + partitions



def _folds_on_ranks(rank: int, world_size: int) -> dict:
    """Stage 2 through the warm-up and one more backward (local gradients), then the whole
    momentum folded twice from the same state: through the kernels and the torch path."""
    import os

    import shardwise
    from shardwise.runtime.optim import native
    from tests.runtime.optim.test_onebit import config
    from tests.runtime.zero.workers import build_model, global_batch, model_loss

    settings = OneBitSettings("adam", stage=2)
    engine = shardwise.initialize(build_model("gpt"), config(settings))
    for step in range(settings.freeze_step + 1):
        x, y = global_batch(step, settings.rows * world_size)
        rows = slice(rank * settings.rows, (rank + 1) * settings.rows)
        engine.backward(model_loss(engine, "gpt", x[rows].to(engine.device), y[rows].to(engine.device)))
        if step < settings.freeze_step:
            engine.step()
    optimizer = engine.optimizer.optimizer
    momentum = optimizer.momentum_flat()
    folded = {}
    for path in ("1", "0"):
        os.environ[native.ENABLE_VARIABLE] = path
        folded[path] = momentum.clone()
        optimizer._partitions.fold_(folded[path], lambda group: optimizer.param_groups[group]["betas"][0], 1.0)
    os.environ[native.ENABLE_VARIABLE] = "1"
    return {"before": momentum.clone(), "native": folded["1"], "torch": folded["0"]}


def test_stage_2_fold_through_the_kernels_equals_the_torch_paths():
    """At stages 1-2 the local gradients are folded into the whole momentum a row of the
    partition matrix at a time by the kernels' `momentum_fold` (zero/onebit_momentum.py):
    the torch path's multiply and fused add, so the same momentum bit for bit."""
    from shardwise.runtime.optim import native

    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    for output in run_distributed(_folds_on_ranks, 2):
        assert not torch.equal(output["native"], output["before"])  # the fold did something
        assert torch.equal(output["native"], output["torch"])


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_with_fp32_accumulation_holds_the_formulas_fp32_gradients(stage):
    """data_types.grad_accum_dtype fp32 beside bf16: the local gradients the exchange folds
    (and stage 2's partition) are fp32 buffers, as onebit_model_state_bytes(grad_dtype=)
    counts them; every rank ends with the same finite losses."""
    settings = OneBitSettings("adam", bf16=True, stage=stage, accumulation=2, grad_accum_fp32=True)
    results = run_distributed(train_engine, 2, settings)
    padded = sum(padded for padded, _ in results[0]["units"])
    for result in results:
        assert all(loss == loss for loss in result["losses"]) and result["losses"] == results[0]["losses"]
        assert result["grads"] == 4 * padded * (1 if stage == 1 else 1 + 1 / 2)
        formula = onebit_model_state_bytes(result["numel"], 2, stage, "bf16", grad_dtype="fp32")["grads"]
        assert abs(result["grads"] - formula) <= 4 * (padded - result["numel"]) * 2
