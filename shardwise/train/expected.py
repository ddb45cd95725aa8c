"""What SPEC §4 predicts for a run: model-state bytes per rank and collective bytes per step.

The report and the stage-comparison figure put these beside the engine's measured
numbers. Plain arithmetic over the planner's formulas, no torch, so the parent process
(which draws the report) and the ranks (which write the numbers) share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.formulas import element_bytes, model_state_bytes, optimizer_state_bytes_for

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
MODEL_STATES = ("params", "grads", "optimizer_states")
# Optimizer types of the config, by the planner's name for their state layout.
PLANNER_OPTIMIZER = {"Adam": "adam", "AdamW": "adam", "SGD": "sgd"}


@dataclass(frozen=True)
class RunShape:
    """The quantities the formulas need. `dtype` is the compute dtype of parameters and
    gradients; `comm_dtype` the dtype gradients are reduced in; `persistent_params` the
    stage-3 parameters kept whole on every rank; `optimizer_state_bytes` is K;
    `accumulation_steps` the micro-batches per optimizer step."""

    num_params: int
    world_size: int
    stage: int
    dtype: str
    comm_dtype: str
    optimizer_state_bytes: int
    persistent_params: int = 0
    accumulation_steps: int = 1


def optimizer_state_bytes(optimizer_type: str, dtype: str, momentum: float = 0.0) -> int:
    """K for a config optimizer: Adam's 8 (+4 master when 16-bit); SGD keeps a momentum
    buffer only when momentum is on."""
    if optimizer_type not in PLANNER_OPTIMIZER:
        raise ValueError(f"no state formula for optimizer {optimizer_type!r}; known: {sorted(PLANNER_OPTIMIZER)}")
    k = optimizer_state_bytes_for(PLANNER_OPTIMIZER[optimizer_type], dtype)
    if optimizer_type == "SGD" and momentum == 0.0:
        k -= 4  # torch's SGD allocates no momentum buffer
    return k


def expected_memory(shape: RunShape) -> dict[str, int]:
    """Model-state bytes per rank by category (SPEC §4 table)."""
    return model_state_bytes(
        shape.num_params,
        shape.world_size,
        shape.stage,
        shape.dtype,
        shape.optimizer_state_bytes,
        shape.persistent_params if shape.stage == 3 else 0,
    )


def ring_share(num_elements: int, bytes_per_element: int, world_size: int) -> int:
    """Bytes one rank sends to all-gather or reduce-scatter `num_elements` in a ring."""
    return num_elements * bytes_per_element * (world_size - 1) // world_size


def expected_comm(shape: RunShape) -> dict[str, int]:
    """Collective bytes per rank per optimizer step (SPEC §4).

    Stage 0 all-reduces gradients (2Ψb(N−1)/N); stages 1-2 reduce-scatter them and
    all-gather the updated parameters (Ψb(N−1)/N each); stage 3 gathers each parameter in
    forward and again in backward, except persistent ones, which are gathered once after
    the update like stage 2. Gradients travel in `comm_dtype`, parameters in `dtype`.
    With accumulation, stages 0-1 reduce once at the boundary, while stages 2-3 hold only
    a gradient partition and so reduce-scatter every micro-batch, and stage 3 gathers
    every micro-batch.
    """
    psi, n, micro = shape.num_params, shape.world_size, shape.accumulation_steps
    grad_bytes, param_bytes = element_bytes(shape.comm_dtype), element_bytes(shape.dtype)
    volume = dict.fromkeys(COLLECTIVES, 0)
    if shape.stage == 0:
        volume["all_reduce"] = 2 * ring_share(psi, grad_bytes, n)
        return volume
    reductions = 1 if shape.stage == 1 else micro
    volume["reduce_scatter"] = reductions * ring_share(psi, grad_bytes, n)
    if shape.stage < 3:
        volume["all_gather"] = ring_share(psi, param_bytes, n)
        return volume
    persistent = shape.persistent_params
    volume["all_gather"] = micro * 2 * ring_share(psi - persistent, param_bytes, n) + ring_share(
        persistent, param_bytes, n
    )
    return volume


def memory_expressions(shape: RunShape) -> dict[str, str]:
    """The §4 term behind each memory category, e.g. "4Ψ/N" or "2Ψ/N + 2P"."""
    p, k = element_bytes(shape.dtype), shape.optimizer_state_bytes
    params = f"{p}Ψ"
    if shape.stage == 3:
        params = f"{p}(Ψ−P)/N + {p}P" if shape.persistent_params else f"{p}Ψ/N"
    return {
        "params": params,
        "grads": f"{p}Ψ/N" if shape.stage >= 2 else f"{p}Ψ",
        "optimizer_states": f"{k}Ψ/N" if shape.stage >= 1 else f"{k}Ψ",
    }


def comm_expressions(shape: RunShape) -> dict[str, str]:
    """The §4 term behind each collective's bytes per step ("" where nothing is sent);
    A is the number of micro-batches per step."""
    g, p = element_bytes(shape.comm_dtype), element_bytes(shape.dtype)
    ring = "(N−1)/N"
    if shape.stage == 0:
        return {"all_reduce": f"2·{g}Ψ{ring}", "all_gather": "", "reduce_scatter": ""}
    per_micro = "A·" if shape.accumulation_steps > 1 else ""
    reduce = f"{per_micro if shape.stage >= 2 else ''}{g}Ψ{ring}"
    gather = f"{p}Ψ{ring}"
    if shape.stage == 3:
        gather = f"({per_micro}2(Ψ−P) + P)·{p}{ring}" if shape.persistent_params else f"{per_micro}2·{p}Ψ{ring}"
    return {"all_reduce": "", "all_gather": gather, "reduce_scatter": reduce}
