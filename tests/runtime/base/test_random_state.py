"""`initialize` leaves the caller's random streams where plain PyTorch would: the CPU
generator at every stage, a model built on the meta device included, and (checked with a
stand-in for CUDA, which this machine lacks) the CUDA generators it draws from."""

import dataclasses

import pytest
import torch

import shardwise
import shardwise.runtime.base.random_state as random_state
from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt.parallelize import GPTAdapter
from shardwise.runtime.parallel.pipeline.timing import measure_layer_costs
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _config(stage: int) -> dict:
    return {**CONFIG, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(dataclasses.replace(GPTConfig.preset("tiny"), dropout=0.1))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_leaves_the_cpu_generator_where_it_was(stage):
    model = build_model("gpt")
    before = torch.get_rng_state()
    shardwise.initialize(model, _config(stage))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_meta_model_is_built_without_advancing_the_callers_stream_yet_follows_its_seed():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = shardwise.initialize(_meta_gpt(), _config(3), param_init_fn=GPT.init_weights)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    again = shardwise.initialize(_meta_gpt(), _config(3), param_init_fn=GPT.init_weights)
    torch.manual_seed(6)
    other = shardwise.initialize(_meta_gpt(), _config(3), param_init_fn=GPT.init_weights)
    weights = [_full_weights(engine) for engine in (first, again, other)]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))  # the caller's seed decides them
    assert not torch.equal(weights[0][0], weights[2][0])


def _full_weights(engine) -> list[torch.Tensor]:
    with shardwise.gathered_parameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _meta_on_ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(100 + rank)  # ranks' own streams differ; the model must not
    before = torch.get_rng_state()
    engine = shardwise.initialize(_meta_gpt(), _config(3), param_init_fn=GPT.init_weights)
    unchanged = torch.equal(torch.get_rng_state(), before)
    return {"unchanged": unchanged, "weights": _full_weights(engine)}


def test_ranks_build_the_same_meta_model_and_keep_their_own_streams():
    results = run_distributed(_meta_on_ranks, 2)
    assert all(result["unchanged"] for result in results)
    for mine, theirs in zip(results[0]["weights"], results[1]["weights"]):
        assert torch.equal(mine, theirs)


def test_timing_layers_for_a_pipeline_split_leaves_the_generator_where_it_was():
    model = GPT(dataclasses.replace(GPTConfig.preset("tiny"), dropout=0.1))
    before = torch.get_rng_state()
    measure_layer_costs(model, GPTAdapter(), micro_batch=2, seq_len=16)
    assert torch.equal(torch.get_rng_state(), before)


class CudaStandIn:
    """Stands in for CUDA (this machine has none): which generators were forked, and
    what each CUDA generator was seeded with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, initialized: bool, current: int):
        self.forked: list[list[int]] = []
        self.seeds: dict[int, int] = {}
        real_fork = torch.random.fork_rng
        stand_in = self

        def fork_rng(devices, **kwargs):
            stand_in.forked.append(list(devices))
            return real_fork(devices=[], **kwargs)  # the CPU part is real

        class Generator:
            def __init__(self, index: int):
                self.index = index

            def manual_seed(self, seed: int) -> None:
                stand_in.seeds[self.index] = seed

        monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "default_generators", tuple(Generator(i) for i in range(4)), raising=False)


def test_the_training_devices_cuda_generator_is_forked_and_seeded_alone(monkeypatch):
    cuda = CudaStandIn(monkeypatch, initialized=True, current=1)
    before = torch.get_rng_state()
    with random_state.seeded_rng(77, torch.device("cuda", 1)):
        torch.rand(3)
    assert cuda.forked == [[1]]
    assert cuda.seeds == {1: 77}  # torch.manual_seed would have reseeded all four devices
    assert torch.equal(torch.get_rng_state(), before)


def test_cuda_in_use_is_forked_even_for_a_block_on_the_cpu(monkeypatch):
    cuda = CudaStandIn(monkeypatch, initialized=True, current=2)
    with random_state.preserved_rng(torch.device("cpu")):
        pass
    assert cuda.forked == [[2]]


def test_a_cpu_run_never_initialises_cuda(monkeypatch):
    cuda = CudaStandIn(monkeypatch, initialized=False, current=0)
    with random_state.seeded_rng(3, torch.device("cpu")):
        pass
    assert cuda.forked == [[]] and cuda.seeds == {}
