"""The README stays true to the code: its defaults table is the config's defaults."""

from pathlib import Path

from shardwise.config import default_config_table
from shardwise.config.keys import deepspeed_key_table

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_readme_lists_every_config_default():
    for key, value in default_config_table():
        shown = value if isinstance(value, str) else repr(value)
        assert f"| `{key}` | {shown} |" in README, f"README's defaults table is missing or wrong for {key}"


def test_readme_classifies_every_deepspeed_key_without_a_field():
    for key, treatment, why in deepspeed_key_table():
        assert f"| `{key}` | {treatment} | {why} |" in README, (
            f"README's DeepSpeed-keys table is missing or wrong for {key}: run scripts/update_readme_defaults.py"
        )


def test_readme_quick_start_has_exactly_the_two_commands():
    quick_start = README.split("## Quick start")[1].split("```bash")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in quick_start.strip().splitlines()]
    assert commands == ["python3 scripts/train.py", "python3 scripts/test.py"]
    for command in commands:
        assert (Path(__file__).resolve().parent.parent / command.split()[1]).is_file()
