"""Rewrite the README's configuration-defaults table from the config schema.

    .venv/bin/python scripts/update_readme_defaults.py

tests/test_readme.py fails when the table and the code disagree; this makes them agree.
"""

from pathlib import Path

from shardwise.config import default_config_table

README = Path(__file__).resolve().parent.parent / "README.md"


def main() -> None:
    text = README.read_text()
    start = text.index("| key | default |", text.index("### Defaults"))
    end = text.index("\n\n", start)
    rows = ["| key | default |", "|---|---|"]
    for key, value in default_config_table():
        rows.append(f"| `{key}` | {value if isinstance(value, str) else repr(value)} |")
    README.write_text(text[:start] + "\n".join(rows) + text[end:])


if __name__ == "__main__":
    main()
