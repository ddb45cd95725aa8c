"""DeepSpeed's ALST API (`deepspeed.runtime.sequence_parallel.ulysses_sp`): the tutorial's
loop on two ranks equals training the whole sequences in one process; the register's,
the adapter's and initialize's checks; the loop with ALST's tiled MLP and loss at ZeRO
1-3; and, when DEEPSPEED_PYTHON is set, the adapter's
shards and the checks' exception types against DeepSpeed 0.19.8 itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api.runtime.sequence_parallel.alst_workers import alst, checks, layout_mismatch

pytest.importorskip("transformers")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_alst_loop_equals_whole_sequences_in_one_process():
    """Register, initialize(mpu=...), the adapter and the token-weighted loss over the
    shards, ZeRO-3 (a step per sequence; the config names sequence_parallel_size, as the
    tutorial's does) and ZeRO-1 (two sequences per step; no sequence_parallel_size in the
    config, as Accelerate writes it: the mpu's is taken): the same
    losses and final weights as the sequences trained whole, in the order the group
    trains them (rank 0's, then rank 1's of each refill; lengths 16, 16, 8, 12; some
    labels masked, so the shards' token counts differ)."""
    results = run_distributed(alst, 2, (3, 1), timeout=120)
    for stage in (3, 1):
        ours = results[0][stage]
        assert ours["tiles"] == {"mlp": 0, "loss": 0}
        assert ours["losses"] == results[1][stage]["losses"]  # every rank of the group reports the whole loss
        for got, want in zip(ours["losses"], ours["reference_losses"], strict=True):
            assert abs(got - want) / abs(want) < 1e-5, (stage, ours["losses"], ours["reference_losses"])
        for name, want in ours["reference_weights"].items():
            assert relative(ours["weights"][name], want) < 1e-5, (stage, name)
            assert relative(ours["initial"][name], want) > 1e-3, (stage, name)  # training moved every weight


def test_alst_loop_with_tiled_mlp_and_loss_under_zero():
    """ALST's TiledMLP in every Llama MLP and the shard's loss through TiledFusedLogitsLoss
    (their weights given as compute_params), then scaled by the token weighting: ZeRO 1-3
    need nothing more, the loop still equals the untiled whole sequences in one process."""
    results = run_distributed(alst, 2, (3, 2, 1), tiled_mlp=True, tiled_loss=True, timeout=120)
    for stage in (3, 2, 1):
        ours = results[0][stage]
        # shards of 8, 8, 4 and 6 positions in 3, 3, 2 (torch.chunk) and 3 tiles, in 2 layers,
        # run in forward and again in backward; the loss in 2 tiles of each micro-batch, twice
        assert ours["tiles"] == {"mlp": (3 + 3 + 2 + 3) * 2 * 2, "loss": 4 * 2 * 2}
        for got, want in zip(ours["losses"], ours["reference_losses"], strict=True):
            assert abs(got - want) / abs(want) < 1e-5, (stage, ours["losses"], ours["reference_losses"])
        for name, want in ours["reference_weights"].items():
            assert relative(ours["weights"][name], want) < 1e-5, (stage, name)


def test_checks_of_register_adapter_and_initialize():
    said = checks_results()
    for rank, answers in enumerate(said):
        assert "more than the 2 ranks" in answers["too_many_ranks"]
        assert "'eager' cannot run Ulysses" in answers["eager"]
        assert "'flash_attention_2' but the model runs attn_implementation 'sdpa'" in answers["mismatch"]
        assert "'no_such_attention' is not an attention implementation" in answers["unknown"]
        assert "3 attention heads do not divide over the sequence-parallel size 2" in answers["heads"]
        assert "already initialized" in answers["twice"]
        assert (answers["sdpa_untouched"], answers["sdpa_wrapped"]) == ("sdpa_attention_forward", "without_mask")
        assert answers["mpu"] == [True, 2, rank, 2, 2, [0, 1]]
        assert "sequence_parallel_size is 1 but the mpu" in answers["config_size"]
        assert "mpu=...) is not supported" in answers["other_mpu"]
        assert "needs `position_ids` in every batch" in answers["no_position_ids"]
        assert "labels's shape (1, 6) must match input_ids' (1, 8)" in answers["shape"]
        assert "sequence length 7 does not divide over sp_world_size 2" in answers["odd_length"]
        assert answers["len"] == 4
        calls = answers["attention"]
        # training: the whole sequence (6 positions) of this rank's 2 of the 4 heads, whole positions
        assert calls["training"] == {"query": [1, 2, 6, 3], "key": [1, 1, 6, 3], "mask": None,
                                     "position_ids": [list(range(6))], "first": [2.0 * rank, 2.0 * rank + 1]}
        assert calls["output"] == [1, 3, 4, 3]  # back to this rank's 3 positions of every head
        # eval with disable_in_eval: the core attention on the shard as it came, mask included
        assert calls["eval"] == {"query": [1, 4, 3, 3], "key": [1, 2, 3, 3], "mask": "mask",
                                 "position_ids": [[3 * rank, 3 * rank + 1, 3 * rank + 2]],
                                 "first": [10.0 * rank + head for head in range(4)]}
        assert "expects query (1, 4, 4, 3)" in calls["fixed_length"]
        assert "seq_length_is_variable=False needs local_seq_length" in calls["no_local_length"]
        assert "needs `position_ids` in every forward" in calls["no_positions"]
        # each refill: rank 0's batch, then rank 1's, each rank its half; labels shifted before the split
        half = slice(4 * rank, 4 * rank + 4)
        expected = []
        for source in (0, 1):
            ids = torch.arange(8) + 10 * source
            shifted = torch.cat([ids[1:] + 100, torch.tensor([-100])])
            expected.append({"input_ids": [ids[half].tolist()], "position_ids": [list(range(8))[half]],
                             "shift_labels": [shifted[half].tolist()], "tag": f"rank{source}"})
        assert answers["epochs"] == [expected * 2] * 2  # the second epoch restarts the loader


@pytest.mark.slow
def test_initialize_refuses_a_layout_whose_groups_differ_from_the_mpus():
    said = run_distributed(layout_mismatch, 4, timeout=180)
    assert "the mpu's sequence-parallel group is ranks [0, 1] but the config's layout puts ranks [0, 2]" in said[0]
    assert "remove tensor_parallel and pipeline_parallel" in said[0]


_checks_cache: list = []


def checks_results() -> list[dict]:
    if not _checks_cache:
        _checks_cache.append(run_distributed(checks, 2, timeout=120))
    return _checks_cache[0]


def test_size_one_and_fixed_length_without_length():
    """Before any group is built: size 1 is nothing to do; a fixed length needs the length."""
    assert UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 1, 1) is None
    with pytest.raises(ValueError, match="seq_length_is_variable=False needs `seq_length`"):
        UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 2, 1, seq_length_is_variable=False)
    with pytest.raises(ValueError, match="seq_length 15 does not divide over sequence_parallel_size 2"):
        UlyssesSPAttentionHF.register_with_transformers("unused", "sdpa", 2, 1, seq_length=15,
                                                        seq_length_is_variable=False)


