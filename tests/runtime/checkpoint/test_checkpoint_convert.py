"""`shardwise convert`: consolidated safetensors (fp32/bf16, sharded) streamed one block
at a time, and Hugging Face folders that `from_pretrained` loads (issue 4, C8)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.runtime.checkpoint import convert_checkpoint
from shardwise.tools.cli.main import main as shardwise_main
from shardwise.tools.testing import run_distributed
from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from tests.runtime.checkpoint.workers import logits_after_training, peak_rss_growth_of_convert
from tests.runtime.zero.workers import global_batch


def test_fp32_single_file_holds_the_trained_weights(stage3_checkpoint, tmp_path):
    written = convert_checkpoint(stage3_checkpoint.directory, tmp_path / "gpt.safetensors")
    assert written == [tmp_path / "gpt.safetensors"]
    tensors = load_file(written[0])
    assert tensors.keys() == stage3_checkpoint.params.keys()  # the tied lm_head is written once
    for name, want in stage3_checkpoint.params.items():
        assert tensors[name].dtype == torch.float32
        assert tensors[name].equal(want), name


def test_bf16_sharded_through_the_cli(stage3_checkpoint, tmp_path, capsys):
    code = shardwise_main(["convert", str(stage3_checkpoint.directory), str(tmp_path), "--dtype", "bf16",
                           "--max-shard-size", "10KB", "--tag", stage3_checkpoint.tag])
    assert code == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert f"wrote {tmp_path / shards[0]}" in capsys.readouterr().out
    sizes = {name: (tmp_path / name).stat().st_size for name in shards}
    largest_tensor = max(t.numel() * 2 for t in stage3_checkpoint.params.values())
    assert all(size < max(10_000, largest_tensor) + 4096 for size in sizes.values()), sizes
    loaded = {}
    for name in shards:
        loaded.update(load_file(tmp_path / name))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in loaded.values())
    assert loaded.keys() == stage3_checkpoint.params.keys() == index["weight_map"].keys()
    for name, want in stage3_checkpoint.params.items():
        assert loaded[name].dtype == torch.bfloat16
        assert loaded[name].equal(want.to(torch.bfloat16)), name


def test_cli_reports_errors(stage3_checkpoint, tmp_path, capsys):
    assert shardwise_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no 'latest' file" in capsys.readouterr().err
    assert shardwise_main(["convert", str(stage3_checkpoint.directory), str(tmp_path), "--hf"]) == 2
    assert "no Hugging Face config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot read size '5 parsecs'"):
        convert_checkpoint(stage3_checkpoint.directory, tmp_path, max_shard_size="5 parsecs")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs /proc/self/clear_refs to reset peak RSS")
def test_memory_stays_near_the_largest_parameter(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    shardwise.initialize(model, config).save_checkpoint(tmp_path / "checkpoint")
    shardwise.initialize(torch.nn.Linear(4, 4), config).save_checkpoint(tmp_path / "small")
    model_bytes, largest = 16 * 1024 * 1024 * 4, 1024 * 1024 * 4
    context = preloaded_forkserver_context()
    for dtype in ("fp32", "bf16"):
        reports, child_end = context.Pipe(duplex=False)
        process = context.Process(target=peak_rss_growth_of_convert,
                                  args=(str(tmp_path / "small"), str(tmp_path / "checkpoint"), str(tmp_path / dtype),
                                        dtype, child_end))
        process.start()
        child_end.close()
        growth = reports.recv()
        process.join()
        # one block read, its cast copy and allocator slack; the whole model would be 64 MiB
        assert growth < 4 * largest, f"{dtype}: peak RSS grew {growth / 2**20:.1f} MiB converting a " \
                                     f"{model_bytes / 2**20:.0f} MiB model with {largest / 2**20:.0f} MiB parameters"
        assert (tmp_path / dtype / "model.safetensors").stat().st_size > model_bytes // (2 if dtype == "bf16" else 1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_folder_loads_with_from_pretrained(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    for stage in (2, 3):
        checkpoint, folder = tmp_path / f"checkpoint-{stage}", tmp_path / f"hf-{stage}"
        trained_logits = run_distributed(logits_after_training, 2, kind, stage, str(checkpoint))[0]
        assert shardwise_main(["convert", str(checkpoint), str(folder), "--hf"]) == 0
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == [{"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[kind]]
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits = model(input_ids=global_batch(99, 2)[0]).logits
        assert logits.equal(trained_logits), f"stage {stage}: max diff {(logits - trained_logits).abs().max()}"
