"""Runs shared by the activation tests: a tiny GPT trained by the engine (one call per rank)
under several recomputation policies in the same processes, and single-process helpers
that measure what a model keeps for backward."""

from __future__ import annotations

import copy
import dataclasses

import torch

import shardwise
from shardwise.runtime.activation import ActivationTracker, apply_activation_checkpointing
from shardwise.models import GPT, GPTConfig

VOCAB = 64
SEQ = 16


def tiny_gpt(n_layer: int = 3, dropout: float = 0.1, n_embd: int = 32, seq: int = SEQ) -> GPT:
    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=2, n_embd=n_embd,
                         dropout=dropout, bias=False))


def batch(step: int, rows: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def engine_config(stage: int, policy: str, extra: dict | None = None) -> dict:
    block = {"policy": policy, **({"every_k": 2} if policy == "every_k" else {})}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "seed": 7,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                              "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": block,
    }
    for key, value in (extra or {}).items():
        config.setdefault(key, {}).update(value) if isinstance(value, dict) else config.__setitem__(key, value)
    return config


def train_policies(rank: int, world_size: int, stage: int, policies: list[str], steps: int = 2,
                   dropout: float = 0.1, extra: dict | None = None, early_stop: bool = True) -> dict:
    """Train the same model once per policy, one engine after the other. `early_stop`
    False makes torch's checkpoint finish every recomputation (it stops at the last tensor
    backward needs by default)."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        return {policy: _train(rank, world_size, stage, policy, steps, dropout, extra) for policy in policies}


def _train(rank: int, world_size: int, stage: int, policy: str, steps: int, dropout: float,
           extra: dict | None) -> dict:
    model = tiny_gpt(dropout=dropout)
    engine = shardwise.initialize(model, engine_config(stage, policy, extra))
    losses = []
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size  # a tensor group reads one slice
    for step in range(steps):
        x, y = batch(step, 2 * data_size)
        rows = slice(2 * data_rank, 2 * data_rank + 2)
        loss = engine(x[rows].to(engine.device), y[rows].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    schedule = getattr(engine.zero.params, "schedule", None)
    result = {
        "losses": losses,
        "params": params,
        "comm": engine.comm_volume(),
        "memory": engine.memory_breakdown(),
        "activations": engine.activations.breakdown(),
        "recomputed_layers": engine.activations.recomputed_layers,
        "recompute_gathers": getattr(schedule, "recompute_gathers", None),
    }
    engine.destroy()
    return result


def measure(model: torch.nn.Module, rows: int = 2, seq: int = SEQ, count_ops: bool = False,
            dtype: torch.dtype = torch.float32) -> tuple[float, list[torch.Tensor], ActivationTracker]:
    """One forward and backward of `model` under a tracker: loss, gradients, tracker."""
    x, y = batch(0, rows, seq)
    tracker = ActivationTracker(count_ops=count_ops)
    torch.manual_seed(99)
    with tracker.track(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(x, y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], tracker


def with_policy(model: torch.nn.Module, policy: str, **options) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    return copied if policy == "none" else apply_activation_checkpointing(copied, policy, **options)


def layer_config(**changes) -> GPTConfig:
    return dataclasses.replace(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32), **changes)


def partitioned_checkpoints(rank: int, world_size: int, policy: str, to_host: bool = False,
                            contiguous: bool = False) -> dict:
    """The same replicated model on every rank of a tensor group: checkpoints whole vs
    partitioned (Pa) over the group, and whether a layer's full input stays alive."""
    import gc
    import weakref

    from shardwise.runtime.accounting import MemoryLedger
    from shardwise.runtime.activation import CheckpointStore
    from shardwise.runtime.distributed.collectives import CommStats, Communicator
    from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
    from shardwise.runtime.distributed.setup import collective_timeout

    mesh = ParallelMesh(ParallelSizes(tensor=world_size), rank, torch.device("cpu"), collective_timeout())
    stats = CommStats()
    store = CheckpointStore(Communicator(mesh["tensor"], stats), to_host=to_host, contiguous=contiguous)
    model = tiny_gpt(n_layer=3, dropout=0.1)
    results = {}
    for name, options in (("none", None), ("whole", {}), ("partitioned", {"store": store})):
        checkpointed = with_policy(model, "none" if options is None else policy, **(options or {}))
        inputs = []
        checkpointed.blocks[2].register_forward_pre_hook(  # a region starts there in every policy
            lambda module, args: inputs.append(weakref.ref(args[0].untyped_storage())))  # the memory, not the tensor
        x, y = batch(0, 2)
        ledger = MemoryLedger()
        tracker = ActivationTracker(ledger)
        torch.manual_seed(99)
        with tracker.track():
            loss = checkpointed(x, y)
        gc.collect()
        alive = inputs[0]() is not None
        loss.backward()
        results[name] = {"loss": loss.item(), "grads": [p.grad.clone() for p in checkpointed.parameters()],
                         "activations": tracker.breakdown(), "input_alive": alive,
                         "tiers": ledger.breakdown_by_tier()}
    results["all_gather"] = stats.totals()["all_gather"]
    results["arena"] = {device.type: (arena.allocations, arena.overflows) for device, arena in store.arenas.items()}
    return results


def buffers_after_training(rank: int, world_size: int, stage: int, layers: int, dtype: str = "fp32",
                           policy: str = "full", reuse_distance: int = 0, extra: dict | None = None) -> dict:
    """memory_breakdown() and activation peaks of a short run with every transient-buffer
    size fixed (Cb); `extra` is merged into the config (offload, tensor parallelism)."""
    model = tiny_gpt(n_layer=layers, dropout=0.0)
    size = 4096
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": size, "allgather_bucket_size": size,
                              "stage3_prefetch_bucket_size": size, "stage3_max_live_parameters": 5 * size,
                              "stage3_param_persistence_threshold": 0, "sub_group_size": size,
                              "stage3_max_reuse_distance": reuse_distance},
        "activation_checkpointing": {"policy": policy},
    }
    for key, value in (extra or {}).items():
        config.setdefault(key, {}).update(value)
    engine = shardwise.initialize(model, config)
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size  # a tensor group reads one slice
    for step in range(2):
        x, y = batch(step, 2 * data_size)
        loss = engine(x[2 * data_rank : 2 * data_rank + 2], y[2 * data_rank : 2 * data_rank + 2])
        engine.backward(loss)
        engine.step()
    return {"memory": engine.memory_breakdown(), "numel": engine.num_parameters(),
            "activations": engine.activations.breakdown()}
