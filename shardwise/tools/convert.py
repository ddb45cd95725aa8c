"""`shardwise convert`: a sharded checkpoint -> consolidated safetensors or a Hugging Face folder;
`--from-deepspeed`: a DeepSpeed checkpoint -> a shardwise checkpoint (optimizer state kept).

The converter (and torch) is imported only when the command runs, so building the
`shardwise` parser stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardwise.runtime.checkpoint.format import CheckpointError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "convert",
        help="consolidate a checkpoint into safetensors (or a Hugging Face folder)",
        description="Convert a sharded shardwise checkpoint into consolidated safetensors "
        "(fp32 or bf16, sharded by size) or a folder transformers' from_pretrained loads; with "
        "--from-deepspeed, a DeepSpeed checkpoint into a shardwise checkpoint that resumes exactly.",
    )
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint (holds 'latest')")
    parser.add_argument("output", help="output directory, or a .safetensors file path")
    parser.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="default fp32")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="split output files at this size, e.g. 5GB, 500MB (default 5GB)")
    parser.add_argument("--hf", action="store_true",
                        help="write a folder transformers' from_pretrained loads (config.json + weights)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier conversion at the output (default: refuse)")
    parser.add_argument("--from-deepspeed", action="store_true",
                        help="CHECKPOINT_DIR is DeepSpeed's (latest + tag folder, or a Trainer's checkpoint-N): write "
                        "it as a shardwise checkpoint under OUTPUT, optimizer state and counters included")
    parser.add_argument("--to-deepspeed", action="store_true",
                        help="write the shardwise checkpoint as DeepSpeed's ZeRO-1/2/3 or pipeline folder under "
                        "OUTPUT, which DeepSpeed's load_checkpoint resumes (needs --world-size)")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="with --to-deepspeed: the DeepSpeed run's data-parallel size (DeepSpeed resumes ZeRO "
                        "files only at the size that wrote them)")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3],
                        help="with --to-deepspeed: the DeepSpeed run's ZeRO stage (default 2, which stage 1 reads "
                        "too; a pipeline: 1)")
    parser.add_argument("--pipeline-parts", metavar="L0,L1,...,N",
                        help="with --to-deepspeed, for a PipelineModule's checkpoint: the DeepSpeed run's "
                        "PipelineModule.parts, the first layer of each stage then the layer count (e.g. 0,4,8)")
    parser.add_argument("--sub-group-size", type=int, metavar="N",
                        help="with --to-deepspeed --zero-stage 3: the DeepSpeed run's zero_optimization."
                        "sub_group_size (default DeepSpeed's, 1e9; 0: one parameter per sub-group)")
    parser.add_argument("--optimizer", metavar="CLASS",
                        help="with --from-deepspeed: the torch optimizer class the run trains with (AdamW, ...), "
                        "needed when the DeepSpeed config has no optimizer block")
    parser.add_argument("--trust-pickles", action="store_true",
                        help="with --from-deepspeed: read files holding types DeepSpeed does not write (this runs "
                        "code from the files: only for files you trust)")
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    if args.from_deepspeed and args.to_deepspeed:
        print("shardwise convert: error: give one of --from-deepspeed and --to-deepspeed", file=sys.stderr)
        return 2
    if args.from_deepspeed:
        return _from_deepspeed(args)
    if args.to_deepspeed:
        return _to_deepspeed(args)
    if args.optimizer or args.trust_pickles:
        print("shardwise convert: error: --optimizer and --trust-pickles go with --from-deepspeed", file=sys.stderr)
        return 2
    from shardwise.runtime.checkpoint.convert import convert_checkpoint

    try:
        written = convert_checkpoint(
            args.checkpoint_dir, args.output, tag=args.tag, dtype=args.dtype,
            max_shard_size=args.max_shard_size, hf=args.hf, overwrite=args.overwrite,
        )
    except (CheckpointError, ValueError) as error:
        print(f"shardwise convert: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


def _from_deepspeed(args: argparse.Namespace) -> int:
    from shardwise.frontends.deepspeed.checkpoints.convert import convert_from_deepspeed

    if args.hf or args.dtype != "fp32":
        print("shardwise convert: error: --from-deepspeed writes a shardwise checkpoint (fp32 masters and optimizer "
              "state); convert that one again for safetensors or a Hugging Face folder", file=sys.stderr)
        return 2
    try:
        written = convert_from_deepspeed(args.checkpoint_dir, args.output, tag=args.tag, optimizer=args.optimizer,
                                         trusted=args.trust_pickles)
    except (CheckpointError, ValueError) as error:
        print(f"shardwise convert: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written} (a shardwise checkpoint; load it with engine.load_checkpoint({args.output!r}))")
    return 0


def _to_deepspeed(args: argparse.Namespace) -> int:
    from shardwise.frontends.deepspeed.checkpoints.to_deepspeed import SUB_GROUP_SIZE, write_deepspeed_checkpoint

    if args.world_size is None:
        print("shardwise convert: error: --to-deepspeed needs --world-size N, the data-parallel size of the DeepSpeed "
              "run that will resume it (DeepSpeed reads ZeRO files only at the size that wrote them)", file=sys.stderr)
        return 2
    try:
        parts = None if args.pipeline_parts is None else [int(part) for part in args.pipeline_parts.split(",")]
    except ValueError:
        print(f"shardwise convert: error: --pipeline-parts {args.pipeline_parts!r}: give comma-separated layer "
              "indices, e.g. 0,4,8", file=sys.stderr)
        return 2
    stage = args.zero_stage if args.zero_stage is not None else 1 if parts is not None else 2
    try:
        sub_group_size = SUB_GROUP_SIZE if args.sub_group_size is None else args.sub_group_size
        written = write_deepspeed_checkpoint(args.checkpoint_dir, args.output, world_size=args.world_size,
                                             stage=stage, tag=args.tag, pipeline_parts=parts,
                                             sub_group_size=sub_group_size)
    except (CheckpointError, ValueError) as error:
        print(f"shardwise convert: error: {error}", file=sys.stderr)
        return 2
    layout = f"pipeline of {len(parts) - 1} stages, ZeRO-{stage}" if parts is not None else f"ZeRO-{stage}"
    print(f"wrote {written} (DeepSpeed's {layout} layout for {args.world_size} ranks; resume it with "
          f"engine.load_checkpoint({args.output!r}) under DeepSpeed)")
    return 0
