"""`deepspeed.runtime.zero.stage_1_and_2`: the ZeRO-1/2 optimizer class scripts test
`engine.optimizer` against, and DeepSpeed's ZeRO-2 model-state memory estimators, which
scripts and Hugging Face's DeepSpeed guide call before choosing a setup.

The estimators return and print what DeepSpeed 0.19.8's do (the same arithmetic, the same
table). They are DeepSpeed's estimate, not shardwise's: DeepSpeed counts 18 bytes per
parameter in the optimizer's partition (16-bit and fp32 gradients, fp32 master, Adam's two
states) where shardwise holds 14 (it keeps no fp32 gradient partition), and multiplies the
host side by a safety factor; docs/deepspeed.md#memory-estimators says where the two agree.
`shardwise plan` (docs/formulas.md#model-states-per-rank) is shardwise's own estimate.
"""

from __future__ import annotations

from torch import nn

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import ZeROOptimizer
from shardwise.frontends.deepspeed.api.runtime.zero.config import OffloadDeviceEnum

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live",
           "model_to_params"]

GIB = 2**30


class DeepSpeedZeroOptimizer(ZeROOptimizer):
    """DeepSpeed's ZeRO stage 1 and 2 optimizer. shardwise's optimizer is never this class;
    `deepspeed.initialize` marks it as one exactly where DeepSpeed's engine would build one
    (base_optimizer.py), so `isinstance(engine.optimizer, DeepSpeedZeroOptimizer)` answers
    as under DeepSpeed."""


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(bytes per node's host memory, bytes per GPU) DeepSpeed estimates for ZeRO-2 with
    Adam in mixed precision: on the GPU the 16-bit parameters (2 bytes each) plus, without
    offload, 18 bytes per parameter of the rank's partition; on the host, with the
    optimizer offloaded, 16 bytes per parameter (at least 4 per GPU of the node), and
    without it 4 bytes per parameter per GPU (loading the fp32 checkpoint), both times
    `additional_buffer_factor`."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def model_to_params(model: nn.Module) -> int:
    """The model's parameter count, a tensor shared between modules counted once."""
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 estimates for `model` (its parameters counted); returns None, as DeepSpeed's."""
    estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model), num_gpus_per_node=num_gpus_per_node,
                                                   num_nodes=num_nodes,
                                                   additional_buffer_factor=additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's table of ZeRO-2 estimates (with and without the optimizer
    offloaded) for a model of `total_params`; returns None, as DeepSpeed's."""
    print(setup_header(total_params, None, num_gpus_per_node, num_nodes))
    print(TABLE_HEADER)
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes, cpu_offload=cpu_offload,
            additional_buffer_factor=additional_buffer_factor)
        print(table_row(cpu_mem, gpu_mem, f"offload_optimizer={offload_name(cpu_offload)}"))


TABLE_HEADER = "  per CPU  |  per GPU |   Options"


def offload_name(offloaded: bool) -> str:
    """The device as DeepSpeed's table names it: the enum member formatted as DeepSpeed
    formats it (on Python 3.11+ that prints `OffloadDeviceEnum.cpu`), or `none`."""
    return f"{OffloadDeviceEnum.cpu:4}" if offloaded else "none"


def setup_header(total_params: int, largest_layer_params: int | None, num_gpus_per_node: int,
                 num_nodes: int) -> str:
    """The three lines above DeepSpeed's table; the largest layer only for ZeRO-3."""
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        model += f", {int(largest_layer_params / 1e6)}M largest layer params"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {'nodes' if num_nodes > 1 else 'node'}, {num_gpus_per_node} "
            f"{'GPUs' if num_gpus_per_node > 1 else 'GPU'} per node.\n{model}.")


def table_row(cpu_mem: int, gpu_mem: int, options: str) -> str:
    return f" {cpu_mem / GIB:7.2f}GB | {gpu_mem / GIB:6.2f}GB | {options}"
