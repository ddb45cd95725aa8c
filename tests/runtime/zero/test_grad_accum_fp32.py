"""fp32 gradient accumulation beside bf16/fp16 training (DeepSpeed's
`data_types.grad_accum_dtype: "fp32"`, `PrecisionPolicy.grad_accum_dtype`) at ZeRO stages
1-3: each micro-batch's gradient comes out of autograd in the training dtype and is added
into fp32 gradient buffers, so a sum of micro-batches keeps the bits a 16-bit sum drops.

- a bf16 model over 4 micro-batches trains like one process that adds the same bf16
  micro-batch gradients in fp32 (bf16 tolerance);
- a gradient built so that its 16-bit running sum rounds away the small micro-batches
  (1 + 2^-8 + 2^-8 + 0 in bf16 is 1): the window's reduced gradient, and the master after
  an SGD step with learning rate 1, are the fp32 sum, at every stage, in bf16 and fp16
  (whose loss scaler unscales that sum), with the optimizer on the device, the host or NVMe;
- fp16 gradients whose 16-bit sum overflows are stepped at stages 2-3: the overflow check
  sees the finite fp32 sum;
- memory_breakdown() counts 4-byte gradient buffers, to the byte of the formula;
- with DEEPSPEED_PYTHON, DeepSpeed 0.19.8 itself ends those rounding gradients in the same
  fp32 sum at stages 1-3, and trains a small bf16 network to shardwise's losses.
"""

import copy
import os

import pytest
import torch
from torch import nn

import shardwise
from shardwise.formulas.memory import model_state_bytes
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json
from tests.runtime.zero.workers import (Case, assert_matches_reference, build_model, global_batch, make_optimizer,
                                        model_loss, train_parallel)

FP32_ACCUMULATION = {"data_types": {"grad_accum_dtype": "fp32"}}


def case_for(stage: int, **options) -> Case:
    return Case(stage=stage, dtype="bf16", accumulation=4, model="gpt-untied" if stage == 3 else "gpt",
                extra_config={**FP32_ACCUMULATION, "zero_optimization": {"stage3_param_persistence_threshold": 0}},
                **options)


def fp32_accumulating_reference(case: Case, world_size: int) -> dict:
    """One process: fp32 masters, a bf16 copy computing every micro-batch of every rank,
    each micro-batch's bf16 gradient added into an fp32 sum, then clipping and AdamW on the
    masters."""
    masters = build_model(case.model)
    compute = copy.deepcopy(masters).to(torch.bfloat16)
    optimizer = make_optimizer(masters, case.lr, case.optimizer)
    rows = world_size * case.accumulation * case.micro_batch
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, rows)
        with torch.no_grad():
            for master, param in zip(masters.parameters(), compute.parameters()):
                param.copy_(master)
        sums = [torch.zeros_like(master) for master in masters.parameters()]
        loss = 0.0
        for rank in range(world_size):
            for micro in range(case.accumulation):
                start = (micro * world_size + rank) * case.micro_batch
                part = model_loss(compute, case.model, x[start : start + case.micro_batch],
                                  y[start : start + case.micro_batch])
                (part.float() / case.accumulation).backward()
                for total, param in zip(sums, compute.parameters()):
                    total += param.grad.float()  # bf16 gradient, fp32 sum
                    param.grad = None
                loss += part.item() / (world_size * case.accumulation)
        for master, total in zip(masters.parameters(), sums):
            master.grad = total / world_size
        torch.nn.utils.clip_grad_norm_(masters.parameters(), case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in masters.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_training_accumulates_micro_batches_in_fp32(stage):
    case = case_for(stage)
    result = run_distributed(train_parallel, 2, case)[0]
    assert_matches_reference(result, fp32_accumulating_reference(case, 2), tolerance=2e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_counts_fp32_gradient_buffers(stage):
    world = 2
    result = run_distributed(train_parallel, world, case_for(stage, steps=1))[0]
    padded = result["numel"] + result["padding"]
    expected = model_state_bytes(padded, world, stage, "bf16", grad_dtype="fp32")
    assert {category: result["memory"][category] for category in expected} == expected
    assert expected["grads"] == 2 * model_state_bytes(padded, world, stage, "bf16")["grads"]


# Micro-batch inputs whose gradients' 16-bit running sum loses the small ones: 1 + 2^-8 is
# a tie in bf16 (8 significant bits) and rounds to even, 1; in fp16 (11 bits) 1 + 2^-11 does.
# Each sum, 1 + 2^-7 and 1 + 2^-10, is exact in its dtype, so the boundary's cast to the
# communication dtype (stage 1) keeps it.
SMALL = {"bf16": 2.0**-8, "fp16": 2.0**-11}
ELEMENTS = 64


class Dot(nn.Module):
    """loss = w·x: the gradient of w is x, exactly, in any dtype."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(ELEMENTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x.to(self.w.dtype)).sum()


def accumulate_gradients(rank: int, world_size: int, dtype: str, stage: int, offload: str, nvme_path: str,
                         values: list[float]) -> dict:
    """Four micro-batches whose gradients are `values` times the loss scale over 4, then an
    SGD step with learning rate 1 from w = 0: the window's reduced gradient, the masters."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
              dtype: {"enabled": True, **({"loss_scale": 4.0} if dtype == "fp16" else {})},
              "zero_optimization": zero, **FP32_ACCUMULATION}
    model = Dot()
    engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    for micro, value in enumerate(values):
        engine.backward(engine(torch.full((ELEMENTS,), value)))
        if micro < 3:
            engine.step()
    engine.zero.store.gradients()  # an offloaded store settles its copies
    grads = {(owned.start, owned.stop): owned.grad.float().clone() for owned in engine.zero.owned_ranges()}
    engine.step()
    masters = {(owned.start, owned.stop): owned.master.float().clone() for owned in engine.zero.owned_ranges()}
    return {"grads": grads, "masters": masters, "scale": engine.loss_scaler.scale, "values": values}


# Offloaded at stages 2-3, each micro-batch's reduced 16-bit chunk was already added into the
# host's fp32 partition before fp32 accumulation existed (ZeRO-Offload's design); the one such
# case holds that it stays so. Every other case fails when the sum is kept in the training dtype.
@pytest.mark.parametrize("stage, dtype, offload", [
    (1, "bf16", "none"), (2, "bf16", "none"), (3, "bf16", "none"),
    (1, "fp16", "none"), (2, "fp16", "none"), (3, "fp16", "none"),
    (1, "bf16", "cpu"), (1, "fp16", "nvme"), (3, "fp16", "cpu"),
])
def test_the_window_gradient_is_the_fp32_sum(stage, dtype, offload, tmp_path):
    small = SMALL[dtype]
    assert torch.tensor(1.0 + small, dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])) == 1.0
    assert_fp32_sum(run_distributed(accumulate_gradients, 2, dtype, stage, offload, str(tmp_path),
                                    [1.0, small, small, 0.0]))


