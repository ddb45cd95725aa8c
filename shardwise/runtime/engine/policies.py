"""Every policy an engine is built from, in one frozen bundle.

The runtime knows no JSON: a front end (the DeepSpeed config's,
frontends/deepspeed/config/policies.py) or a user in Python (`shardwise.build_engine`)
fills these, and the engine, the mesh and each model family's `parallelize` read them.

    Policies(zero=ZeroPolicy(stage=3), precision=PrecisionPolicy(torch.bfloat16),
             tensor=TensorPolicy(size=2), activation=ActivationPolicy(RecomputePolicy("selective")))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from shardwise.runtime.activation.policy import ActivationPolicy
from shardwise.runtime.checkpoint.policy import CheckpointPolicy
from shardwise.runtime.compile.policy import CompilePolicy
from shardwise.runtime.data.policy import DataSamplingPolicy
from shardwise.runtime.data.random_ltd import RandomLTDPolicy
from shardwise.runtime.distributed.topology import TopologyPolicy
from shardwise.runtime.engine.trial import TrialPolicy
from shardwise.runtime.ops.policy import KernelPolicy
from shardwise.runtime.parallel.expert.policy import ExpertPolicy
from shardwise.runtime.parallel.pipeline.policy import PipelinePolicy
from shardwise.runtime.parallel.sequence.policy import SequencePolicy
from shardwise.runtime.parallel.tensor.policy import TensorPolicy
from shardwise.runtime.precision.policy import PrecisionPolicy
from shardwise.runtime.zero.policy import ZeroPolicy


@dataclass(frozen=True)
class OptimizerPolicy:
    """An optimizer by its registered name (runtime/optim/registry.py) and its arguments;
    the engine builds it over the rank's partitions. A torch optimizer passed to the
    engine instead is re-pointed at them."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerPolicy:
    """A learning-rate schedule by name (runtime/optim/schedulers.py), stepped after each update."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingPolicy:
    """The step: micro-batches per update, clipping, how many non-finite steps in a row
    loss scaling may not explain before training stops (runtime/reliability/step_guard.py),
    and every how many steps replicas compare their weights (runtime/reliability/
    replica_check.py; 0: never)."""

    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0  # max global norm; 0: no clipping
    max_consecutive_skipped_steps: int = 3
    replica_check_interval: int = 0
    # each step() ends the accumulation window, however many backward passes it holds
    # (DeepSpeed's managed_gradient_accumulation false): the caller owns the boundary
    caller_ends_windows: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError(f"micro_batch_size and gradient_accumulation_steps must be at least 1, got "
                             f"{self.micro_batch_size} and {self.gradient_accumulation_steps}")
        if self.replica_check_interval < 0:
            raise ValueError(f"replica_check_interval must be >= 0 (0: no check), got {self.replica_check_interval}")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0 (0: no clipping), got {self.gradient_clipping}")


@dataclass(frozen=True)
class Policies:
    zero: ZeroPolicy = field(default_factory=ZeroPolicy)
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    training: TrainingPolicy = field(default_factory=TrainingPolicy)
    tensor: TensorPolicy = field(default_factory=TensorPolicy)
    sequence: SequencePolicy = field(default_factory=SequencePolicy)
    pipeline: PipelinePolicy = field(default_factory=PipelinePolicy)
    expert: ExpertPolicy = field(default_factory=ExpertPolicy)
    activation: ActivationPolicy = field(default_factory=ActivationPolicy)
    compile: CompilePolicy = field(default_factory=CompilePolicy)
    kernels: KernelPolicy = field(default_factory=KernelPolicy)
    topology: TopologyPolicy = field(default_factory=TopologyPolicy)
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    optimizer: OptimizerPolicy | None = None
    scheduler: SchedulerPolicy | None = None
    data_sampling: DataSamplingPolicy | None = None  # curriculum sampling of the loader a front end builds
    random_ltd: RandomLTDPolicy | None = None  # data efficiency's random layer-wise token dropping
    trial: TrialPolicy | None = None  # an autotuning trial: measure steps, write metrics, exit (trial.py)

    def __post_init__(self) -> None:
        if self.zero.partitions_parameters and self.compile.cuda_graph_settings():
            raise ValueError(
                f"compile {', '.join(self.compile.cuda_graph_settings())} uses CUDA graphs, which ZeRO stage 3 "
                "cannot run: a graph replays kernels on the addresses it captured, and stage 3 frees each "
                "module's parameters after use and gathers them into new storage; use mode "
                "'max-autotune-no-cudagraphs' or 'default', or ZeRO stage 2 or lower")
