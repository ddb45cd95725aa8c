"""`deepspeed.init_inference`: a model for inference on shardwise's forward-only engine.

    model = deepspeed.init_inference(model, dtype=torch.bfloat16, tensor_parallel={"tp_size": 2})
    logits = model(input_ids).logits
    tokens = model.generate(input_ids, max_new_tokens=20)

DeepSpeed's inference options are a config dict or keyword arguments (both at once may not
disagree). What each does here:

- honoured: `dtype` (fp16, bf16, fp32: the weights and the compute dtype);
  `tensor_parallel` / `tp` (`tp_size`; `enabled: false` means 1) and its deprecated
  `mp_size`: the model split by shardwise's tensor parallelism (the built-in plans for
  shardwise GPT, Llama, Mistral, Qwen2 and GPT-2, or the config's plan); `zero`: a
  `zero_optimization` block (stage 3: every rank holds 1/N of the weights, gathered per
  module, DeepSpeed's ZeRO-Inference; `offload_param` to host memory or NVMe).
  The world beyond the tensor group runs data-parallel replicas, each on its own inputs.
- accepted, changing no result: `replace_with_kernel_inject` / `kernel_inject`,
  `injection_policy` (the tensor-parallel plan decides which layers split; a model without
  one is refused by the plan, naming it), `enable_cuda_graph`, `use_triton`,
  `triton_autotune`, `triangular_masking`, `return_tuple`, `max_out_tokens`,
  `min_out_tokens`, `transposed_mode`, `replace_method`, `keep_module_on_host`, `config`,
  `tp_grain_size`, `quant` (read by DeepSpeed for int8 only). torch's own kernels run.
- refused with the reason: `dtype` int8 (no quantised inference kernels), checkpoint
  loading (`checkpoint`, `base_dir`, `checkpoint_config`, `save_mp_checkpoint_path`: load
  the weights with from_pretrained first), MoE (`moe`, `ep_size`, `moe_experts`), and a
  caller's model-parallel unit or group (`mpu`, `tp_group`: the mesh is built from sizes).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from shardwise.frontends.deepspeed.api.comm import init_distributed
from shardwise.frontends.deepspeed.initialize import initialize

log = logging.getLogger("shardwise")

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
DTYPE_NAMES = {"torch.float16": torch.float16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
               "torch.bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "bfloat": torch.bfloat16, "torch.float32": torch.float32, "fp32": torch.float32,
               "float32": torch.float32, "float": torch.float32}
ALIASES = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "max_tokens": "max_out_tokens",
           "min_tokens": "min_out_tokens", "injection_dict": "injection_policy", "ckpt_config": "checkpoint_config",
           "args": "config"}
NO_EFFECT = {"replace_with_kernel_inject", "injection_policy", "injection_policy_tuple", "enable_cuda_graph",
             "use_triton", "triton_autotune", "triangular_masking", "return_tuple", "max_out_tokens",
             "min_out_tokens", "transposed_mode", "replace_method", "keep_module_on_host", "config", "quant",
             "set_empty_params", "training_mp_size"}
REFUSED_WHEN_SET = {
    "checkpoint": "load the weights into the model (from_pretrained) before init_inference",
    "base_dir": "load the weights into the model (from_pretrained) before init_inference",
    "save_mp_checkpoint_path": "save with the model's own save_pretrained",
    "mpu": "the tensor group is built from tensor_parallel.tp_size",
    "ep_group": "MoE layers are not provided",
    "ep_mp_group": "MoE layers are not provided",
}


class InferenceEngine(nn.Module):
    """DeepSpeed's InferenceEngine: `engine(...)` runs the model's forward through the
    forward-only engine (inputs cast to its dtype), `engine.module` is the model, and any
    other attribute is the model's (`generate`, `config`, `device`)."""

    def __init__(self, model: nn.Module, config: dict):
        super().__init__()
        self.engine = initialize(model, config)  # the mode stays the caller's, as in DeepSpeed (from_pretrained: eval)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__.get("_modules", {}).get("engine")
            if engine is None or name.startswith("__"):
                raise
        return getattr(engine.module, name)


