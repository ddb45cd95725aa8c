"""The curriculum sampler draws, step by step, the sample indices DeepSpeed 0.19.8's
DeepSpeedDataSampler draws: against a single-process reference written here from its
algorithm (1 and 2 data-parallel ranks), against DeepSpeed itself with DEEPSPEED_PYTHON
set, and after a resume from its saved position."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.runtime.data.difficulty_sampler import DifficultySampler
from shardwise.runtime.data.indexed_dataset import IndexedDataset, write_rows
from shardwise.runtime.data.policy import CurriculumMetricPolicy, DataSamplingPolicy
from shardwise.tools.testing import run_distributed

SAMPLES, MICRO, ACCUMULATION, STEPS, SEED, EPOCHS = 37, 2, 2, 12, 5, 4
# value metric: sample i has value i % 9 (rows 0..8); percentile metric on value (i * 7) % 11
SCHEDULE = {"total_curriculum_step": 6, "difficulty_step": 2}


def metric_index(folder: Path, name: str, values: np.ndarray) -> tuple[str, str]:
    """The index DeepSpeed's DataAnalyzer writes: one row per distinct value (ascending),
    the samples having it, and the value."""
    prefix = str(folder / name)
    distinct = np.unique(values)
    write_rows(f"{prefix}_index_to_sample", [np.flatnonzero(values == value) for value in distinct], np.uint8)
    write_rows(f"{prefix}_index_to_metric", [np.array([value]) for value in distinct], np.uint8)
    return f"{prefix}_index_to_sample", f"{prefix}_index_to_metric"


def metric_policies(folder: Path, kind: str) -> tuple[CurriculumMetricPolicy, ...]:
    index = np.arange(SAMPLES)
    by_value = metric_index(folder, "mod", index % 9)
    by_rank = metric_index(folder, "rank", (index * 7) % 11)
    value = CurriculumMetricPolicy("mod", 2, 8, "fixed_linear", SCHEDULE, "value", "schedule_based", *by_value)
    percentile = CurriculumMetricPolicy("rank", 2, 10, "fixed_root", {**SCHEDULE, "root_degree": 2},
                                        "percentile", "schedule_based", *by_rank)
    truncate = CurriculumMetricPolicy("seqlen_truncate", 8, 32, "fixed_discrete",
                                      {"difficulty": [8, 16, 32], "max_step": [3, 7]}, "value", "single_cluster")
    return {"value": (value,), "percentile": (percentile,), "two": (value, percentile),
            "single": (truncate,)}[kind]


def policy(folder: Path, kind: str) -> DataSamplingPolicy:
    return DataSamplingPolicy(metrics=metric_policies(folder, kind), cluster_path=str(folder / "clusters"),
                              seed=SEED, num_epochs=EPOCHS)


class Alone:
    """The replicas of a one-rank job (the sampler's and loader's only collectives)."""

    rank, size = 0, 1

    def control_all_reduce(self, tensor, what):
        return tensor

    def barrier(self, what):
        pass


# -- the reference: DeepSpeedDataSampler's algorithm, one process, whole global batches --------
def reference_batches(folder: Path, kind: str, steps: int) -> list[list[int]]:
    from shardwise.runtime.data.curriculum import CurriculumScheduler

    metrics = metric_policies(folder, kind)
    rng = np.random.default_rng(SEED)
    schedulers = [CurriculumScheduler(m.scheduler_config()) for m in metrics]
    rows = {m.name: IndexedDataset(m.index_to_sample_path)[:] for m in metrics if m.index_to_sample_path}
    values = {m.name: [int(v[0]) for v in IndexedDataset(m.index_to_metric_path)[:]]
              for m in metrics if m.index_to_metric_path}

    def admitted(metric, low, high):
        if metric.difficulty_type == "value":
            chosen = [row for row, value in zip(rows[metric.name], values[metric.name]) if low < value <= high]
            return np.concatenate(chosen) if chosen else None
        ordered = np.concatenate(rows[metric.name])  # samples by ascending value; percentiles cut it
        per = len(ordered) // metric.max_difficulty
        end = len(ordered) if high == metric.max_difficulty else per * high
        return ordered[per * low: end] if end > per * low else None

    clusters, positions, current, batches = [], [], {}, []
    for step in range(1, steps + 1):
        previous = dict(current)
        difficulties = {m.name: s.update_difficulty(step) for m, s in zip(metrics, schedulers)}
        if difficulties != current:
            current = difficulties
            ordering = [m for m in metrics if m.clustering_type == "schedule_based"]
            if len(ordering) > 1:
                members = None
                for m in metrics:
                    part = admitted(m, float("-inf") if m.difficulty_type == "value" else 0, current[m.name])
                    members = part if members is None else np.intersect1d(members, part, assume_unique=True)
                for cluster in clusters:
                    members = np.setdiff1d(members, cluster, assume_unique=True)
            elif ordering:
                m = ordering[0]
                low = previous.get(m.name, float("-inf") if m.difficulty_type == "value" else 0)
                members = admitted(m, low, current[m.name])
            else:
                members = np.arange(SAMPLES, dtype=np.uint8) if not clusters else None
            if members is not None and len(members):
                members = members.astype(np.uint8)
                rng.shuffle(members)
                clusters.append(members)
                positions.append(0)
        sizes = [len(c) for c in clusters]
        picks = np.bincount(rng.choice(len(clusters), MICRO * ACCUMULATION * 2, replace=True,
                                       p=[s / sum(sizes) for s in sizes]), minlength=len(clusters))
        batch = []
        for c, count in enumerate(picks):
            taken = list(clusters[c][positions[c]: positions[c] + count])
            positions[c] += count
            if len(taken) < count:  # read to its end: reshuffled, the rest from its start
                rest = count - len(taken)
                clusters[c] = np.copy(clusters[c])
                rng.shuffle(clusters[c])
                taken += list(clusters[c][:rest])
                positions[c] = rest
            batch += taken
        rng.shuffle(batch)
        batches.append([int(i) for i in batch])
    return batches


def drawn(sampler: DifficultySampler, micro_batches: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(micro_batches)]


def as_global(micro_batches_per_rank: list[list[list[int]]], steps: int) -> list[list[int]]:
    """Each rank's micro-batches joined back into the global batches (rank slices of each
    micro-batch-times-ranks stretch, in rank order)."""
    stretches = [sum((ranks[i] for ranks in micro_batches_per_rank), []) for i in range(len(micro_batches_per_rank[0]))]
    return [sum(stretches[s * ACCUMULATION:(s + 1) * ACCUMULATION], []) for s in range(steps)]


@pytest.mark.parametrize("kind", ["value", "percentile", "two", "single"])
def test_one_rank_draws_the_reference_batches(tmp_path, kind):
    sampler = DifficultySampler(policy(tmp_path, kind), samples=SAMPLES, micro_batch_size=MICRO * 2,
                                gradient_accumulation_steps=ACCUMULATION, replicas=Alone())
    ours = as_global([drawn(sampler, STEPS * ACCUMULATION)], STEPS)
    assert ours == reference_batches(tmp_path, kind, STEPS)
    if kind == "value":  # the difficulty only admits samples of value <= it
        for step, batch in enumerate(ours, start=1):
            limit = min(8, max(2, (2 + (8 - 2) * step // 6) // 2 * 2))
            assert max(i % 9 for i in batch) <= limit


class WorldReplicas:
    """The default process group as the sampler's data-parallel group."""

    def __init__(self, rank: int, world: int):
        self.rank, self.size = rank, world

    def control_all_reduce(self, tensor, what):
        torch.distributed.all_reduce(tensor)
        return tensor

    def barrier(self, what):
        torch.distributed.barrier()


