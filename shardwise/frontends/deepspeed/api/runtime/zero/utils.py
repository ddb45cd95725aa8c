"""`deepspeed.runtime.zero.utils`: the exception scripts catch around ZeRO's optimizer."""

from __future__ import annotations

__all__ = ["ZeRORuntimeException"]


class ZeRORuntimeException(Exception):
    """A ZeRO setting the run cannot honour (raised where DeepSpeed raises it: an
    optimizer that `zero_force_ds_cpu_optimizer` refuses under optimizer offload)."""
