"""Model shapes for the planner, from a Hugging Face config alone (a JSON read, no
transformers import): each family counts its parameters with the module structure
transformers builds (models/hf/llama.py, models/hf/gpt2.py), so the counts match
`model.parameters()` exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from shardwise.formulas.model_shape import ModelShape
from shardwise.models.core.hf_config import load_config
from shardwise.models.hf import gpt2, llama

FAMILIES = {"llama": llama.shape, "mistral": llama.shape, "gpt2": gpt2.shape}

# Real shapes: GPT-2 as released by OpenAI, llama-* as Llama 2 (70b uses grouped-query
# attention with 8 key/value heads).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    "gpt2-medium": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 50257, "n_positions": 1024},
    "gpt2-large": {"model_type": "gpt2", "n_embd": 1280, "n_layer": 36, "n_head": 20, "vocab_size": 50257, "n_positions": 1024},
    "gpt2-xl": {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257, "n_positions": 1024},
    "llama-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "llama-13b": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000},
    "llama-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000},
}


def preset_shape(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return shape_from_hf_config(PRESETS[name], name=name)


def shape_from_hf_config(path_or_dict: str | Path | Mapping[str, Any], name: str | None = None) -> ModelShape:
    """Shape of a llama/mistral- or gpt2-style Hugging Face model from its config (a dict,
    a config.json, or a directory holding one). Keys a config may omit take transformers'
    defaults; the size keys are required."""
    config, source, where = load_config(path_or_dict)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(FAMILIES)} (or pass --params)")
    return FAMILIES[model_type](config, name or source, where)
