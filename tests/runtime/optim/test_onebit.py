"""1-bit Adam and 1-bit LAMB in the engine (ZeRO stage 0): equal to the single-process
simulation of the same algorithm with N workers (tests/runtime/optim/onebit_reference.py), with
gradients reduced by the engine only during the warm-up, the compressed exchange counted
to the byte, and the optimizer state equal to its formula."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.runtime.optim import native
from shardwise.formulas.communication import onebit_exchange_bytes
from shardwise.formulas.memory import onebit_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.optim.onebit_reference import OneBitSettings, Simulation
from tests.runtime.zero.workers import build_model, global_batch, model_loss, relative_error

STEPS = 5  # freeze_step 2: two full-precision steps, three compressed


def config(settings: OneBitSettings) -> dict:
    return {"train_micro_batch_size_per_gpu": settings.rows, "gradient_clipping": settings.clipping,
            "gradient_accumulation_steps": settings.accumulation, "bf16": {"enabled": settings.bf16},
            "zero_optimization": {"stage": settings.stage, "reduce_bucket_size": 3000},
            "optimizer": settings.optimizer_block(),
            **({"data_types": {"grad_accum_dtype": "fp32"}} if settings.grad_accum_fp32 else {})}


def train_engine(rank: int, world_size: int, settings: OneBitSettings, steps: range = range(STEPS),
                 load_dir: str | None = None, save_dir: str | None = None) -> dict:
    engine = shardwise.initialize(build_model("gpt"), config(settings))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    losses, volumes, frozen = [], [], {}
    for step in steps:
        x, y = global_batch(step, settings.rows * world_size * settings.accumulation)
        engine.reset_comm_volume()
        step_loss = torch.zeros(())
        for micro in range(settings.accumulation):
            start = (micro * world_size + rank) * settings.rows
            rows = slice(start, start + settings.rows)
            loss = model_loss(engine, "gpt", x[rows].to(engine.device), y[rows].to(engine.device))
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float().cpu() / settings.accumulation
        volumes.append(engine.comm_volume())
        losses.append(step_loss)
        if step + 1 == settings.freeze_step:
            frozen = _state_pieces(engine)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / world_size
    optimizer = engine.optimizer.optimizer
    return {
        "losses": losses.tolist(),
        "params": {name: p.detach().to("cpu", copy=True) for name, p in engine.module.named_parameters()},
        "order": [slot.name for unit in engine.units for slot in unit.slots],
        "units": [(unit.padded_numel, [(slot.name, slot.offset) for slot in unit.slots]) for unit in engine.units],
        "volumes": volumes,
        "at_freeze": frozen,
        "final": _state_pieces(engine),
        "optimizer_states": engine.memory_breakdown()["optimizer_states"],
        "grads": engine.memory_breakdown()["grads"],
        "numel": engine.num_parameters(),
        "owned": sum(segment.numel for segment in engine.optimizer.segments),
        "keeps_signs": optimizer.momentum_signs() is not None,
        "partition": optimizer._partitions.partition if optimizer._partitions is not None else None,
    }


def _state_pieces(engine: shardwise.Engine) -> dict[str, list]:
    """Weights and optimizer state of this rank's pieces, by parameter name:
    [(start, stop, state)] (stage 0: whole parameters)."""
    optimizer = engine.optimizer.optimizer
    pieces: dict[str, list] = {}
    for segment in engine.optimizer.segments:
        shard = optimizer.shard_of(segment.master)
        state = {key: value.to("cpu", copy=True) if torch.is_tensor(value) else value
                 for key, value in optimizer.state[segment.master].items()}
        state["weight"] = segment.master.detach().to("cpu", copy=True)
        pieces.setdefault(shard.name, []).append((shard.start, shard.stop, state))
    return pieces


def whole_state(results: list[dict], key: str) -> dict[str, dict]:
    """Every rank's pieces of `key` joined into whole parameters' state (tensors of one
    value per element concatenated, scalars taken from the first piece)."""
    merged: dict[str, dict] = {}
    for name in results[0][key].keys() | {n for r in results for n in r[key]}:
        pieces = {start: (stop, state) for result in results for start, stop, state in result[key].get(name, [])}
        ordered = [pieces[start] for start in sorted(pieces)]
        first = ordered[0][1]
        merged[name] = {
            item: torch.cat([state[item].reshape(-1) for _, state in ordered])
            if torch.is_tensor(value) and value.dim() >= 1 else value
            for item, value in first.items()
        }
    return merged


def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizers' torch path (`SHARDWISE_NATIVE_OPTIM=0`): the simulation takes each
    chunk's scale from torch's fp32 norm, as that path does, and these runs follow it bit
    for bit through the sign decisions. The native kernels' norms are summed in double, a
    scale's last bit may differ, and an element at a sign's tie fall the other way
    (test_onebit_compression.py compares the two paths step by step from the same state)."""
    monkeypatch.setenv(native.ENABLE_VARIABLE, "0")


