"""`data_efficiency` as DeepSpeed 0.19.8 reads it: curriculum learning's block becomes the
runtime's DataSamplingPolicy (with DeepSpeed's defaults), its mistakes are refused with
the reason, and `data_routing` / `dynamic_batching` stay refused unless off."""

from __future__ import annotations

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.errors import ConfigError
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.data.policy import CurriculumMetricPolicy, DataSamplingPolicy

METRIC = {"index_to_sample_path": "/data/seqlen_index_to_sample",
          "index_to_metric_path": "/data/seqlen_index_to_metric",
          "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 64,
          "max_difficulty": 1024, "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8, "root_degree": 2}}


def config(curriculum: dict, **efficiency) -> dict:
    return {"train_batch_size": 8, "data_efficiency": {
        "enabled": True, **efficiency, "data_sampling": {"enabled": True, "curriculum_learning": curriculum}}}


def test_the_block_becomes_the_sampling_policy():
    cfg = load_config(config({"enabled": True, "data_cluster_path": "/tmp/clusters",
                              "curriculum_metrics": {"seqlen": METRIC}}, seed=7), world_size=1)
    assert policies_from_config(cfg).data_sampling == DataSamplingPolicy(
        metrics=(CurriculumMetricPolicy("seqlen", 64, 1024, "fixed_root", METRIC["schedule_config"], "value",
                                        "schedule_based", METRIC["index_to_sample_path"],
                                        METRIC["index_to_metric_path"]),),
        cluster_path="/tmp/clusters", seed=7, num_epochs=1000, num_workers=0, pin_memory=False)


def test_curriculum_off_means_no_sampler():
    cfg = load_config(config({"enabled": False}), world_size=1)
    assert policies_from_config(cfg).data_sampling is None


@pytest.mark.parametrize(("curriculum", "message"), [
    ({"enabled": True, "data_cluster_path": "/tmp/c"}, "without curriculum_metrics"),
    ({"enabled": True, "curriculum_metrics": {"seqlen": METRIC}}, "without data_cluster_path"),
    ({"enabled": True, "data_cluster_path": "/tmp/c",
      "curriculum_metrics": {"seqlen": {**METRIC, "schedule_config": {"total_curriculum_step": 10}}}},
     "needs schedule_config with"),
    ({"enabled": True, "data_cluster_path": "/tmp/c",
      "curriculum_metrics": {"seqlen": {**METRIC, "difficulty_type": "rank"}}}, "difficulty_type"),
])
def test_mistakes_are_refused_with_the_reason(curriculum, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config(curriculum), world_size=1)


def test_an_ordering_metric_needs_its_index():
    metric = {key: value for key, value in METRIC.items() if key != "index_to_metric_path"}
    block = {"enabled": True, "data_cluster_path": "/tmp/c", "curriculum_metrics": {"seqlen": metric}}
    cfg = load_config(config(block), world_size=1)
    with pytest.raises(ValueError, match="needs index_to_metric_path"):
        policies_from_config(cfg)


def test_dynamic_batching_is_refused_unless_off():
    key = "data_efficiency.data_sampling.dynamic_batching.enabled"
    block = {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 100}}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"train_batch_size": 8, "data_efficiency": block}, world_size=1)
    load_config({"train_batch_size": 8, "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": False}}}},
                world_size=1)
