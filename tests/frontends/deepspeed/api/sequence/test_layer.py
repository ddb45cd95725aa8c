"""`deepspeed.sequence.layer.DistributedAttention` (Megatron-DeepSpeed's Ulysses): on two
ranks, forward and backward equal attention over the whole sequences in one process, in
both of DeepSpeed's layouts, with grouped and uneven heads and rotary embeddings; what it
refuses; and, when DEEPSPEED_PYTHON is set, the same shards as DeepSpeed 0.19.8's own
layer on gloo."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.api.sequence.attention_workers import (
    BATCH,
    distributed_attention,
    megatron_deepspeed_ulysses,
    ours_for_deepspeed,
    refusals,
    who_splits_the_sequence,
    whole_inputs,
    whole_sequences_in_one_process,
)


def test_forward_and_backward_equal_whole_sequences_in_both_layouts():
    """[s, b, h, d] (Megatron's, batch_dim_idx 1) with rotary embeddings and [b, s, h, d]
    (batch_dim_idx 0), 4 heads over 2 key/value heads; and 6 heads over 3 key/value heads,
    which do not divide over 2 ranks (rank 0 attends over 4 heads, rank 1 over 2)."""
    cases = [("sbhd", 4, 2, True), ("bshd", 4, 2, False), ("sbhd", 6, 3, False), ("bshd", 6, 3, False)]
    for rank_errors in run_distributed(distributed_attention, 2, cases, timeout=60):
        for case, errors in zip(cases, rank_errors, strict=True):
            assert max(errors.values()) < 1e-6, (case, errors)


def test_refusals_say_what_and_how():
    messages = run_distributed(refusals, 2, timeout=60)[0]
    assert "1 key/value heads over a sequence-parallel group of 2 ranks" in messages["kv_heads"]
    assert "batch_dim_idx must be 0" in messages["batch_dim"]
    assert "4-D tensors" in messages["three_d"]
    assert "scatter_idx=2 and gather_idx=3" in messages["indices"]


DEEPSPEED_SIDE = """
import os, sys, torch
rank, layout = int(sys.argv[3]), sys.argv[4]
os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
import deepspeed
import deepspeed.comm as dist
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import groups
deepspeed.init_distributed(dist_backend="gloo")


class SequenceRank:  # DeepSpeed's uneven-heads exchange reads the rank from an mpu
    def get_sequence_parallel_rank(self):
        return rank


groups.mpu = SequenceRank()
given = torch.load(sys.argv[1])
seq = 1 if layout == "bshd" else 0


def local(q, k, v):
    to = (lambda t: t.permute(0, 2, 1, 3)) if layout == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
    out = torch.nn.functional.scaled_dot_product_attention(to(q), to(k), to(v), is_causal=True, enable_gqa=True)
    return out.permute(0, 2, 1, 3) if layout == "bshd" else out.permute(2, 0, 1, 3)


attention = DistributedAttention(local, dist.new_group([0, 1]), scatter_idx=2, gather_idx=seq)
q, k, v = (given[name].chunk(2, dim=seq)[rank].clone().requires_grad_() for name in "qkv")
out = attention(q, k, v, 1 - seq)
(out * given["g"].chunk(2, dim=seq)[rank]).sum().backward()
torch.save({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, f"{sys.argv[2]}.{rank}")
dist.barrier()  # neither rank tears gloo down under the other
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _deepspeeds(layout: str, given: dict[str, torch.Tensor], directory: Path) -> list[dict[str, torch.Tensor]]:
    torch.save(given, directory / "given.pt")
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu"}
    ranks = [subprocess.Popen([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, str(directory / "given.pt"),
                               str(directory / "theirs"), str(rank), layout], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output.decode()[-3000:]
    return [torch.load(directory / f"theirs.{rank}") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed installed (benchmarks/zero3_vs_fsdp2_deepspeed.py's docstring shows one)")
@pytest.mark.parametrize("layout,heads,kv_heads", [("bshd", 4, 2), ("sbhd", 4, 2), ("sbhd", 6, 3)],
                         ids=["bshd", "sbhd", "sbhd-uneven"])
def test_equals_deepspeeds_distributed_attention_on_gloo(layout, heads, kv_heads, tmp_path):
    """DeepSpeed's layer runs on gloo (its all-to-all is torch's all_to_all_single); its
    uneven-heads exchange reads the rank from `groups`' mpu, which the DeepSpeed side sets."""
    given = whole_inputs(layout, heads, kv_heads)
    theirs = _deepspeeds(layout, given, tmp_path)
    ours = run_distributed(ours_for_deepspeed, 2, layout, given, timeout=60)
    for rank in range(2):
        for name, want in theirs[rank].items():
            assert ((ours[rank][name] - want).norm() / want.norm()).item() < 1e-6, (layout, rank, name)


def test_megatron_deepspeed_ulysses_trains_as_whole_sequences_in_one_process():
    """A plain-torch causal attention model, its attention wrapped in DistributedAttention
    over `groups._get_sequence_parallel_group()` after `deepspeed.initialize` with
    sequence_parallel_size 2 (or mesh_param=(1, 2)), each rank fed half the positions, ZeRO-2
    and Adam: the same losses and final weights as the whole sequences in one process
    (shardwise leaves a model it does not know to the script: the sequence is split once)."""
    want_losses, want_weights = whole_sequences_in_one_process()
    for by_size_source in run_distributed(megatron_deepspeed_ulysses, 2, 2, timeout=60):
        for result in by_size_source.values():
            assert result["sequence_ranks"] == [0, 1] and result["data_size"] == 1 and result["batch"] == BATCH
            for got, want in zip(result["losses"], want_losses, strict=True):
                assert abs(got - want) / want < 1e-5, (result["losses"], want_losses)
            for name, want in want_weights.items():
                assert ((result["weights"][name] - want).norm() / want.norm()).item() < 1e-5, name


def test_who_splits_the_sequence_and_attention_over_other_ranks_refused():
    """shardwise's own Ulysses for a model it knows, unless the model holds the script's
    DistributedAttention (the sequence is split once); an attention exchanging over ranks
    the config's layout does not group is refused with the size to set."""
    answers = run_distributed(who_splits_the_sequence, 2, timeout=60)[0]
    assert answers["gpt"] is False and answers["gpt_with_distributed_attention"] is True
    assert "exchanges over ranks [0, 1] but the config's sequence-parallel group" in answers["refusal"]
    assert "set sequence_parallel_size to 2" in answers["refusal"]
