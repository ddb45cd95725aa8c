"""A backward the script starts itself (runtime/engine/output_backward.py): `loss.backward()`
on the engine's output, or `engine.scale(loss).backward()` with fp16 loss scaling, trains
as `engine.backward(loss)` does, at every ZeRO stage on 2 gloo ranks with accumulation:
the single-process reference's losses and weights (fp32, relative error < 1e-5), and
engine.backward's own weights bit for bit or within rounding. A Hugging Face model's loss,
computed inside it from its logits (both outputs hooked), is divided once. fp16 without
`engine.scale` is refused with DeepSpeed 0.19.8's message; a backward that raises half-way
drops its micro-batch as a failed `engine.backward` does."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import (Case, assert_matches_reference, build_model, global_batch, make_optimizer,
                                        model_loss, relative_error, train_reference)

TOLERANCE = 1e-5


def _train(rank: int, world_size: int, case: Case, backward: str, hf_loss: bool = False) -> dict:
    """train_parallel's run (tests/runtime/zero/workers.py) with the backward started as
    `backward` says: "engine" (engine.backward), "plain" (loss.backward()) or "scaled"
    (engine.scale(loss).backward()). `hf_loss`: the Hugging Face model's own loss (labels
    passed in), which it computes from the logits it also returns."""
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size),
                                  optimizer=make_optimizer(model, case.lr, case.optimizer))
    rows = world_size * case.accumulation * case.micro_batch
    losses = []
    try:
        for step in range(case.steps):
            x, y = global_batch(step, rows)
            step_loss = torch.zeros(())
            for micro in range(case.accumulation):
                start = (micro * world_size + rank) * case.micro_batch
                inputs, targets = x[start:start + case.micro_batch], y[start:start + case.micro_batch]
                if hf_loss:  # Hugging Face shifts the labels itself
                    loss = engine(input_ids=inputs, labels=inputs).loss
                else:
                    loss = model_loss(engine, case.model, inputs, targets)
                if backward == "engine":
                    engine.backward(loss)
                elif backward == "plain":
                    loss.backward()
                else:
                    engine.scale(loss).backward()
                engine.step()
                step_loss += loss.detach().float()
            losses.append(step_loss / case.accumulation)
        losses = engine.comm.control_all_reduce(torch.stack(losses), "test losses")
        with shardwise.gathered_parameters(list(model.parameters())):
            params = {n: p.detach().to(torch.float32, copy=True) for n, p in model.named_parameters()}
        return {"losses": (losses / world_size).tolist(), "params": params, "skipped": engine.skipped_steps}
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_trains_as_engine_backward_at_every_stage(stage):
    """SGD without clipping: its step is proportional to the gradient, so a gradient not
    divided by the accumulation steps (or divided twice) shows."""
    case = Case(stage=stage, accumulation=2, steps=2, optimizer="sgd", clipping=0.0)
    script = run_distributed(_train, 2, case, "plain")[0]
    assert_matches_reference(script, train_reference(case, 2), TOLERANCE)
    engine = run_distributed(_train, 2, case, "engine")[0]
    for name, tensor in engine["params"].items():
        assert relative_error(script["params"][name], tensor) < 1e-6, name


def test_a_loss_the_model_computes_from_its_logits_is_divided_once():
    """GPT-2's output holds the loss and the logits it came from: both get output hooks;
    the division happens at the parameters, once."""
    case = Case(stage=2, model="gpt2", accumulation=2, steps=2, clipping=0.0, optimizer="sgd")
    script = run_distributed(_train, 2, case, "plain", True)[0]
    engine = run_distributed(_train, 2, case, "engine", True)[0]
    assert script["losses"] == pytest.approx(engine["losses"], rel=1e-6)
    for name, tensor in engine["params"].items():
        assert relative_error(script["params"][name], tensor) < 1e-6, name


def _fp16(rank: int, world_size: int) -> dict:
    case = Case(stage=2, dtype="fp16", accumulation=2, steps=2, lr=1e-3)
    model = build_model(case.model)
    engine = shardwise.initialize(model, case.config(world_size), optimizer=make_optimizer(model, case.lr))
    try:
        x, y = global_batch(0, 2)
        with pytest.raises(RuntimeError, match="Loss scaling is required for this configuration") as refused:
            model_loss(engine, case.model, x, y).backward()
        return {"refused": str(refused.value), "pending": engine._backward_pending}
    finally:
        engine.destroy()


def test_fp16_needs_engine_scale_and_scaled_trains_as_engine_backward():
    for answer in run_distributed(_fp16, 2):
        assert answer["pending"] is False  # refused before anything of the backward ran
    case = Case(stage=2, dtype="fp16", accumulation=2, steps=3, lr=1e-3)
    scaled = run_distributed(_train, 2, case, "scaled")[0]
    engine = run_distributed(_train, 2, case, "engine")[0]
    assert scaled["skipped"] == engine["skipped"]
    assert scaled["losses"] == pytest.approx(engine["losses"], rel=1e-6)
    for name, tensor in engine["params"].items():
        assert relative_error(scaled["params"][name], tensor) < 1e-6, name


class RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (a failing custom kernel)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        raise RuntimeError("a kernel failed in backward")


def _interrupted(rank: int, world_size: int, interrupt: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                          "zero_optimization": {"stage": 2}},
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 4, generator=generator) for _ in range(5)]
    try:
        if interrupt:  # the window's first micro-batch raises half-way through its backward
            # built before the engine's forward, autograd reaches it after the output's branch
            # (which opens the pass and hands the reducer the last layer's gradients)
            failing = RaiseInBackward.apply(engine.module[0](batches[0])).sum() * 0
            output = engine(batches[0])
            with pytest.raises(RuntimeError, match="a kernel failed in backward"):
                (output.sum() + failing).backward()
            assert engine._output_backward.open and engine.zero.reducer._in_backward  # left open by the raise
        for batch in batches[1:]:
            engine(batch).square().mean().backward()
            engine.step()
        return {"weights": [param.detach().clone() for param in model.parameters()], "steps": engine.global_steps}
    finally:
        engine.destroy()


def test_a_backward_that_raises_half_way_drops_its_micro_batch():
    """As a failed engine.backward in the first micro-batch of a window: training goes on
    as if the batch had never been seen (bit for bit)."""
    interrupted, clean = run_distributed(_interrupted, 2, True), run_distributed(_interrupted, 2, False)
    for got, want in zip(interrupted, clean):
        assert got["steps"] == want["steps"] == 2
        for a, b in zip(got["weights"], want["weights"]):
            assert torch.equal(a, b)


def _gradient_penalty(rank: int, world_size: int, stage: int) -> dict:
    """WGAN-GP's critic loss: the gradient of the outputs by the inputs (torch.autograd.grad,
    create_graph) in the loss; the output hooks must not take that autograd.grad for a
    backward of the engine's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    engine = shardwise.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}},
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(2 * world_size, 4, generator=generator) for _ in range(3)]

    def critic_loss(module, inputs):
        inputs = inputs.clone().requires_grad_(True)
        output = module(inputs)
        gradient, = torch.autograd.grad(output.sum(), inputs, create_graph=True)
        return output.mean() + (gradient.norm(dim=1) - 1).square().mean()

    try:
        for batch in batches:
            engine.backward(critic_loss(engine, batch[2 * rank:2 * rank + 2]))
            engine.step()
            reference.zero_grad()
            torch.stack([critic_loss(reference, batch[2 * r:2 * r + 2]) for r in range(world_size)]).mean().backward()
            with torch.no_grad():
                for param in reference.parameters():
                    param -= 0.1 * param.grad
        return {"errors": [relative_error(param.detach(), want.detach())
                           for param, want in zip(model.parameters(), reference.parameters())],
                "steps": engine.global_steps}
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gradient_penalty_through_the_outputs_trains_as_plain_torch(stage):
    for answer in run_distributed(_gradient_penalty, 2, stage):
        assert answer["steps"] == 3
        assert max(answer["errors"]) < TOLERANCE
