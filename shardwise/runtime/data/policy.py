"""Which samples each step trains on when curriculum learning is on (DeepSpeed's
`data_efficiency.data_sampling`), as typed settings: the runtime reads these, never the
config (frontends/deepspeed/config/data_efficiency.py maps the block onto them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DifficultyType = Literal["value", "percentile"]
ClusteringType = Literal["schedule_based", "single_cluster"]

# The metric whose difficulty is a sequence length the loader truncates each batch to
# (DeepSpeed's Megatron recipes: `seqlen_truncate`, one cluster of every sample).
TRUNCATING_METRIC = "seqlen_truncate"


@dataclass(frozen=True)
class CurriculumMetricPolicy:
    """One metric: its offline index (which samples have which value), how its difficulty
    is read (a metric value, or a percentile of the samples sorted by value), whether it
    orders the data (`schedule_based`) or only sets a difficulty (`single_cluster`), and
    its schedule (runtime/data/curriculum.py)."""

    name: str
    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    schedule_config: dict[str, Any] = field(default_factory=dict)
    difficulty_type: DifficultyType = "value"
    clustering_type: ClusteringType = "schedule_based"
    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None

    def __post_init__(self) -> None:
        if self.clustering_type == "schedule_based":
            needed = ["index_to_sample_path"] + (["index_to_metric_path"] if self.difficulty_type == "value" else [])
            missing = [name for name in needed if getattr(self, name) is None]
            if missing:
                raise ValueError(f"curriculum metric {self.name!r} orders the data (clustering_type schedule_based, "
                                 f"difficulty_type {self.difficulty_type}) and needs {' and '.join(missing)}: the "
                                 "files `shardwise data analyze` (or DeepSpeed's DataAnalyzer) writes")

    def scheduler_config(self) -> dict[str, Any]:
        """The block runtime/data/curriculum.py's CurriculumScheduler reads (DeepSpeed's shape)."""
        return {"min_difficulty": self.min_difficulty, "max_difficulty": self.max_difficulty,
                "schedule_type": self.schedule_type, "schedule_config": self.schedule_config}


@dataclass(frozen=True)
class DataSamplingPolicy:
    """Curriculum sampling: `seed` seeds the cluster shuffles and draws; the sampler offers
    `num_epochs` times the dataset's samples; `cluster_path` is where the data clusters
    are written (DeepSpeed's file names, so its checkpoints and ours name the same files)."""

    metrics: tuple[CurriculumMetricPolicy, ...]
    cluster_path: str
    seed: int = 1234
    num_epochs: int = 1000
    num_workers: int = 0
    pin_memory: bool = False

    @property
    def truncates_sequences(self) -> bool:
        return any(metric.name == TRUNCATING_METRIC for metric in self.metrics)
