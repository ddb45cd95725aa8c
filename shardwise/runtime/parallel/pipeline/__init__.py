"""Pipeline parallelism: the model split into stages over the pipeline group (split.py),
GPipe / 1F1B / interleaved schedules (schedules.py), point-to-point messages between
stages (p2p.py) at the steps plan.py gives them, run on top of the ZeRO engine (runner.py); a model given as a list of
layers (sequential.py, DeepSpeed's PipelineModule form); importing
`engine_methods` registers the apply stage's "pipeline" step."""

from shardwise.runtime.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    schedule_actions,
    simulate,
)
from shardwise.runtime.parallel.pipeline.sequential import SequentialStages

__all__ = ["SCHEDULES", "Action", "SequentialStages", "schedule_actions", "simulate"]
