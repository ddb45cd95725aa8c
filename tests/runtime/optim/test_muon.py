"""Muon with AdamW for non-matrices: torch.optim.Muon + torch.optim.AdamW in one optimizer,
whose Newton-Schulz step sees whole matrices assembled from ZeRO's pieces."""

import pytest
import torch

from shardwise.runtime.optim.muon import Muon
from shardwise.runtime.optim.muon import muon_state_bytes
from tests.runtime.optim.pieces import train_in_pieces, train_whole
from tests.runtime.optim.workers import (
    STAGES_AND_WORLDS,
    assert_resume_matches,
    check_against_one_process,
    parameter_shapes,
    save_then_resume,
    step_once_in_process,
)

CONFIG = {"type": "Muon", "params": {"lr": 0.01, "adam_lr": 0.003, "ns_dtype": "float32"}}
SHAPES = [(40, 24), (24, 40), (3, 5, 7), (24,)]


def _random_run(steps: int = 4) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES]
    return initial, [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch_muon_and_adamw_bit_for_bit(adjust_lr_fn, nesterov):
    initial, grads = _random_run()
    matrices = [index for index, shape in enumerate(SHAPES) if len(shape) == 2]

    def torch_pair(params):
        muon = torch.optim.Muon([params[i] for i in matrices], lr=0.02, weight_decay=0.1, nesterov=nesterov,
                                adjust_lr_fn=adjust_lr_fn)
        adamw = torch.optim.AdamW([p for i, p in enumerate(params) if i not in matrices], lr=0.003, weight_decay=0.1)
        return _Both(muon, adamw)

    ours, _ = train_whole(lambda params: Muon(params, lr=0.02, adam_lr=0.003, nesterov=nesterov,
                                              adjust_lr_fn=adjust_lr_fn), initial, grads)
    theirs, _ = train_whole(torch_pair, initial, grads)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("boundaries", [[500, 700, 1500], [100, 1000]])
def test_pieces_anywhere_orthogonalise_the_whole_matrix(boundaries):
    """bf16 Newton-Schulz on the summed pieces: with the same gradients, bit for bit."""
    initial, grads = _random_run()
    make = lambda params: Muon(params, lr=0.02)
    whole, _ = train_whole(make, initial, grads)
    pieces, _ = train_in_pieces(make, initial, grads, boundaries)
    for mine, reference in zip(pieces, whole):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize(("stage", "world_size"), STAGES_AND_WORLDS)
def test_muon_matches_single_process_at_every_stage(stage, world_size):
    """Newton-Schulz in fp32 here (`ns_dtype`): in bf16 the last-bit gradient differences
    between one process and N ranks flip bf16 roundings that the iteration spreads over
    the whole update, ~7e-3 relative on the weights after 3 steps."""
    check_against_one_process("muon", stage, world_size, 1e-5)


def test_muon_from_a_deepspeed_config_with_deepspeeds_rate_keys():
    engine = step_once_in_process({"type": "Muon", "params": {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 0.003}})
    optimizer = engine.optimizer.optimizer
    assert isinstance(optimizer, Muon) and optimizer.param_groups[0]["muon_lr"] == 0.02
    expected = sum(muon_state_bytes(shape) for shape in parameter_shapes().values())
    assert engine.memory_breakdown()["optimizer_states"] == expected


def test_muon_state_is_checkpointed_and_resharded(tmp_path):
    saved, resumed, expected = save_then_resume(tmp_path, CONFIG)
    assert_resume_matches(saved[0], resumed, expected, 1e-5)
    held = sum(rank["optimizer_states"] for rank in saved)  # 2 ranks, stage 2: element-wise, split
    assert held == sum(muon_state_bytes(shape) for shape in parameter_shapes().values())


class _Both:
    """Two torch optimizers stepped as one (the reference's Muon + AdamW)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()
