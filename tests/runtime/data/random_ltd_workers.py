"""Random-LTD training runs (runtime/data/random_ltd.py) and the single-process reference
they must match, written from DeepSpeed's formulas: at step s each dropping layer keeps
kept(s) = min(floor(s / require_steps * (max - min) + min) - (that mod seq_per_step), max)
tokens of every sequence, at sorted positions drawn per sample and per layer; the layer
runs on those tokens only (causal among them) and writes its outputs back at their
positions; every other token passes it unchanged.

Rank r reads rows [r * micro, (r + 1) * micro) of each global batch and draws its indices
with data_rank r; the reference draws the same (`draw_kept_indices`) and runs the whole
global batch at once.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.runtime.data.random_ltd import draw_kept_indices

SEQ = 16
VOCAB = 64
MICRO = 2
STEPS = 3
LAYERS = 4
DROPPING = (1, 2)
SEED = 77
SCHEDULE = {"min_value": 4, "max_value": SEQ, "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 3, "seq_per_step": 4}}
ADAM_EPS = 1e-4  # tests/runtime/zero/workers.py's ADAM_EPS says why


def kept_tokens(step: int) -> int:
    """DeepSpeed's fixed_linear value (data_routing/scheduler.py), by hand."""
    low, high, config = SCHEDULE["min_value"], SCHEDULE["max_value"], SCHEDULE["schedule_config"]
    value = math.floor(step / config["require_steps"] * (high - low) + low)
    return min(value - value % config["seq_per_step"], high)


def config(stage: int, *, layers: int = LAYERS, mask_name: str | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                              "stage3_param_persistence_threshold": 0},
        "data_efficiency": {
            "seed": SEED,
            "data_routing": {"random_ltd": {
                "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": len(DROPPING),
                "random_ltd_layer_id": list(DROPPING), "model_mask_name": mask_name, "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim", "random_ltd_schedule": SCHEDULE,
            }},
        },
    }


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "gpt":
        return GPT(dataclasses.replace(GPTConfig.preset("tiny"), n_layer=LAYERS, bias=False))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
    ))


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(500 + step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(x, y)
    logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)


