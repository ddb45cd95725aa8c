"""The config's monitor blocks write DeepSpeed's series (Train/Samples/train_loss, lr,
loss_scale, against samples trained) into files their own readers open: TensorBoard's event
reader, the CSV files, wandb's offline run file, Comet's offline archive."""

import csv
import glob
import importlib.util
import json
import os
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import shardwise

STEPS, MICRO, ACCUMULATION = 3, 2, 2
SAMPLES = [MICRO * ACCUMULATION * (step + 1) for step in range(STEPS)]
# WarmupLR, linear over 4 steps to 1e-2: the rate after each step (the schedule steps first)
LRS = [0.0, 0.0025, 0.005]
HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_COMET = importlib.util.find_spec("comet_ml") is not None


def config(root: Path, comet: bool) -> dict:
    """Every monitor but Comet, or Comet alone: Comet's auto-logging mirrors TensorBoard's and
    wandb's scalars into its experiment when comet_ml was imported before them (transformers'
    Trainer imports it), which would put each series in its archive twice, as under DeepSpeed."""
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2,
                                                     "warmup_type": "linear"}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "tensorboard": {"enabled": not comet, "output_path": str(root / "tb"), "job_name": "job"},
        "csv_monitor": {"enabled": not comet, "output_path": str(root / "csv"), "job_name": "job"},
        "wandb": {"enabled": HAS_WANDB and not comet, "project": "shardwise-test"},
        "comet": {"enabled": comet, "online": False, "samples_log_interval": 1},
    }


def train(root: Path, comet: bool) -> list[float]:
    """One short fp16 run with the monitors of `config`; returns the step losses."""
    saved = dict(os.environ)
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true",
                      COMET_OFFLINE_DIRECTORY=str(root / "comet"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        engine = shardwise.initialize(model, config(root, comet))
        losses = []
        for _ in range(STEPS):
            micro = []
            for _ in range(ACCUMULATION):
                loss = engine(torch.randn(MICRO, 4)).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                micro.append(loss.item())
            losses.append(sum(micro) / len(micro))
        engine.destroy()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return losses


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitors")
    return root, train(root, comet=False)


@pytest.fixture(scope="module")
def comet_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("comet")
    return root, train(root, comet=True)


def expected(losses: list[float]) -> dict[str, list[tuple[int, float]]]:
    return {"Train/Samples/train_loss": list(zip(SAMPLES, losses)),
            "Train/Samples/lr": list(zip(SAMPLES, LRS)),
            "Train/Samples/loss_scale": [(samples, 256.0) for samples in SAMPLES]}


def assert_series(seen: dict[str, list[tuple[int, float]]], losses: list[float], rel: float = 1e-6) -> None:
    for name, points in expected(losses).items():
        assert [step for step, _ in seen[name]] == [step for step, _ in points], name
        assert [value for _, value in seen[name]] == pytest.approx([value for _, value in points], rel=rel), name


def test_tensorboard_events_hold_the_series(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, losses = run
    events = EventAccumulator(str(root / "tb" / "job"))
    events.Reload()
    seen = {tag: [(scalar.step, scalar.value) for scalar in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert_series(seen, losses)


def test_csv_files_hold_the_series_as_deepspeed_writes_them(run):
    root, losses = run
    seen = {}
    for name in expected(losses):
        path = root / "csv" / "job" / f"{name.replace('/', '_')}.csv"
        header, *rows = list(csv.reader(path.open()))
        assert header == ["step", name.split("/")[-1]]
        seen[name] = [(int(step), float(value)) for step, value in rows]
    assert_series(seen, losses)


def read_wandb_history(path: str) -> list[dict]:
    """The history records of a .wandb run file: a 7-byte header, then LevelDB's log format
    (32 KiB blocks of checksum, length, type, data) holding wandb's protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data, block, position = Path(path).read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(pending + chunk)
            pending = b""
        else:
            pending += chunk
    history = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'shardwise[monitors]')")
def test_wandb_offline_run_holds_the_series(run):
    root, losses = run
    (path,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = read_wandb_history(path)
    seen = {name: [(row["_step"], row[name]) for row in history if name in row] for name in expected(losses)}
    assert_series(seen, losses)


@pytest.mark.skipif(not HAS_COMET, reason="comet_ml is not installed (pip install 'shardwise[monitors]')")
def test_comet_offline_archive_holds_the_series(comet_run):
    root, losses = comet_run
    (archive,) = glob.glob(str(root / "comet" / "*.zip"))
    messages = [json.loads(line) for line in zipfile.ZipFile(archive).read("messages.json").splitlines()]
    metrics = [message["payload"]["metric"] for message in messages if message["type"] == "metric_msg"]
    seen = {name: [(metric["step"], metric["metricValue"]) for metric in metrics if metric["metricName"] == name]
            for name in expected(losses)}
    assert_series(seen, losses)


def test_comet_without_its_package_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # import comet_ml raises ImportError
    model = torch.nn.Linear(4, 1)
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "comet": {"enabled": True},
                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert not engine.monitor.enabled
    assert "comet_ml package is not installed" in caplog.text
    engine.destroy()
