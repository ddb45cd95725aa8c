"""What the test scripts beside this file share: where they write their losses, and the
plain-PyTorch reference's view of a data-parallel job.

Every script writes, per rank, the loss of each micro-batch in order to
`<loss_file>.rank<r>.json`. Run under `shardwise run --as-deepspeed` that is the rank's
own loss; run with `--plain-torch` (one process, no shardwise), the script trains the
same model with torch alone on the same global batches, computing each simulated
rank's micro-batch loss in turn and back-propagating their mean, which is what the
data-parallel engine's averaged gradient is, and writes the same files.
"""

from __future__ import annotations

import json
import math
import os

import torch


def add_reference_arguments(parser):
    parser.add_argument("--plain-torch", action="store_true",
                        help="train with torch alone in this process (the reference)")
    parser.add_argument("--world-size", type=int, default=2, help="with --plain-torch: the ranks to simulate")
    parser.add_argument("--loss-file", default=None, help="write each rank's losses to <LOSS_FILE>.rank<r>.json")
    return parser


def write_losses(loss_file, rank, losses):
    if loss_file is not None:
        with open(f"{loss_file}.rank{rank}.json", "w") as handle:
            json.dump([float(loss) for loss in losses], handle)


def rank_of_process():
    return int(os.environ.get("RANK", "0"))


def clip_(parameters, max_norm):
    """Clipping by the global norm, as the engines do."""
    torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)


def warmup_lr(update, warmup_min_lr, warmup_max_lr, warmup_num_steps):
    """DeepSpeed's WarmupLR (log warm-up) for the update that follows `update` earlier
    ones: the schedule starts at iteration -1 and is stepped after every update."""
    iteration = update - 1
    if iteration < 0:
        gamma = 0.0
    elif iteration < warmup_num_steps:
        gamma = math.log(iteration + 1) / math.log(max(2, warmup_num_steps))
    else:
        gamma = 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
