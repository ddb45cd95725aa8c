"""The 1-bit compressed all-reduce (shardwise/runtime/distributed/compressed.py): bit packing, and
the exchange over gloo ranks against the single-process simulation of N workers, to the
bit, with the bytes it sends counted exactly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.compressed import (
    CompressedAllReduce,
    pack_signs,
    padded_length,
    unpack_signs,
)
from shardwise.formulas.communication import onebit_exchange_bytes
from shardwise.runtime.optim import native
from shardwise.runtime.optim.onebit_exchange import NativeCompressedAllReduce
from shardwise.tools.testing import run_distributed
from tests.runtime.optim.onebit_reference import Exchange

CALLS = 3
LENGTH = 96  # a multiple of 8 x 4: whole bytes per chunk at 2 and 4 ranks
NATIVE_LENGTH = 8192  # enough elements for the norms' summation orders to differ
SCALE_RTOL = math.sqrt(NATIVE_LENGTH) * 2**-24  # torch's fp32 norm against the kernels' double sum


def test_signs_pack_eight_per_byte_and_unpack_exactly():
    generator = torch.Generator().manual_seed(0)
    positive = torch.rand(3, 64, generator=generator) > 0.5
    packed = pack_signs(positive)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_signs(packed), positive)
    first = torch.tensor([True, False, False, False, False, False, False, True])
    assert pack_signs(first).item() == 0b10000001  # first element in the highest bit


def test_packing_by_multiplication_equals_packing_bit_by_bit():
    """The int64 multiply-and-shift packing (contiguous input) and the per-bit shifts it
    replaced (the path a strided input takes) give the same bytes, and leave the input as
    it was."""
    generator = torch.Generator().manual_seed(1)
    positive = torch.rand(4, 8 * 1000, generator=generator) > 0.5
    kept = positive.clone()
    strided = torch.stack([positive, ~positive], dim=-1)[..., 0]  # the same booleans, not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(pack_signs(positive), pack_signs(strided))
    assert torch.equal(positive, kept) and torch.equal(unpack_signs(pack_signs(positive)), positive)


def test_padded_length_gives_whole_bytes_per_rank():
    assert padded_length(27808, 2) == 27808
    assert padded_length(27809, 2) == 27824
    assert padded_length(1, 4) == 32


def vectors(call: int, ranks: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + call)
    return [torch.randn(LENGTH, generator=generator) for _ in range(ranks)]


def _exchange_on_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    communicator = Communicator(handle, CommStats())
    exchange = CompressedAllReduce(communicator, LENGTH, torch.device("cpu"))
    results = []
    for call in range(CALLS):
        results.append(exchange.all_reduce_(vectors(call, world_size)[rank].clone(), "test vector").clone())
    return {"results": results, "volume": communicator.stats.totals(),
            "errors": (exchange.worker_error.clone(), exchange.server_error.clone())}


@pytest.mark.parametrize("ranks", [2, 4])
def test_exchange_equals_simulation_bit_for_bit(ranks):
    outputs = run_distributed(_exchange_on_ranks, ranks)
    reference = Exchange(ranks, LENGTH)
    for call in range(CALLS):
        expected = reference.average(vectors(call, ranks))
        for rank, output in enumerate(outputs):
            assert torch.equal(output["results"][call], expected), f"call {call}, rank {rank}"
    for rank, output in enumerate(outputs):
        worker_error, server_error = output["errors"]
        assert torch.equal(worker_error, reference.worker_errors[rank])
        assert torch.equal(server_error, reference.server_errors[rank])
        sent = onebit_exchange_bytes(LENGTH, ranks)
        assert output["volume"]["all_to_all"] == CALLS * sent["all_to_all"]
        assert output["volume"]["all_gather"] == CALLS * sent["all_gather"]
        assert output["volume"]["all_reduce"] == 0


def _both_paths_on_ranks(rank: int, world_size: int) -> dict:
    """Each call through the torch path and the native kernels (optim/onebit_exchange.py)
    from the same error buffers (the torch path's, copied), each with its own byte count."""
    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    plain, kernels = Communicator(handle, CommStats()), Communicator(handle, CommStats())
    exchange = CompressedAllReduce(plain, NATIVE_LENGTH, torch.device("cpu"))
    native_exchange = NativeCompressedAllReduce(kernels, NATIVE_LENGTH, torch.device("cpu"))
    calls = []
    for call in range(CALLS):
        native_exchange.worker_error.copy_(exchange.worker_error)
        native_exchange.server_error.copy_(exchange.server_error)
        vector = torch.randn(NATIVE_LENGTH, generator=torch.Generator().manual_seed(10 * call + rank))
        expected = exchange.all_reduce_(vector.clone(), "torch path").clone()
        got = native_exchange.all_reduce_(vector.clone(), "native kernels").clone()
        calls.append({"expected": expected, "got": got, "errors": (exchange.worker_error.clone(),
                      exchange.server_error.clone()), "native_errors": (native_exchange.worker_error.clone(),
                      native_exchange.server_error.clone())})
    return {"calls": calls, "volume": kernels.stats.totals()}


@pytest.mark.parametrize("ranks", [2])
def test_native_exchange_takes_the_torch_paths_call_and_sends_the_same_bytes(ranks):
    """Step by step from the same state: the worker's signs are the same comparisons (x + e
    >= 0), so its error buffer differs only through the scale, whose norm the kernels sum
    in double and torch in fp32 (about √n · 2⁻²⁴ apart: SCALE_RTOL). The server averages
    scales that differ by as much, so its compensated value may fall on the other side of
    zero where it is a tie at that precision (|c| < 1e-5 of its scale); everywhere else the
    averaged momentum has the same signs and its scale agrees to SCALE_RTOL. The bytes
    sent are the formula's."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    outputs = run_distributed(_both_paths_on_ranks, ranks)
    chunk = NATIVE_LENGTH // ranks
    for call in range(CALLS):
        expected, got = outputs[0]["calls"][call]["expected"], outputs[0]["calls"][call]["got"]
        compensated = torch.cat([output["calls"][call]["errors"][1] for output in outputs]) + expected
        scales = expected.abs().view(ranks, chunk)[:, :1].expand(ranks, chunk).reshape(-1)
        ties = compensated.abs() < 1e-5 * scales
        assert torch.equal(got[~ties].sign(), expected[~ties].sign()), f"call {call}"
        torch.testing.assert_close(got.abs(), expected.abs(), rtol=SCALE_RTOL, atol=0)
        for rank, output in enumerate(outputs):
            worker, server = output["calls"][call]["errors"]
            native_worker, native_server = output["calls"][call]["native_errors"]
            torch.testing.assert_close(native_worker, worker, rtol=0, atol=SCALE_RTOL * worker.abs().max().item())
            own = ~ties.view(ranks, chunk)[rank]
            torch.testing.assert_close(native_server[own], server[own], rtol=0,
                                       atol=SCALE_RTOL * server.abs().max().item())
    sent = onebit_exchange_bytes(NATIVE_LENGTH, ranks)
    for output in outputs:
        assert output["volume"]["all_to_all"] == CALLS * sent["all_to_all"]
        assert output["volume"]["all_gather"] == CALLS * sent["all_gather"]
        assert output["volume"]["all_reduce"] == 0


def test_error_feedback_keeps_the_long_run_average():
    """What error feedback is for: summed over many calls, the compressed averages equal the
    true averages minus the error buffers left at the end (worker errors averaged, plus the
    servers'): bounded, not a drift growing with the number of calls."""
    reference = Exchange(2, LENGTH)
    true_sum, compressed_sum = torch.zeros(LENGTH), torch.zeros(LENGTH)
    for call in range(200):
        pair = vectors(call, 2)
        true_sum += (pair[0] + pair[1]) / 2
        compressed_sum += reference.average(pair)
    left = (reference.worker_errors[0] + reference.worker_errors[1]) / 2 + torch.cat(reference.server_errors)
    assert torch.allclose(compressed_sum, true_sum - left, atol=1e-3)
    assert left.norm() < 0.2 * true_sum.norm(), (left.norm(), true_sum.norm())


def test_length_must_give_whole_bytes_per_chunk():
    handle_size = 2

    class _Group:
        size = handle_size

    with pytest.raises(ValueError, match="multiple of 16"):
        CompressedAllReduce(_Group(), 40, torch.device("cpu"))


FUSED_SHAPES = [(300, 70), (33,), (5000,), (7, 3, 11)]  # chunks cut through tensors; offsets in mid-byte
FUSED_STEPS = 4  # freeze_step 1: one warm-up step, three through the fused exchange


def _fused_and_torch_steps_on_ranks(rank: int, world_size: int, lamb: bool) -> dict:
    """1-bit Adam (or LAMB) at stage 0 twice over the same parameters: the kernels' fused
    step (the fold in the worker's pass, the decode in the update's, or in LAMB's
    statistics pass) and the torch path's (`SHARDWISE_NATIVE_OPTIM=0`), each compressed
    step from the fused one's state (weights, moments, flat momentum, error buffers)
    copied into the other's."""
    import os

    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle
    from shardwise.runtime.optim.onebit_adam import OneBitAdam
    from shardwise.runtime.optim.onebit_lamb import OneBitLamb

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in FUSED_SHAPES]
    optimizers, params, communicators = [], [], []
    for _ in range(2):
        own = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
        groups = [{"params": own[:2]},  # the second group: other betas, decay, eps inside the root
                  {"params": own[2:], "betas": (0.8, 0.99), "weight_decay": 0.01, "eps_inside_sqrt": True}]
        optimizer = (OneBitLamb if lamb else OneBitAdam)(groups, lr=0.01, freeze_step=1, eps=1e-4)
        communicator = Communicator(handle, CommStats())
        optimizer.attach_gradient_exchange(communicator, lambda on: None)
        optimizers.append(optimizer)
        params.append(own)
        communicators.append(communicator)
    (fused, plain), (mine, theirs) = optimizers, params
    steps = []
    for step in range(FUSED_STEPS):
        for index, (param, twin) in enumerate(zip(mine, theirs)):
            grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 * step + 10 * rank + index))
            param.grad = None if (step, index) == (2, 1) else grad  # a tensor without a gradient folds none
            twin.grad = None if param.grad is None else param.grad.clone()
            twin.data.copy_(param.data)
            for key, value in fused.state[param].items():
                if torch.is_tensor(value) and key in plain.state[twin]:
                    plain.state[twin][key].copy_(value)
                elif torch.is_tensor(value):
                    plain.state[twin][key] = value.clone()
                else:
                    plain.state[twin][key] = value
        if fused._exchange is not None:  # the same error feedback and padding
            plain.momentum_flat().copy_(fused.momentum_flat())
            plain._exchange.worker_error.copy_(fused._exchange.worker_error)
            plain._exchange.server_error.copy_(fused._exchange.server_error)
        before = [param.detach().clone() for param in mine]
        communicators[0].stats.clear()
        fused.step()
        os.environ[native.ENABLE_VARIABLE] = "0"
        plain.step()
        os.environ[native.ENABLE_VARIABLE] = "1"
        steps.append({"fused": [param.detach().clone() for param in mine],
                      "plain": [param.detach().clone() for param in theirs], "before": before,
                      "momentum": fused.momentum_flat().clone(), "expected": plain.momentum_flat().clone(),
                      "fresh": [fused.state[param].get("exp_avg_sq_fresh") for param in mine],
                      "expected_fresh": [plain.state[twin].get("exp_avg_sq_fresh") for twin in theirs],
                      "server": None if plain._exchange is None else plain._exchange.server_error.clone(),
                      "volume": communicators[0].stats.totals()})
    return {"steps": steps, "numel": fused.momentum_flat().numel()}


