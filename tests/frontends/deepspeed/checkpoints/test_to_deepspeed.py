"""The way back: a shardwise checkpoint written in DeepSpeed's layouts (`shardwise convert
--to-deepspeed`: ZeRO-1/2, ZeRO-3, a pipeline's layer files, bf16's `bf16_zero_*` files)
continues as shardwise's own checkpoint does, read back by shardwise here and, with
DEEPSPEED_PYTHON set, by DeepSpeed 0.19.8 itself."""

import json
import os
import shutil
import subprocess

import pytest
import torch

from shardwise.frontends.deepspeed.checkpoints.layout import zero3_spans
from shardwise.frontends.deepspeed.checkpoints.pickles import load_pickle, save_pickle
from shardwise.tools.cli.main import main as cli
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.checkpoints.fixtures import make_fixtures
from tests.frontends.deepspeed.checkpoints.test_resume import BF16_TOLERANCE, FP32_TOLERANCE, assert_losses_equal
from tests.frontends.deepspeed.checkpoints.workers import FIXTURES, resume, save_for_deepspeed

CASE = "stage2_fp32"
# case -> the convert options for the DeepSpeed run that resumes it, and the files written
LAYOUTS = {
    "stage2_fp32": (["--world-size", "2"], ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                            "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    "stage3_fp32": (["--world-size", "2", "--zero-stage", "3"], [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    "stage3_bf16": (["--world-size", "2", "--zero-stage", "3"], [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]),
    "stage3_sub_groups": (["--world-size", "2", "--zero-stage", "3", "--sub-group-size", "100"], [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    "stage2_bf16": (["--world-size", "2"], [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt"]),
    "bf16_optimizer": (["--world-size", "2", "--zero-stage", "1"], [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt"]),
    "pipeline_fp32": (["--world-size", "1", "--pipeline-parts", "0,4,8"], [
        *[f"layer_{layer:02d}-model_states.pt" for layer in range(8)], "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt"]),
}
NEEDS_DEEPSPEED = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 installed (DS_ACCELERATOR=cpu is set for it)")


def tolerance_of(case: str) -> float:
    return FP32_TOLERANCE if make_fixtures.CASES[case][1] == "fp32" else BF16_TOLERANCE


@pytest.fixture(scope="module")
def shardwise_checkpoints(tmp_path_factory):
    """Per case, a shardwise checkpoint after step 6 (DeepSpeed's step-3 fixture resumed and
    trained 3 steps) and the losses of shardwise's own next 3 steps from it."""
    made = {}

    def make(case: str):
        if case not in made:
            directory = tmp_path_factory.mktemp(case)
            run_distributed(resume, 2, case, str(FIXTURES / case / "checkpoint"), save_to=str(directory), timeout=240)
            continued = run_distributed(resume, 2, case, str(directory), timeout=240)[0]
            assert continued["global_steps"] == 6
            made[case] = directory, continued["losses"]
        return made[case]

    return make


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case in ("stage2_fp32", "stage3_bf16",
                                                                           "pipeline_fp32") else pytest.mark.slow)
                                  for case in LAYOUTS])
def test_to_deepspeed_reads_back_and_continues_the_same(shardwise_checkpoints, case, tmp_path, capsys):
    directory, expected = shardwise_checkpoints(case)
    options, files = LAYOUTS[case]
    assert cli(["convert", "--to-deepspeed", *options, str(directory), str(tmp_path)]) == 0
    assert "DeepSpeed's" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "resumed").iterdir()) == sorted(files)
    back = run_distributed(resume, 2, case, str(tmp_path), timeout=240)[0]
    assert back["global_steps"] == 6
    assert_losses_equal(back["losses"], expected, tolerance_of(case))


# what DeepSpeed's loaders read from each file (the rest is bookkeeping they ignore)
MODEL_KEYS = ("module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "lr_scheduler",
              "global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size")
OPTIMIZER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups", "base_optimizer_state",
                  "optimizer_state_dict", "group_paddings", "partition_count")


def assert_same(ours, theirs, where: str) -> None:
    if torch.is_tensor(theirs):
        assert torch.is_tensor(ours) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert sorted(map(str, ours)) == sorted(map(str, theirs)), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for number, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}/{number}")
    else:
        assert ours == theirs, f"{where}: {ours!r} vs DeepSpeed's {theirs!r}"


