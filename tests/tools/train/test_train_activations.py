"""The main job with activation checkpointing: the flag reaches the config, and the report
puts the measured activation bytes beside the formulas and explains stage 3's re-gathers."""

from __future__ import annotations

import argparse

import pytest
import torch
from rich.console import Console

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.tools.testing import run_distributed
from shardwise.tools.train.activation_report import activation_summary, activation_table, regather_note
from shardwise.tools.train.cli import add_parser
from shardwise.tools.train.options import apply_flags, default_config

SEQ, LAYERS = 32, 3


def test_flag_sets_the_policy_and_keeps_the_rest_of_the_block():
    user = {"activation_checkpointing": {"policy": "full", "every_k": 3, "cpu_checkpointing": True}}
    config = apply_flags(user, None, False, 1, recompute="every_k")
    assert config["activation_checkpointing"] == {"policy": "every_k", "every_k": 3, "cpu_checkpointing": True}
    assert "activation_checkpointing" not in apply_flags(default_config(5), None, False, 1)
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--activation-checkpointing", "sqrt"]).activation_checkpointing == "sqrt"
    with pytest.raises(SystemExit):
        parser.parse_args(["--activation-checkpointing", "half"])


def summaries(rank: int, world_size: int, policies: list[str]) -> dict:
    """The main job's summary after two steps of a 3-layer GPT at stage 3, per policy."""
    results = {}
    for policy in policies:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=32))
        config = apply_flags(default_config(2), 3, False, 1, recompute=policy)
        engine = shardwise.initialize(model, config)
        for step in range(2):
            rows = engine.config.train_micro_batch_size_per_gpu
            tokens = torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(step + rank))
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        results[policy] = {"activations": activation_summary(engine, SEQ, 2)}
        engine.destroy()
    return results


def test_summary_matches_the_formulas_and_explains_stage_3_regathers():
    result = run_distributed(summaries, 2, ["none", "full", "selective"])[0]
    for policy, summary in result.items():
        measured, formula = summary["activations"]["measured"], summary["activations"]["formula"]
        assert measured["checkpoints"] == formula["checkpoints"], policy  # inputs and kept outputs, exactly
        for kind in ("recompute", "saved", "total"):
            assert abs(measured[kind] - formula[kind]) <= 0.1 * formula[kind], (policy, kind, measured, formula)
        assert measured["layers_per_step"] == formula["layers_per_step"] == (0 if policy == "none" else LAYERS)
    assert result["none"]["activations"]["regather"] is None and regather_note(result["none"]) is None
    regather = result["full"]["activations"]["regather"]
    # 4 units per block at the main job's persistence threshold (the norms stay whole)
    assert regather["units_per_step"] == regather["formula_units_per_step"] == LAYERS * regather["units_per_layer"]
    assert regather["bytes_per_step"] == LAYERS * regather["layer_params"] * 4 // 2
    console = Console(record=True, width=200)
    console.print(activation_table(result["full"]))
    console.print(regather_note(result["full"]))
    text = console.export_text()
    assert "checkpoints (kept inputs, selective's kept outputs)" in text and "exact" in text
    assert f"re-gathered {LAYERS * regather['units_per_layer']} parameter units per step" in text
    assert "adds no all-gather bytes" in text
