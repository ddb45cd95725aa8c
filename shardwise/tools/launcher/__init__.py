"""The `shardwise run` launcher: a checked front end to `torch.distributed.run`."""

from shardwise.tools.launcher.cli import build_torchrun_args

__all__ = ["build_torchrun_args"]
