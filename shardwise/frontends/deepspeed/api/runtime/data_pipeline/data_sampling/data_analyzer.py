"""`deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer`: the offline
metric index with DeepSpeed's constructor, for scripts that compute their own metrics (a
function of a batch giving one value per sample, or a value to sum over samples). One
process computes every metric over the whole dataset and writes DeepSpeed's files
(shardwise/runtime/data/metric_index.py): a `single_value_per_sample` metric's index, an
`accumulate_value_over_samples` metric's `NAME_metric_value`. DeepSpeed's split of the work
over `num_workers` processes and `num_threads` threads, its custom map/reduce hooks and
DistributedDataAnalyzer are not provided: the constructor refuses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

from shardwise.runtime.data.indexed_dataset import smallest_int_dtype, write_rows
from shardwise.runtime.data.metric_index import write_metric_index

__all__ = ["DataAnalyzer"]

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")


class DataAnalyzer:
    def __init__(self, dataset: Any, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: list[int] | None = None, batch_size: int = 1,
                 metric_names: list[str] | None = None, metric_functions: list[Callable] | None = None,
                 metric_types: list[str] | None = None, metric_dtypes: list[Any] | None = None, save_path: str = "./",
                 collate_fn: Callable | None = None, custom_map_init: Callable | None = None,
                 custom_map_update: Callable | None = None, custom_map_finalize: Callable | None = None,
                 custom_reduce: Callable | None = None, sample_indices: list[int] | None = None):
        hooks = [custom_map_init, custom_map_update, custom_map_finalize, custom_reduce]
        if num_workers != 1 or num_threads != 1 or any(hook is not None for hook in hooks):
            raise ValueError("shardwise's DataAnalyzer computes every metric in one process: leave num_workers and "
                             "num_threads at 1 and the custom map/reduce hooks unset (or compute the values yourself "
                             "and write them with shardwise.runtime.data.metric_index.write_metric_index)")
        names, functions, types = list(metric_names or []), list(metric_functions or []), list(metric_types or [])
        if not (len(names) == len(functions) == len(types)) or any(kind not in METRIC_TYPES for kind in types):
            raise ValueError(f"give one metric function and one type ({', '.join(METRIC_TYPES)}) per metric name; "
                             f"got {len(names)} names, {len(functions)} functions, types {types}")
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.metric_names, self.metric_functions, self.metric_types = names, functions, types
        self.save_path, self.sample_indices = save_path, sample_indices

    def run_map_reduce(self, comm_group: Any = None) -> None:
        loader = DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate_fn)
        per_sample: dict[str, list[np.ndarray]] = {name: [] for name in self.metric_names}
        samples: list[int] = []
        for batch in loader:
            for name, function in zip(self.metric_names, self.metric_functions):
                per_sample[name].append(np.asarray(torch.as_tensor(function(batch))).astype(np.int64))
            count = len(per_sample[self.metric_names[0]][-1]) if self.metric_names else 0
            if isinstance(batch, dict) and "index" in batch:  # Megatron's samples carry their index
                samples += [int(row[0]) for row in batch["index"]]
            else:
                samples += list(range(len(samples), len(samples) + count))
        if self.sample_indices is not None:
            samples = [self.sample_indices[index] for index in samples]
        for name, kind in zip(self.metric_names, self.metric_types):
            if kind == "single_value_per_sample":
                values = np.empty(len(self.dataset), dtype=np.int64)
                values[samples] = np.concatenate(per_sample[name]).reshape(-1)
                write_metric_index(values, self.save_path, name)
            else:
                total = np.sum(np.stack(per_sample[name]), axis=0).reshape(-1)
                folder = Path(self.save_path) / name
                folder.mkdir(parents=True, exist_ok=True)
                write_rows(folder / f"{name}_metric_value", [total],
                           smallest_int_dtype(int(total.min()), int(total.max())))

    def run_map(self) -> None:
        """DeepSpeed's two phases run as one here: the map writes the finished files."""
        self.run_map_reduce()

    def run_reduce(self) -> None:
        """Nothing left to do after `run_map`."""
