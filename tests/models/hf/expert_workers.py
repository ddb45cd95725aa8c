"""Training runs for the Mixtral expert-parallel tests: one call per rank, and the
single-process reference on the same global batches.

A tiny random Mixtral (4 experts, 2 per token, the router's auxiliary loss added with
coefficient 0.1), seeded alike on every rank. Each step, every data-parallel rank takes m
micro-batches of b rows of the global batch; the reference runs the same D·m
micro-batches one after another, so every micro-batch's loss (its auxiliary loss over its
own tokens included) is the same in both and the step's loss is their mean. SGD with
momentum and clipping; the experts in a param group of their own (they train apart).
Each rank returns its losses, every parameter it holds whole (gathered over the tensor
group, and the experts over the expert group; a pipeline stage's layers only) and the routed counts of every MoE layer call, for the
byte count.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.models.hf.family_workers import SMALL, train_one_process
from tests.runtime.zero.workers import global_batch

EXPERTS = 4


@dataclasses.dataclass(frozen=True)
class ExpertCase:
    expert: int = 2
    tensor: int = 1
    pipeline: int = 1
    stage: int = 0
    router_loss: bool = True  # output_router_logits (refused by pipeline stages)
    steps: int = 2
    micro_batches: int = 2
    micro_batch: int = 2
    lr: float = 0.05
    clipping: float = 0.5
    caller_ends_windows: bool = False  # managed_gradient_accumulation false: step() only after the last micro-batch

    def config(self) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.micro_batches,
            "managed_gradient_accumulation": not self.caller_ends_windows,
            "gradient_clipping": self.clipping,
            "zero_optimization": {"stage": self.stage},
            "tensor_parallel": {"size": self.tensor},
            "pipeline_parallel": {"size": self.pipeline, "schedule": "1f1b"},
            "expert_parallel": {"enabled": True, "autoep_size": self.expert},
        }


def build_mixtral(router_loss: bool = True) -> torch.nn.Module:
    import transformers

    torch.manual_seed(1234)
    config = transformers.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2, output_router_logits=router_loss,
                                        router_aux_loss_coef=0.1)
    return transformers.MixtralForCausalLM(config)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    dense = [p for name, p in model.named_parameters() if ".experts." not in name]
    groups = [{"params": [p for p in dense if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in dense if p.dim() < 2], "weight_decay": 0.0},
              {"params": experts, "weight_decay": 0.1}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def micro_batches(case: ExpertCase, step: int, data_size: int) -> list[dict]:
    """Every micro-batch of the step, data rank r's m after rank r-1's."""
    x, _ = global_batch(step, data_size * case.micro_batches * case.micro_batch)
    return [{"input_ids": ids, "labels": ids} for ids in x.split(case.micro_batch)]


def train_reference(case: ExpertCase, data_size: int) -> dict:
    """On one intra-op thread, as each rank runs: this tiny model's matmuls only slow down
    when split over threads (twenty-fold on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(case, data_size)
    finally:
        torch.set_num_threads(threads)


def _train_reference(case: ExpertCase, data_size: int) -> dict:
    model = build_mixtral(case.router_loss)
    return train_one_process(model, make_optimizer(model, case.lr),
                             [micro_batches(case, step, data_size) for step in range(case.steps)], case.clipping)


def train_parallel(rank: int, world_size: int, case: ExpertCase) -> dict:
    model = build_mixtral(case.router_loss)
    routed: list[list[int]] = []  # per MoE layer call: pairs routed to each expert by this rank
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(
            lambda _module, _args, output: routed.append(torch.bincount(output[2].reshape(-1),
                                                                        minlength=EXPERTS).tolist()))
    engine = shardwise.initialize(model, case.config(), optimizer=make_optimizer(model, case.lr))
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    losses = []
    for step in range(case.steps):
        mine = micro_batches(case, step, data_size)[data_rank * case.micro_batches:][: case.micro_batches]
        if engine.pipeline is not None:
            losses.append(engine.train_batch(data_iter=iter(mine)).item())
            continue
        total = 0.0
        for index, batch in enumerate(mine):
            loss = engine(**batch).loss
            engine.backward(loss)
            if not case.caller_ends_windows or index == len(mine) - 1:
                engine.step()
            total += loss.item() / case.micro_batches
        losses.append(total)
    tensor = Communicator(engine.mesh["tensor"])
    expert_group = engine.mesh.expert_handles(case.expert)[0]
    dense = [p for name, p in model.named_parameters() if ".experts." not in name]
    params = {}
    with shardwise.gathered_parameters(dense):
        for name, p in model.named_parameters():
            whole = gather_full(p.detach().float(), tensor_shard(p), tensor).cpu()
            if ".experts." in name and expert_group.size > 1:  # this member's experts, then the others' in order
                pieces = [torch.empty_like(whole) for _ in range(expert_group.size)]
                dist.all_gather(pieces, whole, group=expert_group.group)
                whole = torch.cat(pieces)
            params[name] = whole
    return {"losses": losses, "params": params, "routed": routed, "expert_rank": expert_group.rank,
            "data_rank": data_rank, "bytes": engine.comm_stats.by_group().get("expert", {})}


def _train_steps(engine, case: ExpertCase, steps: range) -> list[float]:
    """Per step, the mean loss of this data rank's micro-batches."""
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    losses = []
    for step in steps:
        total = 0.0
        for batch in micro_batches(case, step, data_size)[data_rank * case.micro_batches:][: case.micro_batches]:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / case.micro_batches
        losses.append(total)
    return losses


def resume_at_another_expert_size(rank: int, world_size: int, saving: ExpertCase, loading: ExpertCase,
                                  directory: str) -> list[float]:
    """`saving.steps` steps at its expert-parallel size, a checkpoint; a fresh engine at
    `loading`'s size loads it and trains on to `loading.steps`: the losses after the load."""
    model = build_mixtral(saving.router_loss)
    engine = shardwise.initialize(model, saving.config(), optimizer=make_optimizer(model, saving.lr))
    _train_steps(engine, saving, range(saving.steps))
    engine.save_checkpoint(directory)
    model = build_mixtral(loading.router_loss)
    engine = shardwise.initialize(model, loading.config(), optimizer=make_optimizer(model, loading.lr))
    engine.load_checkpoint(directory)
    return _train_steps(engine, loading, range(saving.steps, loading.steps))
