"""Host tensors through device-only groups: which device a group moves tensors on, and
staging that is a no-op where none is needed (the copy through a CUDA device itself is
checked in tests/gpu/test_cuda_paths.py)."""

import torch
import torch.distributed as dist

from shardwise.runtime.distributed.staging import group_device, staged_on


def test_only_an_nccl_group_has_a_device_of_its_own(monkeypatch):
    """`dist.get_backend` and the current CUDA device are stand-ins (this machine has
    neither NCCL nor a GPU)."""
    group = object()
    assert not dist.is_initialized() and group_device(None) is None  # no process group at all
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert group_device(group) is None and group_device(None) is None
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert group_device(group) == torch.device("cuda", 1)


def test_the_default_group_is_named_none_and_has_the_default_backends_device(monkeypatch):
    """torch.distributed names the default group None; a world of one rank hands it out as
    ZeRO's replicate group, so an offloaded gradient's sum over it must be staged like any
    other NCCL group's (the H200 run of 2026-11-28 found it sent as a host tensor)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is None else "gloo")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert group_device(None) == torch.device("cuda", 0)


def test_a_tensor_already_in_place_is_used_as_it_is():
    tensor = torch.zeros(3)
    for device in (None, torch.device("cpu")):
        with staged_on(tensor, device) as staged:
            assert staged is tensor
            staged.add_(1)
    assert torch.equal(tensor, torch.full((3,), 2.0))
