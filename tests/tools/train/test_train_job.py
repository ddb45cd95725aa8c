"""`shardwise train` end to end: 2 gloo ranks through torchrun, every file it writes checked.

The runs use the tiny GPT preset so the whole module takes a few tens of seconds; the
default 10m job differs only in size and step count.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shardwise.runtime.checkpoint import convert_checkpoint
from shardwise.formulas.memory import element_bytes
from shardwise.tools.train.evaluate import generate_sample
from shardwise.tools.train.expected import COLLECTIVES, MODEL_STATES, ring_share
from shardwise.tools.train.options import TrainOptions
from shardwise.tools.train.setup import build_model

REPO_ROOT = Path(__file__).resolve().parents[3]
STEPS = 5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def shardwise_train(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.tools.cli.main", "train", "--model-size", "tiny", "--nproc", "2", *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert image.std() > 0.05  # not a blank canvas


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    out_dir = tmp_path_factory.mktemp("runs")
    result = shardwise_train(
        "--steps", str(STEPS), "--save-every", "2", "--profile", "--out-dir", str(out_dir), "--name", "e2e"
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return out_dir / "e2e", result.stdout


def test_metrics_have_one_complete_line_per_step(trained):
    run_dir, _ = trained
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert math.isfinite(record["loss"]) and 2.0 < record["loss"] < 6.5
        # DeepSpeed's WarmupCosineLR starts from iteration -1, i.e. lr 0 for the first step.
        assert (record["lr"] > 0) == (record["step"] > 1) and record["grad_norm"] > 0
        assert record["tokens"] == 8 * 128
        assert record["tokens_per_s"] == pytest.approx(record["tokens"] / record["time_s"]["step"])
        assert 0 < record["mfu"] < 1
        times = record["time_s"]
        assert set(times) == {"data", "forward", "backward", "optimizer", "comm_wait", "step"}
        assert times["forward"] > 0 and times["backward"] > 0
        parts = sum(times[phase] for phase in ("data", "forward", "backward", "optimizer", "comm_wait"))
        assert parts <= times["step"] * 1.001
        assert set(record["memory"]) == {*MODEL_STATES, "buffers", "activations", "process_current", "process_peak"}
        assert record["memory"]["process_current"] > 50e6
        assert record["comm_bytes"]["reduce_scatter"] > 0 and record["comm_bytes"]["all_gather"] > 0


def test_summary_memory_equals_the_formula_and_comm_is_explained(trained):
    run_dir, _ = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    run, model = summary["run"], summary["model"]
    assert (run["stage"], run["world_size"], run["dtype"]) == (3, 2, "fp32")
    assert model["num_params"] == 37_760 and model["tied_params"] == 256 * 32
    padding = summary["padding_elements"]
    for category in MODEL_STATES:
        measured, formula = summary["memory"]["measured"][category], summary["memory"]["formula"][category]
        assert abs(measured - formula) <= padding * 8, category
    comm = summary["comm_per_step"]
    assert comm["measured"]["reduce_scatter"] == comm["formula"]["reduce_scatter"]
    # One more gather of the tied embedding than the formula's one-use-per-forward count.
    tied_gather = ring_share(model["tied_params"], element_bytes("fp32"), 2)
    assert comm["measured"]["all_gather"] == comm["formula"]["all_gather"] + tied_gather
    assert summary["final"]["val_loss"] > 0 and summary["train_seconds"] > 0


def test_plots_are_valid_pngs(trained):
    run_dir, _ = trained
    check_png(run_dir / "loss.png")
    check_png(run_dir / "memory.png")


def test_tensorboard_events_hold_the_scalars(trained):
    run_dir, _ = trained
    (event_file,) = run_dir.glob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "perf/mfu", "time/comm_wait_s", "memory/params_MB"} <= set(tags)
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, STEPS + 1))


def test_checkpoint_and_sample_are_written(trained):
    run_dir, _ = trained
    checkpoint = run_dir / "checkpoint"
    assert (checkpoint / "latest").read_text().strip() == f"step{STEPS}"
    # --save-every 2 over 5 steps: steps 2 and 4, then the final one.
    assert sorted(path.name for path in checkpoint.iterdir()) == ["latest", "step2", "step4", f"step{STEPS}"]
    shards = sorted(path.name for path in (checkpoint / f"step{STEPS}").iterdir())
    assert "rank_00000.safetensors" in shards and "rank_00001.safetensors" in shards
    sample = (run_dir / "sample.txt").read_bytes().decode()
    assert sample.startswith("def ") and len(sample.encode()) >= 200


def test_the_consolidated_checkpoint_regenerates_the_sample(trained, tmp_path):
    """The ranks generated from weights gathered across stage-3 shards; one process loading
    the consolidated checkpoint must produce the same text from the same seed."""
    run_dir, _ = trained
    (weights,) = convert_checkpoint(run_dir / "checkpoint", tmp_path / "model.safetensors")
    options = TrainOptions.load(run_dir / "options.json")
    model, _ = build_model(options)
    missing = model.load_state_dict(load_file(weights), strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to wte, stored once
    sample = generate_sample(model, options.sample_prompt, options.sample_tokens, options.seed, torch.device("cpu"))
    assert sample == (run_dir / "sample.txt").read_bytes().decode()  # bytes: the text may hold a \r


def test_profile_traces_every_rank(trained):
    run_dir, _ = trained
    traces = sorted(path.name for path in (run_dir / "profile").glob("*.pt.trace.json"))
    assert [name.split(".")[0] for name in traces] == ["rank0", "rank1"]
    events = json.loads((run_dir / "profile" / traces[0]).read_text())["traceEvents"]
    assert {"forward", "backward", "optimizer"} <= {event.get("name") for event in events}


def test_report_prints_progress_and_measured_vs_formula_tables(trained):
    _, stdout = trained
    assert f"step {STEPS}/{STEPS}" in stdout
    for title in ("Training", "Model states per rank: ZeRO-3", "Communication per rank per step"):
        assert title in stdout
    assert stdout.count("exact") >= 4


def test_compare_stages_matches_section_4(tmp_path):
    result = shardwise_train("--compare-stages", "--steps", "1", "--out-dir", str(tmp_path), "--name", "cmp")
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "cmp"
    comparison = json.loads((run_dir / "zero_stages.json").read_text())
    assert [entry["stage"] for entry in comparison["stages"]] == [0, 1, 2, 3]
    tied_gather = ring_share(comparison["tied_params"], 4, 2)
    for entry in comparison["stages"]:
        padding = entry["padding_elements"]
        for category in MODEL_STATES:
            measured, formula = entry["memory"]["measured"][category], entry["memory"]["formula"][category]
            assert abs(measured - formula) <= padding * 8, (entry["stage"], category)
        extra = {"all_gather": tied_gather} if entry["stage"] == 3 else {}
        for op in COLLECTIVES:
            measured, formula = entry["comm_per_step"]["measured"][op], entry["comm_per_step"]["formula"][op]
            assert abs(measured - formula - extra.get(op, 0)) <= 3 * padding * 4, (entry["stage"], op)
    params = [entry["memory"]["measured"]["params"] for entry in comparison["stages"]]
    assert params[0] == params[1] == params[2] == 2 * params[3]
    check_png(run_dir / "zero_stages.png")
    assert "ZeRO stages, measured / formula MB per rank" in result.stdout


def test_bf16_masters_run_reports_them_and_holds_the_formula(tmp_path):
    """A config asking for bf16 master weights, gradients and optimizer states: the report
    names them, K is 4, and the measured model states equal the formula."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                           "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}))
    result = shardwise_train("--steps", "2", "--config", str(config), "--out-dir", str(tmp_path), "--name", "bf16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "K = 4 (bf16 masters and optimizer states)" in " ".join(result.stdout.split())
    summary = json.loads((tmp_path / "bf16" / "summary.json").read_text())
    assert (summary["run"]["dtype"], summary["run"]["optimizer_state_bytes"], summary["run"]["bf16_masters"]) == (
        "bf16", 4, True)
    padding = summary["padding_elements"]
    for category in MODEL_STATES:
        measured, formula = summary["memory"]["measured"][category], summary["memory"]["formula"][category]
        assert abs(measured - formula) <= padding * 4, category
