"""Hardware speeds the time model prices plans on: datasheet figures for GPUs, and the
profile `shardwise estimate --measure` writes for the machine it runs on.

Datasheet rows name their source. `mfu` is not on any datasheet: it is the fraction of the
dense peak a transformer's forward and backward reach with the kernels of the device's
time, so each row carries its own, from a published measurement of that device that is not
one of the results the model is checked against (tests/tools/planner/test_time_model_papers.py):

    A100  0.5   Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
                Clusters Using Megatron-LM": 44-52% of the 312 TFLOP/s peak across its
                weak-scaling table, communication included
    H100  0.5   the A100 figure carried over (no published H100 measurement is checked
                here); `--mfu` overrides it
    V100  0.3   Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
                Models Using Model Parallelism": its single-V100 baseline (a 1.2B GPT-2 on one
                GPU, no communication) sustains 39 TFLOP/s, 30% of the peak, with the
                2019-2020 kernels the ZeRO paper's runs used
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from shardwise.formulas.step_time import Link, Speeds

GB_S = 1e9
DEFAULT_GPU_MFU = 0.5  # Narayanan et al. 2021 on A100 (module docstring)
V100_MFU = 0.3  # Shoeybi et al. 2019: one V100 at 39 TFLOP/s, 30% of its peak (module docstring)
# InfiniBand across nodes: one 200 Gb/s HDR adapter per GPU (DGX A100) = 25 GB/s, 400 Gb/s
# NDR per GPU (DGX H100) = 50 GB/s; a few microseconds per message through switches.
_IB_HDR = Link(latency_s=5e-6, bandwidth=25 * GB_S)
_IB_NDR = Link(latency_s=5e-6, bandwidth=50 * GB_S)

DATASHEETS: dict[str, Speeds] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3,
    # NVLink 900 GB/s (450 each way); PCIe Gen5 x16 64 GB/s each way; DGX H100: 8 NVMe.
    "h100": Speeds("H100 SXM", 989e12, DEFAULT_GPU_MFU, 3350 * GB_S, Link(3e-6, 450 * GB_S), _IB_NDR,
                   host_bandwidth=25 * GB_S, pcie_bandwidth=64 * GB_S, nvme_bandwidth=25 * GB_S,
                   source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); MFU: the A100's (Narayanan et al. 2021)"),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s dense BF16, 2.039 TB/s
    # HBM2e, NVLink 600 GB/s (300 each way); PCIe Gen4 x16 32 GB/s each way.
    "a100": Speeds("A100 SXM 80GB", 312e12, DEFAULT_GPU_MFU, 2039 * GB_S, Link(3e-6, 300 * GB_S), _IB_HDR,
                   host_bandwidth=20 * GB_S, pcie_bandwidth=32 * GB_S, nvme_bandwidth=12.5 * GB_S,
                   source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); MFU: Narayanan et al. 2021"),
    # NVIDIA V100 datasheet (SXM2 32GB): 125 TFLOP/s FP16 tensor, 900 GB/s HBM2; DGX-2's
    # NVSwitch 150 GB/s each way per GPU; the ZeRO paper's cluster: 800 Gb/s per node of 16
    # GPUs between nodes = 6.25 GB/s per GPU.
    "v100": Speeds("V100 SXM2 32GB (DGX-2)", 125e12, V100_MFU, 900 * GB_S, Link(3e-6, 150 * GB_S),
                   Link(5e-6, 6.25 * GB_S), host_bandwidth=10 * GB_S, pcie_bandwidth=16 * GB_S,
                   nvme_bandwidth=6 * GB_S,
                   source="NVIDIA V100 datasheet; DGX-2 (ZeRO paper's cluster); MFU: Shoeybi et al. 2019"),
}


def datasheet(name: str) -> Speeds:
    if name not in DATASHEETS:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DATASHEETS)} or give --speed-profile "
                         "PATH (written by `shardwise estimate --measure PATH`)")
    return DATASHEETS[name]


def with_overrides(speeds: Speeds, *, mfu: float | None = None, intra_bandwidth: float | None = None,
                   inter_bandwidth: float | None = None, intra_latency: float | None = None,
                   inter_latency: float | None = None) -> Speeds:
    """`speeds` with the flags given (bandwidths in GB/s, latencies in microseconds)."""
    intra, inter = speeds.intra_node, speeds.inter_node
    intra = Link(intra.latency_s if intra_latency is None else intra_latency * 1e-6,
                 intra.bandwidth if intra_bandwidth is None else intra_bandwidth * GB_S)
    inter = Link(inter.latency_s if inter_latency is None else inter_latency * 1e-6,
                 inter.bandwidth if inter_bandwidth is None else inter_bandwidth * GB_S)
    return replace(speeds, mfu=speeds.mfu if mfu is None else mfu, intra_node=intra, inter_node=inter)


def save_profile(speeds: Speeds, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(speeds), indent=2) + "\n")


def load_profile(path: str | Path) -> Speeds:
    """A profile `shardwise estimate --measure` wrote (a clear error for anything else)."""
    try:
        fields = json.loads(Path(path).read_text())
        fields["intra_node"] = Link(**fields["intra_node"])
        fields["inter_node"] = Link(**fields["inter_node"])
        return Speeds(**fields)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"--speed-profile {path}: not a speed profile ({error}); write one with "
                         "`shardwise estimate --measure PATH`") from error
