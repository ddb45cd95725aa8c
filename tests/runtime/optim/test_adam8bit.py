"""8-bit Adam (C17): block-wise quantised moments whose blocks are the parameter's own, so
ZeRO's pieces quantise exactly as one process does; checkpoints hold fp32 moments."""

import copy
import math
import threading

import pytest
import torch

from shardwise.runtime.optim import native
from shardwise.runtime.optim.adam8bit import Adam8bit, AdamW8bit
from shardwise.runtime.optim.adam8bit import _CodedPiece as _Coded, _Fp32Piece as _Small
from shardwise.runtime.optim.quantization import BLOCK, codebook, dynamic_code, quantize
from shardwise.runtime.optim.adam8bit import adam_8bit_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.optim.pieces import train_in_pieces, train_whole
from tests.runtime.optim.workers import (
    STAGES_AND_WORLDS,
    ConfigRun,
    assert_resume_matches,
    check_against_one_process,
    parameter_shapes,
    save_then_resume,
    step_once_in_process,
    train_from_config,
)

CONFIG = {"type": "Adam8bit", "params": {"lr": 0.01, "min_8bit_size": 1024}}
SHAPES = [(40, 24), (3, 5, 70), (300,), (33, 17), ()]
# A code flip (a moment a hair from the midpoint between two code values, rounded the other
# way) changes that moment by one code step, up to 1.4% of its block's absmax. The
# gradients of N ranks differ from one process's in their last bits (summation order),
# which flips a few codes per run: measured ≤ 1.6e-4 relative on the weights after 3 steps
# (stage 0 on 2 ranks, with no piece at all, already 3e-5). Given identical gradients the
# pieces are exact (test_pieces_anywhere_quantise_exactly_like_one_process).
WEIGHT_TOLERANCE = 1e-3


def _random_run(steps: int = 4) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) * 10.0 ** -(step % 3) for shape in SHAPES]
             for step in range(steps)]
    return initial, grads


def test_dynamic_codes_and_nearest_rounding():
    signed, unsigned = dynamic_code(True), dynamic_code(False)
    assert signed.numel() == unsigned.numel() == 256
    assert torch.all(signed[1:] > signed[:-1]) and torch.all(unsigned[1:] > unsigned[:-1])
    assert signed.max() == unsigned.max() == 1.0 and unsigned.min() == 0.0 and 0.0 in signed
    assert signed[signed > 0].min() == pytest.approx(1e-6 * 0.55)  # seven decades down to 1e-6
    values = torch.randn(4, BLOCK) * torch.rand(4, BLOCK) ** 6
    for code, data, signed_code in ((signed, values, True), (unsigned, values.abs(), False)):
        absmax = data.abs().amax(dim=1)
        scaled = data * absmax.reciprocal().unsqueeze(1)
        nearest = (scaled.unsqueeze(-1) - code).abs().argmin(dim=-1)
        assert torch.equal(quantize(data, absmax, codebook(signed_code)).long(), nearest)


def test_rounding_table_equals_a_binary_search_at_every_midpoint():
    """The table lookup against torch.bucketize where it is hardest: at each midpoint
    between two code values (a tie goes to the smaller code), one ulp either side, the
    code values themselves, zeros, denormals, values past 1, infinities and NaN."""
    for signed in (True, False):
        code = dynamic_code(signed)
        midpoints = (code[:-1] + code[1:]) / 2
        specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, 1.0000001, -1.0000001, 3.0, -3.0,
                                 float("inf"), -float("inf"), float("nan")])
        values = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(2.0)),
                            torch.nextafter(midpoints, torch.tensor(-2.0)), code, specials,
                            torch.randn(100_000) * torch.rand(100_000) ** 8])
        codes = quantize(values.view(1, -1), torch.ones(1), codebook(signed)).view(-1)
        assert torch.equal(codes, torch.bucketize(values, midpoints).to(torch.uint8))