DEEPSPEED_SIDE = r'''
import json, os, sys, tempfile
import torch, torch.distributed
import torch.multiprocessing as mp

def raises(call):
    try:
        call()
    except Exception as error:
        return type(error).__name__
    return None

def rank_main(rank, store, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    import deepspeed
    from transformers import LlamaConfig
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    sys.path.insert(0, os.environ["SHARDWISE_TESTS_ROOT"])
    from tests.frontends.deepspeed.api.runtime.sequence_parallel.alst_workers import _WithConfig, _config, tiny_llama_with
    register = UlyssesSPAttentionHF.register_with_transformers
    def again(*args):
        parallel_state_sp._release_sequence_parallel_groups()
        return register(*args)
    model = _WithConfig(_config())
    said = {"too_many_ranks": raises(lambda: register(model, "sdpa", 4, 1)),
            "eager": raises(lambda: again(tiny_llama_with("eager"), "eager", 2, 1)),
            "mismatch": raises(lambda: again(model, "flash_attention_2", 2, 1)),
            "unknown": raises(lambda: again(_WithConfig(LlamaConfig()), "no_such_attention", 2, 1)),
            "heads": raises(lambda: again(_WithConfig(_config(hidden_size=24, num_attention_heads=3,
                                                              num_key_value_heads=3)), "sdpa", 2, 1)),
            "twice": raises(lambda: register(model, "sdpa", 2, 1))}
    group = parallel_state_sp.get_sequence_parallel_group()
    adapter = lambda rows: UlyssesSPDataLoaderAdapter(rows, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")
    ids = torch.arange(8).view(1, 8) + 10 * rank
    good = {"input_ids": ids, "labels": ids + 100, "position_ids": torch.arange(8).view(1, 8), "tag": f"rank{rank}"}
    loader = adapter([good, good])
    said["len"] = len(loader)
    said["epochs"] = [[{k: v.tolist() if torch.is_tensor(v) else v for k, v in b.items()} for b in loader] for _ in range(2)]
    said["no_position_ids"] = raises(lambda: next(adapter([{"input_ids": ids, "labels": ids}])))
    said["shape"] = raises(lambda: next(adapter([dict(good, labels=ids[:, :6])])))
    odd = torch.arange(7).view(1, 7)
    said["odd_length"] = raises(lambda: next(adapter([{"input_ids": odd, "labels": odd, "position_ids": odd}])))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(said, f)

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(os.path.join(d, "store"), sys.argv[1]), nprocs=2)
'''


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
def test_same_shards_and_refusals_as_deepspeed(tmp_path):
    """DeepSpeed 0.19.8's own adapter and register on two gloo ranks: the same micro-batches
    (values and order, both epochs) and the same exception types for the same bad inputs."""
    script = tmp_path / "deepspeed_side.py"
    script.write_text(DEEPSPEED_SIDE)
    root = str(Path(__file__).resolve().parents[6])  # the repository, for the shared rank helpers
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], str(script), str(tmp_path / "theirs")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu", "SHARDWISE_TESTS_ROOT": root})
    assert ran.returncode == 0, ran.stderr[-3000:]
    ours = checks_results()
    kinds = {"too_many_ranks": "RuntimeError", "twice": "AssertionError"}
    for rank in range(2):
        theirs = json.loads((tmp_path / f"theirs.{rank}").read_text())
        assert theirs["epochs"] == ours[rank]["epochs"] and theirs["len"] == ours[rank]["len"]
        for check in ("too_many_ranks", "eager", "mismatch", "unknown", "heads", "twice", "no_position_ids", "shape",
                      "odd_length"):
            assert theirs[check] == kinds.get(check, "ValueError"), (rank, check, theirs[check])
