"""`deepspeed.runtime.zero.stage3`: the ZeRO-3 optimizer class scripts test
`engine.optimizer` against (Hugging Face and Lightning do, to know whether the weights are
partitioned), and DeepSpeed's ZeRO-3 model-state memory estimators.

The estimators return and print what DeepSpeed 0.19.8's do. They are DeepSpeed's
estimate, not shardwise's (stage_1_and_2.py's docstring; docs/deepspeed.md#memory-estimators).
"""

from __future__ import annotations

from torch import nn

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import ZeROOptimizer
from shardwise.frontends.deepspeed.api.runtime.zero.stage_1_and_2 import (TABLE_HEADER, offload_name,
                                                                           setup_header, table_row)

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "model_to_params"]


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's ZeRO stage 3 optimizer. shardwise's optimizer is never this class;
    `deepspeed.initialize` marks it as one at stage 3 (base_optimizer.py), so
    `isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)` answers as under DeepSpeed."""


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(bytes per node's host memory, bytes per GPU, bytes of the largest layer in fp32)
    DeepSpeed estimates for ZeRO-3 with Adam in mixed precision. The GPU always holds the
    largest layer gathered (4 bytes a parameter), plus 2 bytes a parameter of the rank's
    partition with only the optimizer offloaded, or 18 with nothing offloaded. The host
    holds 18 (parameters offloaded too) or 16 bytes a parameter per node with the optimizer
    offloaded; without `zero_init` each GPU first loads the whole model in fp32 (4 bytes a
    parameter per GPU) when that is more; with neither offloaded only that load (or, with
    `zero_init`, the largest layer per GPU). The host side is times `additional_buffer_factor`."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        host_bytes = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:  # the products in DeepSpeed's order: int() of the float must land alike
            cpu_mem = total_params * host_bytes * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, host_bytes * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu_mem = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(parameters, a tensor shared between modules counted once; the most parameters one
    module holds itself, its submodules' not counted)."""
    total_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest_layer_params = max((sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()),
                               default=0)
    return total_params, largest_layer_params


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 estimates for `model` (its parameters counted); returns None, as DeepSpeed's."""
    total_params, largest_layer_params = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                   num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
                                                   additional_buffer_factor=additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's table of ZeRO-3 estimates (parameters and optimizer offloaded,
    the optimizer only, nothing; each with and without `zero.Init`); returns None, as DeepSpeed's."""
    print(setup_header(total_params, largest_layer_params, num_gpus_per_node, num_nodes))
    print(TABLE_HEADER)
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
                cpu_offload=cpu_offload, cpu_offload_params=cpu_offload_params, zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor)
            options = (f"offload_param={offload_name(cpu_offload_params)}, "
                       f"offload_optimizer={offload_name(cpu_offload)}, zero_init={int(zero_init)}")
            print(table_row(cpu_mem, gpu_mem, options))
