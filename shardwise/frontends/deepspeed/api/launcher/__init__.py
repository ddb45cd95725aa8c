"""`deepspeed.launcher`: the names of DeepSpeed's launcher that libraries read
(`runner.DEEPSPEED_ENVIRONMENT_NAME`, which `accelerate launch` writes a multi-node job's
environment into). The launcher itself is `shardwise run` (tools/launcher/)."""

from shardwise.frontends.deepspeed.api.launcher import runner

__all__ = ["runner"]
