"""DeepSpeed's own CPU unit tests, run against shardwise's DeepSpeed API (issue 34).

    python scripts/deepspeed_tests.py --tests /path/to/DeepSpeed            # a checkout (or its tests/)
    python scripts/deepspeed_tests.py --tests /path/to/DeepSpeed.git        # a git directory: its tests/ at --commit
    DEEPSPEED_PYTHON=/venv/bin/python python scripts/deepspeed_tests.py --tests ... --save results.json
    python scripts/deepspeed_tests.py --tests ... --baseline results.json   # reuse saved DeepSpeed runs

The chosen files (FILES, by area) run twice, each test file in its own pytest session:
first under a real DeepSpeed (the interpreter DEEPSPEED_PYTHON names, DeepSpeed 0.19.8 on
CPU: DS_ACCELERATOR=cpu, and LOCAL_SIZE so its harness runs 2-rank tests as processes),
to learn which tests pass there, then under shardwise exactly as `shardwise run
--as-deepspeed` makes it stand in for `deepspeed` (the same alias directory first on
PYTHONPATH, inherited by the harness's worker processes). It prints, per file and per
area, how many tests pass under DeepSpeed and how many of those pass under shardwise,
and the first error line of each test that passes under DeepSpeed but not under shardwise.

Tests of DeepSpeed internals no user touches are deselected in both runs (EXCLUDED, each
with its reason; the docs' DeepSpeed guide lists them). DeepSpeed's harness ends the whole
pytest session when a test hangs past DS_UNITTEST_TIMEOUT (pytest.exit); the hung test is
then recorded as "hang" and the session restarted on the tests after it.

Not part of the default test suite: it needs DeepSpeed's repository and takes tens of
minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

REPOSITORY = Path(__file__).resolve().parent.parent
DEFAULT_COMMIT = "edaa72212"  # DeepSpeed's master on the day the suite was chosen ("Fix ZeRO-1/2 with zero-sized parameters")

FILES: dict[str, list[str]] = {
    "utils": ["unit/utils/test_partition_balanced.py", "unit/runtime/utils/test_partition.py"],
    "pipeline": ["unit/runtime/pipe/test_topology.py", "unit/runtime/pipe/test_pipe_schedule.py",
                 "unit/pipe/test_pipe_module.py", "unit/checkpoint/test_pipeline.py"],
    "checkpoints": ["unit/checkpoint/test_latest_checkpoint.py", "unit/checkpoint/test_tag_validation.py",
                    "unit/checkpoint/test_convert_checkpoint.py", "unit/checkpoint/test_shared_weights.py",
                    "unit/checkpoint/test_other_optimizer.py", "unit/checkpoint/test_zero_optimizer.py"],
    "learning-rate schedules": ["unit/checkpoint/test_lr_scheduler.py", "unit/runtime/test_lr_schedulers.py"],
    "ZeRO": ["unit/runtime/zero/test_ignore_unused_parameters.py", "unit/runtime/zero/test_zero_grad_clip.py",
             "unit/runtime/zero/test_unwrap_model.py", "unit/runtime/zero/test_zero_context_return.py",
             "unit/runtime/zero/test_zero_context.py", "unit/runtime/zero/test_zero_tensor_fragment.py"],
    "activation checkpointing": ["unit/runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
                                 "unit/runtime/activation_checkpointing/test_activation_checkpointing.py"],
    "ops.adam": ["unit/ops/adam/test_adamw.py"],
    "comm": ["unit/comm/test_dist.py"],
    "MoE": ["unit/checkpoint/test_moe_checkpoint.py", "unit/v1/moe/test_moe.py"],
    "config and initialize": ["unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_initialize.py"],
}

# Node-id prefixes deselected in both runs: they test DeepSpeed's internals (its optimizer
# wrapper classes, flat buffers, op builders, config model), not what user code calls.
EXCLUDED: dict[str, str] = {
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation":
        "asserts which of DeepSpeed's internal optimizer wrappers (FP16_Optimizer, BF16_Optimizer, "
        "DeepSpeedZeroOptimizer...) the engine builds for each precision and stage",
    "unit/runtime/test_ds_config_dict.py::TestConfigLoad":
        "DeepSpeed's DeepSpeedConfig class, built directly from a dict, a JSON and an HJSON file",
    "unit/runtime/test_ds_config_dict.py::test_temp_config_json": "DeepSpeedConfig's internal JSON reader",
    "unit/runtime/test_ds_config_dict.py::test_get_bfloat16_enabled":
        "deepspeed.runtime.precision_config.get_bfloat16_config, an internal config parser",
    "unit/runtime/test_ds_config_dict.py::test_gather_16bit_params_on_model_save":
        "DeepSpeedZeroConfig's internal field aliases",
    "unit/runtime/zero/test_zero_context.py::TestScatterGather":
        "a parameter's own all_gather()/partition() methods: DeepSpeed's per-parameter internals",
    "unit/runtime/zero/test_zero_context.py::TestGatherUpdate":
        "a parameter's own all_gather()/partition() methods: DeepSpeed's per-parameter internals",
    "unit/runtime/zero/test_zero_context.py::test_multiple_all_gather_handles_wait_passes_dependency_by_keyword":
        "MultipleAllGatherHandles, the handle DeepSpeed's parameter all-gathers return internally",
    "unit/pipe/test_pipe_module.py::TestPipeModuleCheckpointInterval":
        "PipelineModule's private recomputation cache (_precompute_checkpointable_values, "
        "is_checkpointable_results) and the engine's private _reentrant_activation_checkpointing()",
    "unit/runtime/zero/test_zero_grad_clip.py::TestZeroGradClip":
        "the private _get_norm_groups() of DeepSpeed's stage-3 optimizer class",
    "unit/runtime/zero/test_unwrap_model.py::TestUnwrapModel::test":  # not TestUnwrapModelTraceInvalidate
        "counts the forward hooks DeepSpeed's parameter-offload object keeps (optimizer.parameter_offload)",
}

# Records every test's outcome from inside pytest, whatever ends the session (DeepSpeed's
# harness calls pytest.exit on a hang, which can cut a JUnit report short).
RECORDER = textwrap.dedent(
    """
    import json, os

    def _write(record):
        with open(os.environ["DS_TESTS_RECORD"], "a") as handle:
            handle.write(json.dumps(record) + "\\n")

    def pytest_collection_finish(session):
        _write({"collected": [item.nodeid for item in session.items]})

    def pytest_collectreport(report):
        if report.outcome == "failed":
            _write({"collect_error": _first_error(report)})

    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":
            _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                    "error": _first_error(report) if report.outcome != "passed" else ""})

    def _first_error(report):
        text = getattr(report, "longreprtext", "") or ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            return str(report.longrepr[2])
        lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        errors = [line for line in lines if "Error" in line or "Exception" in line or "assert" in line]
        chosen = (errors or lines or text.strip().splitlines()[-1:] or [""])[0]
        return chosen[:300]
    """
)


def tests_directory(source: Path, commit: str, scratch: Path) -> Path:
    """DeepSpeed's `tests/` directory: inside a checkout, the directory itself, or extracted
    from a (bare) git directory at `commit`."""
    for candidate in (source / "tests", source):
        if (candidate / "unit" / "common.py").is_file():
            return candidate
    archive = scratch / "tests.tar"
    with archive.open("wb") as handle:
        subprocess.run(["git", f"--git-dir={source}", "archive", commit, "tests"], stdout=handle, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    return scratch / "tests"


def outcome_of(records: list[dict]) -> str:
    """One test's outcome from its setup/call/teardown reports."""
    outcomes = [record["outcome"] for record in records]
    if "failed" in outcomes:
        return "failed"
    if "skipped" in outcomes:
        return "skipped"
    return "passed" if outcomes else "missing"