@pytest.mark.parametrize("lamb", [False, True], ids=["adam", "lamb"])
def test_fused_onebit_step_takes_the_torch_paths_step_and_sends_the_same_bytes(lamb):
    """1-bit Adam's and LAMB's fused steps (optim/onebit_exchange.py's `exchange_`, the
    decode in the update's or the statistics' pass) against the torch path, step by step
    from the same state, at two ranks: the averaged momentum has the same signs but at
    ties (as in the test above) and its scales agree to SCALE_RTOL; LAMB's fresh variance
    off ties to that too; every weight off a tie (LAMB: of a tensor without one, whose
    variance factor is a maximum over it) steps as the torch path's to that, two ulps and
    (LAMB) the norms' NORM_RTOL; the bytes sent are the formula's."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    ranks = 2
    outputs = run_distributed(_fused_and_torch_steps_on_ranks, ranks, lamb)
    numel = outputs[0]["numel"]
    chunk, rtol = numel // ranks, math.sqrt(numel // ranks) * 2**-24
    step_rtol = rtol + 2.5e-7 + (2e-5 if lamb else 0.0)
    for step in range(1, FUSED_STEPS):
        expected, got = outputs[0]["steps"][step]["expected"], outputs[0]["steps"][step]["momentum"]
        compensated = torch.cat([output["steps"][step]["server"] for output in outputs]) + expected
        scales = expected.abs().view(ranks, chunk)[:, :1].expand(ranks, chunk).reshape(-1)
        ties = compensated.abs() < 1e-5 * scales
        assert torch.equal(got[~ties].sign(), expected[~ties].sign()), f"step {step}"
        torch.testing.assert_close(got.abs(), expected.abs(), rtol=rtol, atol=0)
        for output in outputs:
            record = output["steps"][step]
            assert torch.equal(record["momentum"], got)  # every rank decodes the same average
            offset = 0
            for index, (param, twin, start) in enumerate(zip(record["fused"], record["plain"], record["before"])):
                off_ties = ~ties[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                if lamb:
                    fresh, expected_fresh = record["fresh"][index], record["expected_fresh"][index]
                    torch.testing.assert_close(fresh[off_ties], expected_fresh[off_ties], rtol=3 * rtol, atol=0)
                    if not off_ties.all():
                        continue
                allowed = 2.5e-7 * twin.abs() + step_rtol * (twin - start).abs()
                assert ((param - twin).abs() <= allowed)[off_ties].all(), f"step {step}"
            sent = onebit_exchange_bytes(numel, ranks)
            assert record["volume"]["all_to_all"] == sent["all_to_all"]
            assert record["volume"]["all_gather"] == sent["all_gather"]
            assert record["volume"]["all_reduce"] == 0


def _lazy_and_settled_on_ranks(rank: int, world_size: int) -> dict:
    """Two native exchanges over the same calls: one whose error buffers are read (so
    settled) after every call, one read only at the end."""
    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    lazy = NativeCompressedAllReduce(Communicator(handle, CommStats()), NATIVE_LENGTH, torch.device("cpu"))
    settled = NativeCompressedAllReduce(Communicator(handle, CommStats()), NATIVE_LENGTH, torch.device("cpu"))
    lazy_results, settled_results = [], []
    for call in range(CALLS + 1):
        vector = torch.randn(NATIVE_LENGTH, generator=torch.Generator().manual_seed(10 * call + rank))
        lazy_results.append(lazy.all_reduce_(vector.clone(), "read at the end").clone())
        settled_results.append(settled.all_reduce_(vector.clone(), "read every call").clone())
        settled.worker_error, settled.server_error  # what the call lost, taken off now
    return {"lazy": lazy_results, "settled": settled_results,
            "lazy_errors": (lazy.worker_error.clone(), lazy.server_error.clone()),
            "settled_errors": (settled.worker_error.clone(), settled.server_error.clone())}


def test_native_exchange_takes_off_what_a_compression_lost_in_the_next_call_exactly():
    """The kernels take what a compression lost off its error buffer in the next call's
    pass (or when the buffer is read): the same operations as taking it off at once, so
    results and buffers equal, bit for bit, an exchange whose buffers are read (settled)
    after every call."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    for output in run_distributed(_lazy_and_settled_on_ranks, 2):
        for call, (lazy, settled) in enumerate(zip(output["lazy"], output["settled"])):
            assert torch.equal(lazy, settled), f"call {call}"
        for lazy, settled in zip(output["lazy_errors"], output["settled_errors"]):
            assert torch.equal(lazy, settled)


