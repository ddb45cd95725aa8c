"""Curriculum sampling: every global batch drawn from the samples the current difficulty
admits, as DeepSpeed 0.19.8's DeepSpeedDataSampler draws it
(deepspeed/runtime/data_pipeline/data_sampling/data_sampler.py), so a run picks the same
sample indices at each step as DeepSpeed does with the same seed, index files and sizes.

At each new global batch the step counter rises and each metric's schedule gives its
difficulty. When a difficulty changes, the samples it newly admits become a new *cluster*:
for one metric that orders the data, those with previous < value <= current (value
difficulty) or between the previous and current percentile of the samples sorted by value
(percentile difficulty); for several, the samples every metric admits minus those already
in a cluster; with no metric ordering the data, one cluster of every sample. The cluster is
shuffled and written to `cluster_path` (DeepSpeed's file names and format). A global batch
then takes, for each of its samples, a cluster drawn with probability proportional to the
cluster's size, reads that many indices from each cluster in order (a cluster read to its
end is reshuffled and read from its start again) and shuffles the batch. Rank 0 of the
data-parallel group draws, the others receive the batch, and each rank takes its slice of
every micro-batch-times-data-parallel-size stretch of it.

One generator (`numpy.random.default_rng(seed)`) makes every draw, in DeepSpeed's order.
The state a checkpoint keeps is small JSON: DeepSpeed's keys (the batch not yet yielded,
the samples consumed, the step, the difficulties, the cluster names and read positions,
the generator's state) and each cluster's history: the difficulties that made it and the
generator's state before each of its shuffles. DeepSpeed saves numpy's global generator
instead of its sampler's, and re-reads cluster files that a later reshuffle may have
rewritten, so its resumed draws can differ from an uninterrupted run's; shardwise rebuilds
every cluster from the metric index and replays its shuffles, so a resumed run draws
exactly what the uninterrupted one drew, and rewrites the cluster files to match.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from shardwise.runtime.data.curriculum import CurriculumScheduler
from shardwise.runtime.data.indexed_dataset import IndexedDataset, smallest_int_dtype, write_rows
from shardwise.runtime.data.policy import DataSamplingPolicy

log = logging.getLogger("shardwise")


class ReplicaGroup(Protocol):
    """The data-parallel group (runtime/distributed/collectives.py's Communicator)."""

    rank: int
    size: int

    def control_all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor: ...

    def barrier(self, what: str) -> None: ...


class DifficultySampler:
    """A batch sampler (yields this rank's index lists, one per micro-batch) whose global
    batches follow the curriculum; `state_dict` / `load_state_dict` are the data position
    a checkpoint holds."""

    def __init__(self, policy: DataSamplingPolicy, *, samples: int, micro_batch_size: int,
                 gradient_accumulation_steps: int, replicas: ReplicaGroup, drop_last: bool = True):
        if samples <= 0 or micro_batch_size <= 0:
            raise ValueError(f"curriculum sampling needs samples and a micro-batch size; got {samples} samples, "
                             f"micro-batch {micro_batch_size}")
        self.policy = policy
        self.samples = samples
        self.total_samples = samples * policy.num_epochs
        self.replicas = replicas
        self.micro_batch_size = micro_batch_size
        self.stretch = micro_batch_size * replicas.size  # one micro-batch on every rank
        self.global_batch_size = self.stretch * gradient_accumulation_steps
        self.drop_last = drop_last
        self.index_dtype = smallest_int_dtype(0, samples)
        self.rng = np.random.default_rng(policy.seed)
        self.schedulers = {metric.name: CurriculumScheduler(metric.scheduler_config()) for metric in policy.metrics}
        self.metrics = {metric.name: metric for metric in policy.metrics}
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.cluster_names: list[str] = []
        self.cluster_positions: list[int] = []
        self.clusters: list[np.ndarray] = []  # rank 0 only, as in DeepSpeed: the others receive batches
        self.cluster_history: list[dict[str, Any]] = []  # rank 0: what rebuilds each cluster on resume
        self._index: dict[str, tuple[IndexedDataset, IndexedDataset | None]] = {}
        self._epoch_size: int | None = None
        if replicas.rank == 0:
            Path(policy.cluster_path).mkdir(parents=True, exist_ok=True)
            for metric in policy.metrics:
                if metric.clustering_type != "single_cluster":
                    values = IndexedDataset(metric.index_to_metric_path) if metric.difficulty_type == "value" else None
                    self._index[metric.name] = (IndexedDataset(metric.index_to_sample_path), values)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_functions: dict[str, Callable[[int], Any]]) -> None:
        for name, scheduler in self.schedulers.items():
            if name in schedule_functions:
                scheduler.set_custom_get_difficulty(schedule_functions[name])

    # -- the draw -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self._next_global_batch()
            stretch, self.batch = self.batch[: self.stretch], self.batch[self.stretch:]
            if len(stretch) == self.stretch or (stretch and not self.drop_last):
                start, end = (round(r * len(stretch) / self.replicas.size)
                              for r in (self.replicas.rank, self.replicas.rank + 1))
                yield stretch[start:end]
                self.consumed_samples += len(stretch)

    def _next_global_batch(self) -> None:
        self.curriculum_step += 1
        previous, changed = {}, False
        for name, scheduler in self.schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            changed |= name not in self.current_difficulties or difficulty != self.current_difficulties[name]
            previous[name] = self.current_difficulties.get(
                name, float("-inf") if self.metrics[name].difficulty_type == "value" else 0)
            self.current_difficulties[name] = difficulty
        if changed:
            self._add_cluster(previous)
        batch = torch.zeros(self.global_batch_size, dtype=torch.long)
        if self.replicas.rank == 0:
            drawn = self._draw_from_clusters()
            batch[: len(drawn)] = torch.tensor(drawn, dtype=torch.long)
            batch[len(drawn):] = -1
        # rank 0's batch reaches every rank as a sum with the others' zeros (a gloo control
        # collective: sample indices are small and needed on the host)
        self.replicas.control_all_reduce(batch, "curriculum sampler's global batch")
        self.batch = [index for index in batch.tolist() if index != -1]

    def _draw_from_clusters(self) -> list[int]:
        if not self.clusters:
            raise ValueError(f"curriculum difficulties {self.current_difficulties} admit no sample at step "
                             f"{self.curriculum_step}: raise min_difficulty to at least the smallest metric value in "
                             "the index (index_to_metric's first row)")
        sizes = [len(cluster) for cluster in self.clusters]
        weights = [size / sum(sizes) for size in sizes]
        per_cluster = np.bincount(self.rng.choice(len(sizes), self.global_batch_size, replace=True, p=weights),
                                  minlength=len(sizes))
        batch: list[Any] = []
        for cluster, count in enumerate(per_cluster):
            batch += self._read_cluster(cluster, int(count))
        self.rng.shuffle(batch)
        return [int(index) for index in batch]

    def _read_cluster(self, cluster: int, count: int) -> list[Any]:
        start = self.cluster_positions[cluster]
        taken = list(np.copy(self.clusters[cluster][start: start + count]))
        self.cluster_positions[cluster] += count
        if len(taken) < count:
            log.info("shardwise: curriculum cluster %d read to its end: reshuffled", cluster)
            reshuffled = np.copy(self.clusters[cluster])
            self.cluster_history[cluster]["shuffles"].append(self.rng.bit_generator.state)
            self.rng.shuffle(reshuffled)
            self._write_cluster(self.cluster_names[cluster], reshuffled)
            self.clusters[cluster] = reshuffled
            rest = count - len(taken)
            taken += list(np.copy(reshuffled[:rest]))
            self.cluster_positions[cluster] = rest
        return taken

    # -- clusters -------------------------------------------------------------------------------
    def _add_cluster(self, previous: dict[str, Any]) -> None:
        name = "cluster" + "".join(f"_{metric}{self.current_difficulties[metric]}" for metric in self.schedulers)
        if self.replicas.rank == 0:
            members = self._new_members(previous)
            if members is not None and len(members) > 0:
                log.info("shardwise: curriculum cluster of %d samples for difficulties %s", len(members),
                         self.current_difficulties)
                self.cluster_history.append({"previous": dict(previous),
                                             "difficulties": dict(self.current_difficulties),
                                             "shuffles": [self.rng.bit_generator.state]})
                self.rng.shuffle(members)
                self._write_cluster(name, members)
                self.clusters.append(members)
        self.replicas.barrier("curriculum sampler's new cluster")
        if os.path.isfile(self._cluster_file(name) + ".bin"):
            self.cluster_names.append(name)
            self.cluster_positions.append(0)

    def _new_members(self, previous: dict[str, Any]) -> np.ndarray | None:
        ordering = [name for name, metric in self.metrics.items() if metric.clustering_type != "single_cluster"]
        if len(ordering) > 1:
            members = None
            for name, metric in self.metrics.items():
                if metric.clustering_type == "single_cluster":
                    admitted = np.arange(self.samples, dtype=self.index_dtype)
                else:
                    low = float("-inf") if metric.difficulty_type == "value" else 0
                    admitted = self._admitted(name, low, self.current_difficulties[name])
                members = admitted if members is None else np.intersect1d(members, admitted, assume_unique=True)
            for cluster in self.clusters:
                members = np.setdiff1d(members, cluster, assume_unique=True)
            return members
        members = np.arange(self.samples, dtype=self.index_dtype) if not self.clusters else None
        for name in ordering:
            members = self._admitted(name, previous[name], self.current_difficulties[name])
        return members

    def _admitted(self, name: str, low: Any, high: Any) -> np.ndarray | None:
        """Samples whose value is in (low, high], or whose percentile rank is in [low, high)."""
        to_sample, to_metric = self._index[name]
        if self.metrics[name].difficulty_type == "value":
            rows = [np.copy(to_sample[row]) for row in range(len(to_sample))
                    if low < to_metric[row][0] <= high]
            return np.concatenate(rows, axis=None) if rows else None
        return self._by_percentile(name, low, high)

    def _by_percentile(self, name: str, low: int, high: int) -> np.ndarray | None:
        to_sample = self._index[name][0]
        if self._epoch_size is None:
            self._epoch_size = sum(len(to_sample[row]) for row in range(len(to_sample)))
        top = self.metrics[name].max_difficulty
        per_percentile = self._epoch_size // top
        start, end = per_percentile * low, (self._epoch_size if high == top else per_percentile * high)
        rows, seen = [], 0
        for row in range(len(to_sample)):
            size = len(to_sample[row])
            if seen + size > start:
                rows.append(np.copy(to_sample[row][max(0, start - seen): min(size, end - seen)]))
            seen += size
            if seen >= end:
                break
        return np.concatenate(rows, axis=None) if rows else None

    def _cluster_file(self, name: str) -> str:
        return f"{self.policy.cluster_path}/{name}"

    def _write_cluster(self, name: str, members: np.ndarray) -> None:
        write_rows(self._cluster_file(name), [members], self.index_dtype)

    # -- the data position ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batch": list(self.batch), "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
                "data_cluster_paths": list(self.cluster_names),
                "data_cluster_current_position": list(self.cluster_positions),
                "np_rng_state": self.rng.bit_generator.state, "samples": self.samples,
                "cluster_history": [dict(entry, shuffles=list(entry["shuffles"])) for entry in self.cluster_history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "cluster_history" not in state:
            raise ValueError("this data position has no cluster_history (a DeepSpeed checkpoint's sampler state, "
                             "or another loader's): shardwise resumes curriculum sampling from its own checkpoints")
        if state["samples"] != self.samples:
            raise ValueError(f"the checkpoint's curriculum position is for a dataset of {state['samples']} samples, "
                             f"but the training data has {self.samples}: resume with the same training_data")
        self.batch = list(state["batch"])
        self.consumed_samples = state["consumed_samples"]
        self.curriculum_step = state["curriculum_step"]
        self.cluster_names = [path.split("/")[-1] for path in state["data_cluster_paths"]]
        self.cluster_positions = list(state["data_cluster_current_position"])
        if self.replicas.rank == 0:
            self._rebuild_clusters(state["cluster_history"])
        self.current_difficulties = dict(state["current_difficulties"])
        for name, difficulty in self.current_difficulties.items():
            self.schedulers[name].state["current_difficulty"] = difficulty
        self.rng.bit_generator.state = state["np_rng_state"]

    def _rebuild_clusters(self, history: list[dict[str, Any]]) -> None:
        """Each cluster as the saved run held it: its samples from the metric index, shuffled
        by the generator states saved before each of its shuffles; its file rewritten."""
        self.clusters, self.cluster_history = [], []
        for name, entry in zip(self.cluster_names, history, strict=True):
            self.current_difficulties = dict(entry["difficulties"])
            members = self._new_members(entry["previous"])
            for generator_state in entry["shuffles"]:
                self.rng.bit_generator.state = generator_state
                members = np.copy(members)
                self.rng.shuffle(members)
            self._write_cluster(name, members)
            self.clusters.append(members)
            self.cluster_history.append({**entry, "shuffles": list(entry["shuffles"])})
