"""Compilation per block (blocks.py) and its policy."""

from shardwise.runtime.compile.blocks import compile_blocks, find_blocks, traceable_hook
from shardwise.runtime.compile.policy import CompilePolicy

__all__ = ["CompilePolicy", "compile_blocks", "find_blocks", "traceable_hook"]
