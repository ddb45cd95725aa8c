"""Sharded, atomic, reshardable checkpoints and their export (C8).

`save_checkpoint` / `load_checkpoint` back `engine.save_checkpoint` / `engine.load_checkpoint`;
`convert_checkpoint` backs `shardwise convert`. The on-disk layout is described in format.py.
Names are imported on first use, so `shardwise --help` (which builds the `convert` parser)
does not import torch.
"""

from typing import Any

__all__ = ["CheckpointError", "convert_checkpoint", "load_checkpoint", "save_checkpoint"]

_LAZY = {
    "CheckpointError": "shardwise.runtime.checkpoint.format",
    "convert_checkpoint": "shardwise.runtime.checkpoint.convert",
    "load_checkpoint": "shardwise.runtime.checkpoint.load",
    "save_checkpoint": "shardwise.runtime.checkpoint.save",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.runtime.checkpoint' has no attribute {name!r}")
