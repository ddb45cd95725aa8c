"""Model shapes for the planner: parameter count plus the layout activations depend on.

Counts come from the Hugging Face config alone (a JSON read, no transformers import), with
the same module structure transformers builds, so they match `model.parameters()` exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

LLAMA_STYLE = ("llama", "mistral")
GPT2_STYLE = ("gpt2",)

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


@dataclass(frozen=True)
class ModelShape:
    """A model as the memory formulas see it. Layout fields are None when only the
    parameter count is known; activations and the stage-3 working set then go uncounted.

    `largest_layer_params` is the biggest unit stage 3 gathers at once, taken as a whole
    transformer block or the embedding/output matrix, whichever is larger: engines that
    gather module by module need less, so this errs on the safe side.
    """

    name: str
    num_params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    largest_layer_params: int | None = None
    trainable_params: int | None = None  # None: all of them; fewer: the rest is frozen (LoRA's base weights)

    def __post_init__(self) -> None:
        if self.num_params <= 0:
            raise ValueError(f"num_params must be positive, got {self.num_params}")
        if self.trainable_params is not None and not 0 < self.trainable_params <= self.num_params:
            raise ValueError(f"trainable_params must be in 1..num_params ({self.num_params:,}), "
                             f"got {self.trainable_params}")
        for field in ("hidden_size", "num_layers", "num_heads", "vocab_size", "intermediate_size", "largest_layer_params"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"{field} must be positive, got {value}")

    @property
    def replicated_params(self) -> int:
        """Parameters every tensor rank holds whole: the norms, (2L + 1)·h (biases of
        row-parallel layers and position tables, if any, are left out: small beside the
        rest). 0 when the layout is unknown."""
        if self.hidden_size is None or self.num_layers is None:
            return 0
        return (2 * self.num_layers + 1) * self.hidden_size

    def params_per_tensor_rank(self, tensor_size: int) -> int:
        """Ψ_T = ⌈(Ψ − Ψ_r)/T⌉ + Ψ_r: a 1/T block of every split parameter, every replicated one whole."""
        replicated = self.replicated_params
        return -(-(self.num_params - replicated) // tensor_size) + replicated

    @property
    def frozen_params(self) -> int:
        """Ψ_f: parameters held but not trained (no gradient, master or optimizer state)."""
        return 0 if self.trainable_params is None else self.num_params - self.trainable_params

    @property
    def has_layout(self) -> bool:
        """Whether activation memory can be computed (needs h, L and a)."""
        return None not in (self.hidden_size, self.num_layers, self.num_heads)

    def describe(self) -> str:
        layout = ""
        if self.has_layout:
            layout = f" (h={self.hidden_size}, L={self.num_layers}, a={self.num_heads}"
            layout += f", V={self.vocab_size})" if self.vocab_size else ")"
        frozen = (f", of which Ψ_t = {self.trainable_params:,} trained and Ψ_f = {self.frozen_params:,} frozen"
                  if self.frozen_params else "")
        return f"{self.name}: Ψ = {self.num_params:,} parameters{frozen}{layout}"

    @classmethod
    def from_params(
        cls,
        num_params: int | float,
        hidden_size: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        vocab_size: int | None = None,
    ) -> ModelShape:
        """A bare parameter count, optionally with the layout for activations. The largest
        gathered unit is then taken as a GPT block, 12h², or the V·h embedding."""
        if float(num_params) != int(num_params):
            raise ValueError(f"num_params must be a whole number, got {num_params}")
        count = int(num_params)
        largest = None
        if hidden_size:
            largest = max(12 * hidden_size * hidden_size, (vocab_size or 0) * hidden_size)
        return cls("model", count, hidden_size, num_layers, num_heads, vocab_size, None, largest)

    @classmethod
    def preset(cls, name: str) -> ModelShape:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls.from_hf_config(PRESETS[name], name=name)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | Mapping[str, Any], name: str | None = None) -> ModelShape:
        """Shape of a llama/mistral- or gpt2-style Hugging Face model from its config
        (a dict, a config.json, or a directory holding one). Keys a config may omit take
        transformers' defaults; the size keys are required."""
        config, source, where = _load_config(path_or_dict)
        model_type = config.get("model_type")
        if model_type in LLAMA_STYLE:
            return _llama_style_shape(config, name or source, where)
        if model_type in GPT2_STYLE:
            return _gpt2_style_shape(config, name or source, where)
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(LLAMA_STYLE + GPT2_STYLE)} (or pass --params)"
        )


