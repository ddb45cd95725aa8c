"""`deepspeed.utils.zero_to_fp32`: whole fp32 weights from a checkpoint that
`engine.save_checkpoint` wrote, at any stage and world size.

    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")        # tag: `latest`
    model = load_state_dict_from_zero_checkpoint(model, "checkpoints", tag="global_step100")
    convert_zero_checkpoint_to_fp32_state_dict("checkpoints", "consolidated")   # a folder or a file

As DeepSpeed's engine does, the compatibility engine's `save_checkpoint` leaves a
`zero_to_fp32.py` beside the tags (`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [-t TAG]
[--safe_serialization] [--max_shard_size 5GB] [--exclude_frozen_parameters]`), which
calls `main` here.

The checkpoint is shardwise's (shardwise/checkpoint; `shardwise convert` writes the same
weights as safetensors); its files' checksums are verified first. As in DeepSpeed, a tied
parameter appears under every name the model gives it, floating-point tensors come back
in fp32, and `exclude_frozen_parameters` leaves out the parameters that were not trained.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from torch import nn

from shardwise.runtime.checkpoint.convert import convert_checkpoint, open_verified
from shardwise.runtime.checkpoint.format import VALUE
from shardwise.runtime.checkpoint.index import PieceIndex

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "main"]

FILE_SUFFIXES = (".bin", ".pt", ".pth")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's state_dict from `checkpoint_dir/tag` (tag None: the one `latest` names).
    `lazy_mode` (DeepSpeed's deferred loading) is accepted; the tensors are read at once."""
    directory, meta, records = open_verified(checkpoint_dir, tag)
    state: dict[str, torch.Tensor] = {}
    with PieceIndex(directory, records) as index:
        entries = [entry for entry in meta["parameters"] if entry["trainable"] or not exclude_frozen_parameters]
        for entry in entries + meta["buffers"]:
            stored = getattr(torch, entry["dtype"])
            dtype = torch.float32 if stored.is_floating_point else stored
            numel = math.prod(entry["shape"])
            index.check_complete(entry["name"], numel)
            state[entry["name"]] = index.read(entry["name"], VALUE, 0, numel, dtype).view(entry["shape"])
    for alias, canonical in meta.get("aliases", {}).items():  # tied: every name the model gives it
        if canonical in state:
            state[alias] = state[canonical]
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model`, moved to the CPU first (as
    DeepSpeed does: the engine that trained it should not be used after this)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: str | int = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None, exclude_frozen_parameters: bool = False,
                                               output_file: str | os.PathLike | None = None) -> None:
    """Write the consolidated fp32 weights: with `safe_serialization`, safetensors in
    `output_dir` (sharded at `max_shard_size`, with an index); otherwise
    `output_dir/pytorch_model.bin`, or the file `output_dir` names when it ends in .bin,
    .pt or .pth (DeepSpeed's older `output_file` form)."""
    target = Path(output_file if output_file is not None else output_dir)
    if safe_serialization:
        if exclude_frozen_parameters:
            raise ValueError("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True, "
                             "exclude_frozen_parameters=True) is not supported: write a .bin file, or drop the "
                             "frozen parameters after loading")
        convert_checkpoint(checkpoint_dir, target, tag=tag, dtype="fp32", max_shard_size=max_shard_size)
        return
    path = target if target.suffix in FILE_SUFFIXES else target / "pytorch_model.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    # a reader never sees half a file; the temporary is this process's own, since every
    # rank of a job may convert to the same path at once (DeepSpeed's own test does)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save(state, partial)
    os.replace(partial, path)


RECOVERY_SCRIPT = (
    '"""Written by shardwise: DeepSpeed\'s zero_to_fp32.py for this checkpoint folder. Run\n'
    'python zero_to_fp32.py CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization] [--max_shard_size 5GB]"""\n'
    "from shardwise.frontends.deepspeed.api.utils.zero_to_fp32 import main\n\n"
    'if __name__ == "__main__":\n    main()\n'
)


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's zero_to_fp32.py command line."""
    parser = argparse.ArgumentParser(description="Whole fp32 weights from a checkpoint folder")
    parser.add_argument("checkpoint_dir", help="the folder holding `latest` and the tag folders")
    parser.add_argument("output_dir", help="a folder, or a .bin / .pt / .pth file")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; changes nothing")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)
