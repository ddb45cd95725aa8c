"""Whether this thread is re-running a checkpointed region in backward.

Code outside the checkpoint machinery must sometimes act differently during a
recomputation: ZeRO-3's gather schedule keeps the units a recompute gathers until their
gradients are complete (backward uses them right after), instead of releasing each one
after its module's forward as it does in the real forward. This module holds only that
flag, so the ZeRO code can read it without importing the checkpoint machinery.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_local = threading.local()


def recomputing() -> bool:
    """True while a checkpointed region's forward is re-run in backward."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def recomputation() -> Iterator[None]:
    """Mark the enclosed code as a recomputation (nests)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
