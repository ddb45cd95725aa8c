"""The loader of a curriculum run: micro-batches of the samples a DifficultySampler draws,
passed through the truncation of a sequence-length curriculum and the caller's
post-process hook (DeepSpeed's DeepSpeedDataLoader with curriculum learning on,
deepspeed/runtime/dataloader.py, and `engine.set_data_post_process_func`).

The hook is DeepSpeed's: `post_process_func(batch, sampler_state)` returns the batch to
train on, `sampler_state["current_difficulties"]` holding each metric's difficulty. With a
`seqlen_truncate` metric the loader itself cuts every tensor of the batch that has a
sequence dimension (dim 1 of a tensor of two or more dimensions) to the current difficulty
before the hook runs, what DeepSpeed's Megatron recipes do in their training step: the
difficulty is a sequence length, and a batch trains on its first that many tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.runtime.data.difficulty_sampler import DifficultySampler
from shardwise.runtime.data.policy import TRUNCATING_METRIC


def truncated(batch: Any, length: int) -> Any:
    """`batch` (a tensor, or dicts, lists and tuples of them) with every tensor of two or
    more dimensions cut to `length` along dim 1; other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :length] if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        return type(batch)((key, truncated(value, length)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(truncated(value, length) for value in batch)
    return batch


class CurriculumDataLoader(DataLoader):
    """A DataLoader over a DifficultySampler (as its batch sampler). `state_dict` is the
    sampler's: the data position a checkpoint holds. With `num_workers` 0 (DeepSpeed's
    default for curriculum sampling) the position is exact; worker processes draw index
    lists ahead of the batches the step has taken, and the position then runs ahead too."""

    def __init__(self, dataset: Dataset, *, sampler: DifficultySampler, collate_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False):
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                         pin_memory=pin_memory)
        self.data_sampler = sampler  # DeepSpeed's attribute name
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None

    def __len__(self) -> int:
        """DeepSpeed's length: the samples offered (num_epochs epochs) over the micro-batch
        size, rounded down with `dataloader_drop_last`, else up."""
        samples, size = len(self.data_sampler), self.data_sampler.micro_batch_size
        return samples // size if self.data_sampler.drop_last else -(-samples // size)

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            yield self._processed(batch)

    def _processed(self, batch: Any) -> Any:
        sampler = self.data_sampler
        if TRUNCATING_METRIC in sampler.current_difficulties:
            batch = truncated(batch, int(sampler.current_difficulties[TRUNCATING_METRIC]))
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, sampler.state_dict())
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.data_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_sampler.load_state_dict(state)