def two_rank_draws(rank: int, world: int, folder: Path) -> list[list[int]]:
    sampler = DifficultySampler(policy(folder, "two"), samples=SAMPLES, micro_batch_size=MICRO,
                                gradient_accumulation_steps=ACCUMULATION, replicas=WorldReplicas(rank, world))
    return drawn(sampler, STEPS * ACCUMULATION)


@pytest.mark.slow  # the default run's 2-rank case: tests/frontends/deepspeed/api/test_curriculum_loader.py
def test_two_ranks_slice_the_reference_batches(tmp_path):
    per_rank = run_distributed(two_rank_draws, 2, tmp_path)
    assert as_global(per_rank, STEPS) == reference_batches(tmp_path, "two", STEPS)


@pytest.mark.parametrize("kind", ["value", "two"])
def test_resume_draws_what_the_uninterrupted_run_drew(tmp_path, kind):
    """Saved mid-way through a global batch; the run goes on past cluster reshuffles (its
    files rewritten) before the resumed sampler, in a fresh process's place, starts."""
    def sampler():
        return DifficultySampler(policy(tmp_path, kind), samples=SAMPLES, micro_batch_size=MICRO * 2,
                                 gradient_accumulation_steps=ACCUMULATION, replicas=Alone())

    first = sampler()
    it = iter(first)
    for _ in range(7):
        next(it)
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint's JSON keeps
    rest = [next(it) for _ in range(2 * STEPS)]
    assert any(len(entry["shuffles"]) > 1 for entry in first.cluster_history)  # reshuffles after the save
    again = sampler()
    again.load_state_dict(saved)
    assert drawn(again, 2 * STEPS) == rest