@pytest.mark.parametrize("boundaries", [[500, 700, 1500], [100, 2000], [2200, 2300, 2400]])
def test_pieces_anywhere_quantise_exactly_like_one_process(boundaries):
    """Boundaries inside blocks, a piece inside two blocks, pieces smaller than a block:
    with the same gradients, weights and quantised state equal one process bit for bit."""
    initial, grads = _random_run()
    make = lambda params: AdamW8bit(params, lr=0.01, min_8bit_size=100)
    whole, whole_optimizer = train_whole(make, initial, grads)
    pieces, optimizers = train_in_pieces(make, initial, grads, boundaries)
    for mine, reference in zip(pieces, whole):
        assert torch.equal(mine, reference)
    for index, param in enumerate(whole[:4]):
        for key in ("exp_avg_codes", "exp_avg_sq_codes"):
            codes = torch.cat([state[key] for optimizer in optimizers for piece, state in optimizer.state.items()
                               if optimizer.shard_of(piece).index == index])
            assert torch.equal(codes, whole_optimizer.state[param][key])


@pytest.mark.parametrize(("stage", "world_size"), STAGES_AND_WORLDS)
def test_adam8bit_matches_single_process_at_every_stage(stage, world_size):
    check_against_one_process("adam8bit", stage, world_size, WEIGHT_TOLERANCE)


