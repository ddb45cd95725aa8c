"""`shardwise tune` (planner/tune.py, tune_cli.py): the candidates, the pruning by the
memory estimator, the ranking by the time model, and one real tune of a tiny GPT script
on 2 gloo ranks whose results are laid out as DeepSpeed's autotuner lays them out."""

import json
from pathlib import Path

import pytest

from shardwise.formulas.memory import NO_OFFLOAD, Offload
from shardwise.formulas.model_shape import ModelShape
from shardwise.models import GPT, GPTConfig
from shardwise.tools.cli.main import main as shardwise_main
from shardwise.tools.planner.devices import datasheet
from shardwise.tools.planner.recommend import Hardware, estimate
from shardwise.tools.planner.timing import predict
from shardwise.tools.planner.tune import SearchSpace, Workload, candidates, prune, rank

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "autotune_gpt.py"
SEQ_LEN = 32


def tiny_shape() -> ModelShape:
    config = GPTConfig.preset("tiny")
    params = sum(p.numel() for p in GPT(config).parameters())
    return ModelShape.from_params(params, config.n_embd, config.n_layer, config.n_head, config.vocab_size)


def workload(gpu_gb: float = 80.0, shape: ModelShape | None = None) -> Workload:
    return Workload(shape or tiny_shape(), Hardware(2, 2, gpu_gb, 512.0, 0.0, 0.0), datasheet("a100"), SEQ_LEN,
                    "fp32", "adamw")


def gpu_bytes(shape: ModelShape, stage: int, offload: Offload = NO_OFFLOAD) -> int:
    result = estimate(shape, Hardware(2, 2, 80.0, 512.0, 0.0, 0.0), 1, SEQ_LEN, "fp32", "adamw")
    return result.option(stage, offload).gpu_total(result.activation("none"))


def test_candidates_cover_the_space_with_deepspeed_names():
    found = candidates(SearchSpace(stages=(0, 1, 2, 3), micro_batches=(1, 2), offload=True))
    # stage 0: no offload; 1 and 2: none or optimizer; 3: none, optimizer, optimizer + parameters
    assert len(found) == 2 * (1 + 2 + 2 + 3)
    names = {candidate.name for candidate in found}
    assert len(names) == len(found)
    assert "z0_gas1_tmbspg2_rbs5e8" in names
    assert "z3_gas1_tmbspg1_offopt-cpu_offparam-cpu_rbs5e8_pfbs5e7" in names


def test_a_plan_that_cannot_fit_is_pruned_with_the_reason():
    shape = tiny_shape()
    between = (gpu_bytes(shape, 0) + gpu_bytes(shape, 3)) / 2 / 1e9  # stage 0 does not fit, stage 3 does
    kept, pruned = prune(candidates(SearchSpace(stages=(0, 3), offload=False)), workload(between, shape))
    assert [c.plan.stage for c in kept] == [3]
    assert [p.candidate.plan.stage for p in pruned] == [0]
    assert "does not fit" in pruned[0].reason and "GB usable" in pruned[0].reason


def test_bucket_sizes_the_model_cannot_fill_run_alike_and_are_pruned():
    space = SearchSpace(stages=(2,), offload=False, reduce_buckets=(10**3, 5 * 10**8, 10**9),
                        allgather_buckets=(5 * 10**8,))
    kept, pruned = prune(candidates(space), workload())
    assert [c.plan.reduce_bucket for c in kept] == [10**3, 5 * 10**8]  # 1e9 is one bucket, as 5e8 is
    assert "runs exactly as z2_gas1_tmbspg1_rbs5e8" in pruned[0].reason


@pytest.mark.parametrize("metric", ["throughput", "latency", "flops"])
def test_ranking_follows_the_time_model(metric):
    load = workload(shape=ModelShape.from_params(1_300_000_000, 2048, 24, 16, 50_304))
    kept, _ = prune(candidates(SearchSpace(stages=(0, 1, 2, 3), micro_batches=(1, 4))), load)
    ranked = rank(kept, load, metric)
    assert len(ranked) == len(kept) > 4
    steps = [entry.prediction.step_s for entry in ranked]
    if metric == "latency":
        assert steps == sorted(steps)
    else:
        values = [entry.predicted_metric for entry in ranked]
        assert values == sorted(values, reverse=True)
    best = ranked[0]
    again = predict(load.shape, best.candidate.plan, load.speeds, num_gpus=2, gpus_per_node=2, seq_len=SEQ_LEN,
                    dtype="fp32", optimizer_state_bytes=estimate(load.shape, load.hardware, 1, SEQ_LEN, "fp32",
                                                                 "adamw").optimizer_state_bytes)
    assert again.step_s == best.prediction.step_s
    # offload moves the optimizer over PCIe and steps it on the host: never the best on an A100
    assert best.candidate.plan.offload == NO_OFFLOAD


