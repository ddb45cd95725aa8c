"""Training runs for the pipeline tests: one call per rank, and the single-process
reference on the same global batches (tests/runtime/zero/workers.py's conventions: seeded model,
AdamW over two param groups, gradient clipping, `global_batch(step, rows)`).

Data-parallel rank d's micro-batch i of step s is rows [(i * D + d) * b, ...) of the
global batch of D * m * b rows; every stage of a pipeline reads the same micro-batches.
Each rank returns the parameters of its own stage under their original names; the test
merges the stages and compares with the reference's whole model.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.nn.functional as F

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.models import GPT, GPTConfig
from shardwise.runtime.parallel.tensor import gather_full, tensor_shard
from tests.runtime.parallel.workers import build_model as build_parallel_model
from tests.runtime.parallel.workers import make_optimizer as make_sgd
from tests.runtime.zero.workers import SEQ_LEN, VOCAB, global_batch, make_optimizer
from tests.runtime.zero.workers import build_model as build_zero_model


HF_MODELS = ("llama", "qwen2", "mistral", "gpt2")


@dataclasses.dataclass(frozen=True)
class PipeCase:
    pipeline: int = 2
    schedule: str = "1f1b"
    virtual: int = 1
    micro_batches: int = 4
    stage: int = 1
    tensor: int = 1
    model: str = "gpt"  # gpt (2 layers, tied) | gpt4 (4 layers, tied) | gpt-untied | llama | qwen2 | mistral
    batch_form: str = "dict"  # dict: the model's own loss | pair: (inputs, labels) with a loss_fn
    micro_batch: int = 2
    steps: int = 3
    lr: float = 1e-2
    clipping: float = 0.05
    sleep: tuple[float, float] = (0.0, 0.0)  # seconds added to each block's forward / backward
    fail_at: tuple[int, int] | None = None  # (pipeline rank, micro-batch) whose forward raises
    optimizer: str = "adamw"  # adamw | sgd (tensor parallelism: see tests/runtime/parallel/workers.py)
    dtype: str = "fp32"  # fp32 | bf16
    partition: str = "parameters"  # parameters | uniform | time

    def config(self) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": self.clipping,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
            "bf16": {"enabled": self.dtype == "bf16"},
            "tensor_parallel": {"size": self.tensor},
            "pipeline_parallel": {"size": self.pipeline, "schedule": self.schedule,
                                  "virtual_stages": self.virtual, "partition": self.partition, "profile_seq_len": 16},
        }


def build_model(kind: str) -> torch.nn.Module:
    if kind == "gpt4":
        torch.manual_seed(1234)
        return GPT(dataclasses.replace(GPTConfig.preset("tiny"), n_layer=4, bias=False))
    if kind in ("qwen2", "mistral"):
        return build_parallel_model(kind)
    return build_zero_model(kind)


def optimizer_for(model: torch.nn.Module, case: PipeCase) -> torch.optim.Optimizer:
    return make_sgd(model, case.lr) if case.optimizer == "sgd" else make_optimizer(model, case.lr)


def pair_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def micro_batch(case: PipeCase, x: torch.Tensor, y: torch.Tensor):
    """One micro-batch in the form the case asks for."""
    if case.batch_form == "pair":
        return x, y
    if case.model in HF_MODELS:
        return {"input_ids": x, "labels": x}  # Hugging Face shifts the labels itself
    return {"idx": x, "targets": y}


def reference_loss(model, case: PipeCase, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case.model in HF_MODELS:
        if case.batch_form == "pair":
            return pair_loss(model(input_ids=x).logits, y)
        return model(input_ids=x, labels=x).loss
    return model(x, y)


def train_reference(case: PipeCase, data_size: int) -> dict:
    """Plain PyTorch, one process: one global batch of data_size * m * b rows per step,
    accumulated micro-batch by micro-batch (rank-major, as tests/runtime/zero/workers.py's
    `per_micro_batch`). Each micro-batch's loss is a mean over the same number of tokens,
    so the mean of the micro-batch means is the global batch's mean; accumulating in the
    pipeline's order keeps AdamW from turning summation-order noise into 1e-5 updates."""
    model = build_model(case.model)
    optimizer = optimizer_for(model, case)
    losses = []
    parts = data_size * case.micro_batches
    for step in range(case.steps):
        x, y = global_batch(step, parts * case.micro_batch)
        loss = torch.zeros(())
        for rank in range(data_size):
            for i in range(case.micro_batches):
                rows = slice((i * data_size + rank) * case.micro_batch, (i * data_size + rank + 1) * case.micro_batch)
                part = reference_loss(model, case, x[rows], y[rows]) / parts
                part.backward()
                loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _add_sleeps(model: torch.nn.Module, forward_s: float, backward_s: float) -> None:
    """Make every block cost fixed time (sleep, which no other process on the machine can
    slow down), so measured bubbles can be compared with the formula."""
    def slow_backward(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(backward_s)
        return grad

    def hook(module, inputs, output):
        time.sleep(forward_s)
        if output.requires_grad:
            output.register_hook(slow_backward)

    for block in model.blocks:
        block.register_forward_hook(hook)


def _add_failure(model: torch.nn.Module, pipeline_rank: int, at_micro_batch: int) -> None:
    calls = {"n": 0}

    def hook(module, inputs, output):
        if int(os.environ["RANK"]) == pipeline_rank:  # pipeline-only runs: pipeline rank == global rank
            calls["n"] += 1
            if calls["n"] == at_micro_batch + 1:
                raise ValueError("injected failure")

    layers = model.blocks if hasattr(model, "blocks") else model.model.layers
    layers[pipeline_rank * len(layers) // 2].register_forward_hook(hook)


def train_pipeline(rank: int, world_size: int, case: PipeCase) -> dict:
    model = build_model(case.model)
    if any(case.sleep):
        _add_sleeps(model, *case.sleep)
    if case.fail_at is not None:
        _add_failure(model, *case.fail_at)
    engine = shardwise.initialize(model, case.config(), optimizer=optimizer_for(model, case))
    data_rank, data_size = engine.mesh.data_rank, engine.mesh.data_size
    loss_fn = pair_loss if case.batch_form == "pair" else None
    losses, timings, volumes = [], [], []
    for step in range(case.steps):
        x, y = global_batch(step, data_size * case.micro_batches * case.micro_batch)
        batches = []
        for i in range(case.micro_batches):
            start = (i * data_size + data_rank) * case.micro_batch
            batches.append(micro_batch(case, x[start:start + case.micro_batch], y[start:start + case.micro_batch]))
        engine.reset_comm_volume()
        losses.append(engine.train_batch(data_iter=iter(batches), loss_fn=loss_fn).item())
        volumes.append(engine.comm_volume(per_group=True))
        timings.append({**engine.pipeline.last_timing, "peak": engine.pipeline.peak_in_flight,
                        "peak_bytes": engine.pipeline.peak_activation_bytes})
    eval_x, eval_y = global_batch(100, data_size * case.micro_batches * case.micro_batch)
    eval_batches = [micro_batch(case, eval_x[(i * data_size + data_rank) * case.micro_batch:][:case.micro_batch],
                                eval_y[(i * data_size + data_rank) * case.micro_batch:][:case.micro_batch])
                    for i in range(case.micro_batches)]
    eval_loss = engine.eval_batch(iter(eval_batches), loss_fn=loss_fn).item()
    tensor = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: gather_full(p.detach().float(), tensor_shard(p), tensor).cpu()
                  for name, p in model.named_parameters()}
    layout = engine.pipeline_layout()
    return {
        "losses": losses, "eval_loss": eval_loss, "params": params, "comm_by_group": volumes,
        "timings": timings, "peak_in_flight": engine.pipeline.peak_in_flight,
        "pipeline_rank": engine.mesh["pipeline"].rank, "chunks": layout.chunks,
        "coordinates": engine.mesh.coordinates,
    }


def failing_pipeline(rank: int, world_size: int, case: PipeCase) -> dict:
    """Train until the injected failure; returns this rank's error and how long it took."""
    started = time.monotonic()
    try:
        train_pipeline(rank, world_size, case)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def reference_eval_loss(case: PipeCase, data_size: int, params: dict) -> float:
    model = build_model(case.model)
    model.load_state_dict(params, strict=False)
    x, y = global_batch(100, data_size * case.micro_batches * case.micro_batch)
    with torch.no_grad():
        return reference_loss(model, case, x, y).item()


__all__ = ["SEQ_LEN", "VOCAB", "PipeCase", "failing_pipeline", "reference_eval_loss", "train_pipeline",
           "train_reference"]


def _micro_batches(case: PipeCase, step: int, data_rank: int, data_size: int) -> list:
    x, y = global_batch(step, data_size * case.micro_batches * case.micro_batch)
    rows = [slice((i * data_size + data_rank) * case.micro_batch, (i * data_size + data_rank + 1) * case.micro_batch)
            for i in range(case.micro_batches)]
    return [micro_batch(case, x[r], y[r]) for r in rows]


def checkpoint_run(rank: int, world_size: int, case: PipeCase, directory: str, steps: range, load: bool) -> dict:
    """Train `steps` of `case` (pipeline_parallel.size 1 trains with the plain engine loop),
    after loading the checkpoint in `directory` if `load`, then save one there."""
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(), optimizer=optimizer_for(model, case))
    if load:
        engine.load_checkpoint(directory)
    loss_fn = pair_loss if case.batch_form == "pair" else None
    losses = []
    for step in steps:
        batches = _micro_batches(case, step, engine.mesh.data_rank, engine.mesh.data_size)
        if engine.pipeline is not None:
            losses.append(engine.train_batch(iter(batches), loss_fn=loss_fn).item())
            continue
        total = 0.0
        for kwargs in batches:
            loss = engine(**kwargs)
            engine.backward(loss)
            engine.step()
            total += loss.item() / case.micro_batches
        losses.append(total)
    engine.save_checkpoint(directory)
    tensor = Communicator(engine.mesh["tensor"])
    with shardwise.gathered_parameters(list(model.parameters())):
        params = {name: gather_full(p.detach().float(), tensor_shard(p), tensor).cpu()
                  for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "global_steps": engine.global_steps}
