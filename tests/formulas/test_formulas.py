"""Model-state, offload, activation and generation-gather formulas against hand-computed numbers (docs/formulas.md)."""

import pytest

from shardwise.tools.planner import Offload, activation_bytes, model_state_bytes, placed_model_state_bytes
from shardwise.formulas.memory import ADAM_FP32_STATES, optimizer_state_bytes
from shardwise.formulas.layers import stage3_gather_bytes
from shardwise.formulas.communication import generation_gather_bytes

PSI = 7_500_000_000
N = 64
PARTITION = PSI // N  # 117,187,500: divides exactly


@pytest.mark.parametrize(
    ("stage", "expected_bytes", "expected_gb"),
    [(0, 120_000_000_000, 120.0), (1, 31_406_250_000, 31.4), (2, 16_640_625_000, 16.6), (3, 1_875_000_000, 1.9)],
)
def test_zero_paper_table_bf16(stage: int, expected_bytes: int, expected_gb: float) -> None:
    states = model_state_bytes(PSI, N, stage)
    assert sum(states.values()) == expected_bytes
    assert round(sum(states.values()) / 1e9, 1) == expected_gb


def test_zero_paper_table_by_category() -> None:
    assert model_state_bytes(PSI, N, 0) == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer_states": 12 * PSI}
    assert model_state_bytes(PSI, N, 1) == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer_states": 12 * PARTITION}
    assert model_state_bytes(PSI, N, 2) == {"params": 2 * PSI, "grads": 2 * PARTITION, "optimizer_states": 12 * PARTITION}
    assert model_state_bytes(PSI, N, 3) == {
        "params": 2 * PARTITION,
        "grads": 2 * PARTITION,
        "optimizer_states": 12 * PARTITION,
    }


@pytest.mark.parametrize(
    ("stage", "expected_bytes"),
    # 4-byte params and grads, K = 8: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N
    [(0, 120_000_000_000), (1, 60_937_500_000), (2, 31_406_250_000), (3, 1_875_000_000)],
)
def test_fp32_table(stage: int, expected_bytes: int) -> None:
    assert sum(model_state_bytes(PSI, N, stage, dtype="fp32").values()) == expected_bytes


def test_optimizer_state_bytes_per_param() -> None:
    """K from an optimizer's fp32 state count (its registry entry's): Adam's two, SGD's momentum."""
    assert optimizer_state_bytes(ADAM_FP32_STATES, "bf16") == 12
    assert optimizer_state_bytes(ADAM_FP32_STATES, "fp16") == 12
    assert optimizer_state_bytes(ADAM_FP32_STATES, "fp32") == 8
    assert optimizer_state_bytes(1, "bf16") == 8
    assert optimizer_state_bytes(1, "fp32") == 4
    assert model_state_bytes(PSI, N, 1, optimizer_state_bytes_per_param=8)["optimizer_states"] == 8 * PARTITION


def test_partitions_are_padded_to_equal_length() -> None:
    # 10 elements over 4 ranks: every rank holds ceil(10 / 4) = 3
    assert model_state_bytes(10, 4, 3) == {"params": 6, "grads": 6, "optimizer_states": 36}
    assert model_state_bytes(10, 4, 2) == {"params": 20, "grads": 6, "optimizer_states": 36}


def test_stage3_persistent_params_are_held_in_full() -> None:
    # 100 of 1000 parameters persist: (900 / 4) partitioned + 100 in full, 2 bytes each
    states = model_state_bytes(1000, 4, 3, persistent_params=100)
    assert states == {"params": 2 * (225 + 100), "grads": 2 * 250, "optimizer_states": 12 * 250}
    assert model_state_bytes(1000, 4, 2, persistent_params=100) == model_state_bytes(1000, 4, 2)


def test_stage1_cpu_optimizer_keeps_full_gradient_on_gpu() -> None:
    placed = placed_model_state_bytes(PSI, N, 1, Offload("cpu"))
    assert placed["gpu"] == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer_states": 0}
    assert placed["cpu"] == {"params": 0, "grads": 4 * PARTITION, "optimizer_states": 12 * PARTITION}


def test_stage2_cpu_optimizer_streams_gradients_to_host() -> None:
    # ZeRO-Offload: GPU keeps 2Ψ of bf16 params; host keeps fp32 grads 4Ψ/N and K·Ψ/N
    placed = placed_model_state_bytes(PSI, N, 2, Offload("cpu"))
    assert placed["gpu"] == {"params": 15_000_000_000, "grads": 0, "optimizer_states": 0}
    assert placed["cpu"] == {"params": 0, "grads": 468_750_000, "optimizer_states": 1_406_250_000}
    assert sum(placed["nvme"].values()) == 0