def _kernel_outputs(avx512: bool) -> dict[str, torch.Tensor]:
    """Every 1-bit kernel whose signs the AVX-512 blocks read or write, on fixed inputs:
    lengths with a partial last block and an 8-lane last vector, a pending compression,
    three rows at the server, a momentum fold with a segment without gradient, the
    previous momentum read from memory and decoded from known signs, decodes starting
    inside a byte and crossing a chunk boundary, with weight decay and without (1-bit
    LAMB's statistics then read both rows of signs as lane masks)."""
    native.use_avx512(avx512)
    library, generator = native.library(), torch.Generator().manual_seed(3)
    n, rows, chunk = 3000, 3, 1000  # 3000 = 2 x 1024 + 952 elements, 952 = 59 x 16 + 8
    random_bytes = lambda count: torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)  # noqa: E731
    momentum, grad = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    out = {"worker_error": torch.randn(n, generator=generator), "server_error": torch.randn(n, generator=generator),
           "server signs": torch.zeros(n // 8, dtype=torch.uint8), "server scale": torch.zeros(1)}
    bounds = torch.tensor([[16, 1500], [1500, 2200]], dtype=torch.int64)
    grads = torch.tensor([grad.data_ptr() + 4 * 16, 0], dtype=torch.int64)
    factors = torch.tensor([[0.9, 0.1], [0.8, 0.2]], dtype=torch.float32)
    pending, known = random_bytes(n // 8), random_bytes(n // 8)
    pending_scale, known_scale = torch.tensor([0.25]), torch.tensor([0.375])
    for key, signs in (("worker", None), ("worker from known signs", known)):  # the momentum read, or decoded
        out.update({f"{key} signs": torch.zeros(n // 8, dtype=torch.uint8), f"{key} scale": torch.zeros(1)})
        library.onebit_worker_compress(momentum.data_ptr(), out["worker_error"].data_ptr(), n, 1, n // 8, 2,
                                       bounds.data_ptr(), grads.data_ptr(), factors.data_ptr(), pending.data_ptr(),
                                       pending_scale.data_ptr(), None if signs is None else signs.data_ptr(),
                                       known_scale.data_ptr(), out[f"{key} signs"].data_ptr(),
                                       out[f"{key} scale"].data_ptr())
    chunk_bytes = n // 8 // rows  # every chunk in one call, one message each
    out.update({"three chunks error": torch.randn(n, generator=generator),
                "three chunks signs": torch.zeros(n // 8, dtype=torch.uint8), "three chunks scales": torch.zeros(rows)})
    pending_scales, known_scales = torch.tensor([0.25, 0.5, 0.125]), torch.tensor([0.375, 0.25, 0.5])
    library.onebit_worker_compress(momentum.data_ptr(), out["three chunks error"].data_ptr(), n // rows, rows,
                                   chunk_bytes, 2, bounds.data_ptr(), grads.data_ptr(), factors.data_ptr(),
                                   pending.data_ptr(), pending_scales.data_ptr(), known.data_ptr(),
                                   known_scales.data_ptr(), out["three chunks signs"].data_ptr(),
                                   out["three chunks scales"].data_ptr())
    incoming, scales = random_bytes(rows * (n // 8)), torch.tensor([0.5, 0.25, 0.75])
    library.onebit_server_compress(incoming.data_ptr(), n // 8, scales.data_ptr(), rows, n,
                                   out["server_error"].data_ptr(), pending.data_ptr(), 0.125,
                                   out["server signs"].data_ptr(), out["server scale"].data_ptr())
    packed, known_rows, known_scales = random_bytes(rows * (chunk // 8)), random_bytes(rows * (chunk // 8)), scales / 3
    for (start, length, inside), decay in itertools.product(((5, 1990, 0), (1003, 11, 1)), (0.01, 0.0)):
        weights, variance = torch.randn(length, generator=generator), torch.rand(length, generator=generator)
        decoded = torch.zeros(length)
        library.onebit_decode_apply(packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, start, length,
                                    decoded.data_ptr(), variance.data_ptr(), weights.data_ptr(), -0.01, 1e-4, decay,
                                    inside)
        out.update({f"decoded {start} {decay}": decoded, f"weights {start} {decay}": weights})
        for key, signs in (("", None), (" from known signs", known_rows)):  # the previous momentum read, or decoded
            fresh, statistics = variance.clone(), torch.zeros(3, dtype=torch.float64)
            library.onebit_lamb_decode_statistics(
                packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, start, weights.data_ptr(),
                momentum.data_ptr(), None if signs is None else signs.data_ptr(), known_scales.data_ptr(),
                variance.data_ptr(), fresh.data_ptr(), length, 0.9, 0.1, 0.999, 0.001, 1e-4, inside, decay,
                statistics.data_ptr())
            out.update({f"fresh {start} {decay}{key}": fresh, f"statistics {start} {decay}{key}": statistics})
    return out


def test_avx512_signs_equal_the_portable_loops():
    """The 1-bit kernels' AVX-512 blocks (signs read as lane masks, packed from
    comparisons) against the portable loops: the same signs, scales, errors, decoded
    momentum, weights and statistics, bit for bit."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    if not native.use_avx512(True):
        pytest.skip("this CPU has no AVX-512: the kernels take only their portable loops")
    try:
        portable, avx512 = _kernel_outputs(False), _kernel_outputs(True)
    finally:
        native.use_avx512(True)
    for key, expected in portable.items():
        assert torch.equal(avx512[key], expected), key


def _lamb_maximum(avx512: bool, variance: torch.Tensor, fresh: torch.Tensor, start: int,
                  inside: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit LAMB's statistics pass without weight decay from both rows of signs (its
    AVX-512 block screens ratios by estimates), over the given variances: (largest ratio,
    fresh variance)."""
    native.use_avx512(avx512)
    generator, n = torch.Generator().manual_seed(5), variance.numel()
    chunk = 4096
    packed, known = (torch.randint(0, 256, (chunk // 8,), dtype=torch.uint8, generator=generator) for _ in range(2))
    scales, known_scales = torch.tensor([0.02]), torch.tensor([0.03])
    fresh, statistics = fresh.clone(), torch.zeros(3, dtype=torch.float64)
    native.library().onebit_lamb_decode_statistics(
        packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, start, variance.data_ptr(), variance.data_ptr(),
        known.data_ptr(), known_scales.data_ptr(), variance.data_ptr(), fresh.data_ptr(), n, 0.9, 0.1, 0.999, 0.001,
        1e-8, inside, 0.0, statistics.data_ptr())
    return statistics[0], fresh


@pytest.mark.parametrize("case", ["spread", "ties", "zeros and subnormals", "infinity", "nan"])
@pytest.mark.parametrize("inside", [0, 1])
def test_lamb_maximum_screened_by_estimates_equals_every_ratio_computed(case, inside):
    """The AVX-512 statistics pass computes a ratio d(v) / d(f) exactly only where an
    estimate could reach the largest so far: the largest (and NaN where a ratio is NaN)
    and the fresh variance are the portable loop's, which computes every ratio, bit for
    bit: on spread-out variances, on equal ones (many ratios within the estimates' error
    of the largest), and with zeros, subnormals, an infinity or a NaN among them."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    if not native.use_avx512(True):
        pytest.skip("this CPU has no AVX-512: the kernels take only their portable loops")
    generator, n = torch.Generator().manual_seed(7), 3000
    variance = torch.rand(n, generator=generator).square() * 1e-4
    fresh = variance * torch.empty(n).uniform_(0.5, 2.0, generator=generator)
    if case == "ties":
        variance, fresh = torch.full((n,), 1e-6), torch.full((n,), 1e-6)
    elif case == "zeros and subnormals":
        variance[::7], fresh[::11] = 0.0, 0.0
        variance[3::13], fresh[5::17] = 1e-42, 1e-41
    elif case == "infinity":
        variance[1234] = math.inf
    elif case == "nan":
        fresh[2500] = math.nan
    try:
        portable, avx512 = (_lamb_maximum(flag, variance, fresh, 5, inside) for flag in (False, True))
    finally:
        native.use_avx512(True)
    assert torch.equal(avx512[1], portable[1]) or case == "nan" and torch.equal(avx512[1].isnan(), portable[1].isnan())
    if case == "nan":
        assert avx512[0].isnan() and portable[0].isnan()
    else:
        assert avx512[0].item() == portable[0].item() and math.isfinite(portable[0].item()) == (case != "infinity")


def _known_and_read_momentum_on_ranks(rank: int, world_size: int, lamb: bool) -> dict:
    """Two fused optimizers stepping alike at stage 0: one reads the previous momentum from
    the last step's gathered signs (`momentum_signs`), the other, whose signs are forgotten
    before every step, from memory. Then an in-place write to one tensor's momentum."""
    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle
    from shardwise.runtime.optim.onebit_adam import OneBitAdam
    from shardwise.runtime.optim.onebit_lamb import OneBitLamb

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    initial = [torch.randn(shape, generator=torch.Generator().manual_seed(0)) for shape in FUSED_SHAPES]
    optimizers, params = [], []
    for _ in range(2):
        own = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
        optimizer = (OneBitLamb if lamb else OneBitAdam)(own, lr=0.01, freeze_step=1, eps=1e-4, weight_decay=0.01)
        optimizer.attach_gradient_exchange(Communicator(handle, CommStats()), lambda on: None)
        optimizers.append(optimizer)
        params.append(own)
    (known, read), known_before = optimizers, []
    for step in range(FUSED_STEPS):
        for index, (param, twin) in enumerate(zip(*params)):
            seed = torch.Generator().manual_seed(100 * step + 10 * rank + index)
            param.grad = torch.randn(param.shape, generator=seed)
            twin.grad = param.grad.clone()
        known_before.append(known.momentum_signs() is not None)
        read._momentum_signs = None
        known.step()
        read.step()
    kept, momentum = known.momentum_signs() is not None, [optimizer.momentum_flat().clone() for optimizer in optimizers]
    known.state[params[0][1]]["exp_avg"].mul_(0.5)  # a write the signs do not know of
    return {"weights": [[param.detach().clone() for param in own] for own in params], "momentum": momentum,
            "known_before": known_before, "kept": kept, "forgotten": known.momentum_signs() is None}


@pytest.mark.parametrize("lamb", [False, True], ids=["adam", "lamb"])
def test_momentum_read_from_the_last_signs_equals_it_read_from_memory(lamb):
    """After a fused step the flat momentum is the decode of the gathered signs, so the next
    step reads it (the worker's pass, LAMB's statistics pass) from them: the same steps,
    bit for bit, as reading it from memory; an in-place write to the momentum makes the
    optimizer forget the signs."""
    if not native.enabled():  # (SHARDWISE_NATIVE_OPTIM=0: no fused step, no signs kept)
        pytest.skip("the kernels are off or cannot be built here: no fused step")
    for output in run_distributed(_known_and_read_momentum_on_ranks, 2, lamb):
        assert output["known_before"] == [False, False, True, True]  # the warm-up, the first compressed step
        assert output["kept"] and output["forgotten"]
        for mine, theirs in zip(*output["weights"]):
            assert torch.equal(mine, theirs)
        assert torch.equal(*output["momentum"])


LAMB_TENSORS = [(0, 400, 0.0, 0, 0.1), (400, 1100, 0.01, 1, 0.1), (1500, 300, 0.0, 1, 10.0)]  # start, n, decay,
# eps_inside_sqrt, factor_threshold: the second crosses the chunk boundary, the third's factor is clamped to its range


def _lamb_steps(batched: bool, known: bool) -> dict[str, object]:
    """1-bit LAMB's compressed step on fixed gathered signs over three tensors: in one call
    (`onebit_lamb_decode_steps`) or tensor by tensor, each tensor's scale from Python's
    `_update_scale` between its statistics and its update."""
    from shardwise.runtime.optim.onebit_lamb import _update_scale

    library, generator = native.library(), torch.Generator().manual_seed(5)
    rows, chunk = 2, 1000
    packed = torch.randint(0, 256, (rows, chunk // 8), dtype=torch.uint8, generator=generator)
    known_rows = torch.randint(0, 256, (rows, chunk // 8), dtype=torch.uint8, generator=generator)
    scales, known_scales = torch.tensor([0.5, 0.25]), torch.tensor([0.375, 0.125])
    momentum = torch.randn(rows * chunk, generator=generator)
    weights = [torch.randn(n, generator=generator) for _, n, *_ in LAMB_TENSORS]
    variances = [torch.rand(n, generator=generator) for _, n, *_ in LAMB_TENSORS]
    fresh = [variance * torch.rand(variance.shape, generator=generator) for variance in variances]
    states = [{"lamb_coeff_freeze": 0.7 + k / 10, "last_factor": 1.0 + k / 5} for k in range(len(LAMB_TENSORS))]
    groups = [{"betas": (0.9, 0.999), "eps": 1e-4, "weight_decay": decay, "eps_inside_sqrt": bool(inside),
               "factor_min": 0.5, "factor_max": 4.0, "factor_threshold": threshold}
              for _, _, decay, inside, threshold in LAMB_TENSORS]
    step_size = 0.01
    signs = (known_rows.data_ptr(), known_scales.data_ptr()) if known else (None, None)
    if batched:
        table = torch.tensor([[start, n, w.data_ptr(), v.data_ptr(), f.data_ptr(), inside]
                              for (start, n, _, inside, _), w, v, f in zip(LAMB_TENSORS, weights, variances, fresh)],
                             dtype=torch.int64)
        settings = torch.tensor([[step_size, state["lamb_coeff_freeze"], state["last_factor"], *group["betas"],
                                  group["eps"], group["weight_decay"], group["factor_min"], group["factor_max"],
                                  group["factor_threshold"]] for state, group in zip(states, groups)],
                                dtype=torch.float64)
        library.onebit_lamb_decode_steps(packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, momentum.data_ptr(),
                                         *signs, len(LAMB_TENSORS), table.data_ptr(), settings.data_ptr())
        factors = settings[:, 2].tolist()
    else:
        for (start, n, decay, inside, _), w, v, f, state, group in zip(LAMB_TENSORS, weights, variances, fresh, states,
                                                                      groups):
            statistics = torch.zeros(3, dtype=torch.float64)
            library.onebit_lamb_decode_statistics(
                packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, start, w.data_ptr(),
                momentum.data_ptr() + 4 * start, *signs, v.data_ptr(), f.data_ptr(), n, 0.9, 1 - 0.9, 0.999,
                1 - 0.999, 1e-4, inside, decay, statistics.data_ptr())
            maximum, preliminary, update = statistics.tolist()
            scale = _update_scale(state, group, step_size, maximum, (math.sqrt(preliminary), math.sqrt(update)))
            library.onebit_decode_apply(packed.data_ptr(), chunk // 8, scales.data_ptr(), chunk, start, n,
                                        momentum.data_ptr() + 4 * start, v.data_ptr(), w.data_ptr(), scale, 1e-4,
                                        decay, inside)
        factors = [state["last_factor"] for state in states]
    return {"weights": weights, "fresh": fresh, "momentum": momentum, "factors": factors}


@pytest.mark.parametrize("known", [False, True], ids=["momentum read", "momentum from known signs"])
def test_lamb_step_in_one_call_equals_it_tensor_by_tensor(known):
    """1-bit LAMB's compressed step in one native call (`onebit_lamb_decode_steps`, the
    update's scale computed in C) against the calls per tensor around Python's
    `_update_scale`: the same weights, fresh variances, momentum and factors, bit for
    bit, with and without weight decay, eps inside the root, a factor bounded by its
    threshold and one by its range."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    batched, separate = _lamb_steps(True, known), _lamb_steps(False, known)
    assert batched["factors"] == separate["factors"]
    # the first two moved by their threshold from their last factor, the third at factor_max
    assert batched["factors"] == [1.0 * (1 + 0.1), (1.0 + 1 / 5) * (1 + 0.1), 4.0]
    for key in ("weights", "fresh"):
        for mine, theirs in zip(batched[key], separate[key]):
            assert torch.equal(mine, theirs), key
    assert torch.equal(batched["momentum"], separate["momentum"])


SAVED_AFTER = 3  # freeze_step 1: two fused steps before the save, three after it


def _saved_and_straight_lamb_on_ranks(rank: int, world_size: int) -> dict:
    """1-bit LAMB's fused steps at stage 0: one optimizer straight through, taking its own
    `state_dict()` back after step SAVED_AFTER (a load resets error feedback, so the straight
    run loads too), and one built fresh at that point from a deep copy of the first's
    state dict."""
    import copy

    import torch.distributed as dist

    from shardwise.runtime.distributed.mesh import GroupHandle
    from shardwise.runtime.optim.onebit_lamb import OneBitLamb

    handle = GroupHandle("data", tuple(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    initial = [torch.randn(shape, generator=torch.Generator().manual_seed(1)) for shape in FUSED_SHAPES]

    def build(weights: list[torch.Tensor]) -> tuple[OneBitLamb, list[torch.nn.Parameter]]:
        own = [torch.nn.Parameter(tensor.clone()) for tensor in weights]
        groups = [{"params": own[:2]}, {"params": own[2:], "weight_decay": 0.01}]
        optimizer = OneBitLamb(groups, lr=0.01, freeze_step=1, eps=1e-4, factor_threshold=0.5)
        optimizer.attach_gradient_exchange(Communicator(handle, CommStats()), lambda on: None)
        return optimizer, own

    def steps(optimizer: OneBitLamb, own: list[torch.nn.Parameter], numbers: range) -> None:
        for step in numbers:
            for index, param in enumerate(own):
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(
                    100 * step + 10 * rank + index))
            optimizer.step()

    straight, weights = build(initial)
    steps(straight, weights, range(SAVED_AFTER))
    saved = copy.deepcopy(straight.state_dict())
    resumed, resumed_weights = build([param.detach() for param in weights])
    resumed.load_state_dict(saved)
    straight.load_state_dict(straight.state_dict())
    steps(straight, weights, range(SAVED_AFTER, FUSED_STEPS + 2))
    steps(resumed, resumed_weights, range(SAVED_AFTER, FUSED_STEPS + 2))
    factors = [[optimizer.state[param]["last_factor"] for param in own]
               for optimizer, own in ((straight, weights), (resumed, resumed_weights))]
    return {"weights": [[param.detach().clone() for param in own] for own in (weights, resumed_weights)],
            "momentum": [optimizer.momentum_flat().clone() for optimizer in (straight, resumed)],
            "factors": factors, "saved_factors": [state["last_factor"] for state in saved["state"].values()]}



def test_lamb_state_saved_mid_run_continues_as_the_straight_run():
    """1-bit LAMB's state after fused steps (the factors written back by the one-call
    step, the fresh variances, the momentum) saved and loaded into a new optimizer
    continues exactly as the run that saved it, from the same reset of error feedback."""
    if native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    for output in run_distributed(_saved_and_straight_lamb_on_ranks, 2):
        assert all(factor != 1.0 for factor in output["saved_factors"])  # moved by the fused steps
        assert output["factors"][0] == output["factors"][1]
        for mine, theirs in zip(*output["weights"]):
            assert torch.equal(mine, theirs)
        assert torch.equal(*output["momentum"])
