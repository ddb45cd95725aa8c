"""MFU arithmetic and the peak it divides by: datasheet for known GPUs, measured on CPU."""

import pytest
import torch

from shardwise.models import GPT, GPTConfig
from shardwise.tools.profiling import device_peak_flops, measure_matmul_flops, model_flops_utilization, table_peak_flops


def test_mfu_is_model_flops_per_second_over_peak():
    # 1e6 FLOPs per token at 2,000 tokens/s = 2e9 FLOP/s achieved, on 2 devices of 5e9 each.
    assert model_flops_utilization(1e6, 2_000, 2 * 5e9) == pytest.approx(0.2)


def test_mfu_of_a_gpt_uses_its_training_flops_per_token():
    config = GPTConfig.preset("tiny")
    model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    per_token = model.flops_per_token()
    assert per_token == 6 * params + 12 * config.n_layer * config.n_embd * config.block_size
    assert model_flops_utilization(per_token, 1_000, per_token * 4_000) == pytest.approx(0.25)


def test_mfu_rejects_meaningless_inputs():
    with pytest.raises(ValueError, match="peak FLOP/s must be positive"):
        model_flops_utilization(1e6, 10, 0)
    with pytest.raises(ValueError, match="non-negative"):
        model_flops_utilization(-1, 10, 1e9)


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H200", torch.float16, 989e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, None),
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_datasheet_peaks_cover_known_gpus_in_16_bit_only(name, dtype, peak):
    assert table_peak_flops(name, dtype) == peak


def test_cpu_peak_is_a_timed_matmul_with_this_process_threads():
    measured = measure_matmul_flops(torch.device("cpu"), torch.float32, size=128, seconds=0.05)
    assert 1e8 < measured < 1e14  # anything from a slow core to a large server
    peak = device_peak_flops(torch.device("cpu"), torch.float32)
    assert peak.flops_per_second > 1e8
    threads = torch.get_num_threads()
    assert peak.source.startswith("measured: CPU float32 matmul, ")
    assert f"{threads} thread" in peak.source
