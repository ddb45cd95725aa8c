"""Adafactor (C17): torch.optim.Adafactor's update, with the row and column statistics of
whole matrices when ZeRO cuts them into pieces, and O(rows + columns) state."""

import pytest
import torch

from shardwise.runtime.optim import native
from shardwise.runtime.optim.adafactor import Adafactor
from shardwise.runtime.optim.adafactor import adafactor_state_bytes
from tests.runtime.optim.pieces import train_in_pieces, train_whole
from tests.runtime.optim.workers import (
    STAGES_AND_WORLDS,
    assert_resume_matches,
    check_against_one_process,
    parameter_shapes,
    save_then_resume,
    step_once_in_process,
)

CONFIG = {"type": "Adafactor", "params": {"lr": 0.01, "weight_decay": 0.01}}
SHAPES = [(40, 24), (3, 5, 70), (300,), (33, 17), ()]


def _random_run(steps: int = 4) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial values and per-step gradients, some steps' gradients small (eps1 matters)."""
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) * 10.0 ** -(3 * (step % 2)) for shape in SHAPES]
             for step in range(steps)]
    return initial, grads


@pytest.mark.parametrize(("stage", "world_size"), STAGES_AND_WORLDS)
def test_adafactor_matches_single_process_at_every_stage(stage, world_size):
    check_against_one_process("adafactor", stage, world_size, 1e-5)


@pytest.mark.parametrize(("weight_decay", "maximize", "eps1"), [(0.0, False, None), (0.1, True, 1e-4)])
def test_adafactor_equals_torch_adafactor_bit_for_bit(weight_decay, maximize, eps1, monkeypatch):
    """The torch path (the native kernels' path is compared with it step by step in
    test_native.py: its sums are in double, so not bit for bit)."""
    monkeypatch.setenv(native.ENABLE_VARIABLE, "0")
    initial, grads = _random_run()
    options = dict(lr=0.05, weight_decay=weight_decay, maximize=maximize, eps=(eps1, 1e-3))
    ours, _ = train_whole(lambda params: Adafactor(params, **options), initial, grads)
    theirs, _ = train_whole(lambda params: torch.optim.Adafactor(params, **options), initial, grads)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


def test_adafactor_agrees_with_transformers_where_their_settings_coincide():
    """transformers' Adafactor with relative_step, scale_parameter, no beta1 and no weight
    decay is the same algorithm; it adds eps1 = 1e-30 to g² where torch floors the
    estimate at machine epsilon, and orders its arithmetic differently (≈ 4e-8 here)."""
    from transformers.optimization import Adafactor as HFAdafactor

    initial, grads = _random_run(steps=10)
    initial, grads = initial[:4], [step[:4] for step in grads]  # transformers refuses 0-dim tensors
    grads = [[grad * 1e3 if step % 2 else grad for grad in step_grads] for step, step_grads in enumerate(grads)]
    ours, _ = train_whole(lambda params: Adafactor(params), initial, grads)
    theirs, _ = train_whole(lambda params: HFAdafactor(params, lr=None, relative_step=True, scale_parameter=True,
                                                    warmup_init=False, beta1=None, weight_decay=0.0), initial, grads)
    for mine, reference in zip(ours, theirs):
        assert ((mine - reference).norm() / reference.norm()).item() < 1e-6


@pytest.mark.parametrize("native_kernels", ["1", "0"])
@pytest.mark.parametrize("boundaries", [[500, 700, 1500], [100, 2000], [1200, 2200]])
def test_pieces_cut_anywhere_give_the_whole_matrices_statistics(boundaries, native_kernels, monkeypatch):
    """Cuts inside rows, a piece inside one row's run, a 3-D parameter cut inside and
    across its matrices; the gradients are the same, so only summation order differs.
    Both paths: the native kernels (optim/native.py) and torch operations."""
    monkeypatch.setenv(native.ENABLE_VARIABLE, native_kernels)
    initial, grads = _random_run()
    make = lambda params: Adafactor(params, lr=0.05, weight_decay=0.01)
    whole, _ = train_whole(make, initial, grads)
    pieces, optimizers = train_in_pieces(make, initial, grads, boundaries)
    for mine, reference in zip(pieces, whole):
        assert torch.allclose(mine, reference, rtol=1e-6, atol=1e-7)
    stored = sum(optimizer.state_codec.state_bytes(state, 0) for optimizer in optimizers
                 for state in optimizer.state.values())
    assert stored == sum(adafactor_state_bytes(shape) for shape in SHAPES)  # no statistic held twice


def test_adafactor_from_a_deepspeed_config_holds_rows_plus_columns():
    engine = step_once_in_process(CONFIG, stage=2)
    assert isinstance(engine.optimizer.optimizer, Adafactor)
    expected = sum(adafactor_state_bytes(shape) for shape in parameter_shapes().values())
    assert engine.memory_breakdown()["optimizer_states"] == expected
    assert expected < 0.25 * 4 * engine.num_parameters()  # vs 4 bytes per element unfactored


def test_a_config_naming_torch_adafactors_foreach_is_accepted():
    """DeepSpeed builds torch.optim.Adafactor from {"type": "Adafactor"} and passes it the
    params, `foreach` among them: accepted, stepping the same."""
    engine = step_once_in_process({**CONFIG, "params": {**CONFIG.get("params", {}), "foreach": True}}, stage=2)
    reference = step_once_in_process(CONFIG, stage=2)
    assert isinstance(engine.optimizer.optimizer, Adafactor)
    for mine, theirs in zip(engine.module.parameters(), reference.module.parameters()):
        assert torch.equal(mine, theirs)


def test_adafactor_state_is_checkpointed_and_resharded(tmp_path):
    saved, resumed, expected = save_then_resume(tmp_path, CONFIG)
    assert_resume_matches(saved[0], resumed, expected, 1e-5)
    held = sum(rank["optimizer_states"] for rank in saved)  # 2 ranks, stage 2: split, not repeated
    assert held == sum(adafactor_state_bytes(shape) for shape in parameter_shapes().values())
