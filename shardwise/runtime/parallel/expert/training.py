"""Training the experts of expert-parallel layers beside ZeRO's dense parameters.

With expert-parallel size P over D data-parallel ranks, a rank holds 1/P of each layer's
experts, and the D/P ranks at its place in every expert group (the expert-data group)
hold the same ones. Its experts' gradients already carry every token of its expert group
(the all-to-all's backward brought them home), so summing them over the expert-data
group gives the sum over all D ranks, and dividing by D gives the gradient of the mean
of the ranks' losses: what ZeRO gives the dense parameters, which it reduces over the
data-parallel ranks as always. Summing an expert's gradient with the dense ones over
all D ranks would mix different experts that sit in the same place on different ranks,
so the experts stay out of ZeRO's flat buffers: each rank keeps its experts whole (they
are already 1/P of the experts, at any ZeRO stage, stage 3 included) and steps them with
an optimizer of its own, built from the caller's expert param groups.

The global gradient norm counts each expert once: a rank adds its experts' squares
divided by the D/P ranks holding copies of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.distributed.peers import PeerDirectory
from shardwise.runtime.parallel.expert.marking import ExpertParallelLayer, expert_parallel_size

BuildOptimizer = Callable[[list[dict]], torch.optim.Optimizer]


class ExpertTraining:
    """The experts' gradients, norm and update; the engine calls it beside ZeRO's."""

    def __init__(self, params: list[tuple[str, nn.Parameter, int]], optimizer: torch.optim.Optimizer,
                 expert_data: dict[int, Communicator], *, data_size: int):
        """`params`: (name, parameter, expert-parallel size); `expert_data`: the
        expert-data communicator for each size; `data_size`: D."""
        self.params = params
        self.optimizer = optimizer
        self.expert_data = expert_data
        self.data_size = data_size

    @staticmethod
    def split_optimizer(optimizer: torch.optim.Optimizer, experts: set[int]) -> tuple[list[dict], dict[int, int]]:
        """Take the param groups holding experts out of `optimizer` (in place): (the expert
        groups, old dense group index -> new). A group mixing experts and dense parameters
        cannot be split in two and keep one set of hyper-parameters, so it is refused."""
        expert_groups, kept, index = [], [], {}
        for position, group in enumerate(optimizer.param_groups):
            held = [id(param) in experts for param in group["params"]]
            if any(held) and not all(held):
                raise ValueError("an optimizer param group holds both expert and dense parameters; with ep_size > 1 "
                                 "the experts train apart: put them in groups of their own "
                                 "(split_params_into_different_moe_groups_for_optimizer)")
            if held and all(held):
                expert_groups.append(group)
            else:
                index[position] = len(kept)
                kept.append(group)
        optimizer.param_groups[:] = kept
        return expert_groups, index

    def reduce_gradients(self) -> None:
        """Sum each expert's gradient over its expert-data group and divide by D."""
        for _, param, size in self.params:
            if param.grad is None:  # an expert no token reached on any rank of its group still steps (weight decay)
                param.grad = torch.zeros_like(param)
        for size, comm in self.expert_data.items():
            grads = [param.grad for _, param, each in self.params if each == size]
            flat = torch.cat([grad.reshape(-1).float() for grad in grads])
            comm.all_reduce(flat, f"expert gradients (ep_size {size})").wait()
            flat.div_(self.data_size)
            for grad, piece in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(piece.view_as(grad))

    def norm_squared_share(self, replicate_size: int) -> torch.Tensor:
        """This rank's part of the squared gradient norm, in the step guard's units (it
        divides every rank's share by `replicate_size` and sums over the D ranks)."""
        total = torch.zeros((), dtype=torch.float32)
        for _, param, size in self.params:
            copies = self.data_size // size
            total += torch.linalg.vector_norm(param.grad, dtype=torch.float32).cpu().square() / copies
        return total * replicate_size

    def step(self, grad_scale: float) -> None:
        if grad_scale != 1.0:
            for _, param, _ in self.params:
                param.grad.mul_(grad_scale)
        self.optimizer.step()

    def zero_grads(self) -> None:
        for _, param, _ in self.params:
            param.grad = None


def expert_parameters(named: list[tuple[str, nn.Parameter, int]]) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, expert-parallel size) of the marked parameters split over > 1 rank."""
    return [(name, param, size) for name, param, _ in named
            if (size := expert_parallel_size(param)) is not None and size > 1]


def connect_expert_layers(model: nn.Module, mesh: ParallelMesh, stats: CommStats, ledger: MemoryLedger,
                          peers: PeerDirectory | None) -> bool:
    """Give every expert-parallel layer of `model` its expert group (created on the mesh
    once per size, in module order, alike on every rank); whether there was one."""
    layers = [module for module in model.modules()
              if isinstance(module, ExpertParallelLayer) and module.expert_parallel_size > 1]
    for layer in layers:
        expert, _ = mesh.expert_handles(layer.expert_parallel_size)
        layer.use_expert_groups(Communicator(expert, stats, ledger, peers))
    return bool(layers)
