"""DeepSpeed's `data_efficiency` block, read as DeepSpeed 0.19.8 reads it
(deepspeed/runtime/data_pipeline/config.py), and its `data_sampling` part as the runtime's
DataSamplingPolicy.

    data_efficiency: {enabled, seed,
                      data_sampling: {enabled, num_epochs, num_workers, pin_memory,
                                      curriculum_learning: {enabled, data_cluster_path,
                                                            curriculum_metrics: {NAME: {...}}},
                                      dynamic_batching (refused unless off)},
                      data_routing (random-LTD: random_ltd.py)}

DeepSpeed builds its curriculum sampler whenever
`data_sampling.curriculum_learning.enabled` is true, whatever the two `enabled` above it
say (they only gate its other features), and so does shardwise. Each metric needs
`difficulty_type`, `clustering_type`, `min_difficulty`, `max_difficulty` and
`schedule_type` (DeepSpeed fails on a missing one); the index paths are needed where the
metric orders the data.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from shardwise.frontends.deepspeed.config.fields import Bool, Int, Section
from shardwise.frontends.deepspeed.config.random_ltd import DataRoutingConfig
from shardwise.runtime.data.curriculum import CurriculumScheduler
from shardwise.runtime.data.policy import CurriculumMetricPolicy, DataSamplingPolicy


class CurriculumMetricConfig(Section):
    """One `curriculum_metrics.<name>` block: the metric's offline index, how its
    difficulty is read, and its schedule (shardwise/runtime/data/curriculum.py)."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"]
    clustering_type: Literal["schedule_based", "single_cluster"]
    min_difficulty: Int
    max_difficulty: Int
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]
    schedule_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _schedule(self) -> "CurriculumMetricConfig":
        CurriculumScheduler(self.model_dump())  # the schedule's own keys, with its errors
        return self


class CurriculumLearningConfig(Section):
    enabled: Bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete(self) -> "CurriculumLearningConfig":
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum_learning is enabled without curriculum_metrics: name at least one metric "
                             "(DeepSpeed asserts the same)")
        if self.enabled and self.data_cluster_path is None:
            raise ValueError("curriculum_learning is enabled without data_cluster_path: give a folder where the "
                             "sampler writes its data clusters (DeepSpeed requires it too)")
        return self


class DataSamplingConfig(Section):
    enabled: Bool = False
    num_epochs: Int = Field(1000, ge=1)
    num_workers: Int = Field(0, ge=0)
    pin_memory: Bool = False
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)


class DataEfficiencyConfig(Section):
    """DeepSpeed's data-efficiency library: curriculum sampling (`data_sampling`, here) and
    random-LTD (`data_routing`, random_ltd.py); `seed` seeds both the sampler and the
    kept-token draws."""

    enabled: Bool = False
    seed: Int = 1234
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)


def data_sampling_policy(block: DataEfficiencyConfig) -> DataSamplingPolicy | None:
    """The sampling policy the engine's loader follows; None where curriculum learning is off."""
    sampling = block.data_sampling
    curriculum = sampling.curriculum_learning
    if not curriculum.enabled:
        return None
    metrics = tuple(
        CurriculumMetricPolicy(name=name, min_difficulty=metric.min_difficulty, max_difficulty=metric.max_difficulty,
                               schedule_type=metric.schedule_type, schedule_config=dict(metric.schedule_config),
                               difficulty_type=metric.difficulty_type, clustering_type=metric.clustering_type,
                               index_to_sample_path=metric.index_to_sample_path,
                               index_to_metric_path=metric.index_to_metric_path)
        for name, metric in curriculum.curriculum_metrics.items())
    return DataSamplingPolicy(metrics=metrics, cluster_path=curriculum.data_cluster_path, seed=block.seed,
                              num_epochs=sampling.num_epochs, num_workers=sampling.num_workers,
                              pin_memory=sampling.pin_memory)
