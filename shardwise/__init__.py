"""shardwise: ZeRO-style memory-efficient training for PyTorch, small enough to read.

The public names are imported on first use, so command-line tools that need no torch
(`shardwise estimate`, `--help`) start instantly.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "initialize", "gathered_parameters", "__version__"]

_LAZY = {
    "Engine": "shardwise.runtime.engine",
    "initialize": "shardwise.runtime.engine",
    "gathered_parameters": "shardwise.runtime.zero.gathered",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
