"""ZeRO-Infinity's NVMe tier (C12): masters and optimizer state in a private swap file, paged
one sub-group at a time; the same training bit for bit; bytes counted on the NVMe tier;
resumable both ways; clear errors for a bad path or a full disk."""

import os

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import Run, train_run
from tests.runtime.zero.workers import Case, train_parallel


def nvme_case(path, stage: int = 2, accumulation: int = 1, dtype: str = "fp32", steps: int = 3, **zero) -> Case:
    settings = {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
                "sub_group_size": 1500, **zero}  # many sub-groups, not aligned to the 4 KiB I/O blocks
    if stage == 3:
        settings["stage3_param_persistence_threshold"] = 0
    return Case(stage=stage, dtype=dtype, accumulation=accumulation, model="gpt-untied" if stage == 3 else "gpt",
                steps=steps, extra_config={"zero_optimization": settings})


def plain_case(stage: int, accumulation: int = 1) -> Case:
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    return Case(stage=stage, accumulation=accumulation, model="gpt-untied" if stage == 3 else "gpt",
                extra_config=extra)


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 2), (3, 1)])
def test_nvme_offload_trains_exactly_like_no_offload(stage, accumulation, tmp_path):
    plain = run_distributed(train_parallel, 2, plain_case(stage, accumulation))
    swapped = run_distributed(train_parallel, 2, nvme_case(tmp_path, stage, accumulation))
    for without, with_swap in zip(plain, swapped):
        assert with_swap["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_swap["params"][name].equal(tensor), name
    assert os.listdir(tmp_path) == []  # the swap files were private to the run


def test_optimizer_state_is_counted_on_nvme(tmp_path):
    result = run_distributed(train_parallel, 2, nvme_case(tmp_path, 2))[0]
    tiers = result["memory_by_tier"]
    padded = result["numel"] + result["padding"]
    assert tiers["nvme"]["optimizer_states"] == 12 * padded // 2  # fp32 master + Adam's two moments
    assert tiers["device"]["optimizer_states"] == 0
    assert tiers["host"]["grads"] == 4 * padded // 2
    # in memory at once: at most three pages (reading, stepping, writing) of 1500 elements x 3 tensors
    assert tiers["host"]["buffers"] <= 3 * 3 * 8192


@pytest.mark.parametrize(("stage", "saved_with", "loaded_with"),
                         [(2, "nvme", "none"), (2, "none", "nvme"), (3, "nvme", "none"), (3, "none", "nvme")])
def test_resume_across_nvme_and_memory(stage, saved_with, loaded_with, tmp_path):
    """Stage 3 swaps the parameter shards too."""
    swap = tmp_path / "swap"
    swap.mkdir()

    def case(device: str) -> Case:
        if device == "none":
            return plain_case(stage)
        return nvme_case(swap, 2) if stage == 2 else nvme_params_case(swap)

    checkpoint = str(tmp_path / "checkpoint")
    uninterrupted = run_distributed(train_run, 2, Run(case("none"), steps=3))[0]
    run_distributed(train_run, 2, Run(case(saved_with), steps=1, save_dir=checkpoint))
    resumed = run_distributed(train_run, 2, Run(case(loaded_with), first_step=1, steps=2, load_dir=checkpoint))[0]
    assert resumed["losses"] == uninterrupted["losses"][1:]
    for name, tensor in uninterrupted["params"].items():
        assert resumed["params"][name].equal(tensor), name


def test_an_nvme_path_that_is_not_a_directory_is_named(tmp_path):
    from shardwise.tools.testing import DistributedTestError

    missing = tmp_path / "not-there"
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(train_parallel, 1, nvme_case(missing, 2))
    assert f"nvme_path {missing} is not a directory" in str(failure.value)


def test_a_full_disk_is_reported_with_the_bytes_before_training(tmp_path, monkeypatch):
    """The real condition cannot be produced here: posix_fallocate is made to fail as a
    full file system does (ENOSPC)."""
    import errno

    from shardwise.runtime.zero.swap import SwapError, SwapFile

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    swap = SwapFile(tmp_path, rank=0)
    swap.region(1_000_000, __import__("torch").float32)
    with pytest.raises(SwapError, match=r"no space for the swap file .* it needs 4,001,792 bytes and [\d,]+ are free"):
        swap.reserve()
    swap.close()


def test_bytes_moved_between_tiers_follow_the_formula(tmp_path):
    from shardwise.formulas.communication import offload_transfer_bytes

    result = run_distributed(train_parallel, 2, nvme_case(tmp_path, 2, accumulation=2, steps=1))[0]
    padded = result["numel"] + result["padding"]
    expected = offload_transfer_bytes(padded // 2, stage=2, grad_bytes=4, param_bytes=4, accumulation_steps=2,
                                      state_tensors=2)
    moved = result["comm_by_group"]["offload"]
    assert moved["device_to_host"] == expected["device_to_host"]
    assert moved["host_to_device"] == expected["host_to_device"]
    # the first step reads only the masters (the optimizer creates its state in that step)
    # and writes masters and state; each sub-group's regions are rounded up to 4 KiB
    pages = -(-padded // 2 // 1500)
    assert expected["nvme_write"] <= moved["nvme_write"] <= expected["nvme_write"] + pages * 3 * 4096
    assert moved["nvme_read"] <= expected["nvme_read"] // 3 + pages * 4096


@pytest.mark.parametrize("optimizer", ["lamb", "adafactor", "adam8bit"])
def test_whole_parameter_and_quantised_optimizers_page_too(optimizer, tmp_path):
    import dataclasses

    plain = run_distributed(train_parallel, 2, dataclasses.replace(plain_case(2), optimizer=optimizer))
    swapped = run_distributed(train_parallel, 2, dataclasses.replace(nvme_case(tmp_path, 2), optimizer=optimizer))
    for without, with_swap in zip(plain, swapped):
        for name, tensor in without["params"].items():
            assert with_swap["params"][name].equal(tensor), name


def nvme_params_case(path, dtype: str = "fp32", optimizer_device: str = "nvme", steps: int = 3) -> Case:
    """ZeRO-Infinity in full: stage 3 with the parameter shards and the optimizer on NVMe."""
    case = nvme_case(path, 3, dtype=dtype, steps=steps)
    zero = case.extra_config["zero_optimization"]
    zero["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    zero["offload_optimizer"] = {"device": optimizer_device, "nvme_path": str(path)}
    return case


@pytest.mark.parametrize("optimizer_device", ["nvme", "cpu"])
def test_parameters_on_nvme_train_exactly_like_no_offload(optimizer_device, tmp_path):
    plain = run_distributed(train_parallel, 2, plain_case(3))
    swapped = run_distributed(train_parallel, 2, nvme_params_case(tmp_path, optimizer_device=optimizer_device))
    for without, with_swap in zip(plain, swapped):
        assert with_swap["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_swap["params"][name].equal(tensor), name
    assert os.listdir(tmp_path) == []


def test_parameter_shards_are_counted_on_nvme_and_paged(tmp_path):
    result = run_distributed(train_parallel, 2, nvme_params_case(tmp_path, steps=1))[0]
    tiers = result["memory_by_tier"]
    padded = result["numel"] + result["padding"]
    assert tiers["device"]["params"] == 0 and tiers["host"]["params"] == 0
    # the shard of every unit, each region rounded up to 4 KiB for direct I/O
    assert padded // 2 * 4 <= tiers["nvme"]["params"] <= padded // 2 * 4 + result["units"] * 4096
