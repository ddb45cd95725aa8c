"""The loader `deepspeed.initialize(training_data=...)` and `engine.deepspeed_io` build
(`deepspeed.runtime.dataloader` names it: api/runtime/dataloader.py), which knows where it
is in its data, so a checkpoint can hold that position.

DeepSpeed's loader is a torch DataLoader over a DistributedSampler (shuffled with seed
0, the same order every epoch unless the script calls `loader.sampler.set_epoch`). Its
position in an epoch is one number for the whole job: every data-parallel rank reads
the shuffled order interleaved (rank r takes positions r, r + N, r + 2N, ...), so after
k micro-batches of m samples on each of N ranks, exactly the first k·m·N positions of the
epoch's order have been read, whichever rank read them. A run resumed from that number
starts every rank at that position of the same order, so with the same data-parallel
size it reads the batches the uninterrupted run would have read, and with another size
(the same global batch) it reads the rest of the epoch with no sample repeated or
skipped. Only the last, padded stretch of an epoch depends on the size (the sampler
repeats a few samples so the ranks stay even, or drops them with `dataloader_drop_last`).

The position is saved by `engine.save_checkpoint` (the engine's `data_position`) and
restored by `engine.load_checkpoint`: the next pass over the loader that starts in the
saved epoch starts at the saved position. A pass that had yielded all its batches is
saved as the start of the next one. A loader the script builds itself is not the
engine's: its position is the script's to save, in `client_state`
(docs/checkpoints.md#where-the-data-was).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = ["DeepSpeedDataLoader", "PositionedSampler", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_TRAIN"]

# the loaders `engine.deepspeed_io` builds, by what they are read for (DeepSpeed's routes)
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"


class PositionedSampler(DistributedSampler):
    """DeepSpeed's DistributedSampler, which can start an epoch part-way through: the same
    indices for the same epoch, seed and size, from a given position of the epoch's order."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, drop_last: bool, seed: int = 0,
                 shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._start = 0  # position of the epoch's order the next pass starts at (then back to 0)

    def epoch_order(self) -> list[int]:
        """Every index of this epoch, in the order the ranks read them interleaved,
        padded (by repeating from the start) or cut to a multiple of the replicas."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist() if self.shuffle \
            else list(range(len(self.dataset)))
        return (order * math.ceil(self.total_size / len(order)))[: self.total_size]

    def start_next_pass_at(self, position: int) -> None:
        self._start = position

    def remaining(self, start: int) -> int:
        """How many indices this rank reads in a pass that starts at `start`."""
        return max(0, self.total_size - start) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        return iter(self.epoch_order()[start + self.rank : self.total_size : self.num_replicas])


class DeepSpeedDataLoader(DataLoader):
    """A DataLoader of micro-batches. Over a `PositionedSampler` it counts the samples its
    current pass has yielded: `state_dict()` is the data position a checkpoint holds. Over
    another sampler (one the script gave `engine.deepspeed_io`) it is a plain DataLoader
    whose position is the script's to keep.

    `num_workers` 0 (the batches read in the training process) where DeepSpeed's loader
    starts two worker processes per device: the data position stays exact, and the
    script that wants workers passes `num_local_io_workers`."""

    def __init__(self, dataset: Dataset, *, batch_size: int, sampler: Sampler, collate_fn: Callable | None,
                 drop_last: bool, num_workers: int = 0, pin_memory: bool = False):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                         num_workers=num_workers, pin_memory=pin_memory)
        self._consumed = 0  # positions of the epoch's order read by every rank in the current pass
        self._pass_length = getattr(sampler, "total_size", 0)  # where the current pass ends, in the same positions
        self._resume: tuple[int, int] | None = None  # (epoch, position) for the next pass to start at
        self.tput_timer: Any = None  # the engine's ThroughputTimer, started as each batch is read (DeepSpeed's)

    @property
    def data_sampler(self) -> Sampler:
        """The sampler, under DeepSpeed's attribute name (`loader.data_sampler.set_epoch(epoch)`)."""
        return self.sampler

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.sampler, PositionedSampler):
            return self._positioned_pass()
        return self._timed_pass()

    def _timed_pass(self) -> Iterator[Any]:
        for batch in super().__iter__():
            if self.tput_timer is not None:
                self.tput_timer.start()
            yield batch

    def _positioned_pass(self) -> Iterator[Any]:
        """One pass, from the restored position when it starts in the restored epoch. A
        generator, so the position is taken when the pass yields its first batch (a
        RepeatingLoader calls iter() when it is built, before a checkpoint is loaded)."""
        sampler: PositionedSampler = self.sampler
        start = 0
        if self._resume is not None:
            epoch, position = self._resume
            self._resume = None
            start = position if epoch == sampler.epoch else 0
        sampler.start_next_pass_at(start)
        replicas, per_rank = sampler.num_replicas, sampler.remaining(start)
        self._consumed, self._pass_length = start, start + per_rank * replicas
        read = 0
        for batch in super().__iter__():
            size = min(self.batch_size, per_rank - read)
            read += size
            self._consumed += size * replicas
            if self.tput_timer is not None:
                self.tput_timer.start()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The job's position: epoch, positions of its order read (a finished pass counts
        as the start of the next), and what the order depends on."""
        sampler = self._positioned_sampler("state_dict")
        consumed = self._consumed if self._consumed < self._pass_length else 0
        return {"epoch": sampler.epoch, "consumed": consumed, "seed": sampler.seed, "shuffle": sampler.shuffle,
                "samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass in `state["epoch"]` at the saved position (the sampler is
        set to that epoch). Refused where the saved position names other samples: another
        dataset length, seed or shuffle, or a position the data-parallel size cannot split."""
        sampler = self._positioned_sampler("load_state_dict")
        saved = (state["samples"], state["seed"], state["shuffle"])
        current = (len(self.dataset), sampler.seed, sampler.shuffle)
        if saved != current:
            raise ValueError(
                f"the checkpoint's data position is for a dataset of {saved[0]} samples shuffled with seed "
                f"{saved[1]} (shuffle={saved[2]}), but the training data has {current[0]} samples, seed "
                f"{current[1]} (shuffle={current[2]}): its positions would name other samples. Resume with the "
                "same training_data, or load with a fresh loader (deepspeed.initialize without the checkpoint's "
                "data) and start it where you choose")
        if state["consumed"] % sampler.num_replicas:
            raise ValueError(
                f"the checkpoint's data position ({state['consumed']} samples into epoch {state['epoch']}) does "
                f"not split evenly over {sampler.num_replicas} data-parallel ranks, so they cannot start together; "
                "resume at a data-parallel size that divides it (the checkpoint was saved mid-way through a "
                "global batch), or save at an optimizer step")
        sampler.set_epoch(state["epoch"])
        self._resume = (state["epoch"], state["consumed"])

    def _positioned_sampler(self, call: str) -> PositionedSampler:
        if not isinstance(self.sampler, PositionedSampler):
            raise TypeError(f"loader.{call}(): this loader reads the script's own sampler "
                            f"({type(self.sampler).__name__}), whose position the script keeps itself")
        return self.sampler