def init_inference(model: nn.Module, config: dict | str | os.PathLike | None = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's `init_inference` (see the module docstring for every option)."""
    shardwise_config = _shardwise_config(_merged(config, kwargs))  # refusals come before any process group
    init_distributed()
    return InferenceEngine(model, shardwise_config)


def _merged(config: dict | str | os.PathLike | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as handle:
            config = json.load(handle)
    options = {ALIASES.get(key, key): value for key, value in (config or {}).items()}
    for key, value in kwargs.items():
        key = ALIASES.get(key, key)
        if key in options and options[key] != value:
            raise ValueError(f"init_inference: {key} is {options[key]!r} in the config and {value!r} as a keyword "
                             "argument; give it once")
        options[key] = value
    return options


def _shardwise_config(options: dict[str, Any]) -> dict:
    known = NO_EFFECT | set(REFUSED_WHEN_SET) | {"dtype", "tensor_parallel", "mp_size", "zero", "moe", "ep_size",
                                                 "moe_experts", "moe_type", "checkpoint_config"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"init_inference: unknown option {unknown[0]!r}; DeepSpeed's inference options are "
                         f"{sorted(known)}")
    for key, reason in REFUSED_WHEN_SET.items():
        if options.get(key) not in (None, "", {}):
            raise ValueError(f"init_inference({key}=...) is not supported: {reason}")
    if any(value for value in (options.get("checkpoint_config") or {}).values()):
        raise ValueError("init_inference(checkpoint_config=...) is not supported: load the weights into the model "
                         "(from_pretrained) before init_inference")
    _refuse_moe(options)
    dtype = _dtype(options.get("dtype", torch.float16))
    tp_size = _tensor_parallel_size(options)
    ignored = sorted(key for key in NO_EFFECT if options.get(key))
    if ignored:
        log.info("init_inference: %s change no result here (torch's kernels run)", ", ".join(ignored))
    zero = dict(options.get("zero") or {})
    zero.setdefault("stage", 0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "tensor_parallel": {"size": tp_size},
        "fp16": {"enabled": DTYPES[dtype] == "fp16"},
        "bf16": {"enabled": DTYPES[dtype] == "bf16"},
    }


def _dtype(value: Any) -> torch.dtype:
    dtype = DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if dtype == torch.int8 or value == "int8":
        raise ValueError("init_inference(dtype=torch.int8) is not supported: shardwise has no quantised inference "
                         "kernels; use torch.float16, torch.bfloat16 or torch.float32")
    if dtype not in DTYPES:
        raise ValueError(f"init_inference: dtype {value!r} is not one of torch.float16, torch.bfloat16, torch.float32")
    return dtype


def _tensor_parallel_size(options: dict[str, Any]) -> int:
    block = options.get("tensor_parallel") or {}
    if not isinstance(block, dict):  # DeepSpeedTPConfig-like object
        block = {key: getattr(block, key) for key in ("enabled", "tp_size", "tp_group", "mpu") if hasattr(block, key)}
    if block.get("tp_group") is not None or block.get("mpu") is not None:
        raise ValueError("init_inference(tensor_parallel={'tp_group' / 'mpu': ...}) is not supported: the tensor group "
                         "is built from tensor_parallel.tp_size")
    size = block.get("tp_size", 1) if block.get("enabled", True) else 1
    legacy = options.get("mp_size", 1)
    if legacy != 1:
        if "tp_size" in block and block["tp_size"] != legacy:
            raise ValueError(f"init_inference: mp_size {legacy} and tensor_parallel.tp_size {block['tp_size']} differ; "
                             "give tensor_parallel.tp_size only (mp_size is its deprecated name)")
        size = legacy
    return int(size)


def _refuse_moe(options: dict[str, Any]) -> None:
    moe = options.get("moe")
    experts = options.get("moe_experts", [1])
    moe_on = moe is True or (isinstance(moe, dict) and moe and moe.get("enabled", True)
                             and moe.get("num_experts", moe.get("moe_experts", [1])) != [1])
    if moe_on or options.get("ep_size", 1) != 1 or experts != [1]:
        raise ValueError("init_inference: MoE options (moe, ep_size, moe_experts) are not supported: shardwise "
                         "provides no MoE layers")
