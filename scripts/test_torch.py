"""Run a fast subset of the suite under another torch release:
`python3 scripts/test_torch.py VERSION [--python PY] [--venv PATH] [pytest args]`.

The default suite runs on the pinned torch (scripts/bootstrap.py); this checks the other
end of the supported range. It creates (or reuses) `.venv-torch-VERSION/`, installs
`torch==VERSION` there first, then `shardwise[dev]` under a constraint that pins that torch
(so no dependency can replace it), and runs SUBSET: every ZeRO stage, offload, tensor and
pipeline parallelism, checkpoints, one Hugging Face model, and what shardwise/runtime/base/torch_compat.py
switches (selective checkpointing, compiled blocks, group timeouts, the launcher's
signals), in a few minutes on 2 CPU cores;
pytest arguments after the options replace SUBSET. `--venv` reuses an existing venv (one
that already holds the wanted torch skips the multi-GB download). The shardwise install is
skipped while pyproject.toml and the torch are those of the last one. A machine whose pip
configuration caps torch below VERSION needs that cap lifted for the run
(`PIP_CONFIG_FILE=/dev/null`).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SUBSET = [
    *(f"tests/runtime/zero/test_stage012_equivalence.py::test_matches_single_process_reference[{case}]"
      for case in ("0-fp32-2-2", "1-fp32-2-2", "2-bf16-2-2")),
    "tests/runtime/zero/test_stage3_equivalence.py::test_matches_single_process_reference[fp32-2-2-small]",
    "tests/runtime/zero/test_stage3_equivalence.py::test_stage3_equals_stage0",
    "tests/runtime/zero/test_host_offload.py::test_offload_trains_exactly_like_no_offload[2-none-2]",
    "tests/runtime/zero/test_host_offload.py::test_offload_trains_exactly_like_no_offload[3-cpu-2]",
    "tests/runtime/parallel/test_tensor_parallel.py::test_tp2_matches_single_process[gpt]",
    "tests/runtime/parallel/test_tensor_parallel.py::test_tp2_with_zero_over_two_data_parallel_ranks[3]",
    "tests/runtime/parallel/test_pipeline.py::test_pp2_matches_single_process[1f1b]",
    "tests/runtime/parallel/test_pipeline.py::test_pp2_dp2_with_zero[2]",
    "tests/runtime/checkpoint/test_checkpoint_resume.py::test_resume_at_same_layout_is_bit_identical[3-fp32]",
    "tests/runtime/checkpoint/test_checkpoint_resume.py::test_resume_at_another_world_size_and_stage[2r-s2-to-4r-s3]",
    "tests/runtime/zero/test_hf_models.py::test_hf_model_matches_single_process[llama-3]",
    "tests/runtime/activation/test_policies.py::test_policy_equals_no_recomputation_with_dropout[selective]",
    "tests/runtime/ops/test_compile_composition.py::test_compiled_tensor_parallel_blocks_train_like_eager[gpt-aot_eager]",
    "tests/runtime/ops/test_compile_composition.py::test_compiled_blocks_with_zero3_and_recomputation_train_like_eager",
    "tests/runtime/test_engine.py::test_a_collective_that_times_out_names_rank_and_operation",
    "tests/tools/launcher/test_launcher.py::test_launches_two_processes_that_all_reduce_and_get_the_script_arguments_untouched",
    "tests/faults/test_interrupts.py::test_a_second_sigint_ends_train_at_once_even_with_ranks_that_cannot_finish",
    "tests/runtime/base/test_torch_compat.py",
    "tests/scripts/test_bootstrap.py",
]


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def _installed_torch(python: Path) -> str | None:
    probe = "import importlib.metadata as m\ntry: print(m.version('torch'))\nexcept m.PackageNotFoundError: pass"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.strip() or None


def _fingerprint(torch_version: str) -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + str(ROOT).encode() + torch_version.encode()
    return hashlib.sha256(text).hexdigest()


def prepare(version: str, venv: Path, base_python: str) -> Path:
    """Return the venv's python with torch==`version` and shardwise[dev] (editable)."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([base_python, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    installed = _installed_torch(python)
    if installed is None or installed.split("+")[0] != version:
        _run([*pip, f"torch=={version}"])
        installed = _installed_torch(python)
    stamp, fingerprint = venv / ".shardwise-installed", _fingerprint(installed)
    if not stamp.exists() or stamp.read_text() != fingerprint:
        constraint = venv / "torch-constraint.txt"
        constraint.write_text(f"torch=={installed}\n")
        _run([*pip, "-c", str(constraint), "-e", f"{ROOT}[dev]"])
        stamp.write_text(fingerprint)
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="torch release, e.g. 2.9.1")
    parser.add_argument("--python", default=sys.executable, help="interpreter that creates the venv")
    parser.add_argument("--venv", type=Path, help="venv to use (default .venv-torch-VERSION/)")
    args, pytest_args = parser.parse_known_args()
    venv = (args.venv or ROOT / f".venv-torch-{args.version}").resolve()
    python = prepare(args.version, venv, args.python)
    describe = "import sys, torch; print('torch', torch.__version__, 'on Python', sys.version.split()[0])"
    subprocess.run([str(python), "-c", describe], check=True)
    start = time.perf_counter()
    code = subprocess.run([str(python), "-m", "pytest", "-q", *(pytest_args or SUBSET)], cwd=ROOT).returncode
    print(f"torch {args.version}: pytest exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