@pytest.mark.parametrize("native_kernels", [True, False])
def test_adam8bit_against_bitsandbytes_cpu(native_kernels, monkeypatch):
    """bitsandbytes' CPU Adam8bit (weight decay decoupled in both classes, as here): the
    same code tables and scales, the first step and the fp32 path (small parameters)
    identical; later steps differ by its CPU quantiser, which picks a code by an
    approximate search (e.g. -1e-9 becomes +2.1e-5) where this one takes the nearest.
    The native kernel (optim/native.py) takes the correctly rounded square root, where
    torch's vectorised CPU `sqrt`, which bitsandbytes' CPU code calls, is one ulp off for
    about 20% of inputs: with it the 8-bit parameters' first step agrees to two ulps of
    the weight and of its change (test_native.py), with the torch path exactly."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import create_dynamic_map

    monkeypatch.setenv(native.ENABLE_VARIABLE, "1" if native_kernels else "0")
    assert torch.equal(create_dynamic_map(signed=True), dynamic_code(True))
    assert torch.equal(create_dynamic_map(signed=False), dynamic_code(False))
    initial, grads = _random_run(steps=5)
    initial, grads = initial[:4], [step[:4] for step in grads]
    for ours_class, their_class in ((Adam8bit, bnb.optim.Adam8bit), (AdamW8bit, bnb.optim.AdamW8bit)):
        def run(cls: type, steps: int) -> list[torch.Tensor]:
            return train_whole(lambda params: cls(params, lr=0.01, min_8bit_size=1000), initial, grads[:steps])[0]

        for start, mine, theirs in zip(initial, run(ours_class, 1), run(their_class, 1)):
            if native_kernels and mine.numel() >= 1000:
                allowed = 2.5e-7 * (theirs.abs() + (theirs - start).abs())
                assert ((mine - theirs).abs() <= allowed).all()
            else:
                assert torch.equal(mine, theirs)
        ours, theirs = run(ours_class, len(grads)), run(their_class, len(grads))
        assert torch.equal(ours[2], theirs[2]) and torch.equal(ours[3], theirs[3])  # fp32 moments
        for mine, reference in zip(ours[:2], theirs[:2]):
            assert ((mine - reference).norm() / reference.norm()).item() < 2e-4


def test_8bit_adams_from_a_deepspeed_config_hold_two_bytes_and_scales():
    shapes = parameter_shapes()
    for name, decay in (("Adam8bit", 0.0), ("AdamW8bit", 0.01)):
        engine = step_once_in_process({"type": name, "params": {"lr": 0.01}})
        optimizer = engine.optimizer.optimizer
        assert type(optimizer).__name__ == name and optimizer.param_groups[0]["weight_decay"] == decay
        expected = sum(adam_8bit_state_bytes(0, math.prod(s), math.prod(s), 4096) for s in shapes.values())
        assert engine.memory_breakdown()["optimizer_states"] == expected


def test_adam8bit_state_is_checkpointed_resumed_exactly_and_resharded(tmp_path):
    saved, resumed, expected = save_then_resume(tmp_path / "resharded", CONFIG)
    assert_resume_matches(saved[0], resumed, expected, WEIGHT_TOLERANCE)
    for rank in saved:  # 2 ranks, stage 2: codes per element, scales per block each piece touches
        shapes = {name: shape for name, shape, _, _ in rank["pieces"]}
        assert rank["optimizer_states"] == sum(adam_8bit_state_bytes(start, stop, math.prod(shapes[name]), 1024)
                                               for name, _, start, stop in rank["pieces"])
    # at the same layout, resuming from the fp32 moments is exact
    again = run_distributed(train_from_config, 2, ConfigRun(CONFIG, stage=2, first_step=1, steps=2,
                                                            load_dir=str(tmp_path / "resharded")))
    straight = run_distributed(train_from_config, 2, ConfigRun(CONFIG, stage=2, steps=3))
    for name, want in straight[0]["params"].items():
        assert torch.equal(again[0]["params"][name], want), name


needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")
BATCH_SHAPES = [(40, 24), (5000,), (1031,), (33,), (7, 3, 11), ()]


def _stepped_alone(optimizer: Adam8bit) -> Adam8bit:
    """The optimizer with every tensor stepped alone, as before the batched kernels: the
    per-tensor kernel with the scalars computed in Python, torch operations for the small
    tensors."""
    optimizer._batchable = lambda *args: None
    return optimizer


def _two_groups(params: list[torch.Tensor]) -> Adam8bit:
    return AdamW8bit([{"params": params[::2]}, {"params": params[1::2], "lr": 0.003, "weight_decay": 0.0}],
                     lr=0.01, weight_decay=0.02, min_8bit_size=900)


def _assert_same_state(mine: Adam8bit, reference: Adam8bit, pairs) -> None:
    for param, twin in pairs:
        state, twin_state = mine.state[param], reference.state[twin]
        assert state.keys() == twin_state.keys()
        for key, value in state.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(value, twin_state[key], rtol=0, atol=0, equal_nan=True, msg=key)
            else:
                assert value == twin_state[key], key


@needs_kernels
def test_batched_kernels_step_exactly_as_each_tensor_alone():
    """The steady-state step (one native call for every coded tensor, with the step count
    advanced and the scalars derived in C; two calls around torch's square roots for the
    small tensors) against every tensor stepped alone: weights, codes, scales, fp32 moments
    and step counts equal bit for bit, over steps whose bias corrections change, in two
    param groups, with a tensor that skips a step (its step count then differs from the
    others') and a gradient that turns a block's scale to NaN."""
    generator = torch.Generator().manual_seed(3)
    initial = [torch.randn(shape, generator=generator) for shape in BATCH_SHAPES]
    mine = [torch.nn.Parameter(t.clone()) for t in initial]
    reference = [torch.nn.Parameter(t.clone()) for t in initial]
    batched, alone = _two_groups(mine), _stepped_alone(_two_groups(reference))
    for step in range(6):
        for index, (param, twin) in enumerate(zip(mine, reference)):
            skip = step == 3 and index in (1, 4)
            grad = None if skip else torch.randn(param.shape, generator=generator) * 10.0 ** -(step % 3)
            if step == 4 and index == 2:
                grad[700] = float("nan")
            param.grad, twin.grad = grad, None if grad is None else grad.clone()
        batched.step()
        alone.step()
        for param, twin in zip(mine, reference):
            torch.testing.assert_close(param, twin, rtol=0, atol=0, equal_nan=True)
        _assert_same_state(batched, alone, zip(mine, reference))
    assert all(isinstance(batched._batched[p], cls) for p, cls in zip(mine, [_Coded, _Coded, _Coded, _Small, _Small,
                                                                            _Small]))
    assert [batched.state[p]["step"].item() for p in mine] == [6.0, 5.0, 6.0, 6.0, 5.0, 6.0]


@needs_kernels
@pytest.mark.parametrize("boundaries", [[500, 700, 1500], [2200, 2300, 2400]])
def test_batched_kernels_step_cut_pieces_exactly_as_each_piece_alone(boundaries):
    """ZeRO's pieces, blocks cut by their boundaries (pieces.py: ranks as threads)."""
    initial, grads = _random_run(steps=4)
    make = lambda params: AdamW8bit(params, lr=0.01, min_8bit_size=100)
    batched, batched_optimizers = train_in_pieces(make, initial, grads, boundaries)
    alone, alone_optimizers = train_in_pieces(lambda params: _stepped_alone(make(params)), initial, grads, boundaries)
    for mine, reference in zip(batched, alone):
        assert torch.equal(mine, reference)
    for mine, reference in zip(batched_optimizers, alone_optimizers):
        pairs = list(zip(mine.state, reference.state))
        assert any(isinstance(mine._batched[p], _Coded) and mine._batched[p].cut for p, _ in pairs)
        _assert_same_state(mine, reference, pairs)


@needs_kernels
def test_a_loaded_state_takes_the_batched_step_from_where_it_was():
    """load_state_dict in the middle of a run (the state's dictionaries and tensors
    replaced under the optimizer's kept pieces): the run goes on exactly as without it."""
    generator = torch.Generator().manual_seed(4)
    initial = [torch.randn(shape, generator=generator) for shape in BATCH_SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in BATCH_SHAPES] for _ in range(5)]
    straight, _ = train_whole(_two_groups, initial, grads)

    params = [t.clone() for t in initial]
    first = _two_groups(params)
    for step_grads in grads[:3]:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        first.step()
    resumed = _two_groups(params)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for step_grads in grads[3:]:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        resumed.step()
    for mine, reference in zip(params, straight):
        assert torch.equal(mine, reference)
    assert [resumed.state[p]["step"].item() for p in params] == [5.0] * len(params)


