"""`deepspeed.runtime.data_pipeline.data_routing.basic_layer`: random-LTD's layer wrapper
(shardwise/runtime/data/random_ltd.py) under DeepSpeed's name."""

from shardwise.runtime.data.random_ltd import RandomLayerTokenDrop

__all__ = ["RandomLayerTokenDrop"]
