"""shardwise's GPT (model.py) and its parallelisms (parallelize.py)."""

from shardwise.models.gpt.model import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
