"""`deepspeed.init_inference` on the forward-only engine: a Hugging Face Llama split by
tensor parallelism (`tensor_parallel.tp_size`, or the deprecated `mp_size`) or held 1/N per
rank (`zero` stage 3) gives the logits and the greedy generation of the plain model;
options that cannot be honoured are refused before anything starts."""

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import VOCAB, build_model

ROWS, PROMPT, NEW_TOKENS = 2, 4, 6


def _inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, 12), generator=torch.Generator().manual_seed(5))


def infer(rank: int, world_size: int, options: dict) -> dict:
    engine = deepspeed.init_inference(build_model("llama").eval(), **options)
    ids = _inputs()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    generated = engine.generate(ids[:, :PROMPT], max_new_tokens=NEW_TOKENS, do_sample=False)
    held = engine.engine.memory_breakdown()["params"]
    return {"logits": logits, "generated": generated, "params": held,
            "config_is_hf": type(engine.config).__name__ == "LlamaConfig", "module_is_model": engine.module.training}


def reference() -> dict:
    model = build_model("llama").eval()
    ids = _inputs()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    generated = model.generate(ids[:, :PROMPT], max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"logits": logits, "generated": generated, "params": sum(p.numel() for p in model.parameters()) * 4}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("options", [
    {"dtype": torch.float32, "tensor_parallel": {"tp_size": 2}, "replace_with_kernel_inject": False},
    {"dtype": "fp32", "mp_size": 2, "replace_with_kernel_inject": True, "max_tokens": 64},
    {"dtype": torch.float, "zero": {"stage": 3, "stage3_param_persistence_threshold": 0}},
], ids=["tp2", "mp_size2", "zero3"])
def test_init_inference_equals_the_plain_model(options):
    expected = reference()
    for result in run_distributed(infer, 2, options, timeout=240):
        assert _relative(result["logits"], expected["logits"]) < 1e-5
        assert torch.equal(result["generated"], expected["generated"])
        assert result["config_is_hf"] and not result["module_is_model"]
        assert result["params"] < 0.6 * expected["params"]  # each rank holds half the weights, or a TP shard


def test_init_inference_in_bf16_is_close():
    expected = reference()
    for result in run_distributed(infer, 2, {"dtype": torch.bfloat16, "tensor_parallel": {"tp_size": 2}}, timeout=240):
        assert _relative(result["logits"], expected["logits"]) < 2e-2


@pytest.mark.parametrize("options, message", [
    ({"dtype": torch.int8}, "no quantised inference kernels"),
    ({"checkpoint": "checkpoint.json"}, "from_pretrained"),
    ({"moe": {"enabled": True, "num_experts": [8]}}, "no MoE layers"),
    ({"tensor_parallel": {"tp_size": 2}, "mp_size": 4}, "mp_size 4 and tensor_parallel.tp_size 2 differ"),
    ({"quantize_bits": 8}, "unknown option 'quantize_bits'"),
])
def test_init_inference_refuses_what_it_cannot_honour(options, message):
    with pytest.raises(ValueError, match=message):
        deepspeed.init_inference(torch.nn.Linear(2, 2), **options)


def test_config_and_keyword_arguments_may_not_disagree():
    with pytest.raises(ValueError, match="dtype is .* in the config and"):
        deepspeed.init_inference(torch.nn.Linear(2, 2), config={"dtype": "fp16"}, dtype=torch.float32)