@pytest.mark.parametrize("case", ["stage2_fp32", "stage3_fp32", "stage3_sub_groups", "stage3_bf16", "pipeline_fp32"])
def test_round_trip_rewrites_deepspeeds_own_files(case, tmp_path):
    """DeepSpeed's fixture converted to shardwise's format and back: every tensor and count
    DeepSpeed's loaders read equals the file DeepSpeed wrote (the layouts, to the element)."""
    source = FIXTURES / case / "checkpoint"
    assert cli(["convert", "--from-deepspeed", str(source), str(tmp_path / "shardwise")]) == 0
    options, files = LAYOUTS[case]
    assert cli(["convert", "--to-deepspeed", *options, str(tmp_path / "shardwise"), str(tmp_path / "ds")]) == 0
    assert sorted(path.name for path in (tmp_path / "ds" / "step3").iterdir()) == sorted(files)
    for name in files:
        ours, theirs = (load_pickle(folder / "step3" / name) for folder in (tmp_path / "ds", source))
        if "optim_states" in name:
            ours, theirs = ours["optimizer_state_dict"], theirs["optimizer_state_dict"]
            if "fp32_flat_groups" in theirs:
                model_file = name.removeprefix("bf16_").replace("optim", "model")
                shapes = load_pickle(source / "step3" / model_file)["param_shapes"]
                rank = int(model_file.split("_")[3])
                for state in (ours, theirs):
                    _zero_zero3_padding(state, shapes, rank)
            keys = [key for key in OPTIMIZER_KEYS if key in theirs]
            for state in (ours, theirs):  # group hyper-parameters: the lr scheduler's at the save, compared below
                inner = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
                inner["param_groups"] = [group["params"] for group in inner["param_groups"]]
        elif name.startswith("layer_"):
            keys = list(theirs)
        else:
            keys = MODEL_KEYS
        for key in keys:
            assert_same(ours[key], theirs[key], f"{name}/{key}")


def _zero_zero3_padding(state: dict, shapes: list[dict], rank: int) -> None:
    """DeepSpeed leaves ZeRO-3's padding elements uninitialised: zero them before comparing."""
    inner = state["optimizer_state_dict"]["state"]
    for sub_group, sub_shapes in enumerate(shapes):
        flat = state["fp32_flat_groups"][sub_group]
        kept = torch.zeros(flat.numel(), dtype=torch.bool)
        for span in zero3_spans(list(sub_shapes), [shape.numel() for shape in sub_shapes.values()], 2, rank):
            kept[span.offset : span.offset + span.stop - span.start] = True
        for tensor in [flat, *(value for value in inner[sub_group].values() if torch.is_tensor(value))]:
            tensor.detach().masked_fill_(~kept, 0.0)


def test_engine_saves_in_deepspeeds_layout(shardwise_checkpoints, tmp_path):
    """`engine.save_deepspeed_checkpoint` mid-run: reading it back continues as the run did."""
    _, expected = shardwise_checkpoints(CASE)
    saved = run_distributed(save_for_deepspeed, 2, CASE, str(FIXTURES / CASE / "checkpoint"), str(tmp_path),
                            timeout=240)[0]
    assert saved["written"] == str(tmp_path / "global_step6")
    assert not (tmp_path / ".shardwise-for-deepspeed").exists()
    assert_losses_equal(saved["losses"], expected, FP32_TOLERANCE)
    back = run_distributed(resume, 2, CASE, str(tmp_path), timeout=240)[0]
    assert back["client_state"] == {"note": "back"}
    assert_losses_equal(back["losses"], expected, FP32_TOLERANCE)


