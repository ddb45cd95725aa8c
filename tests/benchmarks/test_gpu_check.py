"""scripts/gpu_check.sh and benchmarks/gpu/ keep working without a GPU, so that the few
minutes a lent GPU gives are spent measuring, not fixing typos (issue 23).

The driver runs here as it would on a machine without CUDA (every check starts and says
SKIP); the sizing formulas are checked against the real model; the summary lines are
checked for each outcome; and the benchmarks' toy mode (the CPU rehearsal) runs for the
quick ones. The slow toy runs (compilation, offload) belong to the full rehearsal,
`SHARDWISE_GPU_CHECK_CPU=1 OUT=/tmp/gpucheck_out bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHMARKS = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU_BENCHMARKS))

import gpt_sizes  # noqa: E402
import summarize  # noqa: E402

SCRIPTS = ("train_job", "gpt_speed", "kernels", "optimizers", "recompute_memory", "offload_scale", "gpt_sizes",
           "summarize")


def run_main(module_name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """A benchmark's main() in this process with `argv`: (exit status, its output)."""
    module = __import__(module_name)
    saved = sys.argv
    sys.argv = [module.__file__, *argv]
    try:
        module.main()
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 0
    finally:
        sys.argv = saved
    return status, capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_has_a_help(name, capsys):
    status, out = run_main(name, ["--help"], capsys)
    assert status == 0
    assert "usage:" in out


def test_the_size_formula_counts_the_real_models_parameters():
    from shardwise.models import GPT, GPTConfig

    shape = gpt_sizes.Shape(hidden=96, heads=4, vocab=300, seq_len=40, micro_batch=2)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=300, block_size=40, n_layer=3, n_head=4, n_embd=96))
    assert shape.num_params(3) == sum(p.numel() for p in model.parameters())


def test_the_largest_fitting_gpt_is_the_last_depth_within_the_budget():
    shape = gpt_sizes.Shape(hidden=4096, heads=32, vocab=50304, seq_len=2048, micro_batch=2)
    memory = int(79.6 * 2**30)  # an H100's 81559 MiB
    plan = gpt_sizes.largest_fitting(shape, memory, ["plain", "stage0", "stage3"])
    assert plan.layers == 16 and plan.num_params == shape.num_params(16)
    assert max(plan.peak(v) for v in plan.predicted) <= 0.9 * memory
    deeper = gpt_sizes.largest_fitting(shape, memory, ["plain"], fraction=2.0)
    assert deeper.layers > plan.layers  # the bound, not the search's ceiling, stopped it
    one_more = {v: sum(gpt_sizes.predicted_terms(shape, 17, v, workspace_bytes=int(1.5 * 2**30)).values())
                for v in ("plain", "stage0", "stage3")}
    assert max(one_more.values()) > 0.9 * memory
    with pytest.raises(ValueError, match="not even one layer fits"):
        gpt_sizes.largest_fitting(shape, 2**30, ["stage0"])


def test_summary_lines_say_timeout_fail_and_the_benchmarks_own_status(tmp_path):
    log = tmp_path / "check.log"
    log.write_text("step 3 of 5\nRuntimeError: CUDA error: an illegal memory access\n")
    assert summarize.summary_line("speed", 124, 160, 150, None, log).startswith("TIMEOUT speed: stopped at its budget")
    failed = summarize.summary_line("speed", 1, 12, 150, None, log)
    assert failed.startswith("FAIL speed: exit 1 without a result") and "illegal memory access" in failed
    result = {"status": "SKIP", "summary": "no CUDA device"}
    assert summarize.summary_line("memory", 0, 3, 40, result, log) == "SKIP memory: no CUDA device (3 s of 40 s)"


def test_junit_reports_become_pass_skip_and_fail(tmp_path):
    def report(cases: str) -> Path:
        path = tmp_path / "report.xml"
        path.write_text(f'<testsuites><testsuite name="pytest" tests="{cases.count("<testcase")}" '
                        f'failures="{cases.count("<failure")}" errors="0" skipped="{cases.count("<skipped")}">'
                        f"{cases}</testsuite></testsuites>")
        return path

    passed = '<testcase classname="tests.gpu.test_a" name="test_one"/>'
    skipped = '<testcase classname="tests.gpu.test_a" name="test_two"><skipped message="needs CUDA"/></testcase>'
    failed = ('<testcase classname="tests.gpu.test_a" name="test_three"><failure message="assert 0.1 &lt; 1e-05">'
              "</failure></testcase>")
    assert summarize.junit_result(report(passed + skipped), 0)["status"] == "PASS"
    all_skipped = summarize.junit_result(report(skipped), 0)
    assert all_skipped["status"] == "SKIP" and "needs CUDA" in all_skipped["summary"]
    failure = summarize.junit_result(report(passed + failed), 1)
    assert failure["status"] == "FAIL" and "test_three (assert 0.1 < 1e-05)" in failure["summary"]
    assert summarize.junit_result(tmp_path / "missing.xml", 2)["status"] == "FAIL"


