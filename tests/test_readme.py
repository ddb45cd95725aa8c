"""The README's front door works: its quick start is exactly the two commands, and its
Python example runs and trains. (Its links: tests/docs/test_site.py.)"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLE_TIMEOUT_S = 240


def test_readme_quick_start_has_exactly_the_two_commands():
    quick_start = README.split("## Quick start")[1].split("```bash")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in quick_start.strip().splitlines()]
    assert commands == ["python3 scripts/train.py", "python3 scripts/test.py"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file()


def test_readme_python_example_trains_and_saves_a_checkpoint(tmp_path):
    """One process: initialize falls back to a single rank when no launcher set it up."""
    example = README.split("## From Python")[1].split("```python")[1].split("```")[0]
    ast.parse(example)
    lines = len(example.strip().splitlines())
    assert lines <= 25, f"the README's example has grown to {lines} lines"
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            timeout=EXAMPLE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    memory, comm = (ast.literal_eval(line) for line in result.stdout.strip().splitlines()[-2:])
    assert memory["params"] == 4 * (512 * 2048 + 2048 + 2048 * 512 + 512)  # fp32, whole on one rank
    assert comm["all_gather"] == 0 and comm["reduce_scatter"] == 0  # a single process sends nothing
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step20"
