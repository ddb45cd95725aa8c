"""ZeRO-3 on the awkward cases: modules called twice, parameters without gradients,
weights read or edited outside forward, rank-dependent branches, and a model built
already partitioned because it does not fit one rank."""

import ctypes
import resource
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.runtime.zero import shared_param_home
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.runtime.zero.workers import VOCAB, build_model, global_batch, relative_error

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}


def config(zero: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": zero, **extra}


class ReuseNet(nn.Module):
    """`shared` runs twice per forward; `branch` only on even steps; `never` not at all."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, 32)
        self.shared = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32)
        self.never = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.use_branch = True

    def forward(self, x, y):
        h = torch.tanh(self.shared(self.embed(x)))
        h = torch.tanh(self.shared(h))
        if self.use_branch:
            h = h + self.branch(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _reuse_worker(rank: int, world_size: int, zero: dict) -> dict:
    model = ReuseNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = shardwise.initialize(model, config(zero), optimizer=optimizer)
    losses = []
    for step in range(4):
        model.use_branch = step % 2 == 0  # data-independent: equal on every rank
        x, y = global_batch(step, 2 * world_size)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardwise.gathered_parameters(list(model.parameters())):
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _reuse_reference(world_size: int) -> dict:
    """One process; a parameter without gradient counts as a zero gradient, as in every
    ZeRO stage (its flat gradient buffer holds zeros), so Adam and weight decay still
    touch it."""
    model = ReuseNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        model.use_branch = step % 2 == 0
        x, y = global_batch(step, 2 * world_size)
        model(x, y).backward()
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zero", [{"stage": 2, "reduce_bucket_size": 3000}, STAGE3], ids=["stage2", "stage3"])
def test_module_called_twice_and_parameters_without_gradients(zero):
    results = run_distributed(_reuse_worker, 2, zero)
    expected = _reuse_reference(2)
    for result in results:
        for name, want in expected.items():
            error = relative_error(result["params"][name], want)
            assert error < 1e-5, f"{name}: relative error {error:.2e}"


class ReturnsItsBias(nn.Linear):
    def forward(self, h):
        return F.linear(h, self.weight), self.bias


class PassesItOn(nn.Module):
    """Owns no parameter: the bias rises through it to the module that adds it."""

    def __init__(self):
        super().__init__()
        self.inner = ReturnsItsBias(32, 32)

    def forward(self, h):
        return self.inner(h)


class ReturnedBiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(VOCAB, 32)
        self.passer = PassesItOn()
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, x, y):
        out, bias = self.passer(self.embed(x))
        logits = self.head(torch.tanh(out + bias))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _returned_bias_worker(rank: int, world_size: int) -> dict:
    model = ReturnedBiasNet()
    engine = shardwise.initialize(model, config(STAGE3), optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(3):
        x, y = global_batch(step, 2 * world_size)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
    with shardwise.gathered_parameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_parameter_returned_by_its_module_stays_gathered_for_the_caller():
    """A forward returning its module's (partitioned) bias to a caller that adds it: the
    unit stays gathered until the caller's forward ends, as DeepSpeed keeps an external
    parameter of the caller gathered."""
    results = run_distributed(_returned_bias_worker, 2)
    model = ReturnedBiasNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        x, y = global_batch(step, 4)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for result in results:
        for name, want in model.named_parameters():
            error = relative_error(result[name], want.detach())
            assert error < 1e-5, f"{name}: relative error {error:.2e}"


def _gathered_worker(rank: int, world_size: int) -> dict:
    model = build_model("gpt")
    engine = shardwise.initialize(model, config(STAGE3), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    weight = model.blocks[0].mlp.fc.weight
    outside = weight.numel()
    with shardwise.gathered_parameters(weight):
        inside_shape, checksum = tuple(weight.shape), weight.double().sum().item()
    with shardwise.gathered_parameters(weight, modifier_rank=0), torch.no_grad():
        if rank == 0:
            weight.fill_(0.5)
    with shardwise.gathered_parameters(weight):
        after_edit = weight.unique().tolist()
    x, y = global_batch(0, 2 * world_size)
    engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
    engine.step()
    with shardwise.gathered_parameters(weight):
        drift = (weight - 0.5).abs().max().item()
    return {"outside": outside, "shape": inside_shape, "checksum": checksum, "after_edit": after_edit, "drift": drift}


def test_gathered_parameters_read_and_initialise_weights_outside_forward():
    results = run_distributed(_gathered_worker, 2)
    for result in results:
        assert result["outside"] == 0, "a partitioned weight must be empty outside forward"
        assert result["shape"] == (128, 32)
        assert result["checksum"] == results[0]["checksum"]
        assert result["after_edit"] == [0.5], "rank 0's edit must reach every rank"
        # one Adam step moves each element by about lr; a stale master copy would
        # have put the old initial values (|w| ~ 0.02, so drift ~0.5) back
        assert 0 < result["drift"] < 5e-3, result["drift"]


class BranchNet(nn.Module):
    def __init__(self, wide_b: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.branch_a = nn.Linear(32, 32, bias=False)
        self.branch_b = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)) if wide_b else nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, x, y, take_a: bool):
        h = self.embed(x)
        h = self.branch_a(h) if take_a else self.branch_b(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def _branch_worker(rank: int, world_size: int, wide_b: bool) -> None:
    model = BranchNet(wide_b)
    engine = shardwise.initialize(model, config(STAGE3), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y, take_a=rank == 0))  # rank-dependent branch
    engine.step()


@pytest.mark.parametrize("wide_b", [False, True], ids=["same-size-branches", "different-size-branches"])
def test_rank_dependent_branches_raise_a_clear_error_not_a_hang(wide_b):
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_branch_worker, 2, wide_b, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "5"})
    message = str(failure.value)
    assert time.monotonic() - started < 30
    assert "rank " in message
    assert "branch_" in message or "head" in message or "embed" in message, message


def _meta_worker(rank: int, world_size: int) -> dict:
    def peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # glibc raises its mmap threshold after large frees and then keeps freed blocks in
    # the heap, so RSS would count memory that is no longer live; pin the threshold.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    gpt_config = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=16, n_embd=1024)
    before = peak_rss()
    with torch.device("meta"):
        model = GPT(gpt_config)
    full_fp32 = 4 * sum(p.numel() for p in model.parameters())
    engine = shardwise.initialize(
        model,
        config(
            dict(
                STAGE3, reduce_bucket_size=10_000_000, stage3_prefetch_bucket_size=2_000_000,
                stage3_max_live_parameters=4_000_000, stage3_max_reuse_distance=0,
                sub_group_size=2_000_000,  # bounds the fp32 gradient copy of the step
            ),
            bf16={"enabled": True},
        ),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), param_init_fn=GPT.init_weights,
    )
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"growth": peak_rss() - before, "full_fp32": full_fp32, "losses": losses}


def test_model_larger_than_one_rank_budget_is_built_partitioned_and_trains():
    # a process's RSS counts every shared page it touches: with the partitioned parameters
    # kept once per host in shared memory (shared_param_home.py) each rank's RSS would hold
    # the host's one copy of them, so the per-rank budget is measured on the copying gathers
    results = run_distributed(_meta_worker, 4, timeout=300, env={shared_param_home.ENABLE_VARIABLE: "0"})
    full_fp32 = results[0]["full_fp32"]
    # A budget below the fp32 weights alone: this rank could not build the model, let
    # alone train it (weights + gradients = 2x). Partitioned in bf16 with SGD at N=4:
    # shards, gradients and fp32 master are (2 + 2 + 4) / 4 = 2 bytes per parameter, half
    # of it; activations, gathered units and reduction buffers use part of the rest.
    budget = 0.8 * full_fp32
    for result in results:
        assert result["growth"] < budget, (result["growth"], budget)
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"][1] < result["losses"][0], "training must make progress"


class SwapNet(nn.Module):
    """Two blocks whose order flips when `swap` is set (equally on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(VOCAB, 32)
        self.first = nn.Linear(32, 32)
        self.second = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)
        self.swap = False

    def forward(self, x, y):
        h = self.embed(x)
        for block in (self.second, self.first) if self.swap else (self.first, self.second):
            h = torch.tanh(block(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


SWAPS = [False, False, True, True, False]


def _swap_worker(rank: int, world_size: int) -> dict:
    model = SwapNet()
    engine = shardwise.initialize(model, config(STAGE3), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    prefetched = []
    for step, swap in enumerate(SWAPS):
        model.swap = swap
        x, y = global_batch(step, 2 * world_size)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
        prefetched.append(engine.zero.params.schedule.prefetched)
    with shardwise.gathered_parameters(list(model.parameters())):
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "prefetched": prefetched}


def test_changed_module_order_falls_back_to_on_demand_and_stays_exact():
    results = run_distributed(_swap_worker, 2)
    model = SwapNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, swap in enumerate(SWAPS):
        model.swap = swap
        x, y = global_batch(step, 4)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for result in results:
        for name, want in model.named_parameters():
            error = relative_error(result["params"][name], want.detach())
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
        prefetched = result["prefetched"]
        assert prefetched[0] == 0, "the first step has no trace to prefetch along"
        assert prefetched[1] > prefetched[0], "the second step prefetches along the trace"
        assert prefetched[3] > prefetched[2], "after a change the new order becomes the trace"


def _late_branch_worker(rank: int, world_size: int) -> None:
    """Ranks agree for two steps (a trace is recorded), then branch by rank."""
    model = BranchNet(wide_b=False)
    engine = shardwise.initialize(model, config(STAGE3), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        x, y = global_batch(step, 2)
        engine.backward(engine(x, y, take_a=step < 2 or rank == 0))
        engine.step()


def test_ranks_leaving_a_recorded_trace_differently_fail_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_late_branch_worker, 2, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "5"})
    message = str(failure.value)
    assert time.monotonic() - started < 30
    assert "rank " in message and "branch_" in message, message
