"""`deepspeed.checkpoint`: of DeepSpeed's checkpoint package, the helper libraries call
(`utils.clone_tensors_for_torch_save`, which Accelerate's `get_state_dict` uses below
ZeRO-3). DeepSpeed's own checkpoint folders are read and written by `shardwise convert
--from-deepspeed` / `--to-deepspeed` (frontends/deepspeed/checkpoints/)."""

from shardwise.frontends.deepspeed.api.checkpoint import utils
from shardwise.frontends.deepspeed.api.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save", "utils"]
