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
    pipeline_bubble_seconds,
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
    with pytest.raises(ValueError, match="host_cores must be >= 0"):
        Speeds("x", 1e12, 0.5, 1e9, LINK, LINK, 1e9, 1e9, 1e9, host_cores=-1)


def test_bubble_is_p_minus_1_over_m_with_a_core_or_device_per_rank() -> None:
    for ranks, cores in ((4, 0), (2, 2), (4, 8)):  # GPUs (0: a device per rank), ranks <= cores
        assert pipeline_bubble_seconds(8.0, stages=2, micro_batches=4, ranks_per_host=ranks,
                                       host_cores=cores) == 8.0 * 1 / 4
    assert pipeline_bubble_seconds(8.0, stages=1, micro_batches=4, ranks_per_host=4, host_cores=2) == 0.0


def test_oversubscribed_pipeline_ramps_run_on_the_idle_stages_cores() -> None:
    """4 ranks on 2 cores, 2 stages: with every rank busy each has half a core; in the warm-up
    and cool-down slot only one stage's 2 ranks compute, a core each, so those slots take half
    as long: 3 full slots + 2 half slots = 4 slots of compute/4: no bubble at all."""
    assert pipeline_bubble_seconds(8.0, stages=2, micro_batches=4, ranks_per_host=4, host_cores=2) == 0.0
    # 4 stages of 1 rank on 2 cores, m = 4: slots busy 1,2,3,4,3,2,1; a slot with n busy ranks
    # takes share(4)/share(n) = 0.5/min(1, 2/n) of a full slot: 0.5+0.5+0.75+1+0.75+0.5+0.5 = 4.5
    assert pipeline_bubble_seconds(8.0, stages=4, micro_batches=4, ranks_per_host=4,
                                   host_cores=2) == pytest.approx(8.0 * (4.5 - 4) / 4)
    # the same on 4 cores (no oversubscription): 3 slots of bubble
    assert pipeline_bubble_seconds(8.0, stages=4, micro_batches=4, ranks_per_host=4, host_cores=4) == 6.0
    # fewer micro-batches than stages: m = 1 runs one stage at a time, each at a full core
    assert pipeline_bubble_seconds(4.0, stages=4, micro_batches=1, ranks_per_host=4,
                                   host_cores=2) == pytest.approx(4.0 * (4 * 0.5 - 1))


def test_step_time_uses_the_oversubscribed_bubble() -> None:
    work = StepWork(flops=1e12, micro_batches=4, pipeline_stages=2, ranks_per_host=4)
    assert step_seconds(work, SPEEDS).bubble == pytest.approx(0.5)  # host_cores 0: a device per rank
    cpu = Speeds("cpu", 1e12, 0.5, 1e10, LINK, LINK, 2e9, 1e9, 5e8, host_cores=2)
    assert step_seconds(work, cpu).bubble == 0.0
    assert step_seconds(StepWork(flops=1e12, micro_batches=4, pipeline_stages=2, ranks_per_host=2), cpu).bubble \
        == pytest.approx(0.5)
