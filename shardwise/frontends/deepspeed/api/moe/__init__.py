"""`deepspeed.moe`: the mixture-of-experts layer (`moe.layer.MoE`, routing in
`moe.sharded_moe`) with every expert on every rank, and the param-group helpers
(`moe.utils`)."""

from shardwise.frontends.deepspeed.api.moe import layer, sharded_moe, utils

__all__ = ["layer", "sharded_moe", "utils"]