def _load_config(path_or_dict: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str, str]:
    """(config, the model's name, where the config came from for messages)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "config", "config"
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path}")
    try:
        data = path.read_bytes()
        config = json.loads(data.decode("utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
                         "a Hugging Face config.json is UTF-8 JSON; check that the path names one") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config, path.parent.name or str(path), str(path)


def _require(config: Mapping[str, Any], key: str, where: str) -> int:
    if config.get(key) is None:
        raise ValueError(f"{where}: config has no {key!r}, needed to count parameters")
    return _count(config, key, where)


def _optional(config: Mapping[str, Any], key: str, default: int, where: str) -> int:
    """A key transformers fills in when it is absent or null."""
    return default if config.get(key) is None else _count(config, key, where)


def _count(config: Mapping[str, Any], key: str, where: str) -> int:
    """A size or count from the config; JSON may write it as 64.0, but not as "64", 0 or NaN."""
    value = config[key]
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value <= 0:
        raise ValueError(f"{where}: {key} is {value!r}, not a positive integer (a size or count of the model); "
                         "correct it in the config")
    return int(value)


def _check_divides(whole: tuple[str, int], part: tuple[str, int], why: str, where: str) -> None:
    """A layout the model family does not define (attention splits the width evenly): said before
    counting, rather than counting a model that cannot be meant."""
    if whole[1] % part[1]:
        raise ValueError(f"{where}: {whole[0]} {whole[1]} is not divisible by {part[0]} {part[1]}: {why}; "
                         "correct the config")


def _llama_style_shape(config: Mapping[str, Any], source: str, where: str) -> ModelShape:
    """Embedding V·h; per block q/k/v/o projections (k and v narrowed by grouped-query
    attention), a gated MLP of three h×I matrices and two RMSNorm weights; a final norm;
    an untied V·h output head. Mistral never has biases, llama may."""
    h = _require(config, "hidden_size", where)
    layers = _require(config, "num_hidden_layers", where)
    heads = _require(config, "num_attention_heads", where)
    inner = _require(config, "intermediate_size", where)
    vocab = _require(config, "vocab_size", where)
    kv_heads = _optional(config, "num_key_value_heads", heads, where)
    if config.get("head_dim") is None:
        _check_divides(("hidden_size", h), ("num_attention_heads", heads),
                       "each attention head gets hidden_size / num_attention_heads dimensions (or set head_dim)", where)
    head_dim = _optional(config, "head_dim", h // heads, where)
    if config.get("num_key_value_heads") is not None:
        _check_divides(("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       "grouped-query attention gives each key/value head the same number of query heads", where)
    llama = config["model_type"] == "llama"
    attention_bias = llama and bool(config.get("attention_bias", False))
    mlp_bias = llama and bool(config.get("mlp_bias", False))
    tied = bool(config.get("tie_word_embeddings", False))

    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if attention_bias:
        attention += q_width + 2 * kv_width + h
    mlp = 3 * h * inner + (2 * inner + h if mlp_bias else 0)
    block = attention + mlp + 2 * h
    embedding = vocab * h
    total = embedding + layers * block + h + (0 if tied else embedding)
    return ModelShape(source, total, h, layers, heads, vocab, inner, max(block, embedding))


def _gpt2_style_shape(config: Mapping[str, Any], source: str, where: str) -> ModelShape:
    """Token and position embeddings; per block two LayerNorms (weight and bias), a fused
    QKV projection and an output projection, a two-matrix MLP, all with biases; a final
    LayerNorm; the output head tied to the token embedding unless the config says not."""
    h = _require(config, "n_embd", where)
    layers = _require(config, "n_layer", where)
    heads = _require(config, "n_head", where)
    vocab = _require(config, "vocab_size", where)
    positions = _require(config, "n_positions", where)
    _check_divides(("n_embd", h), ("n_head", heads), "each attention head gets n_embd / n_head dimensions", where)
    inner = _optional(config, "n_inner", 4 * h, where)
    tied = bool(config.get("tie_word_embeddings", True))

    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * inner + inner) + (inner * h + h)
    block = attention + mlp + 2 * 2 * h
    embedding = vocab * h
    total = embedding + positions * h + layers * block + 2 * h + (0 if tied else embedding)
    return ModelShape(source, total, h, layers, heads, vocab, inner, max(block, embedding))