def assert_equal_to(result: dict, losses: list[float], params: dict[str, torch.Tensor]) -> None:
    for step, (got, want) in enumerate(zip(result["losses"], losses)):
        assert abs(got - want) / want < 1e-5, f"step {step}: loss {got} vs simulated {want}"
    for name, want in params.items():
        error = relative_error(result["params"][name], want)
        assert error < 1e-5, f"{name}: relative error {error:.2e} from the simulation"


@pytest.mark.parametrize(("algorithm", "ranks", "accumulation"),
                         [("adam", 2, 1), ("lamb", 2, 1), ("adam", 4, 1), ("lamb", 4, 1), ("adam", 2, 2)])
def test_equals_simulation_of_n_workers(algorithm, ranks, accumulation, monkeypatch):
    """Losses and weights equal the simulation's (with gradient accumulation too: each
    rank's window of micro-batches is its local gradient); after the warm-up no gradient
    is all-reduced and the exchange sends exactly the formula's bytes, at most 1/16 of an
    fp32 all-reduce plus the scales; the optimizer state equals its formula."""
    torch_path(monkeypatch)
    settings = OneBitSettings(algorithm, weight_decay=0.01, clipping=0.05, accumulation=accumulation)
    results = run_distributed(train_engine, ranks, settings)
    simulation = Simulation(settings, ranks, results[0]["order"], results[0]["units"])
    losses = simulation.train(range(settings.freeze_step))
    # gloo sums 4 ranks' gradients in an order of its own: the warm-up agrees to rounding,
    # then the compressed phase starts from the engine's state, where it must agree exactly
    # (a sign compressor turns a last-bit difference into a flip)
    simulation.adopt(whole_state(results, "at_freeze"), tolerance=1e-5)
    losses += simulation.train(range(settings.freeze_step, STEPS))
    numel = results[0]["numel"]
    fp32_all_reduce = 2 * 4 * numel * (ranks - 1) // ranks
    exchange = onebit_exchange_bytes(numel, ranks)
    for result in results:
        assert_equal_to(result, losses, simulation.weights())
        for step, volume in enumerate(result["volumes"]):
            if step < settings.freeze_step:
                assert volume["all_reduce"] == fp32_all_reduce and volume["all_to_all"] == 0, step
                continue
            assert volume["all_reduce"] == 0, f"step {step}: gradients were all-reduced after the warm-up"
            assert volume["all_to_all"] == exchange["all_to_all"] and volume["all_gather"] == exchange["all_gather"]
            scales = 2 * 4 * ranks * (ranks - 1) // ranks
            assert volume["all_to_all"] + volume["all_gather"] <= fp32_all_reduce / 16 + scales
        assert result["optimizer_states"] == onebit_state_bytes(numel, ranks, lamb=algorithm == "lamb")


def test_bf16_exchanges_the_fp32_momentum():
    """bf16 training: the local bf16 gradients feed the fp32 momentum, which is exchanged
    exactly as in fp32 (same bytes); the state adds the fp32 master copy."""
    settings = OneBitSettings("lamb", bf16=True)
    results = run_distributed(train_engine, 2, settings)
    numel = results[0]["numel"]
    for result in results:
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"] == results[0]["losses"]
        assert result["volumes"][-1]["all_reduce"] == 0
        assert result["volumes"][-1]["all_to_all"] == onebit_exchange_bytes(numel, 2)["all_to_all"]
        assert result["optimizer_states"] == onebit_state_bytes(numel, 2, lamb=True,
                                                                keeps_signs=result["keeps_signs"]) + 4 * numel
    for name, weight in results[0]["params"].items():
        assert torch.equal(weight, results[1]["params"][name]), f"{name} differs between ranks"