def train(rank: int, world: int, kind: str, stage: int, steps: int = STEPS, *, checkpoint: str | None = None,
          resume: str | None = None, tensor: int = 1) -> dict:
    """`checkpoint`: save after the first step; `resume`: load it first and run the rest;
    `tensor`: the tensor-parallel size (its ranks read the same rows)."""
    model = build(kind)
    engine = shardwise.initialize(model, {**config(stage), "tensor_parallel": {"size": tensor}},
                                  optimizer=optimizer(model))
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    first = 0
    if resume is not None:
        engine.load_checkpoint(resume)
        first = engine.global_steps
    losses, kept = [], []
    for step in range(first, steps):
        x, y = batch(step, data_size * MICRO)
        rows = slice(data_rank * MICRO, (data_rank + 1) * MICRO)
        loss = loss_of(engine, kind, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        kept.append(engine.random_ltd.kept())
        if checkpoint is not None and step == 0:
            engine.save_checkpoint(checkpoint, tag="first")
    mean = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / data_size
    with shardwise.gathered_parameters(list(model.parameters())):  # tensor-parallel: this rank's shards
        params = {name.replace(".random_ltd_layer", ""): p.detach().clone() for name, p in model.named_parameters()}
    state = engine.random_ltd.state_dict()
    indices = engine.random_ltd.indices.cpu()
    engine.destroy()
    return {"losses": mean.tolist(), "params": params, "kept": kept, "state": state, "indices": indices}


def train_gpt(rank: int, world: int, directory: str) -> dict:
    """The shardwise GPT cases of tests/runtime/data/test_random_ltd.py, in one start of the ranks."""
    return {
        "gpt0": train(rank, world, "gpt", 0),
        "gpt3": train(rank, world, "gpt", 3, checkpoint=directory),
        "gpt3-resumed": train(rank, world, "gpt", 3, resume=directory),
    }


def train_llama_and_api(rank: int, world: int) -> dict:
    """Hugging Face Llama through its parallelize, the GPT through DeepSpeed's API, and the
    GPT split over a tensor-parallel group of both ranks (one data slice)."""
    return {"llama3": train(rank, world, "llama", 3), "api": train_through_deepspeed_api(rank, world),
            "gpt-tp": train(rank, world, "gpt", 0, tensor=2)}


# -- the reference -----------------------------------------------------------------------
def dropped_layer(layer, hidden: torch.Tensor, indices: torch.Tensor, **inputs) -> torch.Tensor:
    """DeepSpeed's formula: out = hidden; out[b, kept[b]] = layer(hidden[b, kept[b]])."""
    out = hidden.clone()
    rows = torch.arange(hidden.shape[0])[:, None]
    result = layer(hidden[rows, indices], **inputs)
    out[rows, indices] = result[0] if isinstance(result, tuple) else result
    return out


def reference_indices(step: int, world: int) -> torch.Tensor:
    """[layers, world * micro, kept]: each rank's draw, in its rows of the global batch."""
    return torch.cat([draw_kept_indices(seed=SEED, data_rank=rank, step=step, draw=0, layers=len(DROPPING),
                                        batch=MICRO, seq=SEQ, kept=kept_tokens(step)) for rank in range(world)], dim=1)


def reference_loss(model, kind: str, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    chosen = {layer: position for position, layer in enumerate(sorted(DROPPING))}
    if kind == "gpt":
        hidden = model.drop(model.wte(x) + model.wpe(torch.arange(SEQ)))
        for number, block in enumerate(model.blocks):
            hidden = dropped_layer(block, hidden, indices[chosen[number]]) if number in chosen else block(hidden)
        logits = model.lm_head(model.ln_f(hidden))
    else:
        inner = model.model
        hidden = inner.embed_tokens(x)
        positions = torch.arange(SEQ)[None].expand(x.shape[0], -1)
        cos, sin = inner.rotary_emb(hidden, positions)
        for number, layer in enumerate(inner.layers):
            if number in chosen:
                kept = indices[chosen[number]]
                rows = torch.arange(x.shape[0])[:, None]
                hidden = dropped_layer(layer, hidden, kept, attention_mask=None,
                                       position_embeddings=(cos[rows, kept], sin[rows, kept]))
            else:
                hidden = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        logits = model.lm_head(inner.norm(hidden))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def train_reference(kind: str, world: int) -> dict:
    model = build(kind)
    model.train()
    opt = optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world * MICRO)
        loss = reference_loss(model, kind, x, y, reference_indices(step, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


class Decoder(torch.nn.Module):
    """The tiny GPT inside a model shardwise has no plan for: its layers are wrapped by
    DeepSpeed's API (`convert_to_random_ltd`), not by a family's parallelize."""

    def __init__(self):
        super().__init__()
        self.gpt = build("gpt")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y)


def train_through_deepspeed_api(rank: int, world: int) -> dict:
    """A DeepSpeed script's order: initialize, then convert_to_random_ltd(engine, Block)."""
    import shardwise.frontends.deepspeed.api as deepspeed
    from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_routing.helper import (
        convert_to_random_ltd,
        save_without_random_ltd,
    )
    from shardwise.models.gpt.model import Block

    model = Decoder()
    plain_names = sorted(model.state_dict())
    # no clipping, as the reference: a DeepSpeed config without the key clips at 1.0, as DeepSpeed 0.19.8 does
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model),
                                      config={**config(0), "gradient_clipping": 0.0})
    x, y = batch(0, world * MICRO)
    try:
        engine(x[:MICRO], y[:MICRO])
        refusal = ""
    except RuntimeError as error:
        refusal = str(error)
    engine = convert_to_random_ltd(engine, Block)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world * MICRO)
        loss = engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    mean = engine.comm.control_all_reduce(torch.stack(losses), "test losses") / world
    wrapped = [name for name, module in model.named_modules() if type(module).__name__ == "RandomLayerTokenDrop"]
    attached = [module.random_ltd_layer_id for module in model.modules()
                if type(module).__name__ == "RandomLayerTokenDrop"]
    engine.destroy()
    return {"losses": mean.tolist(), "refusal": refusal, "wrapped": wrapped, "attached": attached,
            "unwrapped_names": sorted(save_without_random_ltd(engine)) == plain_names,
            "scheduler_state": engine.random_ltd_scheduler.state_dict(), "enabled": engine.random_ltd_enabled(),
            "params": {name.replace(".random_ltd_layer", "").removeprefix("gpt."): p.detach().clone()
                       for name, p in model.named_parameters()}}
