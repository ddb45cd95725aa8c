"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: curriculum learning's
difficulty schedule (shardwise/runtime/data/curriculum.py) under DeepSpeed's name."""

from shardwise.runtime.data.curriculum import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
