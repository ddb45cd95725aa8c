"""`deepspeed.runtime.data_pipeline.data_routing`: random-LTD's token-count schedule
(`scheduler.RandomLTDScheduler`); the token-dropping layers are not provided yet."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_routing import scheduler

__all__ = ["scheduler"]
