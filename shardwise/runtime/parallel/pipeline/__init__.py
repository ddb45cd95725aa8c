"""Pipeline parallelism: the model split into stages over the pipeline group (stages.py,
split.py), GPipe / 1F1B / interleaved schedules (schedules.py), point-to-point messages
between stages (p2p.py) at the steps plan.py gives them, run on top of the ZeRO engine
(runner.py); how a model family runs as stages (adapter.py); a model given as a list of
layers (sequential.py, DeepSpeed's PipelineModule form)."""

from shardwise.runtime.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    schedule_actions,
    simulate,
)
from shardwise.runtime.parallel.pipeline.policy import PipelinePolicy
from shardwise.runtime.parallel.pipeline.sequential import SequentialStages

__all__ = ["SCHEDULES", "Action", "PipelinePolicy", "SequentialStages", "schedule_actions", "simulate"]
