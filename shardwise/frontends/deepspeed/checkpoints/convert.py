"""`shardwise convert --from-deepspeed`: a DeepSpeed checkpoint folder as a shardwise checkpoint,
written once so later runs load shardwise's own format (verified, memory-mapped, resharded)
without reading DeepSpeed's pickles again.

The converter runs without an engine, so what the engine would supply comes from the
checkpoint: the optimizer from its DeepSpeed config (or `optimizer`, for a script that
passed its own), and the param groups from its files (a checkpoint written without ZeRO
with several groups does not record them: resume it with engine.load_checkpoint instead).
"""

from __future__ import annotations

import os
from pathlib import Path

from shardwise.frontends.deepspeed.checkpoints.detect import deepspeed_checkpoint_dir
from shardwise.frontends.deepspeed.checkpoints.reader import read_deepspeed_checkpoint
from shardwise.frontends.deepspeed.checkpoints.to_shardwise import optimizer_class_of, write_shardwise_checkpoint
from shardwise.runtime.checkpoint.format import CheckpointError


def convert_from_deepspeed(load_dir: str | os.PathLike, output: str | os.PathLike, *, tag: str | None = None,
                           optimizer: str | None = None, trusted: bool = False) -> Path:
    """Write the DeepSpeed checkpoint `load_dir/tag` (None: the one `latest` names) as a
    shardwise checkpoint under `output` (same tag; `output/latest` names it); returns its
    folder. `optimizer`: the torch optimizer class the run trains with (AdamW, Adam, ...),
    needed only when the checkpoint's config has no optimizer block."""
    directory = deepspeed_checkpoint_dir(load_dir, tag)
    if directory is None:
        where = Path(load_dir) / (tag if tag is not None else "<the tag `latest` names>")
        raise CheckpointError(f"{where} is not a DeepSpeed checkpoint (no mp_rank_*_model_states.pt, layer files or "
                              f"universal zero/ folder, or no `latest` in {load_dir}); pass --tag to name one")
    contents = read_deepspeed_checkpoint(directory, trusted=trusted)
    saved_class = optimizer_class_of(contents)
    if optimizer is not None and saved_class is not None and optimizer != saved_class:
        raise CheckpointError(f"{directory} was trained with {saved_class} (its DeepSpeed config's optimizer), not "
                              f"{optimizer}: drop --optimizer, or convert the weights through zero_to_fp32 instead")
    optimizer_class = optimizer or saved_class
    if optimizer_class is None:
        raise CheckpointError(f"{directory}'s DeepSpeed config has no optimizer block (the script passed its own "
                              "optimizer): name the torch optimizer class it trained with, e.g. --optimizer AdamW")
    written = write_shardwise_checkpoint(contents, Path(output), optimizer_class=optimizer_class)
    return Path(output) / written