@pytest.mark.parametrize("stage", [2, 3])
def test_an_fp16_sum_beyond_fp16_is_stepped(stage, tmp_path):
    """Four fp16 gradients of 40000: their fp16 sum is inf (above 65504), so without fp32
    accumulation the loss scaler would skip the step; in fp32 the overflow check sees a
    finite sum and the step unscales it. (Stage 1 casts its fp32 sum to the communication
    dtype, fp16, for the reduce-scatter, as DeepSpeed casts its own for its reduction: a
    rank's sum above 65504 overflows there.)"""
    assert_fp32_sum(run_distributed(accumulate_gradients, 2, "fp16", stage, "none", str(tmp_path), [40000.0] * 4))


def assert_fp32_sum(results: list[dict]) -> None:
    """Every rank's reduced gradient is the micro-batches' fp32 sum (with its loss scale),
    and the SGD step moved the masters by that sum, unscaled."""
    fp32_sum = sum(results[0]["values"]) / 4  # the loss is divided by the 4 micro-batches
    owned = 0
    for result in results:
        for (start, stop), grad in result["grads"].items():
            assert torch.equal(grad, torch.full_like(grad, fp32_sum * result["scale"])), (
                f"rank's gradient {grad[:4].tolist()}: the fp32 sum is {fp32_sum * result['scale']}")
            assert torch.equal(result["masters"][(start, stop)], torch.full_like(grad, -fp32_sum))
            owned += stop - start
    assert owned == ELEMENTS


# DeepSpeed 0.19.8 itself, one rank on its CPU accelerator: the same rounding gradients
# (stage 1 is its BF16_Optimizer, stages 2-3 its ZeRO optimizers) end in the fp32 sum, and
# a small bf16 network trained over 4 micro-batches has shardwise's losses.
DEEPSPEED_SIDE = ONE_RANK + """
import json, sys, torch, deepspeed
deepspeed.init_distributed("gloo")
given = torch.load(sys.argv[1])
answers = {"masters": {}, "losses": {}}
for stage in given["rounding_stages"]:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(given["elements"]))
    model.forward = lambda x, model=model: (model.w * x.to(model.w.dtype)).sum()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=given["rounding"][stage])
    for value in given["values"]:
        engine.backward(engine(torch.full((given["elements"],), value)))
        engine.step()
    answers["masters"][stage] = deepspeed.utils.safe_get_full_fp32_param(model.w).tolist()
for stage, config in given["training"].items():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.load_state_dict(given["state"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4),
                                      config=config)
    losses = []
    for x, y in given["batches"]:
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()), y.bfloat16())
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    answers["losses"][stage] = losses
print(json.dumps(answers))
"""


def small_network_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
            "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, **FP32_ACCUMULATION}


def train_small_network(rank: int, world_size: int, given: dict, stage: int) -> list[float]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.load_state_dict(given["state"])
    engine = shardwise.initialize(model, small_network_config(stage),
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    losses = []
    for x, y in given["batches"]:
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()), y.bfloat16())
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"),
                    reason="set DEEPSPEED_PYTHON to an interpreter with DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_accumulates_the_same(tmp_path):
    torch.manual_seed(0)
    state = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).state_dict()
    batches = [(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(12)]  # 3 steps of 4 micro-batches
    small = SMALL["bf16"]
    rounding = {stage: {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                        "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                        **FP32_ACCUMULATION} for stage in (1, 2, 3)}
    given = {"elements": ELEMENTS, "values": [1.0, small, small, 0.0], "rounding_stages": [1, 2, 3],
             "rounding": rounding, "state": state, "batches": batches,
             "training": {stage: small_network_config(stage) for stage in (1, 2, 3)}}
    torch.save(given, tmp_path / "given.pt")
    theirs = deepspeed_json(DEEPSPEED_SIDE, str(tmp_path / "given.pt"), timeout=600)
    for stage, master in theirs["masters"].items():
        assert master == [-(1.0 + 2 * small) / 4] * ELEMENTS, f"stage {stage}"
    for stage in (1, 2, 3):
        ours = run_distributed(train_small_network, 1, {"state": state, "batches": batches}, stage)[0]
        for step, (got, want) in enumerate(zip(ours, theirs["losses"][str(stage)])):
            assert abs(got - want) <= 2e-2 * abs(want), f"stage {stage} micro-batch {step}: {got} vs DeepSpeed's {want}"
