"""`deepspeed.runtime.data_pipeline.data_routing.scheduler`: random-LTD's token-count
schedule (shardwise/runtime/data/token_schedule.py) under DeepSpeed's name."""

from shardwise.runtime.data.token_schedule import RandomLTDScheduler

__all__ = ["RandomLTDScheduler"]