def test_without_the_kernels_every_tensor_steps_alone_on_the_torch_path(monkeypatch):
    """No compiler (the library could not be built, warned then): the torch path, every
    step, and the same weights as with the kernels switched off."""
    initial, grads = _random_run(steps=3)
    monkeypatch.setenv(native.ENABLE_VARIABLE, "0")
    switched_off, _ = train_whole(_two_groups, initial, grads)
    monkeypatch.delenv(native.ENABLE_VARIABLE)
    monkeypatch.setattr(native._compiled, "library", None)
    monkeypatch.setattr(native._compiled, "tried", True)
    params, optimizer = train_whole(_two_groups, initial, grads)
    assert not optimizer._batched
    for mine, reference, start in zip(params, switched_off, initial):
        assert torch.equal(mine, reference) and not torch.equal(mine, start)


def test_threads_stepping_at_once_get_the_kept_codebooks_addresses():
    """The kernels' codebook addresses built from four threads at once (ranks as threads
    on their first step): every thread gets the addresses of the tables the cache keeps,
    not those of tables another thread built and dropped (the kernels then read freed
    memory)."""
    from shardwise.runtime.optim.adam8bit import _native_book_addresses, _native_books, _native_codebook

    _native_book_addresses.cache_clear()
    _native_codebook.cache_clear()
    got, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        got.append(_native_books())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    kept = tuple(table.data_ptr() for signed in (True, False) for table in _native_codebook(signed))
    assert got == [kept] * 4
