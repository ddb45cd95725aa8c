"""ZenFlow's own state in a checkpoint (runtime/zero/zenflow.py): the selected columns, the
selective AdamW's moments and step counts, and the host's gradient sum of the unfinished
update window. Without them a resume would choose columns again and drop up to
`update_interval` - 1 steps of gradient.

Each rank writes `rank_<r>.zenflow.safetensors` (listed in the manifest with its checksum,
like every tensor file) and a `zenflow` entry in its JSON record. The moments and columns
are the same on every rank (every rank runs the same selective update); the window sum is
the rank's own partition.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.runtime.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter, TensorEntry
from shardwise.runtime.engine_protocol import EngineProtocol


def zenflow_file(rank: int) -> str:
    return f"rank_{rank:05d}.zenflow.safetensors"


def save_zenflow(engine: EngineProtocol, staging: Path) -> tuple[dict, dict[str, tuple[int, str]]]:
    """This rank's ZenFlow record and file ({name: (bytes, sha256)}); masters settled first,
    so the weights the checkpoint saves are the ones the device trains with."""
    zenflow = engine.zenflow
    tensors = {key: tensor.detach().cpu().contiguous() for key, tensor in zenflow.state_tensors().items()}
    path = staging / zenflow_file(engine.rank)
    entries = [TensorEntry(key, tensor.dtype, (tensor.numel(),)) for key, tensor in tensors.items()]
    with SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        for key, tensor in tensors.items():
            writer.write(key, tensor)
        digest = writer.close()
    return zenflow.state_record(), {path.name: digest}


def load_zenflow(engine: EngineProtocol, directory: Path, meta: dict, records: list[dict]) -> None:
    """Restore ZenFlow's state from the rank's own record (at another world size: rank 0's
    columns and moments, and an empty window, which the engine checks it may be)."""
    same_world = meta["world_size"] == engine.world_size
    source = engine.rank if same_world else 0
    record = records[source].get("zenflow")
    if record is None:
        raise ValueError("this checkpoint was saved without zero_optimization.zenflow: its columns, selective "
                         "moments and window sum are missing; resume without zenflow, or start ZenFlow from its "
                         "weights with load_checkpoint(..., load_module_only=True)")
    reader = SafetensorsReader(directory / zenflow_file(source))
    try:
        def read(key: str, out) -> None:
            staged = reader.read(key, 0, out.numel())
            out.copy_(staged.to(out.device))

        engine.zenflow.load_state(record, read, same_layout=same_world)
        if not same_world:  # every saved window must be empty, not only rank 0's
            for rank, other in enumerate(records[1:], start=1):
                other_reader = SafetensorsReader(directory / zenflow_file(rank))
                try:
                    for index, size in enumerate(other["zenflow"]["window_sizes"]):
                        if other_reader.read(f"window.{index}", 0, size).any():
                            raise ValueError("this checkpoint was saved in the middle of a ZenFlow update window "
                                             "at another world size; resume at the saving world size")
                finally:
                    other_reader.close()
    finally:
        reader.close()
