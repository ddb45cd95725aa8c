"""Nonsense input fails at once with a message naming the key, file or flag, the reason and
the fix (reliability issue, part 5): configs, checkpoints, `shardwise convert` and
`shardwise estimate`. CLI cases run in-process and must return exit code 2: an uncaught
exception (a traceback) would fail the test instead."""

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import shardwise
from shardwise.runtime.checkpoint import CheckpointError, convert_checkpoint, safetensors_io
from shardwise.tools.cli.main import main as shardwise_main
from shardwise.frontends.deepspeed.config import ConfigError, load_config

NOT_FINITE = (
    "is not a finite number: NaN and Infinity (which Python's JSON reader accepts) are not valid settings; "
    "give a finite number"
)
GIVE_TAG = "or give the tag to load (tag= in load_checkpoint, --tag in shardwise convert)"


def config_problems(config: dict | str | Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=1)
    return caught.value.problems


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_gradient_clipping_must_be_finite(value):
    assert config_problems({"train_batch_size": 8, "gradient_clipping": value}) == [
        f"gradient_clipping: {value} is not a finite gradient norm: give a maximum norm such as 1.0, "
        "or 0 to disable clipping"
    ]


@pytest.mark.parametrize("power", [65, 2000])  # 2.0 ** 2000 raises OverflowError in Python
def test_initial_scale_power_is_bounded_with_the_reason(power):
    assert config_problems({"train_batch_size": 8, "fp16": {"enabled": True, "initial_scale_power": power}}) == [
        f"fp16.initial_scale_power: {power} is above 64: the loss is multiplied by 2**{power} in fp32, and fp16 "
        "gradients overflow above 2**16, so every step overflows and is skipped, each overflow halving the scale "
        f"once (after fp16.hysteresis overflows are tolerated): about {power - 16} steps would be skipped before "
        "the first update. Use at most 64 (DeepSpeed's default is 16)"
    ]


@pytest.mark.parametrize(
    ("key", "config"),
    [
        ("fp16.loss_scale", {"fp16": {"enabled": True, "loss_scale": float("inf")}}),
        ("fp16.min_loss_scale", {"fp16": {"enabled": True, "min_loss_scale": float("nan")}}),
        ("optimizer.params.lr", {"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}),
        ("optimizer.params.eps", {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": float("inf")}}}),
        ("optimizer.params.betas.1",
         {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, float("nan")]}}}),
        ("optimizer.params.weight_decay",
         {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "weight_decay": float("-inf")}}}),
        ("scheduler.params.warmup_max_lr",
         {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("inf")}}}),
        ("scheduler.params.cos_min_ratio",
         {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "scheduler": {"type": "WarmupCosineLR",
                        "params": {"total_num_steps": 10, "warmup_num_steps": 1, "cos_min_ratio": float("nan")}}}),
    ],
)
def test_every_float_setting_must_be_finite(key, config):
    (problem,) = config_problems({"train_batch_size": 8, **config})
    assert problem.startswith(f"{key}: ") and problem.endswith(NOT_FINITE), problem