def run_file(python: str, tests: Path, file: str, environment: dict[str, str], *, file_timeout: float,
             scratch: Path) -> dict[str, dict]:
    """{node id: {"outcome", "error"}} for one test file, restarting after hangs."""
    plugin = scratch / "ds_tests_recorder.py"
    plugin.write_text(RECORDER)
    deselect = [arg for prefix in EXCLUDED if prefix.startswith(file) for arg in ("--deselect", prefix)]
    results: dict[str, dict] = {}
    targets = [file]
    started = time.monotonic()
    while targets:
        record_path = scratch / "record.jsonl"
        record_path.unlink(missing_ok=True)
        env = {**environment, "DS_TESTS_RECORD": str(record_path),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(scratch), environment.get("PYTHONPATH", "")]))}
        left = file_timeout - (time.monotonic() - started)
        command = [python, "-m", "pytest", "-p", "ds_tests_recorder", "-p", "no:cacheprovider", "-q", "-rN",
                   *deselect, *targets]
        try:
            subprocess.run(command, cwd=tests, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=max(left, 1))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        collected, by_test, collect_error = [], defaultdict(list), ""
        if record_path.exists():
            for line in record_path.read_text().splitlines():
                record = json.loads(line)
                if "collected" in record:
                    collected = collected or record["collected"]
                elif "collect_error" in record:
                    collect_error = collect_error or record["collect_error"]
                else:
                    by_test[record["nodeid"]].append(record)
        if collect_error:
            results[f"{file}::<collection>"] = {"outcome": "failed", "error": f"collection: {collect_error}"}
        for nodeid, records in by_test.items():
            errors = [record["error"] for record in records if record["error"]]
            results[nodeid] = {"outcome": outcome_of(records), "error": errors[0] if errors else ""}
        remaining = [nodeid for nodeid in collected if nodeid not in by_test]
        if not remaining:
            break
        hung = remaining[0]
        results[hung] = {"outcome": "hang", "error": "timed out: the file's time ran out" if timed_out else
                         "hung: DeepSpeed's harness ended the session (DS_UNITTEST_TIMEOUT)"}
        targets = [] if timed_out else remaining[1:]
        for nodeid in remaining[1:] if timed_out else []:
            results[nodeid] = {"outcome": "not run", "error": "the file's time ran out before it"}
    return results