def test_memory_benchmark_toy_run(tmp_path, capsys):
    out = tmp_path / "memory.json"
    status, _ = run_main("recompute_memory", ["--toy", "--device", "cpu", "--policies", "none", "full",
                                              "--steps", "1", "--json-out", str(out)], capsys)
    result = json.loads(out.read_text())
    assert status == 0 and result["status"] == "PASS"
    assert set(result["runs"]) == {"none", "full", "full+contiguous"}
    none, full = result["runs"]["none"], result["runs"]["full"]
    assert full["engine_activations"]["total"] < none["engine_activations"]["total"]


def test_optimizer_benchmark_toy_run(tmp_path, capsys):
    """On the CPU the optimizers take their native kernels, Triton's off: the run, the
    agreement check and the ratios are what the GPU's will be."""
    out = tmp_path / "optim.json"
    status, printed = run_main("optimizers", ["--toy", "--device", "cpu", "--json-out", str(out)], capsys)
    result = json.loads(out.read_text())
    assert status == 0 and result["status"] == "PASS", printed
    assert result["triton_kernels"] is False
    ran = {name for name, run in result["variants"].items() if run["outcome"] == "ok"}
    assert {"fused_adamw", "lamb_triton", "lamb_torch", "adamw8bit_triton", "adamw8bit_torch"} <= ran
    assert all(error < 1e-5 for error in result["agreement"].values())


def test_speed_benchmark_runs_one_toy_variant(capsys):
    status, printed = run_main("gpt_speed", ["--toy", "--device", "cpu", "--one", "stage3", "eager", "--layers", "2"],
                               capsys)
    run = json.loads(printed.strip().splitlines()[-1])
    assert status == 0 and run["outcome"] == "ok", printed
    assert run["num_params"] == gpt_sizes.Shape(64, 4, 256, 64, 2).num_params(2) and 0 < run["mfu"] < 1
    assert len(run["losses"]) == 3 and run["memory_breakdown"]["optimizer_states"] > 0


def test_speed_goals_are_judged_on_the_compiled_mfu_and_the_stage3_overhead():
    import gpt_speed

    def run(mfu: float, step_s: float) -> dict:
        return {"outcome": "ok", "mfu": mfu, "step_s": [step_s], "num_params": 3_436_519_424}

    runs = {"stage0-eager": run(0.40, 1.00), "stage3-eager": run(0.39, 1.03), "stage0-compiled": run(0.52, 0.80),
            "stage3-compiled": run(0.50, 0.83), "plain-eager": run(0.38, 1.05), "plain-compiled": {"outcome": "oom"}}
    status, summary, derived = gpt_speed.judge(runs, toy=False)
    assert status == "PASS", summary
    assert derived["stage3_overhead_compiled"] == pytest.approx(0.0375)
    assert summary.startswith("GPT 3.44B: MFU stage0-eager 40.0%") and "plain-compiled oom" in summary
    runs["stage3-compiled"] = run(0.45, 0.90)  # hooks cost 12.5%
    status, summary, _ = gpt_speed.judge(runs, toy=False)
    assert status == "FAIL" and summary.startswith("goal missed (stage-3 compiled overhead +12.5%)")


def test_the_driver_starts_and_skips_every_check_without_cuda(tmp_path):
    """The whole script, as on a machine without CUDA: every line SKIP, the files written."""
    out = tmp_path / "out"
    python = Path(sys.executable)
    env = {**os.environ, "OUT": str(out), "PYTHON": str(python), "SHARDWISE_GPU_CHECK_WORK": str(tmp_path / "work"),
           "SHARDWISE_GPU_CHECKS": "memory", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["SKIP memory"], lines
    results = json.loads((out / "results.json").read_text())
    assert results["checks"]["memory"]["status"] == "SKIP" and results["environment"]["cuda_available"] is False
    assert (out / "artifacts.tar.gz").stat().st_size > 0 and "== summary" in (out / "gpu_check.log").read_text()


def test_a_result_printed_before_the_timeout_counts():
    """On the first H100 run a plain-PyTorch child printed its result and was still freeing
    70 GB when its time ran out; the result must not be lost as a timeout."""
    import harness

    late = ["-c", "import json, time; print(json.dumps({'mfu': 0.5}), flush=True); time.sleep(60)"]
    result = harness.run_child(late, timeout=2, log=lambda line: None)
    assert result["outcome"] == "ok" and result["mfu"] == 0.5 and "timeout" in result["exit"]
    silent = harness.run_child(["-c", "import time; time.sleep(60)"], timeout=1, log=lambda line: None)
    assert silent["outcome"] == "timeout"


def test_the_stored_curve_judges_only_a_run_on_its_own_corpus():
    """The corpus is this Python's standard library, which changes between patch releases:
    the stored curve counts only where its corpus digest is this machine's."""
    import train_job

    run = {"losses": [5.0, 4.0, 3.0], "final_loss": 3.0}
    curve = {"losses": [5.0, 4.0, 4.0], "final_loss": 4.0}
    assert train_job.compare_reference(run, curve)["same_corpus"] is False  # recorded before digests
    same = train_job.compare_reference(run, {**curve, "corpus_sha256": train_job.corpus_digest()})
    assert same["same_corpus"] is True and same["agrees"] is False  # 25% off at the end