def _tune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autotuning: dict, *flags: str) -> int:
    shape = tiny_shape()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "autotuning": {"start_profile_step": 1, "end_profile_step": 2,
                             "model_info": {"num_params": shape.num_params, "hidden_size": shape.hidden_size,
                                            "num_layers": shape.num_layers}, **autotuning}}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    return shardwise_main(["tune", "--config", "ds_config.json", "--nproc", "2", "--heads", str(shape.num_heads),
                           "--vocab-size", str(shape.vocab_size), "--seq-len", str(SEQ_LEN), "--device", "a100",
                           "--headroom", "0", *flags, str(SCRIPT), "--deepspeed_config", "ds_config.json",
                           "--preset", "tiny", "--seq-len", str(SEQ_LEN)])


def test_tune_measures_what_fits_and_writes_the_best_config(tmp_path, monkeypatch):
    """One trial on 2 ranks: stage 0 cannot fit the memory given, so it never runs; stage 1
    runs, its engine writes metrics.json, and it becomes ds_config_optimal.json."""
    shape = tiny_shape()
    between = (gpu_bytes(shape, 0) + gpu_bytes(shape, 1)) / 2 / 1e9
    code = _tune(tmp_path, monkeypatch, {"tuner_type": "model_based", "max_train_micro_batch_size_per_gpu": 1},
                 "--stages", "0,1", "--no-offload", "--device-memory", f"{between:.9f}")
    assert code == 0
    results = tmp_path / "autotuning_results"
    assert not (results / "z0_gas1_tmbspg1_rbs5e8").exists()  # pruned: not run
    trial = results / "z1_gas1_tmbspg1_rbs5e8_agbs5e8"
    metrics = json.loads((trial / "metrics.json").read_text())
    assert metrics["steps_measured"] == 2 and metrics["latency"] > 0
    assert metrics["throughput"] == pytest.approx(2 / metrics["latency"])  # 2 ranks × micro-batch 1
    assert json.loads((trial / "ds_config.json").read_text())["autotuning"]["enabled"] is True
    assert (tmp_path / "autotuning_exps" / f"{trial.name}.json").exists()
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 1 and "autotuning" not in optimal
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    report = json.loads((results / "report.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["z0_gas1_tmbspg1_rbs5e8"]["status"].startswith("pruned: does not fit")
    assert rows[trial.name]["measured"] == pytest.approx(metrics["throughput"])
    assert rows[trial.name]["predicted"] > 0
    assert report["best"] == trial.name
    assert trial.name in (results / "summary.txt").read_text()


@pytest.mark.slow
def test_gridsearch_measures_every_fitting_candidate(tmp_path, monkeypatch):
    code = _tune(tmp_path, monkeypatch, {"tuner_type": "gridsearch", "tuner_early_stopping": 100,
                                         "max_train_micro_batch_size_per_gpu": 2,
                                         "num_tuning_micro_batch_sizes": 2}, "--stages", "0,1,2,3", "--no-offload")
    assert code == 0
    report = json.loads((tmp_path / "autotuning_results" / "report.json").read_text())
    assert report["trials"] == 8  # 4 stages × micro-batches 1 and 2
    assert all(row["measured"] is not None for row in report["rows"])


def test_the_script_must_receive_the_config(tmp_path, monkeypatch, capsys):
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    monkeypatch.chdir(tmp_path)
    code = shardwise_main(["tune", "--config", "ds_config.json", "--preset", "gpt2", "--seq-len", "32",
                           "--device", "a100", str(SCRIPT), "--deepspeed_config", "other.json"])
    assert code == 2
    assert "do not include ds_config.json" in capsys.readouterr().err