def test_stage3_offload_variants() -> None:
    cpu_optimizer = placed_model_state_bytes(PSI, N, 3, Offload("cpu"))
    assert cpu_optimizer["gpu"]["params"] == 2 * PARTITION
    assert sum(cpu_optimizer["cpu"].values()) == 16 * PARTITION

    cpu_everything = placed_model_state_bytes(PSI, N, 3, Offload("cpu", "cpu"))
    assert sum(cpu_everything["gpu"].values()) == 0
    assert sum(cpu_everything["cpu"].values()) == 18 * PARTITION

    nvme_optimizer = placed_model_state_bytes(PSI, N, 3, Offload("nvme"))
    assert nvme_optimizer["gpu"]["params"] == 2 * PARTITION
    assert nvme_optimizer["cpu"] == {"params": 0, "grads": 4 * PARTITION, "optimizer_states": 0}
    assert nvme_optimizer["nvme"] == {"params": 0, "grads": 0, "optimizer_states": 12 * PARTITION}

    nvme_everything = placed_model_state_bytes(PSI, N, 3, Offload("nvme", "nvme"))
    assert sum(nvme_everything["gpu"].values()) == 0
    assert nvme_everything["nvme"] == {"params": 2 * PARTITION, "grads": 0, "optimizer_states": 12 * PARTITION}


def test_fp32_offload_adds_host_master_copy() -> None:
    # fp32 weights are their own master on the GPU, but the host optimizer needs a copy: 4 + K = 12
    placed = placed_model_state_bytes(PSI, N, 2, Offload("cpu"), dtype="fp32")
    assert placed["gpu"]["params"] == 4 * PSI
    assert placed["cpu"] == {"params": 0, "grads": 4 * PARTITION, "optimizer_states": 12 * PARTITION}


def test_persistent_params_stay_on_gpu_under_param_offload() -> None:
    placed = placed_model_state_bytes(1000, 4, 3, Offload("cpu", "cpu"), persistent_params=100)
    assert placed["gpu"]["params"] == 2 * 100
    assert placed["cpu"]["params"] == 2 * 225


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_on_nvme_at_every_partitioned_stage(stage: int) -> None:
    """As the engine's NVMe tier does: the optimizer partition on NVMe, its fp32 gradient
    partition in host memory, stage 1's full 16-bit gradient still on the GPU."""
    placed = placed_model_state_bytes(1000, 4, stage, Offload("nvme"))
    assert placed["nvme"]["optimizer_states"] == 12 * 250
    assert placed["cpu"]["grads"] == 4 * 250
    assert placed["gpu"]["grads"] == (2 * 1000 if stage == 1 else 0)


