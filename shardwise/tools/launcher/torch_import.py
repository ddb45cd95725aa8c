"""Set a worker up once its script imports torch, without importing torch for a script
that never does (a plain Python script under `shardwise run` starts as fast as with
`python`)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_waiting: list[Callable[[], None]] = []


def after_torch_import(callback: Callable[[], None]) -> None:
    """Call `callback` once `import torch` has finished (now, if it has already)."""
    if "torch" in sys.modules:
        callback()
        return
    _waiting.append(callback)
    if not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds `torch` as usual, and runs the waiting callbacks once its import has finished."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            while _waiting:
                _waiting.pop(0)()

        spec.loader.exec_module = exec_module
        return spec
