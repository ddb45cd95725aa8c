"""What each ZeRO stage partitions, asked by name (docs/formulas.md#model-states-per-rank).

ZeRO (Rajbhandari et al., 2020) removes the data-parallel redundancy one model state at a
time, and each stage keeps what the stages below it partition:

    stage   optimizer states   gradients   16-bit parameters
    0       whole              whole       whole     (plain data parallelism)
    1       1/N                whole       whole
    2       1/N                1/N         whole
    3       1/N                1/N         1/N

This is the one place where a stage number is compared. The formulas, the planner, the
training tool's report and the runtime's `ZeroPolicy` ask the question they mean (are the
gradients partitioned? is the full gradient buffer kept?), so what a stage does is written
once, here, and a reader of the callers need not decode `stage >= 2`.
"""

from __future__ import annotations

STAGES = (0, 1, 2, 3)


def check_stage(stage: int) -> int:
    """`stage`, once it is known to be one of ZeRO's stages (a clear error otherwise: every
    question below would silently answer for a stage that does not exist)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return stage


def partitions_optimizer(stage: int) -> bool:
    """Stages 1-3: each rank keeps 1/N of the optimizer states (KΨ/N), the first state ZeRO
    partitions. Stage 0 partitions nothing: every rank holds every state."""
    return check_stage(stage) >= 1


def partitions_gradients(stage: int) -> bool:
    """Stages 2-3: each rank keeps only its 1/N partition of the gradients (2Ψ/N)."""
    return check_stage(stage) >= 2


def partitions_parameters(stage: int) -> bool:
    """Stage 3: each rank stores 1/N of the 16-bit parameters and gathers them on use, in
    forward and again in backward."""
    return check_stage(stage) >= 3


def keeps_full_gradients(stage: int) -> bool:
    """Stages 0-1 accumulate the whole model's gradient and reduce it once, at the
    accumulation boundary; stages 2-3 keep only their partition, so they reduce every
    micro-batch."""
    return not partitions_gradients(stage)


def gathers_updated_parameters(stage: int) -> bool:
    """Stages 1-2: each rank updates only its partition of the parameters and all-gathers
    the updated 16-bit parameters after the step. Stage 0 updates every parameter itself;
    stage 3 keeps them partitioned and gathers them on use instead."""
    return partitions_optimizer(stage) and not partitions_parameters(stage)
