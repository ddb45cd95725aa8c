"""`deepspeed.runtime.data_pipeline`: the data efficiency library's names that scripts
import (today its curriculum schedule, `curriculum_scheduler.CurriculumScheduler`)."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline import curriculum_scheduler

__all__ = ["curriculum_scheduler"]