@pytest.mark.parametrize("case", ["stage3_fp32", "pipeline_fp32"])
def test_engine_saves_zero3_and_pipelines_in_their_layouts(shardwise_checkpoints, case, tmp_path):
    """At ZeRO-3 and with a pipeline the engine writes the layout of its own run (its stage;
    its stage split as the pipeline's parts), which continues as the run did."""
    _, expected = shardwise_checkpoints(case)
    saved = run_distributed(save_for_deepspeed, 2, case, str(FIXTURES / case / "checkpoint"), str(tmp_path),
                            timeout=240)[0]
    assert sorted(path.name for path in (tmp_path / "global_step6").iterdir()) == sorted(LAYOUTS[case][1])
    assert_losses_equal(saved["losses"], expected, FP32_TOLERANCE)
    back = run_distributed(resume, 2, case, str(tmp_path), timeout=240)[0]
    assert_losses_equal(back["losses"], expected, FP32_TOLERANCE)


def test_to_deepspeed_needs_the_world_size(shardwise_checkpoints, tmp_path, capsys):
    directory, _ = shardwise_checkpoints(CASE)
    assert cli(["convert", "--to-deepspeed", str(directory), str(tmp_path)]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_to_deepspeed_refuses_bad_pipeline_parts(shardwise_checkpoints, tmp_path, capsys):
    directory, _ = shardwise_checkpoints(CASE)
    assert cli(["convert", "--to-deepspeed", "--world-size", "2", "--pipeline-parts", "0,4", str(directory),
                str(tmp_path)]) == 2
    assert "is not a layer of a PipelineModule" in capsys.readouterr().err
    assert cli(["convert", "--to-deepspeed", "--world-size", "2", "--pipeline-parts", "0,4,8", "--zero-stage", "2",
                str(directory), str(tmp_path)]) == 2
    assert "ZeRO-1" in capsys.readouterr().err
    assert cli(["convert", "--to-deepspeed", "--world-size", "2", "--pipeline-parts", "0,4,4", str(directory),
                str(tmp_path)]) == 2
    assert "PipelineModule.parts" in capsys.readouterr().err


@NEEDS_DEEPSPEED
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_deepspeed_resumes_the_converted_checkpoint_exactly(shardwise_checkpoints, case, tmp_path):
    """DeepSpeed 0.19.8, configured as the fixture's case, loads the converted folder with
    engine.load_checkpoint; its next 3 losses equal shardwise's continuation."""
    directory, expected = shardwise_checkpoints(case)
    options, _ = LAYOUTS[case]
    assert cli(["convert", "--to-deepspeed", *options, str(directory), str(tmp_path / "ds")]) == 0
    out = tmp_path / "deepspeed.json"
    done = subprocess.run([os.environ["DEEPSPEED_PYTHON"], make_fixtures.__file__, "resume", case,
                           str(tmp_path / "ds"), str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = json.loads(out.read_text())
    assert theirs["global_steps_loaded"] == 6
    assert_losses_equal(theirs["resumed"], expected, tolerance_of(case))


def test_random_ltd_counters_survive_both_conversions(tmp_path):
    """DeepSpeed resumes its random-LTD scheduler from the model file's `random_ltd` (it
    fails on None when random-LTD is on): the counters go to shardwise's checkpoint and back."""
    source = tmp_path / "source"
    shutil.copytree(FIXTURES / CASE / "checkpoint", source)
    model_file = source / "step3" / "mp_rank_00_model_states.pt"
    counters = {"consumed_layer_tokens": 98304, "current_steps": 3, "current_value": 64, "min_value": 32,
                "max_value": 128}
    save_pickle({**load_pickle(model_file), "random_ltd": counters}, model_file)
    assert cli(["convert", "--from-deepspeed", str(source), str(tmp_path / "shardwise")]) == 0
    assert cli(["convert", "--to-deepspeed", *LAYOUTS[CASE][0], str(tmp_path / "shardwise"), str(tmp_path / "ds")]) == 0
    assert load_pickle(tmp_path / "ds" / "step3" / "mp_rank_00_model_states.pt")["random_ltd"] == counters
