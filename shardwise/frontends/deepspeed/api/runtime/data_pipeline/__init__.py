"""`deepspeed.runtime.data_pipeline`: the data efficiency library's names that scripts
import: curriculum learning's schedule (`curriculum_scheduler.CurriculumScheduler`) and
random-LTD's token-count schedule (`data_routing.scheduler.RandomLTDScheduler`)."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline import curriculum_scheduler, data_routing

__all__ = ["curriculum_scheduler", "data_routing"]
