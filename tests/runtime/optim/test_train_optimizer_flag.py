"""`shardwise train --optimizer NAME`: every name gives a config the ranks accept, the
1-bit optimizers get ZeRO stage 2 (the highest they support; 0/1 Adam stage 0) unless the user chose a
stage, and --lr still wins."""

from __future__ import annotations

import pytest

from shardwise.tools.cli.main import build_parser
from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.runtime.optim.registry import optimizer_spec, registered_optimizers
from shardwise.tools.train.options import apply_flags, default_config, optimizer_block, optimizer_names

HIDDEN = 384  # the 10m preset's width, which "auto" bucket sizes follow


@pytest.mark.parametrize("name", optimizer_names())
def test_every_name_resolves_to_a_registered_optimizer(name):
    block = optimizer_block(name, steps=200)
    assert block["type"] in registered_optimizers()
    stages = optimizer_spec(block["type"]).zero_stages
    stage = None if 3 in stages else max(stages)  # the highest stage it runs at, as `shardwise train` picks
    config = load_config(apply_flags(default_config(200), stage, False, 1, optimizer=block), world_size=2,
                         hidden_size=HIDDEN)
    assert config.optimizer.type == block["type"]


def test_onebit_warm_up_is_a_fifth_of_the_steps():
    assert optimizer_block("onebitadam", steps=200)["params"]["freeze_step"] == 40
    assert optimizer_block("onebitlamb", steps=3)["params"]["freeze_step"] == 1


def _prepared(tmp_path, *flags: str) -> dict:
    from shardwise.tools.train.cli import prepare_run

    args = build_parser().parse_args(["train", "--steps", "10", "--nproc", "2", "--out-dir", str(tmp_path), *flags])
    return prepare_run(args)[0].config


def test_onebit_gets_stage_2_and_lr_still_wins(tmp_path):
    config = _prepared(tmp_path, "--optimizer", "onebitlamb", "--lr", "0.03", "--name", "a")
    assert config["zero_optimization"]["stage"] == 2
    assert config["optimizer"]["type"] == "OneBitLamb" and config["optimizer"]["params"]["lr"] == 0.03
    assert _prepared(tmp_path, "--optimizer", "muon", "--name", "b")["zero_optimization"]["stage"] == 3


def test_onebit_with_stage_3_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.type 'OneBitAdam' runs at zero_optimization.stage 0, 1 or 2, not 3"):
        _prepared(tmp_path, "--optimizer", "onebitadam", "--stage", "3", "--name", "c")


def test_unknown_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer", "muadam"])
    assert "argument --optimizer: invalid choice: 'muadam'" in capsys.readouterr().err
