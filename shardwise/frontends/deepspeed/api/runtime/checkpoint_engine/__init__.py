"""`deepspeed.runtime.checkpoint_engine`: DeepSpeed's interface of a checkpoint writer
(`CheckpointEngine`, `CheckpointCommitInfo`) and its torch.save one (`TorchCheckpointEngine`),
which scripts import to save and load files of their own the way DeepSpeed's engine does.

shardwise's engine does not write its checkpoints through one: they are sharded safetensors
and JSON (runtime/checkpoint/), not the pickles a `CheckpointEngine.save` writes, and
DeepSpeed 0.19.8 offers no argument to pass one in (its engine builds its own from the
config's `checkpoint` block; docs/deepspeed.md#checkpoint-engines).
"""

from shardwise.frontends.deepspeed.api.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from shardwise.frontends.deepspeed.api.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
