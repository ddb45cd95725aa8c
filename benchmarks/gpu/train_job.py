"""The main job (`shardwise train`, C23) on the device, against the same job's loss on the CPU.

Runs `python3 -m shardwise.cli.main train --nproc 1 ...` from the repository (no virtual
environment needed: PYTHONPATH holds the repository), reads the run's metrics.jsonl and
summary.json, and compares the loss with benchmarks/gpu/train_reference.json, recorded on
the CPU with the same command (`--record-reference`). The job builds its GPT on the CPU
from the seed and draws the same global batches whatever the device, so:

  - the first step's loss (same weights, same batch, no update yet) must agree to 1e-4
    relative: fp32 on both devices, differing only in summation order;
  - after that the trajectories may drift apart (different kernels round differently,
    and Adam amplifies it), so the later losses are compared at a loose 5%, the final
    loss must be below the first, and the per-step table is reported for reading.

    python3 benchmarks/gpu/train_job.py                         # 10m GPT, 200 steps, ZeRO-3, fp32
    python3 benchmarks/gpu/train_job.py --toy                   # tiny GPT, 10 steps (CPU rehearsal)
    python3 benchmarks/gpu/train_job.py --toy --record-reference
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

REFERENCE = Path(__file__).with_name("train_reference.json")
FULL = {"model_size": "10m", "steps": 200}
TOY = {"model_size": "tiny", "steps": 10}
FIRST_STEP_TOLERANCE = 1e-4
LATER_TOLERANCE = 0.05
COMPARED_EVERY = 50


def job_command(model_size: str, steps: int, out_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "1", "--model-size", model_size,
            "--steps", str(steps), "--out-dir", str(out_dir), "--name", name]


def run_job(command: list[str], timeout: float | None, hide_cuda: bool) -> tuple[int | None, str]:
    """Exit status (None: timed out) and the job's combined output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")]))}
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=harness.REPO)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or b""
        return None, output.decode(errors="replace") if isinstance(output, bytes) else output
    return done.returncode, done.stdout + done.stderr


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = records[len(records) // 10 + 1:] or records  # past the warm-up steps
    return {
        "losses": [record["loss"] for record in records],
        "final_loss": summary["final"]["loss"],
        "val_loss": summary["final"]["val_loss"],
        "tokens_per_s": harness.median([record["tokens_per_s"] for record in timed]),
        "mfu": harness.median([record["mfu"] for record in timed]),
        "peak_flops": summary["peak_flops_per_device"],
        "process_peak_bytes": max(record["memory"].get("process_peak", 0) for record in records),
        "train_seconds": summary["train_seconds"],
        "device": summary["run"]["device"],
        "dtype": summary["run"]["dtype"],
        "stage": summary["run"]["stage"],
        "num_params": summary["model"]["num_params"],
    }


def compare(run: dict, reference: dict) -> dict:
    """The checks of the module doc, with the numbers they were judged on."""
    losses, expected = run["losses"], reference["losses"]
    first_error = abs(losses[0] - expected[0]) / abs(expected[0])
    steps = sorted({*range(COMPARED_EVERY - 1, min(len(losses), len(expected)), COMPARED_EVERY),
                    min(len(losses), len(expected)) - 1})
    table = [{"step": s + 1, "loss": losses[s], "reference": expected[s],
              "relative": (losses[s] - expected[s]) / expected[s]} for s in steps]
    final_error = abs(run["final_loss"] - reference["final_loss"]) / reference["final_loss"]
    return {"first_step_relative_error": first_error, "final_relative_error": final_error, "table": table,
            "first_step_agrees": first_error <= FIRST_STEP_TOLERANCE,
            "final_agrees": final_error <= LATER_TOLERANCE,
            "loss_fell": run["final_loss"] < losses[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_arguments(parser)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the run directory goes (default: a temporary one, removed after)")
    parser.add_argument("--record-reference", action="store_true",
                        help=f"run on the CPU and store the losses in {REFERENCE.name} as this size's reference")
    args = parser.parse_args()
    device = harness.pick_device("cpu" if args.record_reference else args.device)
    if (skip := harness.refuse_cpu_at_full_size(device, args.toy or args.record_reference, "train")) is not None:
        harness.emit(skip, args.json_out)
        return
    size = TOY if args.toy else FULL
    key = f"{size['model_size']}-{size['steps']}"
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="shardwise-train-"))
    name = f"{key}-{device.type}-{time.strftime('%H%M%S')}"
    command = job_command(size["model_size"], size["steps"], out_dir, name)
    hide_cuda = device.type == "cpu" and harness.torch.cuda.is_available()  # a CPU reference on a GPU machine
    shown = ("CUDA_VISIBLE_DEVICES= " if hide_cuda else "") + "python3 -m shardwise.cli.main train " + " ".join(command[4:])
    print(f"running: {shown}", flush=True)
    deadline = harness.Deadline(args.budget)
    status, output = run_job(command, None if args.budget is None else max(1.0, deadline.left() - 3), hide_cuda)
    print(output, flush=True)
    numbers = {"command": shown, "size": key, **harness.environment(device)}
    if status is None:
        harness.emit(harness.Result("train", "FAIL", f"the job did not finish in {args.budget:.0f} s",
                                    "finishes", numbers), args.json_out)
        sys.exit(1)
    if status != 0:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        harness.emit(harness.Result("train", "FAIL", f"the job exited {status}: {tail[0][:200]}", "finishes",
                                    numbers), args.json_out)
        sys.exit(1)
    run = read_run(out_dir / name)
    if args.out_dir is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.record_reference:
        references = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        references[key] = {"command": shown, "torch": numbers["torch"], **{k: run[k] for k in (
            "losses", "final_loss", "val_loss", "dtype", "stage", "num_params")}}
        REFERENCE.write_text(json.dumps(references, indent=1) + "\n")
        print(f"recorded {key} in {REFERENCE}")
    reference = json.loads(REFERENCE.read_text()).get(key) if REFERENCE.exists() else None
    goal = (f"first-step loss within {FIRST_STEP_TOLERANCE:g} of the CPU's, final loss within "
            f"{LATER_TOLERANCE:.0%} of the CPU's and below the first")
    numbers.update({k: v for k, v in run.items() if k != "losses"})
    numbers["losses_every_10"] = run["losses"][::10]
    if reference is None:
        harness.emit(harness.Result("train", "FAIL", f"no CPU reference for {key} in {REFERENCE.name}", goal,
                                    numbers), args.json_out)
        sys.exit(1)
    verdict = compare(run, reference)
    numbers["comparison"] = verdict
    passed = verdict["first_step_agrees"] and verdict["final_agrees"] and verdict["loss_fell"]
    summary = (f"{key} {run['dtype']} ZeRO-{run['stage']} on {run['device']}: loss {run['losses'][0]:.4f} -> "
               f"{run['final_loss']:.4f} (CPU {reference['losses'][0]:.4f} -> {reference['final_loss']:.4f}; "
               f"first step {verdict['first_step_relative_error']:.1e}, final {verdict['final_relative_error']:+.1%}), "
               f"val {run['val_loss']:.4f}, {run['tokens_per_s']:,.0f} tok/s, MFU {run['mfu']:.1%}")
    harness.emit(harness.Result("train", "PASS" if passed else "FAIL", summary, goal, numbers), args.json_out)


if __name__ == "__main__":
    main()
