"""Running the DeepSpeed-shaped scripts of tests/frontends/deepspeed/api/scripts: under
`shardwise run --as-deepspeed` (the job under test) and with `--plain-torch` in one plain
process (the reference), then comparing every rank's per-micro-batch losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


SCRIPTS = Path(__file__).resolve().parent / "scripts"
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
# The reference never calls DeepSpeed's API, but the scripts import it at the top, as the
# originals do: the alias makes those imports succeed in the plain process.
PLAIN_RUNNER = (
    "import runpy, sys\n"
    "from shardwise.frontends.deepspeed.alias import install_alias\n"
    "install_alias()\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, {scripts!r})\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _environment() -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["OMP_NUM_THREADS"] = "1"
    return environment


def _run(command: list[str], cwd: Path, timeout: float) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_environment())
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result.stdout


def launch(script: str, *args: str, cwd: Path, nproc: int = 2, timeout: float = 300) -> str:
    """`shardwise run --as-deepspeed --nproc N scripts/<script> ARGS`; returns its stdout."""
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--nproc", str(nproc),
               str(SCRIPTS / script), *args]
    return _run(command, cwd, timeout)


def run_plain(script: str, *args: str, cwd: Path, timeout: float = 300) -> str:
    """The script's `--plain-torch` path in one process."""
    command = [sys.executable, "-c", PLAIN_RUNNER.format(scripts=str(SCRIPTS)), str(SCRIPTS / script),
               "--plain-torch", *args]
    return _run(command, cwd, timeout)


def read_losses(prefix: Path, world_size: int = 2) -> list[list[float]]:
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(world_size)]


def assert_losses_match(prefix: Path, reference_prefix: Path, tolerance: float = FP32_TOLERANCE,
                        world_size: int = 2) -> None:
    """Every rank's losses, step by step, within `tolerance` (relative) of the reference's."""
    actual, expected = read_losses(prefix, world_size), read_losses(reference_prefix, world_size)
    for rank, (run, reference) in enumerate(zip(actual, expected)):
        assert len(run) == len(reference) > 0, f"rank {rank}: {len(run)} losses, reference {len(reference)}"
        for step, (value, want) in enumerate(zip(run, reference)):
            error = abs(value - want) / max(abs(want), 1e-12)
            assert error < tolerance, (f"rank {rank} micro-step {step}: loss {value!r}, plain torch {want!r} "
                                       f"(relative error {error:.2e} >= {tolerance:g})\nrun: {run}\nreference: {reference}")