DEEPSPEED_SIDE = r"""
import json, sys
import numpy as np
from deepspeed.runtime.data_pipeline.data_sampling import data_sampler as module
module.dist.barrier = lambda **kwargs: None
module.dist.broadcast = lambda *args, **kwargs: None  # one process stands for every rank: rank 0 draws
config, samples, micro, accumulation, ranks, micro_batches = json.loads(sys.argv[1])

class Group:
    def size(self):
        return ranks

out = []
for rank in range(ranks):
    config["data_sampling"]["curriculum_learning"]["data_cluster_path"] += f"/ds{rank}"
    sampler = module.DeepSpeedDataSampler(config, samples, micro, rank, ranks, Group(), accumulation, 0)
    it = iter(sampler)
    out.append([[int(i) for i in next(it)] for _ in range(micro_batches)])
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
@pytest.mark.parametrize("kind,ranks", [("value", 1), ("percentile", 1), ("two", 2), ("single", 2)])
def test_equals_deepspeeds_sampler(tmp_path, kind, ranks):
    sampling = policy(tmp_path, kind)
    metrics = {m.name: {"index_to_sample_path": m.index_to_sample_path, "index_to_metric_path": m.index_to_metric_path,
                        "difficulty_type": m.difficulty_type, "clustering_type": m.clustering_type,
                        **m.scheduler_config()} for m in sampling.metrics}
    config = {"seed": SEED, "data_sampling": {"num_epochs": EPOCHS, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(tmp_path), "curriculum_metrics": metrics}}}
    run = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE,
                          json.dumps([config, SAMPLES, MICRO * 2 // ranks, ACCUMULATION, ranks, STEPS * ACCUMULATION])],
                         check=True, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    sampler = DifficultySampler(sampling, samples=SAMPLES, micro_batch_size=MICRO * 2,
                                gradient_accumulation_steps=ACCUMULATION, replicas=Alone())
    ours = as_global([drawn(sampler, STEPS * ACCUMULATION)], STEPS)
    assert as_global(theirs, STEPS) == ours


def test_a_custom_schedule_sets_the_difficulty(tmp_path):
    """schedule_type custom: the caller's function of the step (DeepSpeed's
    set_custom_curriculum_learning_schedule) decides which samples each batch may hold."""
    metric = CurriculumMetricPolicy("mod", 0, 8, "custom", {}, "value", "schedule_based",
                                    *metric_index(tmp_path, "mod", np.arange(SAMPLES) % 9))
    sampler = DifficultySampler(DataSamplingPolicy((metric,), str(tmp_path / "clusters"), seed=SEED, num_epochs=4),
                                samples=SAMPLES, micro_batch_size=4, gradient_accumulation_steps=1, replicas=Alone())
    sampler.set_custom_curriculum_learning_schedule({"mod": lambda step: min(8, 2 * step)})
    it = iter(sampler)
    for step in range(1, 7):
        batch = next(it)
        assert sampler.current_difficulties == {"mod": min(8, 2 * step)}
        assert max(index % 9 for index in batch) <= min(8, 2 * step)
