"""The engine (engine.py), the policies it is built from (policies.py) and the job it
trains in (job.py)."""

from shardwise.runtime.engine.engine import Engine
from shardwise.runtime.engine.job import Job, start_job
from shardwise.runtime.engine.policies import OptimizerPolicy, Policies, SchedulerPolicy, TrainingPolicy

__all__ = ["Engine", "Job", "OptimizerPolicy", "Policies", "SchedulerPolicy", "TrainingPolicy", "start_job"]