def run_suite(python: str, tests: Path, files: list[str], environment: dict[str, str], *, file_timeout: float,
              label: str, progress: Callable[[dict[str, dict]], None] = lambda results: None) -> dict[str, dict]:
    """Every file's results; `progress` is called with those so far after each file."""
    results = {}
    for file in files:
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ds-tests-") as scratch:
            results[file] = run_file(python, tests, file, environment, file_timeout=file_timeout, scratch=Path(scratch))
        passed = sum(result["outcome"] == "passed" for result in results[file].values())
        print(f"[{label}] {file}: {passed}/{len(results[file])} passed in {time.monotonic() - began:.0f} s",
              file=sys.stderr, flush=True)
        progress(results)
    return results


def common_environment(test_timeout: int) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    environment.update({"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1",
                        "DS_UNITTEST_TIMEOUT": str(test_timeout), "CUDA_VISIBLE_DEVICES": ""})
    return environment


def excluded(nodeid: str) -> bool:
    return any(nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "[")
               for prefix in EXCLUDED)


def report(baseline: dict[str, dict], candidate: dict[str, dict]) -> dict:
    """Prints the per-file and per-area table; returns the totals."""
    area_of = {file: area for area, files in FILES.items() for file in files}
    by_area: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    lines = []
    for file, results in baseline.items():
        passing = [nodeid for nodeid, result in results.items()
                   if result["outcome"] == "passed" and not excluded(nodeid)]
        ours = candidate.get(file, {})
        kept = [nodeid for nodeid in passing if ours.get(nodeid, {}).get("outcome") == "passed"]
        by_area[area_of.get(file, "other")][0] += len(passing)
        by_area[area_of.get(file, "other")][1] += len(kept)
        lines.append(f"{file}: {len(passing)} pass under DeepSpeed, {len(kept)} of them under shardwise")
        for nodeid in passing:
            if nodeid not in kept:
                result = ours.get(nodeid) or ours.get(f"{file}::<collection>") or {
                    "outcome": "missing", "error": "not run under shardwise"}
                lines.append(f"    {nodeid.split('::', 1)[1]}: {result['outcome']}: {result['error']}")
    print("\n".join(lines))
    print("\nby area (passing under DeepSpeed / of those, passing under shardwise):")
    total = [0, 0]
    for area in FILES:
        if area in by_area:
            deepspeed_count, shardwise_count = by_area[area]
            total[0] += deepspeed_count
            total[1] += shardwise_count
            share = f"{100 * shardwise_count / deepspeed_count:.0f}%" if deepspeed_count else "-"
            print(f"  {area}: {deepspeed_count} / {shardwise_count} ({share})")
    share = f"{100 * total[1] / total[0]:.1f}%" if total[0] else "-"
    print(f"  all: {total[0]} / {total[1]} ({share})")
    return {"deepspeed": total[0], "shardwise": total[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", required=True, type=Path,
                        help="DeepSpeed's repository: a checkout, its tests/ directory, or a git directory")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="the commit to take tests/ from a git directory at")
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON"),
                        help="an interpreter with DeepSpeed 0.19.8 (default: $DEEPSPEED_PYTHON)")
    parser.add_argument("--baseline", type=Path, nargs="+",
                        help="--save files whose DeepSpeed results to reuse (merged: e.g. runs of different --files)")
    parser.add_argument("--save", type=Path, help="write both runs' results (JSON) here")
    parser.add_argument("--deepspeed-only", action="store_true", help="run the baseline only (with --save)")
    parser.add_argument("--files", nargs="*", help="only these files (paths under tests/, e.g. unit/comm/test_dist.py)")
    parser.add_argument("--test-timeout", type=int, default=90, help="DeepSpeed's per-test timeout (seconds)")
    parser.add_argument("--file-timeout", type=float, default=1800, help="seconds per file and run")
    args = parser.parse_args()
    files = args.files or [file for chosen in FILES.values() for file in chosen]
    environment = common_environment(args.test_timeout)
    with tempfile.TemporaryDirectory(prefix="ds-tests-source-") as scratch:
        tests = tests_directory(args.tests.resolve(), args.commit, Path(scratch))
        if args.baseline is not None:
            saved = {file: results for path in args.baseline for file, results in
                     json.loads(path.read_text())["deepspeed"].items()}
            baseline = {file: saved[file] for file in files if file in saved}
            files = list(baseline)
        elif args.deepspeed_python:
            def save_baseline(results: dict[str, dict]) -> None:
                if args.save is not None:
                    args.save.write_text(json.dumps({"commit": args.commit, "deepspeed": results}, indent=1))

            baseline = run_suite(args.deepspeed_python, tests, files, environment, file_timeout=args.file_timeout,
                                 label="deepspeed", progress=save_baseline)
        else:
            parser.error("give DEEPSPEED_PYTHON (or --deepspeed-python) for the baseline, or --baseline FILE")
        if args.deepspeed_only:
            return 0
        sys.path.insert(0, str(REPOSITORY))
        from shardwise.frontends.deepspeed.alias import as_deepspeed_environment

        # a file none of whose tests pass under DeepSpeed has nothing to measure
        measured = [file for file in files
                    if any(result["outcome"] == "passed" and not excluded(nodeid)
                           for nodeid, result in baseline.get(file, {}).items())]
        with as_deepspeed_environment() as alias:
            candidate = run_suite(sys.executable, tests, measured, {**environment, **alias},
                                  file_timeout=args.file_timeout, label="shardwise")
    totals = report(baseline, candidate)
    if args.save is not None:
        args.save.write_text(json.dumps({"commit": args.commit, "totals": totals, "deepspeed": baseline,
                                         "shardwise": candidate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
