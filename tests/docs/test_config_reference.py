"""docs/reference/config.md's tables are the code's: the config defaults and the
classification of DeepSpeed's other keys, exactly as scripts/update_docs_tables.py writes them."""

from tests.docs.doc_files import DOCS, ROOT, load_module

from shardwise.frontends.deepspeed.config import default_config_table
from shardwise.frontends.deepspeed.config.keys import deepspeed_key_table

CONFIG_REFERENCE = DOCS / "reference" / "config.md"


def test_generated_tables_equal_the_code():
    script = load_module(ROOT / "scripts" / "update_docs_tables.py")
    text = CONFIG_REFERENCE.read_text()
    assert script.render(text) == text, (
        "docs/reference/config.md's generated tables differ from the code: run "
        ".venv/bin/python scripts/update_docs_tables.py"
    )


def test_every_default_and_every_deepspeed_key_is_listed():
    text = CONFIG_REFERENCE.read_text()
    defaults, keys = default_config_table(), deepspeed_key_table()
    assert len(defaults) > 100 and len(keys) > 50  # the tables are the schema's, not a stub
    for key, value in defaults:
        shown = value if isinstance(value, str) else repr(value)
        assert f"| `{key}` | {shown} |" in text, f"the defaults table is missing or wrong for {key}"
    for key, treatment, why in keys:
        assert f"| `{key}` | {treatment} | {why} |" in text, f"the DeepSpeed-keys table is missing or wrong for {key}"
