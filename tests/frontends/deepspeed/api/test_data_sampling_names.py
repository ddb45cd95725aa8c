"""DeepSpeed's data-sampling names (the alias finds them: test_names.py): DeepSpeedDataSampler with
DeepSpeed's constructor draws what shardwise's sampler draws; DataAnalyzer with DeepSpeed's
constructor writes the files `shardwise data analyze` writes; MMapIndexedDatasetBuilder's
files read back through MMapIndexedDataset."""

from __future__ import annotations

import numpy as np
import torch

from shardwise.frontends.deepspeed.api.runtime.data_pipeline.constants import CURRICULUM_LEARNING_CURRENT_DIFFICULTIES
from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)
from shardwise.runtime.data.difficulty_sampler import DifficultySampler
from shardwise.runtime.data.metric_index import write_metric_index
from shardwise.runtime.data.policy import CurriculumMetricPolicy, DataSamplingPolicy
from tests.runtime.data.test_difficulty_sampler import Alone


def test_deepspeeds_sampler_constructor_draws_shardwises_batches(tmp_path):
    values = np.arange(30) % 6
    folder = write_metric_index(values, tmp_path / "index", "mod")
    metric = {"index_to_sample_path": str(folder / "mod_index_to_sample"),
              "index_to_metric_path": str(folder / "mod_index_to_metric"), "difficulty_type": "value",
              "clustering_type": "schedule_based", "min_difficulty": 1, "max_difficulty": 5,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1}}
    config = {"enabled": True, "seed": 9, "data_sampling": {"enabled": True, "num_epochs": 5, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(tmp_path / "a"), "curriculum_metrics": {"mod": metric}}},
        "data_routing": {"enabled": False, "random_ltd": {"enabled": False}}}
    theirs = DeepSpeedDataSampler(config, 30, 3, 0, 1, None, 2, 0)
    mod = CurriculumMetricPolicy("mod", 1, 5, "fixed_linear", metric["schedule_config"], "value", "schedule_based",
                                 metric["index_to_sample_path"], metric["index_to_metric_path"])
    ours = DifficultySampler(DataSamplingPolicy((mod,), str(tmp_path / "b"), seed=9, num_epochs=5),
                             samples=30, micro_batch_size=3, gradient_accumulation_steps=2, replicas=Alone())
    a, b = iter(theirs), iter(ours)
    assert [next(a) for _ in range(12)] == [next(b) for _ in range(12)]
    assert theirs.state_dict()[CURRICULUM_LEARNING_CURRENT_DIFFICULTIES] == {"mod": 5}


def test_deepspeeds_analyzer_constructor_writes_the_analyze_files(tmp_path):
    rows = torch.randint(1, 9, (20, 6), generator=torch.Generator().manual_seed(1))
    rows[torch.arange(20), torch.arange(20) % 6] = 0
    analyzer = DataAnalyzer(rows, batch_size=3, metric_names=["seqlen"],
                            metric_functions=[lambda batch: (batch != 0).sum(dim=1)],
                            metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                            save_path=str(tmp_path / "ds"))
    analyzer.run_map()
    analyzer.run_reduce()
    write_metric_index((rows != 0).sum(dim=1).numpy(), tmp_path / "ours", "seqlen")
    for name in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged"):
        for suffix in (".bin", ".idx"):
            assert (tmp_path / "ds" / "seqlen" / f"seqlen_{name}{suffix}").read_bytes() == \
                (tmp_path / "ours" / "seqlen" / f"seqlen_{name}{suffix}").read_bytes()


def test_the_builders_rows_read_back(tmp_path):
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "rows.bin"), dtype=np.uint16)
    builder.add_item(torch.tensor([3, 1, 4]))
    builder.add_item_numpy(np.array([1, 5], dtype=np.int64))
    builder.end_document()
    builder.finalize(str(tmp_path / "rows.idx"))
    rows = MMapIndexedDataset(str(tmp_path / "rows"), skip_warmup=True)
    assert [list(row) for row in rows[:]] == [[3, 1, 4], [1, 5]] and rows.dtype == np.uint16
    assert list(rows.doc_idx) == [0, 2] and MMapIndexedDataset.exists(str(tmp_path / "rows"))
