"""`deepspeed.runtime.data_pipeline`: the data efficiency library's names that scripts
import: curriculum learning's schedule (`curriculum_scheduler.CurriculumScheduler`), its
sampler, analyzer and file format (`data_sampling`), the config key names (`constants`)
and random-LTD's token-count schedule (`data_routing.scheduler.RandomLTDScheduler`)."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline import (
    constants,
    curriculum_scheduler,
    data_routing,
    data_sampling,
)

__all__ = ["constants", "curriculum_scheduler", "data_routing", "data_sampling"]