def test_nan_literal_in_a_json_file_is_refused(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": NaN}}}')
    assert config_problems(path) == [f"optimizer.params.lr: nan {NOT_FINITE}"]


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_bytes(b'{"train_batch_size": 8, "_comment": "caf\xe9"}')  # Latin-1, not UTF-8
    assert config_problems(path) == [
        f"config file {path} is not UTF-8 text (byte 0xe9 at offset 40): JSON configs must be UTF-8; save it as "
        "UTF-8, or check that the path names the config and not another file"
    ]


def test_config_file_that_is_a_directory(tmp_path):
    assert config_problems(tmp_path) == [
        f"config file {tmp_path} is a directory: give the path of the JSON config file inside it"
    ]


# --- checkpoints ----------------------------------------------------------------------------

ENGINE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def tiny_engine():
    torch.manual_seed(0)
    return shardwise.initialize(torch.nn.Linear(4, 4), ENGINE_CONFIG)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    tiny_engine().save_checkpoint(root, tag="step1")
    return root


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    """A private copy of a single-rank checkpoint with tag 'step1', free to damage."""
    root = tmp_path / "checkpoint"
    shutil.copytree(saved, root)
    return root


def load_error(root: Path) -> str:
    with pytest.raises(CheckpointError) as caught:
        tiny_engine().load_checkpoint(root)
    return str(caught.value)


def convert_error(argv: list[str], capsys) -> str:
    assert shardwise_main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise convert: error: ")
    return err.removeprefix("shardwise convert: error: ").rstrip("\n")


def test_latest_that_is_not_utf8(checkpoint):
    (checkpoint / "latest").write_text("step1\n", encoding="utf-16")  # b"\xff\xfes\x00t\x00..."
    assert load_error(checkpoint) == (
        f"checkpoint file {checkpoint / 'latest'} is not UTF-8 text (it starts "
        r"b'\xff\xfes\x00t\x00e\x00p\x001\x00\n\x00'; byte 0xff at offset 0 cannot be decoded), so it is not "
        f"what shardwise wrote: write one of the tags present (step1) into it, {GIVE_TAG}"
    )


@pytest.mark.parametrize(("content", "what"), [("", "is empty"), (" \n\t", r"holds only whitespace (' \n\t')")])
def test_latest_that_names_no_tag(checkpoint, content, what):
    (checkpoint / "latest").write_text(content)
    assert load_error(checkpoint) == (
        f"checkpoint file {checkpoint / 'latest'} {what}: it should hold the tag of the newest checkpoint; "
        f"write one of the tags present (step1) into it, {GIVE_TAG}"
    )


@pytest.mark.parametrize("content", ["../elsewhere", "step1/..", "/etc"])
def test_latest_that_names_a_path(checkpoint, content, capsys, tmp_path):
    (checkpoint / "latest").write_text(content + "\n")
    assert convert_error([str(checkpoint), str(tmp_path / "out")], capsys) == (
        f"checkpoint file {checkpoint / 'latest'} holds {content!r}, which is not a checkpoint tag: a tag names a "
        "directory beside 'latest' (letters, digits and _ . + = -), never a path with '/' or '..'; "
        f"write one of the tags present (step1) into it, {GIVE_TAG}"
    )


@pytest.mark.parametrize("key", ["sha256", "bytes"])
def test_manifest_entry_without_its_checksum_or_size(checkpoint, key):
    manifest = checkpoint / "step1" / "manifest.json"
    entries = json.loads(manifest.read_text())
    del entries["files"]["meta.json"][key]
    manifest.write_text(json.dumps(entries))
    assert load_error(checkpoint) == (
        f"checkpoint file {manifest} lists 'meta.json' without its '{key}': the manifest was damaged or edited, "
        "so the checkpoint cannot be verified; restore manifest.json from a copy, or save the checkpoint again"
    )


def test_manifest_that_is_not_utf8(checkpoint):
    manifest = checkpoint / "step1" / "manifest.json"
    data = manifest.read_bytes().replace(b'"files"', b'"f\xe9les"')  # Latin-1 where UTF-8 belongs
    manifest.write_bytes(data)
    assert load_error(checkpoint) == (
        f"checkpoint file {manifest} is not UTF-8 text (it starts {data[:16]!r}; byte 0xe9 at offset "
        f"{data.index(0xE9)} cannot be decoded), so it is not what shardwise wrote: it was corrupted or replaced; "
        "restore it from a copy, or save the checkpoint again"
    )


@pytest.mark.parametrize("extra", ["rank_00001.safetensors", "rank_00001.json"])
def test_file_the_manifest_does_not_list_is_reported(checkpoint, extra, capsys, tmp_path):
    tag_dir = checkpoint / "step1"
    shutil.copy(tag_dir / extra.replace("00001", "00000"), tag_dir / extra)
    expected = (
        f"checkpoint {tag_dir} holds {extra}, which its manifest does not list: an unlisted file cannot be "
        "verified, yet a loader would read it; remove it if it does not belong to this checkpoint (e.g. copied "
        "in from another run), or save the checkpoint again"
    )
    assert load_error(checkpoint) == expected
    assert convert_error([str(checkpoint), str(tmp_path / "out")], capsys) == expected


class FullDisk:
    """A file whose writes after the first fail with ENOSPC. A real full disk cannot be produced
    here (it needs a file system filled to its last block), so the error is injected where the
    writer's bytes reach the file, as the kernel would raise it."""

    def __init__(self, file):
        self._file, self._writes = file, 0

    def write(self, data):
        self._writes += 1
        if self._writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_full_disk_while_writing_a_tensor_file_names_the_bytes(saved, tmp_path, monkeypatch):
    size = (saved / "step1" / "rank_00000.safetensors").stat().st_size
    engine = tiny_engine()
    monkeypatch.setattr(safetensors_io, "open", lambda path, mode: FullDisk(open(path, mode)), raising=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    with pytest.raises(CheckpointError) as caught:
        engine.save_checkpoint(tmp_path, tag="step1")
    assert str(caught.value) == (
        f"cannot write {tmp_path / '.step1.partial' / 'rank_00000.safetensors'}: no space left on device; the file "
        f"needs {size:,} bytes and 4,096 bytes are free on its file system. Free some space (or raise the quota), "
        "or write to another directory"
    )
    assert not (tmp_path / "latest").exists()  # nothing was published


def test_convert_refuses_to_replace_output_without_overwrite(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert shardwise_main(["convert", str(checkpoint), str(out)]) == 0
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an earlier conversion")
    capsys.readouterr()
    assert convert_error([str(checkpoint), str(out)], capsys) == (
        f"output files {out / 'model-00001-of-00002.safetensors'}, {out / 'model.safetensors'} already exist: "
        "pass --overwrite (overwrite=True in convert_checkpoint) to replace them, or choose another output"
    )
    assert shardwise_main(["convert", str(checkpoint), str(out), "--overwrite"]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["model.safetensors"]
    single = tmp_path / "gpt.safetensors"
    convert_checkpoint(checkpoint, single)
    with pytest.raises(CheckpointError, match=rf"^output file {single} already exists: pass --overwrite"):
        convert_checkpoint(checkpoint, single)


def test_convert_onto_a_path_that_cannot_be_created_or_written(checkpoint, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    out = tmp_path / "notes.txt" / "out"
    assert convert_error([str(checkpoint), str(out)], capsys) == (
        f"cannot create output directory {out}: {tmp_path / 'notes.txt'} is a file, not a directory; "
        "choose another output path"
    )
    (tmp_path / "out" / "model.safetensors").mkdir(parents=True)  # the output file's name is taken by a folder
    assert convert_error([str(checkpoint), str(tmp_path / "out")], capsys) == (
        f"cannot write {tmp_path / 'out' / 'model.safetensors'}: Is a directory; choose an output path you can "
        "write to"
    )


# --- estimator ------------------------------------------------------------------------------


def estimate_error(argv: list[str], capsys) -> str:
    assert shardwise_main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("shardwise estimate: error: ")
    return captured.err.removeprefix("shardwise estimate: error: ").rstrip("\n")


@pytest.mark.parametrize(("value", "shown"), [("inf", "inf"), ("nan", "nan"), ("-5", "-5"), ("0", "0")])
def test_estimate_params_must_be_a_positive_finite_count(value, shown, capsys):
    assert estimate_error(["--params", value], capsys) == (
        f"--params {shown} is not a parameter count: give the model's number of parameters, a positive finite "
        "number such as 7.5e9"
    )


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 1000}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads is 0, not a positive integer"),
        ({"num_hidden_layers": -2}, "num_hidden_layers is -2, not a positive integer"),
        ({"hidden_size": -64}, "hidden_size is -64, not a positive integer"),
        ({"hidden_size": "64k"}, "hidden_size is '64k', not a positive integer"),
        ({"hidden_size": [64]}, "hidden_size is [64], not a positive integer"),
    ],
)
def test_estimate_model_config_sizes_must_be_positive_integers(change, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **change}))
    assert estimate_error(["--hf-config", str(path)], capsys) == (
        f"{path}: {message} (a size or count of the model); correct it in the config"
    )


def test_estimate_model_config_heads_must_divide_hidden(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "num_attention_heads": 3}))
    assert estimate_error(["--hf-config", str(tmp_path)], capsys) == (
        f"{path}: hidden_size 64 is not divisible by num_attention_heads 3: each attention head gets "
        "hidden_size / num_attention_heads dimensions (or set head_dim); correct the config"
    )
    assert estimate_error(["--params", "1e6", "--hidden-size", "64", "--heads", "3"], capsys) == (
        "--hidden-size 64 is not divisible by --heads 3: each attention head gets hidden-size / heads dimensions"
    )


def test_a_rate_or_list_of_rates_gets_one_problem_from_the_member_that_fits():
    """warmup_max_lr is a rate or a list of rates (one per param group): a bad element of a
    list is named by its index, without the scalar member's "should be a number"."""
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, -1]}}
    assert config_problems({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                            "scheduler": scheduler}) == [
        "scheduler.params.warmup_max_lr.1: Input should be greater than or equal to 0 (got -1)"]
