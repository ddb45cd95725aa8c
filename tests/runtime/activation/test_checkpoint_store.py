"""Where checkpoints live: partitioned over the tensor group (Pa), in host memory (CPU
checkpointing), in one contiguous buffer (Md); and DeepSpeed's checkpointing API."""

import pytest
import torch

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.activation import ActivationTracker, CheckpointStore
from shardwise.frontends.deepspeed import checkpointing as deepspeed_api
from shardwise.runtime.activation.contiguous import ContiguousArena
from shardwise.tools.testing import run_distributed
from tests.runtime.activation.workers import SEQ, batch, measure, partitioned_checkpoints, tiny_gpt, with_policy

LAYER_INPUT = 2 * SEQ * 32 * 4  # rows x seq x hidden, fp32


@pytest.mark.parametrize(("policy", "to_host", "contiguous"),
                         [("full", False, False), ("sqrt", False, False), ("full", True, True)])
def test_partitioned_checkpoints_equal_and_halve_memory(policy, to_host, contiguous):
    """A tensor group of 2 over a replicated model: the inputs are equal on both ranks, so
    Pa must reproduce no recomputation exactly, while each rank keeps half of each input
    and the full input is really freed (DeepSpeed's issue #3779: theirs was not)."""
    for result in run_distributed(partitioned_checkpoints, 2, policy, to_host, contiguous):
        reference = result["none"]
        for name in ("whole", "partitioned"):
            assert result[name]["loss"] == reference["loss"]
            for got, want in zip(result[name]["grads"], reference["grads"]):
                assert torch.equal(got, want), name
        regions = {"full": 3, "sqrt": 2}[policy]
        whole = result["whole"]["activations"]["checkpoints"]
        assert whole == regions * LAYER_INPUT
        assert result["partitioned"]["activations"]["checkpoints"] == whole // 2
        host = result["partitioned"]["tiers"].get("host", {}).get("activations", 0)
        assert host == (whole // 2 if to_host else 0)
        assert result["whole"]["input_alive"], "without Pa the checkpoint is the input itself"
        assert not result["partitioned"]["input_alive"], "with Pa the full input must be freed"
        assert result["all_gather"] == regions * LAYER_INPUT // 2  # each rank sends its half once
        if contiguous:
            assert result["arena"] == {"cpu": (0, 3)}  # one step: learned, served by plain allocations


def test_cpu_checkpoints_are_counted_on_the_host_tier():
    """On a CPU-only machine the checkpoints already are in host memory; they are counted on
    the host tier, so the device's activation peak is the rest."""
    ledger = MemoryLedger()
    tracker = ActivationTracker(ledger)
    model = with_policy(tiny_gpt(n_layer=3), "full", store=CheckpointStore(to_host=True))
    x, y = batch(0, 2)
    with tracker.track():
        loss = model(x, y)
    loss.backward()
    tiers = ledger.breakdown_by_tier()
    assert tiers["host"]["activations"] == 3 * LAYER_INPUT
    assert tiers["device"]["activations"] == tracker.breakdown()["total"]
    whole = measure(with_policy(tiny_gpt(n_layer=3), "full"))[2].breakdown()["total"]
    assert tracker.breakdown()["total"] <= whole - 2 * LAYER_INPUT  # at the first recomputation 3 inputs, 1 back


def test_contiguous_buffer_is_allocated_once_and_reused():
    store = CheckpointStore(contiguous=True)
    model = with_policy(tiny_gpt(n_layer=3, dropout=0.1), "full", store=store)
    reference = tiny_gpt(n_layer=3, dropout=0.1)
    for step in range(3):
        got, want = measure(model)[:2], measure(reference)[:2]
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1]):
            assert torch.equal(a, b)
        model.zero_grad()
        reference.zero_grad()
    arena = store.arenas[torch.device("cpu")]
    assert (arena.allocations, arena.capacity, arena.overflows) == (1, 3 * LAYER_INPUT, 3)  # step 1 learned it


def test_arena_sized_by_number_checkpoints_and_overflow():
    arena = ContiguousArena(torch.device("cpu"), number_checkpoints=2)
    first = arena.slot(torch.Size([4, 4]), torch.float32)
    second = arena.slot(torch.Size([4, 4]), torch.float32)
    third = arena.slot(torch.Size([4, 4]), torch.float32)  # beyond the 2 planned
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert second.data_ptr() - first.data_ptr() == 64
    assert third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert (arena.allocations, arena.overflows) == (1, 1)
    for _ in range(3):
        arena.release()
    arena.slot(torch.Size([4, 4]), torch.float32)  # the next step grows the buffer to the demand
    assert arena.capacity == 3 * 64


def test_deepspeed_api_checkpoint_and_rng_tracker():
    deepspeed_api.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})
    assert deepspeed_api.is_configured()
    deepspeed_api.model_parallel_cuda_manual_seed(11)
    tracker = deepspeed_api.get_cuda_rng_tracker()
    linear = torch.nn.Linear(8, 8)

    def layer(x, scale=None):
        with tracker.fork():
            dropped = torch.nn.functional.dropout(linear(x), 0.5)
        return torch.nn.functional.dropout(dropped, 0.3) * scale

    x = torch.randn(4, 8, requires_grad=True)
    scale = torch.full((8,), 2.0)
    outputs = []
    for run in (lambda: layer(x, scale=scale), lambda: deepspeed_api.checkpoint(layer, x, scale=scale)):
        states = (torch.get_rng_state(), tracker.get_states())
        out = run()
        out.sum().backward()
        outputs.append((out.detach(), x.grad.clone(), linear.weight.grad.clone()))
        x.grad, linear.weight.grad = None, None
        torch.set_rng_state(states[0])
        tracker.set_states(states[1])
    for got, want in zip(*outputs):
        assert torch.equal(got, want)
    assert deepspeed_api.checkpoint_stats().regions == 1
    assert deepspeed_api.checkpoint_stats().recompute_seconds > 0
    with pytest.raises(ValueError, match="was never added"):
        with tracker.fork("other"):
            pass
    deepspeed_api.reset()
