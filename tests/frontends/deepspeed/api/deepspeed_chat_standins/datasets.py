"""The data source of the DeepSpeed-Chat test copies (../deepspeed_chat/): the two functions
of Hugging Face's `datasets` that DeepSpeed-Chat's `local/jsonfile` dataset calls, reading
the small synthetic JSON files the tests write, so the scripts run unmodified without the
`datasets` package or a download. Put first on PYTHONPATH for those runs only."""

from __future__ import annotations

import json

__all__ = ["load_dataset", "load_from_disk"]


def load_dataset(kind: str, data_files: dict[str, str] | None = None, **kwargs) -> dict[str, list[dict]]:
    """`load_dataset("json", data_files={split: path})`: each split a list of records (a JSON
    array, or one object per line)."""
    if kind != "json" or not data_files:
        raise ValueError(f"the test stand-in for `datasets` reads local JSON files only, got {kind!r}")
    splits = {}
    for split, path in data_files.items():
        with open(path) as handle:
            text = handle.read().strip()
        splits[split] = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]
    return splits


def load_from_disk(path: str):
    raise ValueError(f"the test stand-in for `datasets` has no saved datasets ({path}); use local/jsonfile")
