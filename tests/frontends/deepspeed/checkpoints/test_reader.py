"""Reading DeepSpeed's files without DeepSpeed: every fixture layout (ZeRO 0-3, ZeRO-3
sub-groups, the bf16 optimizer, fp16, a pipeline, a universal folder) gives the same parameters, and the same fp32
masters and Adam moments where the runs were the same fp32 computation."""

import math

import pytest
import torch

from shardwise.frontends.deepspeed.checkpoints.detect import deepspeed_checkpoint_dir
from shardwise.frontends.deepspeed.checkpoints.reader import read_deepspeed_checkpoint
from tests.frontends.deepspeed.checkpoints.fixtures import make_fixtures
from tests.frontends.deepspeed.checkpoints.workers import FIXTURES

tiny = make_fixtures.tiny
FP32_RUNS = ["stage0_fp32", "stage1_fp32", "stage2_fp32", "stage3_fp32", "stage3_sub_groups", "universal"]


def read(case: str):
    directory = deepspeed_checkpoint_dir(FIXTURES / case / "checkpoint")
    assert directory is not None, case
    return read_deepspeed_checkpoint(directory, groups=_groups())


def _groups() -> dict[str, int]:
    model = tiny.build_model()
    groups = tiny.param_groups(model)
    names = {id(param): name for name, param in model.named_parameters()}
    return {names[id(param)]: index for index, group in enumerate(groups) for param in group["params"]}


def whole(contents, key: str) -> dict[str, torch.Tensor]:
    """Each trained parameter's `key` state joined from its pieces, which must tile it exactly."""
    shapes = {parameter.name: parameter.shape for parameter in contents.parameters if parameter.group is not None}
    joined = {}
    for name, shape in shapes.items():
        pieces = sorted((piece for piece in contents.pieces if piece.name == name), key=lambda piece: piece.start)
        assert [piece.start for piece in pieces] == [0] + [piece.stop for piece in pieces[:-1]], name
        assert pieces[-1].stop == math.prod(shape), name
        joined[name] = torch.cat([piece.tensors[key].float() for piece in pieces]).reshape(shape)
    return joined


@pytest.mark.parametrize("case", list(make_fixtures.CASES))
def test_every_layout_reads_the_model_its_run_trained(case):
    contents = read(case)
    _, precision, pipeline = make_fixtures.CASES[case]
    prefix = "layers." if pipeline > 1 else ""
    expected = _groups() if pipeline == 1 else None
    trained = {parameter.name: parameter.group for parameter in contents.parameters if parameter.group is not None}
    if expected is not None:
        assert trained == expected
    assert len(trained) == 7 and all(name.startswith(prefix) for name in trained)
    frozen = [parameter.name for parameter in contents.parameters if parameter.group is None]
    assert frozen == [prefix + ("0.bias" if pipeline > 1 else "embed.bias")]
    initial = tiny.build_model().embed.bias.detach()  # frozen: as built
    assert torch.equal(contents.whole[frozen[0]], initial.to(contents.whole[frozen[0]].dtype))
    assert any(name.endswith("scale") for name in contents.buffers)
    # DeepSpeed's fp16/bf16 optimizer without ZeRO steps once at start-up with zero gradients
    # (FP16_Optimizer.initialize_optimizer_states), so its Adam count is one ahead; the fp16
    # run skipped one step on overflow, so its count is one behind
    adam_steps = {"stage0_bf16": 4, "fp16_dynamic": 2}.get(case, 3)
    assert contents.global_steps == 3 and contents.group_steps == [adam_steps, adam_steps]
    assert contents.client_state == {"note": "fixture", "epoch": 1}
    assert contents.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert [group["weight_decay"] for group in contents.param_groups] == [0.1, 0.0]
    assert contents.state_names == ["exp_avg", "exp_avg_sq"]


def test_fp32_layouts_hold_the_same_masters_and_moments():
    """Stages 0-3 (and the universal folder of the stage-2 run) trained the same fp32 steps on
    the same batches: their masters and Adam moments agree to rounding."""
    reference = read("stage0_fp32")
    for case in FP32_RUNS[1:]:
        contents = read(case)
        for key in ("value", "exp_avg", "exp_avg_sq"):
            ours, theirs = whole(contents, key), whole(reference, key)
            for name, tensor in theirs.items():
                error = ((ours[name] - tensor).norm() / tensor.norm()).item()
                assert error < 1e-5, (case, key, name, error)
