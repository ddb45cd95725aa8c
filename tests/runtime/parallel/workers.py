"""Training runs for the tensor/sequence-parallel tests: one call per rank, compared with
the single-process reference of tests/runtime/zero/workers.py on the same global batch.

Ranks of one tensor (or sequence) group read the same rows: the global batch is split
over the data-parallel ranks only (`engine.mesh.data_rank` of `engine.mesh.data_size`).
Final weights are gathered over ZeRO's shards (gathered_parameters) and then over the
tensor group (gather_full), so they compare with the reference's full tensors.

The optimizer is SGD with momentum and gradient clipping rather than Adam: Adam divides
each update by the gradient's own size, so (a) a wrong gradient norm, which only scales
every gradient, would go unseen, and (b) entries whose true gradient is near zero turn the
last-bit differences of split matrix products (row-parallel partial sums) into updates of
size lr. SGD's update is linear in the clipped gradient, so both stay visible and exact.
"""

from __future__ import annotations

import torch

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.runtime.zero.workers import SEQ_LEN, VOCAB, Case, global_batch, model_loss
from tests.runtime.zero.workers import build_model as build_zero_model


def parallel_case(stage: int = 1, tensor: int = 1, sequence: int = 1, megatron_sp: bool = False,
                  model: str = "gpt", steps: int = 3, managed_accumulation: bool = True, **options) -> Case:
    extra = {"tensor_parallel": {"size": tensor, "sequence_parallel": megatron_sp},
             "sequence_parallel": {"size": sequence, "mode": "ulysses"}}
    if not managed_accumulation:  # every step() ends the window (DeepSpeed's managed_gradient_accumulation false),
        extra["managed_gradient_accumulation"] = False  # which stages 0-1 reduce in step(): nothing to overlap
        extra["zero_optimization"] = {"overlap_comm": False}
    options.setdefault("lr", 0.05)
    return Case(stage=stage, model=model, steps=steps, extra_config=extra, **options)


def build_model(kind: str) -> torch.nn.Module:
    """The ZeRO tests' models, plus tiny Qwen2 (q/k/v biases) and Mistral, GQA 4/2 heads."""
    if kind not in ("qwen2", "mistral"):
        return build_zero_model(kind)
    import transformers

    torch.manual_seed(1234)
    name = {"qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=kind == "qwen2")
    return getattr(transformers, f"{name}ForCausalLM")(config)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Two param groups (decay / no decay), as real training scripts build them."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def train_reference(case: Case, data_size: int) -> dict:
    """Plain PyTorch, one process: the whole global batch of `data_size` ranks per step."""
    model = build_model(case.model)
    optimizer = make_optimizer(model, case.lr)
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, data_size * case.accumulation * case.micro_batch)
        loss = model_loss(model, case.model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def train_parallel(rank: int, world_size: int, case: Case) -> dict:
    """Train `case` on this rank; losses averaged over data-parallel ranks, full weights."""
    model = build_model(case.model)
    config = case.config(world_size)
    engine = shardwise.initialize(model, config, optimizer=make_optimizer(model, case.lr))
    # managed_gradient_accumulation false: every step() ends the window, so only its last micro-batch steps
    caller_ends = config.get("managed_gradient_accumulation") is False
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, data_size * case.accumulation * case.micro_batch)
        step_loss = torch.zeros(())
        for micro in range(case.accumulation):
            start = (micro * data_size + data_rank) * case.micro_batch
            inputs, targets = x[start : start + case.micro_batch], y[start : start + case.micro_batch]
            loss = model_loss(engine, case.model, inputs, targets)
            engine.backward(loss)
            if not caller_ends or micro == case.accumulation - 1:
                engine.step()
            step_loss += loss.detach().float()
        losses.append(step_loss / case.accumulation)
    comm_by_group = engine.comm_volume(per_group=True)
    losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / engine.comm.size
    tensor = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: gather_full(p.detach().float(), tensor_shard(p), tensor).cpu()
                  for name, p in model.named_parameters()}
    return {"losses": losses.tolist(), "params": params, "comm_by_group": comm_by_group,
            "memory": engine.memory_breakdown(), "local_numel": engine.num_parameters(),
            "padding": engine.padding_elements()}



def assert_equivalent(results: list[dict], reference: dict, tolerance: float = 1e-5) -> None:
    """Every rank's losses and full weights equal the reference's (relative error)."""
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
            assert abs(got - want) / abs(want) < tolerance, f"rank {rank} step {step}: loss {got} vs {want}"
        for name, want in reference["params"].items():
            error = ((result["params"][name] - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert error < tolerance, f"rank {rank} {name}: relative error {error:.2e}"
    for name, tensor in results[0]["params"].items():  # replicated copies stay bit-identical
        for result in results[1:]:
            assert result["params"][name].equal(tensor), name
