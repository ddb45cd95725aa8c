"""`--compare-stages`: the ZeRO paper's memory figure, measured rather than computed.

The same model (same seed, same batches) is trained for a few steps at each stage 0-3;
after each, the rank's model-state bytes by category and the bytes it sent in the last
step are recorded beside the formulas (docs/formulas.md#model-states-per-rank). Stage 3 runs with no persistent
parameters and no reuse window (`stage3_param_persistence_threshold` and
`stage3_max_reuse_distance` 0), the setting in which the formula's 3Ψ·b(N−1)/N holds, so the
figure shows the formulas themselves rather than their tuned variants.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from rich.console import Console

import shardwise
from shardwise.formulas.stages import STAGES, partitions_parameters
from shardwise.tools.profiling import StepTimer
from shardwise.tools.train.expected import RunShape, expected_comm, expected_memory
from shardwise.tools.train.loop import mean_over_ranks, train_step
from shardwise.tools.train.options import TrainOptions
from shardwise.tools.train.run_files import COMPARISON_FILE
from shardwise.tools.train.setup import ModelFacts, build_model, run_shape, samplers
from shardwise.tools.train.stopping import StopRequest

STAGE3_EXACT = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


@dataclass(frozen=True)
class StageMeasurement:
    rank: int
    shape: RunShape
    facts: ModelFacts
    loss: float
    step_seconds: float
    memory: dict[str, int]
    comm_per_step: dict[str, int]
    padding_elements: int

    def as_entry(self) -> dict[str, Any]:
        """The stage's entry in zero_stages.json: measured beside formula."""
        return {
            "stage": self.shape.stage,
            "loss": self.loss,
            "step_seconds": self.step_seconds,
            "memory": {"measured": self.memory, "formula": expected_memory(self.shape)},
            "comm_per_step": {"measured": self.comm_per_step, "formula": expected_comm(self.shape)},
            "padding_elements": self.padding_elements,
            "persistent_params": self.shape.persistent_params,
        }


def stage_config(config: dict[str, Any], stage: int) -> dict[str, Any]:
    config = copy.deepcopy(config)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = stage
    if partitions_parameters(stage):
        zero.update(STAGE3_EXACT)
    return config


def measure_stage(options: TrainOptions, stage: int, stop: StopRequest) -> StageMeasurement | None:
    """Train `options.steps` steps at `stage` and measure the last one; None when the
    ranks agreed to stop early (there is nothing to checkpoint in a comparison)."""
    model, facts = build_model(options)
    engine = shardwise.initialize(model, stage_config(options.config, stage))
    train_sampler, _ = samplers(options, engine.config.train_batch_size)
    timer = StepTimer(engine.comm_stats, engine.device)
    for step in range(options.steps):
        local_loss, times, comm = train_step(engine, train_sampler, step, timer)
        if stop.agreed(engine):
            engine.destroy()
            return None
    measurement = StageMeasurement(
        rank=engine.rank,
        shape=run_shape(engine, facts.num_params),
        facts=facts,
        loss=mean_over_ranks(engine, local_loss),
        step_seconds=times.step,
        memory=engine.memory_breakdown(),
        comm_per_step=comm,
        padding_elements=engine.padding_elements(),
    )
    engine.destroy()
    return measurement


def compare_stages(options: TrainOptions, stop: StopRequest) -> int:
    """Measure every stage and (rank 0) write zero_stages.json; 0 when done, else the
    signal that stopped the comparison early."""
    if options.steps < 1:
        raise ValueError(f"--compare-stages needs at least 1 step per stage, got {options.steps}")
    console = Console()
    measurements = []
    for stage in STAGES:
        measured = measure_stage(options, stage, stop)
        if measured is None:
            return stop.signum
        measurements.append(measured)
        if measured.rank == 0:
            console.print(
                f"stage {stage}: {options.steps} step(s), loss {measured.loss:.3f}, "
                f"{measured.step_seconds:.2f} s/step",
                highlight=False,
                soft_wrap=True,
            )
    first = measurements[0]
    if first.rank == 0:
        comparison = {
            "model_size": options.model_size,
            "seq_len": options.seq_len,
            "steps_per_stage": options.steps,
            "num_params": first.facts.num_params,
            "tied_params": first.facts.tied_params,
            "world_size": first.shape.world_size,
            "dtype": first.shape.dtype,
            "comm_dtype": first.shape.comm_dtype,
            "optimizer_state_bytes": first.shape.optimizer_state_bytes,
            "stages": [measured.as_entry() for measured in measurements],
        }
        (options.path / COMPARISON_FILE).write_text(json.dumps(comparison, indent=2) + "\n")
    return 0
