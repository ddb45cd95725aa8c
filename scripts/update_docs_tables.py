"""Rewrite the tables in docs/ that are generated from the code: the config defaults (read
off the config schema) and the classification of DeepSpeed's other keys
(shardwise/frontends/deepspeed/config/deepspeed_keys.py), both in docs/reference/config.md.

    .venv/bin/python scripts/update_docs_tables.py

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`;
tests/docs/test_config_reference.py fails when a table and the code disagree, and this
script makes them agree.
"""

from pathlib import Path

from shardwise.frontends.deepspeed.config import default_config_table
from shardwise.frontends.deepspeed.config.keys import deepspeed_key_table

CONFIG_REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"


def defaults_table() -> list[str]:
    rows = [f"| `{key}` | {value if isinstance(value, str) else repr(value)} |" for key, value in default_config_table()]
    return ["| key | default |", "|---|---|", *rows]


def deepspeed_keys_table() -> list[str]:
    rows = [f"| `{key}` | {treatment} | {why} |" for key, treatment, why in deepspeed_key_table()]
    return ["| key | treatment | why |", "|---|---|---|", *rows]


TABLES = {"defaults": defaults_table, "deepspeed-keys": deepspeed_keys_table}


def render(text: str) -> str:
    """`text` with every generated table replaced by what the code says today."""
    for name, table in TABLES.items():
        start_marker, end_marker = f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"
        if text.count(start_marker) != 1 or text.count(end_marker) != 1:
            raise ValueError(f"{CONFIG_REFERENCE} must hold '{start_marker}' and '{end_marker}' once each")
        start = text.index(start_marker) + len(start_marker)
        end = text.index(end_marker, start)
        text = text[:start] + "\n" + "\n".join(table()) + "\n" + text[end:]
    return text


def main() -> None:
    CONFIG_REFERENCE.write_text(render(CONFIG_REFERENCE.read_text()))


if __name__ == "__main__":
    main()
