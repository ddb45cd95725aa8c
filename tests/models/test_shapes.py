"""Parameter counts from configs and presets against the models transformers builds."""

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from shardwise.tools.planner import ModelShape
from shardwise.models.shapes import PRESETS
from shardwise.models.shapes import preset_shape, shape_from_hf_config


def parameter_count(model: torch.nn.Module) -> int:
    """model.parameters() yields a tied weight once, as the optimizer sees it."""
    return sum(p.numel() for p in model.parameters())


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    settings = dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "mlp_bias": True}, {"head_dim": 12}],
    ids=["gqa", "tied", "biases", "head-dim"],
)
def test_llama_config_json_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    config = tiny_llama_config(**overrides)
    config.to_json_file(tmp_path / "config.json")
    shape = shape_from_hf_config(tmp_path / "config.json")
    assert shape.num_params == parameter_count(LlamaForCausalLM(config))
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.vocab_size) == (64, 3, 8, 1000)
    assert shape_from_hf_config(tmp_path).num_params == shape.num_params  # a directory works too


def test_mistral_and_gpt2_configs_match_transformers(tmp_path: Path) -> None:
    mistral = MistralConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=500)
    assert shape_from_hf_config(mistral.to_dict()).num_params == parameter_count(MistralForCausalLM(mistral))

    gpt2 = GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=300, n_positions=64)
    gpt2.to_json_file(tmp_path / "config.json")
    assert shape_from_hf_config(tmp_path / "config.json").num_params == parameter_count(GPT2LMHeadModel(gpt2))


def test_known_preset_counts() -> None:
    assert preset_shape("gpt2").num_params == 124_439_808
    assert preset_shape("llama-7b").num_params == 6_738_415_616
    assert preset_shape("llama-70b").num_params == 68_976_648_192


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_match_transformers_on_meta_device(name: str) -> None:
    settings = {key: value for key, value in PRESETS[name].items() if key != "model_type"}
    llama = PRESETS[name]["model_type"] == "llama"
    config = LlamaConfig(**settings) if llama else GPT2Config(**settings)
    with torch.device("meta"):
        model = LlamaForCausalLM(config) if llama else GPT2LMHeadModel(config)
    shape = preset_shape(name)
    assert shape.num_params == parameter_count(model)
    largest_block = max(parameter_count(block) for block in (model.model.layers if llama else model.transformer.h))
    assert shape.largest_layer_params == max(largest_block, config.vocab_size * shape.hidden_size)


def test_from_params_keeps_optional_layout() -> None:
    bare = ModelShape.from_params(7.5e9)
    assert bare.num_params == 7_500_000_000 and not bare.has_layout and bare.largest_layer_params is None
    shaped = ModelShape.from_params(1e9, hidden_size=2048, num_layers=20, num_heads=16, vocab_size=50000)
    assert shaped.has_layout
    assert shaped.largest_layer_params == max(12 * 2048 * 2048, 50000 * 2048)


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'llama-8b'; choose from gpt2"):
        preset_shape("llama-8b")
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        shape_from_hf_config({"model_type": "bert"})
    with pytest.raises(ValueError, match="no 'intermediate_size'"):
        shape_from_hf_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "vocab_size": 10})
    with pytest.raises(FileNotFoundError, match="no Hugging Face config"):
        shape_from_hf_config(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        shape_from_hf_config(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="whole number"):
        ModelShape.from_params(1.5)
