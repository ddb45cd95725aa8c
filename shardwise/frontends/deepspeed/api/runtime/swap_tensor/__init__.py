"""`deepspeed.runtime.swap_tensor`: `MIN_SWAPPABLE_BYTES`, the size (1 MiB) below which
DeepSpeed keeps an NVMe-offloaded tensor in memory rather than swap it, which scripts and
tests use to size tensors that do go to disk. shardwise's NVMe store (runtime/zero/nvme_store.py)
writes every partition it is given whatever its size, so here the value only informs."""

__all__ = ["MIN_SWAPPABLE_BYTES"]

MIN_SWAPPABLE_BYTES = 1024**2
