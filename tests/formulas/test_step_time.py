"""Step-time formulas (docs/formulas.md#step-time) against hand-computed numbers."""

import pytest

from shardwise.formulas.step_time import (
    CommTerm,
    Link,
    Speeds,
    StepWork,
    buckets,
    collective_seconds,
    exposed_seconds,
    forward_flops_per_token,
    optimizer_update_bytes,
    step_seconds,
    training_flops_per_token,
)

LINK = Link(latency_s=1e-5, bandwidth=1e9)
SPEEDS = Speeds("test", peak_flops=1e12, mfu=0.5, memory_bandwidth=1e10, intra_node=LINK, inter_node=LINK,
                host_bandwidth=2e9, pcie_bandwidth=1e9, nvme_bandwidth=5e8)


def test_flops_match_megatron_formula() -> None:
    """Narayanan et al. 2021: 96·B·s·l·h²(1 + s/6h + V/16lh) per batch with full recomputation."""
    layers, hidden, seq, vocab = 24, 2304, 2048, 51200
    psi = 12 * layers * hidden**2 + vocab * hidden  # the count their formula assumes
    megatron = 96 * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    ours = training_flops_per_token(psi, layers=layers, hidden=hidden, seq_len=seq, recompute="full",
                                    vocab=vocab) * seq
    assert ours == pytest.approx(megatron, rel=1e-12)
    no_recompute = training_flops_per_token(psi, layers=layers, hidden=hidden, seq_len=seq) * seq
    layer_forward = (24 * layers * hidden**2 + 4 * layers * seq * hidden) * seq  # what recomputation re-runs
    assert no_recompute == pytest.approx(megatron - layer_forward, rel=1e-12)


def test_flops_by_recompute_mode() -> None:
    forward = forward_flops_per_token(1000, layers=2, hidden=8, seq_len=16)
    assert forward == 2000 + 4 * 2 * 16 * 8
    assert training_flops_per_token(1000, layers=2, hidden=8, seq_len=16, recompute="selective") == 3 * forward + 1024
    with pytest.raises(ValueError, match="recompute must be one of"):
        training_flops_per_token(1000, layers=2, hidden=8, seq_len=16, recompute="some")


def test_alpha_beta_collectives() -> None:
    # all-reduce over 4 ranks: 2·3 steps of α, plus the bytes each rank sends over β
    assert collective_seconds("all_reduce", 1e6, 4, LINK) == pytest.approx(6e-5 + 1e-3)
    assert collective_seconds("all_gather", 1e6, 4, LINK, messages=10) == pytest.approx(30e-5 + 1e-3)
    assert collective_seconds("all_gather", 1e6, 1, LINK) == 0.0


def test_exposed_is_what_compute_cannot_cover_but_at_least_the_last_message() -> None:
    assert exposed_seconds(1.0, 3.0, 1.0, 0.1) == 0.1
    assert exposed_seconds(1.0, 0.5, 1.0, 0.1) == 0.5
    assert exposed_seconds(1.0, 3.0, 0.0, 0.1) == 1.0  # no overlap: all of it shows


def test_update_bytes() -> None:
    assert optimizer_update_bytes(1, grad_bytes=4, state_bytes=8, param_bytes=4, fp32_training=True) == 32
    assert optimizer_update_bytes(1, grad_bytes=2, state_bytes=12, param_bytes=2, fp32_training=False) == 30
    assert buckets(10, 3) == 4 and buckets(0, 3) == 1


def test_step_sums_its_causes() -> None:
    work = StepWork(flops=1e12, comm=(CommTerm("shard", "reduce_scatter", 1e9, 2, LINK, 1, "backward"),
                                      CommTerm("shard", "all_gather", 1e8, 2, LINK, 1, "none")),
                    micro_batches=4, pipeline_stages=2, optimizer_bytes=1e10, optimizer_on_host=True,
                    pcie_bytes=1e9, nvme_bytes_per_node=5e8)
    time = step_seconds(work, SPEEDS)
    assert time.compute == pytest.approx(2.0)
    assert time.bubble == pytest.approx(2.0 * 1 / 4)
    # backward = 4/3 s hides 1 s of the 1.00001 s reduce-scatter; it shows its single last message
    assert time.comm["shard reduce_scatter"] == pytest.approx(1.0 + 1e-5)
    assert time.comm["shard all_gather"] == pytest.approx(0.1 + 1e-5)
    assert time.optimizer == pytest.approx(5.0)  # on the host: 1e10 B at 2e9 B/s
    assert time.offload == pytest.approx(1.0 + 1.0)
    assert time.total == pytest.approx(2.0 + 0.5 + 1.0 + 1e-5 + 0.1 + 1e-5 + 5.0 + 2.0)


def test_bad_speeds_are_refused() -> None:
    with pytest.raises(ValueError, match="mfu in"):
        Speeds("x", 1e12, 1.5, 1e9, LINK, LINK, 1e9, 1e9, 1e9)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(1e-6, 0)
