"""Rewrite the README's configuration tables: the defaults from the config schema, and the
classification of DeepSpeed's other keys from shardwise/config/deepspeed_keys.py.

    .venv/bin/python scripts/update_readme_defaults.py

tests/test_readme.py fails when a table and the code disagree; this makes them agree.
"""

from pathlib import Path

from shardwise.config import default_config_table
from shardwise.config.keys import deepspeed_key_table

README = Path(__file__).resolve().parent.parent / "README.md"


def replace_table(text: str, section: str, header: str, rows: list[str]) -> str:
    start = text.index(header, text.index(section))
    end = text.index("\n\n", start)
    return text[:start] + "\n".join([header, rows[0], *rows[1:]]) + text[end:]


def main() -> None:
    text = README.read_text()
    defaults = ["|---|---|"] + [f"| `{key}` | {value if isinstance(value, str) else repr(value)} |"
                                for key, value in default_config_table()]
    text = replace_table(text, "### Defaults", "| key | default |", defaults)
    keys = ["|---|---|---|"] + [f"| `{key}` | {treatment} | {why} |" for key, treatment, why in deepspeed_key_table()]
    text = replace_table(text, "### DeepSpeed keys without", "| key | treatment | why |", keys)
    README.write_text(text)


if __name__ == "__main__":
    main()