@pytest.mark.parametrize(
    ("stage", "offload", "message"),
    [
        (0, Offload("cpu"), "stage 1 or more"),
        (2, Offload("cpu", "cpu"), "parameter offload needs stage 3"),
        (4, Offload(), "stage must be one of"),
        (3, Offload("disk"), "none, cpu or nvme"),
    ],
)
def test_invalid_placements_are_rejected(stage: int, offload: Offload, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        placed_model_state_bytes(PSI, N, stage, offload)


def test_parameter_offload_alone_moves_only_the_parameter_shards() -> None:
    placed = placed_model_state_bytes(1000, 4, 3, Offload("none", "cpu"))
    assert placed["cpu"] == {"params": 2 * 250, "grads": 0, "optimizer_states": 0}
    assert placed["gpu"] == {"params": 0, "grads": 2 * 250, "optimizer_states": 12 * 250}


def test_bf16_masters_keep_two_bytes_per_state_and_no_master() -> None:
    assert optimizer_state_bytes(ADAM_FP32_STATES, "bf16", bf16_masters=True) == 4
    assert optimizer_state_bytes(ADAM_FP32_STATES, "bf16") == 12
    with pytest.raises(ValueError, match="bf16 masters need bf16 training"):
        optimizer_state_bytes(ADAM_FP32_STATES, "fp16", bf16_masters=True)


def test_invalid_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_state_bytes(PSI, N, 0, dtype="int8")
    with pytest.raises(ValueError, match="world_size must be positive"):
        model_state_bytes(PSI, 0, 0)
    with pytest.raises(ValueError, match="persistent_params"):
        model_state_bytes(100, 2, 3, persistent_params=101)


def test_activation_bytes_match_korthikanti_formula() -> None:
    # llama-7b shape, s = 2048, b = 1: per layer s·b·h·(34 + 5·a·s/h), logits 4·s·b·V
    s, b, h, a, layers, vocab = 2048, 1, 4096, 32, 32, 32000
    per_layer = s * b * h * (34 + 5 * a * s // h)
    logits = 4 * s * b * vocab
    assert per_layer == 956_301_312
    batch = {"seq_len": s, "micro_batch": b, "dtype": "bf16"}
    assert activation_bytes(layers, h, a, vocab, **batch, recompute="none") == layers * per_layer + logits
    # shardwise's policies: each layer keeps its input (2·sbh), selective also its linear
    # outputs (9 × 2·sbh); backward brings back one layer at a time
    selective = (layers - 1) * 2 * (1 + 9) * s * b * h + per_layer + logits
    assert activation_bytes(layers, h, a, vocab, **batch, recompute="selective") == selective
    assert activation_bytes(layers, h, a, vocab, **batch, recompute="full") == (layers - 1) * 2 * s * b * h + per_layer + logits
    assert activation_bytes(layers, h, a, None, **batch, recompute="none") == layers * per_layer


def test_fp32_activations_double_the_two_byte_tensors() -> None:
    # (16e + 2)·sbh + (2e + 1)·a·s²·b with e = 4: masks stay one byte
    s, b, h, a = 128, 2, 64, 4
    fp32 = activation_bytes(1, h, a, None, seq_len=s, micro_batch=b, dtype="fp32", recompute="none")
    assert fp32 == 66 * s * b * h + 9 * a * s * s * b


def test_stage3_gather_working_set() -> None:
    assert stage3_gather_bytes(1_000_000, "bf16") == 6_000_000
    assert stage3_gather_bytes(1_000_000, "fp32") == 12_000_000


def test_zero_plus_plus_cuts_the_bytes_between_nodes_four_times_at_the_papers_scale():
    """ZeRO++'s 3M -> 0.75M (Wang et al., 2023): 384 GPUs, 48 nodes of 8, a 1-billion
    parameter unit; with few nodes the ring's (N-1)/N and qgZ's (n-1)/n make it larger."""
    from shardwise.formulas.communication import ZeroPlusPlusShape, inter_node_bytes_per_node, zero_plus_plus_ratio

    assert zero_plus_plus_ratio(384 * 2**22, shard_size=384, ranks_per_node=8) == pytest.approx(4.0, abs=0.01)
    assert zero_plus_plus_ratio(4 * 2**22, shard_size=4, ranks_per_node=2) == pytest.approx(4.48, abs=0.01)
    # per node, plain ZeRO-3 sends one rank's ring share of three collectives: 3·2Ψ(N-1)/N
    plain = ZeroPlusPlusShape((384 * 2**22,), 384, 8, param_bytes=2, grad_bytes=2)
    assert inter_node_bytes_per_node(plain) == 3 * 2 * 383 * 2**22
    assert inter_node_bytes_per_node(ZeroPlusPlusShape((8,), 8, 8, param_bytes=2, grad_bytes=2)) == 0  # one node


def test_hpz_secondary_partition_memory():
    from shardwise.formulas.memory import hpz_secondary_bytes

    assert hpz_secondary_bytes(1024, 8, "bf16") == 256
    assert hpz_secondary_bytes(1024, 1, "bf16") == 0
    with pytest.raises(ValueError, match="must be >= 1 and divide"):
        hpz_secondary_bytes(1000, 3, "fp32")


def test_generation_gathers_the_partitioned_policy_once_or_per_token() -> None:
    # Ψ = 20 640 padded fp32 elements, P = 640 of them whole, over S = 4: (Ψ−P)·p(S−1)/S per gather
    once = generation_gather_bytes(20_640, persistent_params=640, param_bytes=4, shard_size=4, gathers=1)
    assert once == 20_000 * 4 * 3 // 4 == 60_000
    assert generation_gather_bytes(20_640, persistent_params=640, param_bytes=4, shard_size=4, gathers=6) == 6 * once
    assert generation_gather_bytes(20_640, persistent_params=0, param_bytes=4, shard_size=1, gathers=1) == 0
