"""Random-LTD (runtime/data/random_ltd.py): the layer against DeepSpeed's formula, and
training with it at ZeRO stages 0 and 3 on 2 gloo ranks (shardwise GPT; Hugging Face Llama
and DeepSpeed's convert_to_random_ltd in the slow run) against the single-process reference
of random_ltd_workers.py, with a checkpoint resumed exactly.

DeepSpeed's own RandomLayerTokenDrop cannot run here as shipped: its gather, scatter and
sort are the `random_ltd` CUDA op (RandomLTDBuilder), which DeepSpeed 0.19.8's CPU
accelerator refuses to load ("This op had not been implemented on CPU backend"). With
DEEPSPEED_PYTHON set, its wrapper runs with that op replaced by torch code written from the
op's source (the one mock here, for CUDA) and equals ours forward and backward. Its
schedule is compared with DeepSpeed's in test_token_schedule.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch import nn

from shardwise.runtime.data.random_ltd import (
    RandomLayerTokenDrop,
    RandomLTDPolicy,
    RandomLTDState,
    draw_kept_indices,
    wrap_layers,
)
from shardwise.tools.testing import run_distributed
from tests.runtime.data import random_ltd_workers as workers


def policy(**change) -> RandomLTDPolicy:
    settings = dict(total_layer_num=3, layer_ids=(1,), min_value=3, max_value=8, require_steps=4, seq_per_step=1,
                    global_batch_size=2, seed=5)
    return RandomLTDPolicy(**{**settings, **change})


class Scaled(nn.Module):
    """A layer whose output depends on every kept token (a causal prefix sum) and on a weight."""

    def __init__(self, seq_dim: int = 1):
        super().__init__()
        self.seq_dim = seq_dim
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=self.seq_dim) * self.weight


@pytest.mark.parametrize("batch_first", [True, False])
def test_the_layer_runs_on_the_kept_tokens_and_passes_the_others(batch_first):
    layers = nn.ModuleList([nn.Identity(), Scaled(1 if batch_first else 0), nn.Identity()])
    order = "batch_seq_dim" if batch_first else "seq_batch_dim"
    state = RandomLTDState(policy(hidden_state_order=order), data_rank=0)
    wrap_layers(layers, state)
    state.update_seq(1)  # kept(1) = floor(1/4 * 5 + 3) = 4 of 8
    hidden = torch.randn(3, 8, 4, dtype=torch.float64, requires_grad=True)
    out = layers[1](hidden if batch_first else hidden.transpose(0, 1))
    out = out if batch_first else out.transpose(0, 1)
    indices = draw_kept_indices(seed=5, data_rank=0, step=1, draw=0, layers=1, batch=3, seq=8, kept=4)[0]
    assert torch.equal(state.indices[0], indices) and indices.shape == (3, 4)
    assert all(torch.equal(row, row.sort().values) and len(set(row.tolist())) == 4 for row in indices)

    weight = layers[1].random_ltd_layer.weight
    expected = hidden.clone()  # DeepSpeed's formula: out[b, kept[b]] = layer(hidden[b, kept[b]])
    rows = torch.arange(3)[:, None]
    expected[rows, indices] = torch.cumsum(hidden[rows, indices], dim=1) * weight
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), [hidden, weight])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, weight])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dropped = torch.ones(3, 8, dtype=torch.bool)
    dropped[rows, indices] = False
    assert torch.equal(out[dropped], hidden[dropped])  # the others passed unchanged

    layers.eval()  # evaluation: every token through the layer
    whole = hidden if batch_first else hidden.transpose(0, 1)
    torch.testing.assert_close(layers[1](whole), layers[1].random_ltd_layer(whole))


def test_a_decoder_mask_is_cut_to_the_kept_corner_and_an_encoder_mask_gathered():
    seen = {}

    class Masked(nn.Module):
        def forward(self, x, mask=None):
            seen["mask"] = mask
            return x

    for model_type, expected in (("decoder", lambda m, i: m[:, :, :4, :4]),
                                 ("encoder", lambda m, i: torch.stack([m[b][:, i[b]][:, :, i[b]] for b in range(2)]))):
        layers = nn.ModuleList([Masked()])
        state = RandomLTDState(policy(total_layer_num=1, layer_ids=(0,), mask_name="mask", model_type=model_type),
                               data_rank=1)
        wrap_layers(layers, state)
        state.update_seq(1)
        mask = torch.randn(2, 1, 8, 8)
        layers[0](torch.randn(2, 8, 4), mask=mask)
        torch.testing.assert_close(seen["mask"], expected(mask, state.indices[0]), rtol=0, atol=0)


def test_draws_are_seeded_and_differ_by_rank_step_and_draw():
    base = dict(seed=1, data_rank=0, step=3, draw=0, layers=2, batch=2, seq=32, kept=8)
    first = draw_kept_indices(**base)
    assert torch.equal(first, draw_kept_indices(**base))
    for change in ({"data_rank": 1}, {"step": 4}, {"draw": 1}, {"seed": 2}):
        assert not torch.equal(first, draw_kept_indices(**{**base, **change}))
    assert not torch.equal(first[0], first[1])  # each layer its own tokens


def test_wrong_layer_counts_and_orders_are_refused():
    with pytest.raises(ValueError, match="total_layer_num is 3 but the model has 2 layers"):
        wrap_layers(nn.ModuleList([nn.Identity(), nn.Identity()]), RandomLTDState(policy(), data_rank=0))
    with pytest.raises(ValueError, match=r"random_ltd_layer_id \[1, 3\]"):
        policy(layer_ids=(1, 3))
    with pytest.raises(ValueError, match="min_value <= max_value"):
        policy(min_value=9)
    with pytest.raises(ValueError, match="needs model_mask_name"):
        policy(model_type="encoder")


def test_training_equals_the_reference_at_stages_0_and_3_and_resumes_exactly(tmp_path):
    """fp32, 2 ranks, 3 steps while the kept count rises 4 -> 8 -> 12 of 16 tokens, in
    layers 1 and 2 of 4 of shardwise GPT; the reference draws each rank's indices and runs
    the global batch. The cases share one start of the ranks (the suite's time budget)."""
    results = run_distributed(workers.train_gpt, 2, str(tmp_path / "checkpoint"), timeout=240)
    assert results[0]["gpt0"]["kept"] == [workers.kept_tokens(step) for step in range(workers.STEPS)] == [4, 8, 12]
    reference = workers.train_reference("gpt", world=2)
    for case in ("gpt0", "gpt3"):
        assert_matches(results[0][case], reference, case)
    straight, resumed = results[0]["gpt3"], results[0]["gpt3-resumed"]
    assert resumed["losses"] == straight["losses"][1:]
    assert resumed["state"] == straight["state"]
    # DeepSpeed's count: global batch * (kept * dropping layers + max * the other layers), per step
    assert straight["state"]["consumed_layer_tokens"] == sum(4 * (workers.kept_tokens(s) * 2 + 16 * 2)
                                                            for s in range(workers.STEPS))
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.slow
def test_llama_deepspeed_s_api_and_tensor_parallel_train_like_the_reference():
    """Llama (4 layers) at ZeRO 3 through its family's parallelize (rotary tables gathered
    for the kept tokens); a model shardwise has no plan for, refused until its layers are
    wrapped by DeepSpeed's convert_to_random_ltd(engine, Block) after initialize, as
    DeepSpeed scripts do (frontends/deepspeed/api/.../data_routing/helper.py); the GPT
    tensor-parallel over both ranks."""
    ranks = run_distributed(workers.train_llama_and_api, 2, timeout=240)
    results = ranks[0]
    assert_matches(results["llama3"], workers.train_reference("llama", world=2), "llama3")
    # a tensor-parallel group (one data slice) drops the same tokens on both ranks; its
    # weights are shards, so the losses of 3 updated steps stand for them
    assert torch.equal(ranks[0]["gpt-tp"]["indices"], ranks[1]["gpt-tp"]["indices"])
    torch.testing.assert_close(torch.tensor(results["gpt-tp"]["losses"]),
                               torch.tensor(workers.train_reference("gpt", world=1)["losses"]), rtol=1e-5, atol=0)
    api = results["api"]
    assert_matches(api, workers.train_reference("gpt", world=2), "api")
    assert "no layer of Decoder drops tokens" in api["refusal"] and "convert_to_random_ltd" in api["refusal"]
    assert api["wrapped"] == [f"gpt.blocks.{i}" for i in range(workers.LAYERS)]  # every Block
    assert api["attached"] == [-1, 0, 1, -1]  # names holding the sorted random_ltd_layer_id, in order
    assert api["unwrapped_names"] and api["enabled"]
    assert api["scheduler_state"]["current_value"] == workers.kept_tokens(workers.STEPS - 1)


def assert_matches(got: dict, reference: dict, case: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert got["params"].keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"{case} {name}")


# DeepSpeed's RandomLayerTokenDrop with its CUDA op (`random_ltd_module`: token_sort_,
# token_gather, token_scatter_) replaced by torch code written from the op's source
# (csrc/random_ltd/: the scatter overwrites the kept positions) -- the op alone cannot run on
# CPU. Its wrapper, masks and autograd functions (GatherTokens / ScatterTokens) run as
# DeepSpeed ships them, on the indices given.
DEEPSPEED_LAYER = """
import json, sys
import torch
from torch import nn
from deepspeed.ops.random_ltd import dropping_utils
from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

class CudaOpStandIn:
    @staticmethod
    def token_sort_(indices, seq):
        return indices.sort(dim=-1).values
    @staticmethod
    def token_gather(acts, indices, batch_first):
        acts = acts if batch_first else acts.transpose(0, 1)
        rows = torch.arange(acts.shape[0])[:, None]
        out = acts[rows, indices.long()]
        return out if batch_first else out.transpose(0, 1).contiguous()
    @staticmethod
    def token_scatter_(all_acts, layer_acts, indices, batch_first):
        target = all_acts if batch_first else all_acts.transpose(0, 1)
        source = layer_acts if batch_first else layer_acts.transpose(0, 1)
        rows = torch.arange(target.shape[0])[:, None]
        target[rows, indices.long()] = source
        return all_acts

dropping_utils.random_ltd_module = CudaOpStandIn
case = json.loads(sys.argv[1])
indices = torch.tensor(case["indices"], dtype=torch.int32)
kept = indices.shape[-1]

class Layer(nn.Module):
    def __init__(self, seq_dim):
        super().__init__()
        self.seq_dim = seq_dim
        self.weight = nn.Parameter(torch.tensor(case["weight"], dtype=torch.float64))
    def forward(self, x, mask=None):
        return (torch.cumsum(x, dim=self.seq_dim) * self.weight, mask.sum())

scheduler = RandomLTDScheduler({"total_layer_num": 1, "random_ltd_layer_num": 1, "global_batch_size": 2,
    "random_ltd_schedule": {"min_value": kept, "max_value": 8, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 10, "seq_per_step": 1}},
    "layer_token_lr_schedule": {"enabled": False}})
layer = RandomLayerTokenDrop(Layer(1 if case["batch_first"] else 0))
layer.init_config({"model_mask_name": "mask", "micro_batch_size": 2, "model_type": "decoder",
                   "hidden_state_order": "batch_seq_dim" if case["batch_first"] else "seq_batch_dim"}, scheduler, 0)
layer.index_generator = lambda reserved, seq, batch, layers, device, mask: (indices, mask[:, :, :reserved, :reserved])
hidden = torch.tensor(case["hidden"], dtype=torch.float64, requires_grad=True)
mask = torch.tensor(case["mask"], dtype=torch.float64)
layer.train()
out, mask_sum = layer(hidden if case["batch_first"] else hidden.transpose(0, 1), mask=mask)
out = out if case["batch_first"] else out.transpose(0, 1)
(out * torch.tensor(case["upstream"], dtype=torch.float64)).sum().backward()
print(json.dumps({"out": out.tolist(), "mask_sum": mask_sum.item(), "hidden_grad": hidden.grad.tolist(),
                  "weight_grad": layer.random_ltd_layer.weight.grad.tolist()}))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
@pytest.mark.parametrize("batch_first", [True, False])
def test_the_layer_equals_deepspeed_s_wrapper_forward_and_backward(batch_first):
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 8, 4, dtype=torch.float64, generator=generator)
    upstream = torch.randn(2, 8, 4, dtype=torch.float64, generator=generator)
    mask = torch.randn(2, 1, 8, 8, dtype=torch.float64, generator=generator)
    weight = [0.5, 0.75, 1.25, 1.5]
    order = "batch_seq_dim" if batch_first else "seq_batch_dim"
    layers = nn.ModuleList([MaskSum(1 if batch_first else 0, weight)])
    state = RandomLTDState(policy(total_layer_num=1, layer_ids=(0,), min_value=3, max_value=8, mask_name="mask",
                                  hidden_state_order=order), data_rank=0)
    wrap_layers(layers, state)
    state.update_seq(0)
    hidden_ours = hidden.clone().requires_grad_()
    out, mask_sum = layers[0](hidden_ours if batch_first else hidden_ours.transpose(0, 1), mask=mask)
    out = out if batch_first else out.transpose(0, 1)
    (out * upstream).sum().backward()

    case = {"indices": state.indices.tolist(), "hidden": hidden.tolist(), "upstream": upstream.tolist(),
            "mask": mask.tolist(), "weight": weight, "batch_first": batch_first}
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_LAYER, json.dumps(case)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    torch.testing.assert_close(out, torch.tensor(theirs["out"], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert mask_sum.item() == pytest.approx(theirs["mask_sum"], rel=1e-12)  # the decoder mask's kept corner
    torch.testing.assert_close(hidden_ours.grad, torch.tensor(theirs["hidden_grad"], dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layers[0].random_ltd_layer.weight.grad,
                               torch.tensor(theirs["weight_grad"], dtype=torch.float64), rtol=1e-12, atol=1e-12)


class MaskSum(nn.Module):
    """The DeepSpeed side's layer: a causal prefix sum times a weight, and the mask it got."""

    def __init__(self, seq_dim: int, weight: list[float]):
        super().__init__()
        self.seq_dim = seq_dim
        self.weight = nn.Parameter(torch.tensor(weight, dtype=torch.float64))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cumsum(x, dim=self.seq_dim) * self.weight, mask.sum()
