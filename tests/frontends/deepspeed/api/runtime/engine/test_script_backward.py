"""DeepSpeed 0.19.8's backward forms on the DeepSpeed engine: the script's own backward
(`loss.backward()` or `engine.scale(loss).backward()`, then `engine.step()`),
`engine.backward(loss, scale_wrt_gas=False)` on a loss the script averaged itself, and
`retain_graph=True` with `torch.autograd.grad` of the inputs after it, each give the weights `engine.backward(loss)` gives, bit for bit, with
accumulation, at stages 0-2 (one gloo rank); with DEEPSPEED_PYTHON set, DeepSpeed's own
weights (it refuses the script's own backward at stage 0, where shardwise takes it). Where the forward also returns the output the
loss came from, DeepSpeed divides that loss's gradient by the accumulation steps once per
output (twice here); shardwise divides it once, as engine.backward."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

RUN = """
import torch

class Regression(torch.nn.Module):
    def __init__(self, with_output):
        super().__init__()
        self.hidden, self.out, self.with_output = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), with_output

    def forward(self, x, y):
        out = self.out(torch.tanh(self.hidden(x)))
        loss = (out - y).square().mean()
        return {"loss": loss, "out": out} if self.with_output else {"loss": loss}

def run(deepspeed, backward, stage, with_output):
    torch.manual_seed(0)
    model = Regression(with_output)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1)
    try:
        for _ in range(4):
            inputs = torch.randn(2, 4).requires_grad_(backward == "retained")
            loss = engine(inputs, torch.randn(2, 1))["loss"]
            if backward == "engine":
                engine.backward(loss)
            elif backward == "averaged by the script":  # verl's form: the loss already over its window
                engine.backward(loss / 2, scale_wrt_gas=False)
            elif backward == "retained":  # the graph kept for the input's gradient after it
                engine.backward(loss, retain_graph=True)
                torch.autograd.grad(loss, inputs)
            elif backward == "plain":
                loss.backward()
            else:
                engine.scale(loss).backward()
            engine.step()
        return [param.detach().flatten().tolist() for param in engine.module.parameters()]
    except RuntimeError as error:
        return str(error)[:60]
    finally:
        engine.destroy()
"""
namespace: dict = {}
exec(RUN, namespace)
BACKWARDS = ("engine", "averaged by the script", "retained", "plain", "scaled")
CASES = [(backward, stage, with_output) for stage in (0, 1, 2) for backward in BACKWARDS
         for with_output in (False, True)]


def test_script_backward_gives_engine_backwards_weights():
    for stage in (0, 1, 2):
        for with_output in (False, True):
            expected = namespace["run"](deepspeed, "engine", stage, with_output)
            for backward in BACKWARDS[1:]:
                assert namespace["run"](deepspeed, backward, stage, with_output) == expected, (backward, stage)


def test_engine_backward_returns_the_loss_as_divided():
    model = torch.nn.Linear(2, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        loss = engine(torch.ones(1, 2)).sum()
        assert torch.equal(engine.backward(loss, retain_graph=True), loss / 4)
        assert engine.backward(loss, scale_wrt_gas=False) is loss
    finally:
        engine.destroy()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_gives_the_same_weights_where_it_divides_once():
    script = ("import json, sys, deepspeed\n" + ONE_RANK + "deepspeed.init_distributed()\n" + RUN +
              "print(json.dumps([run(deepspeed, *case) for case in json.loads(sys.argv[1])]))\n")
    compared = [case for case in CASES if case[0] != "retained"]  # DeepSpeed's output hooks run in autograd.grad
    theirs = dict(zip(compared, deepspeed_json(script, json.dumps(compared), timeout=600)))
    ours = {case: namespace["run"](deepspeed, *case) for case in compared}
    for (backward, stage, with_output), weights in theirs.items():
        if stage == 0 and backward in ("plain", "scaled"):
            assert weights.startswith("Direct calls to tensor.backward() are not")  # DeepSpeed refuses it there
        elif with_output and backward in ("plain", "scaled"):
            assert weights != theirs["engine", stage, with_output]  # DeepSpeed divides once per output
        else:
            assert weights == ours[backward, stage, with_output], (backward, stage, with_output)
