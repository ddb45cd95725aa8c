"""The CUDA halves of checks the CPU suite runs with stand-ins (skipped without CUDA):
generators left where they were, host tensors staged through the device for NCCL, NCCL
refusing host tensors by name, and the step timer timing a step with events alone."""

import dataclasses

import pytest
import torch

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.runtime.distributed.staging import staged_on
from shardwise.models import GPT, GPTConfig
from shardwise.tools.profiling import StepTimer
from shardwise.runtime.base.random_state import seeded_rng
from shardwise.tools.testing import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_seeded_draws_on_the_device_repeat_and_leave_its_generator_where_it_was():
    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.get_rng_state(device)
    with seeded_rng(11, device):
        first = torch.rand(4, device=device)
    with seeded_rng(11, device):
        second = torch.rand(4, device=device)
    assert torch.equal(first, second)
    assert torch.equal(torch.cuda.get_rng_state(device), before)


def test_initialize_of_a_meta_model_on_cuda_leaves_cpu_and_cuda_generators_alone():
    torch.cuda.init()
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
    with torch.device("meta"):
        model = GPT(dataclasses.replace(GPTConfig.preset("tiny"), dropout=0.1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    shardwise.initialize(model, config, param_init_fn=GPT.init_weights)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(torch.cuda.get_rng_state(), cuda)


def test_a_host_tensor_is_staged_through_the_device_and_written_back():
    host = torch.arange(4.0)
    with staged_on(host, torch.device("cuda", torch.cuda.current_device())) as staged:
        assert staged.is_cuda
        staged.mul_(2)
    assert torch.equal(host, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_the_step_timer_times_a_cuda_step_without_synchronising_inside_it(monkeypatch):
    engine = shardwise.initialize(GPT(GPTConfig.preset("tiny")), {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    })
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    tokens = torch.randint(0, engine.module.config.vocab_size, (2, 17), device=engine.device)
    timer = StepTimer(engine.comm_stats, engine.device)
    timer.start_step()
    with timer.phase("forward"):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
    with timer.phase("backward"):
        engine.backward(loss)
    with timer.phase("optimizer"):
        engine.step()
    times = timer.end_step()
    assert calls == []
    assert times.forward > 0 and times.backward > 0 and times.optimizer > 0
    parts = times.data + times.forward + times.backward + times.optimizer + times.comm_wait
    assert parts <= times.step * 1.001  # the device may idle between phases while Python runs


def _host_tensor_on_nccl(rank: int, world_size: int) -> str:
    mesh = ParallelMesh(ParallelSizes(data_shard=world_size), rank, torch.device("cuda", rank), collective_timeout())
    comm = Communicator(mesh["shard"])
    try:
        comm.all_reduce(torch.ones(4), "a host tensor")
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs for an NCCL group of two")
def test_nccl_refuses_a_host_tensor_by_name():
    for message in run_distributed(_host_tensor_on_nccl, 2, backend="nccl"):
        assert "all_reduce of a host tensor in the shard group" in message and "CUDA tensors only" in message
