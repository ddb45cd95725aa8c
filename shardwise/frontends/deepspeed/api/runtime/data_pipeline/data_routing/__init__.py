"""`deepspeed.runtime.data_pipeline.data_routing`: random-LTD under DeepSpeed's names: the
token-count schedule (`scheduler.RandomLTDScheduler`), the token-dropping layer
(`basic_layer.RandomLayerTokenDrop`) and the model conversion (`helper.convert_to_random_ltd`,
`save_without_random_ltd`)."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_routing import basic_layer, helper, scheduler

__all__ = ["basic_layer", "helper", "scheduler"]
