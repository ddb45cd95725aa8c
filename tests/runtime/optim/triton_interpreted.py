"""The GPU kernels of LAMB and 8-bit Adam (optim/triton_kernels.py), run on the CPU by
Triton's interpreter: the optimizers take them where the native CPU kernels are off, and
they compute what the optimizers' torch path computes.

Not collected by itself: test_triton_kernels.py runs this file in a pytest process of its
own with `TRITON_INTERPRET=1` and `SHARDWISE_NATIVE_OPTIM=0`, since Triton fixes its
functions' mode (compiled or interpreted) when it is first imported.

The interpreter evaluates each kernel's operations in numpy, rounding every one (no fused
multiply-add), where torch's CPU kernels may fuse some: values agree to fp32 rounding, and
an 8-bit code may move by one where a moment lies a hair from a code midpoint. So 8-bit
Adam is compared one step at a time from the same state, codes at most one apart.
"""

import math
import threading

import pytest
import torch

from shardwise.runtime.optim import native, triton_gate
from shardwise.runtime.optim.adam8bit import AdamW8bit, _Hyper, _step_and_quantise
from shardwise.runtime.optim.lamb import Lamb
from shardwise.runtime.optim.layout import PaddedRows
from shardwise.runtime.optim.quantization import BLOCK, codebook, dequantize_piece, quantize
from tests.runtime.optim.pieces import train_in_pieces

SHAPES = [(40, 24), (3, 5, 70), (2100,), (33,), ()]
_ENCODE = None  # the kernels' encoder, for the encoder test's own kernel


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels' module (the process runs Triton's interpreter, the native CPU kernels
    off: CPU tensors take the Triton kernels), its functions wrapped to count their calls."""
    assert triton_gate.interpreting() and not native.enabled(), "run by test_triton_kernels.py"
    kernels = triton_gate.kernels()
    assert kernels is not None
    calls = {}
    one_at_a_time = threading.Lock()  # the interpreter's state is global: ranks as threads take turns
    for name in ("lamb_moments_and_squares", "lamb_apply", "adam8bit_step"):
        def counted(*args, _name=name, _function=getattr(kernels, name), **kwargs):
            with one_at_a_time:
                calls[_name] = calls.get(_name, 0) + 1
                return _function(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    kernels.calls = calls
    return kernels


def _run(make, steps: int, *, triton: bool, monkeypatch, seed: int = 0) -> tuple[list[torch.Tensor], object]:
    """`steps` steps of `make(params)` from seeded weights and gradients, on the Triton
    kernels or on the torch path."""
    monkeypatch.setenv(triton_gate.ENABLE_VARIABLE, "1" if triton else "0")
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = make(params)
    for step in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * 10.0 ** -(step % 3)
        optimizer.step()
    return [param.detach() for param in params], optimizer


@pytest.mark.parametrize(("weight_decay", "eps_inside_sqrt"), [(0.0, False), (0.01, True)])
def test_lamb_on_the_triton_kernels_steps_as_its_torch_path(interpreted, monkeypatch, weight_decay, eps_inside_sqrt):
    """Moments, both norms per parameter (blocks summed in float64), trust ratios and
    weights, over four steps in two param groups."""
    def make(params):
        return Lamb([{"params": params[::2]}, {"params": params[1::2], "lr": 0.003}], lr=0.01,
                    weight_decay=weight_decay, eps_inside_sqrt=eps_inside_sqrt)

    mine, optimizer = _run(make, 4, triton=True, monkeypatch=monkeypatch)
    reference, torch_path = _run(make, 4, triton=False, monkeypatch=monkeypatch)
    assert interpreted.calls == {"lamb_moments_and_squares": 8, "lamb_apply": 8}  # 2 groups x 4 steps
    for param, twin in zip(mine, reference):
        torch.testing.assert_close(param, twin, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(optimizer.last_trust_ratios, torch_path.last_trust_ratios, rtol=1e-6, atol=0)
    for state, twin_state in zip(optimizer.state.values(), torch_path.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], twin_state[key], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(("start", "numel"), [(0, 1024), (100, 1000), (300, 50), (256, 255)])
@pytest.mark.parametrize("coded", [False, True])
def test_an_8bit_adam_piece_steps_as_the_torch_path_from_the_same_state(interpreted, start, numel, coded):
    """One step of a piece (elements [start, start + numel) of a parameter, blocks cut at
    both ends or not), from fp32 moments (a first step) or from codes: weights to fp32
    rounding; codes equal but for a few one code apart; block scales and the fp32 edge
    rows (for the blocks a ZeRO boundary cuts) to fp32 rounding at the row's scale."""
    generator = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator) * 0.1
    exp_avg = torch.randn(numel, generator=generator) * 0.01
    exp_avg_sq = torch.rand(numel, generator=generator) * 1e-4
    blocks = PaddedRows(start, numel, BLOCK)
    hyper = _Hyper(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, decay=0.02, correction1=1 - 0.9**7,
                   correction2=math.sqrt(1 - 0.999**7))
    books = (codebook(True), codebook(False))
    if coded:  # the moments as a step left them: codes and scales
        codes = _step_and_quantise(torch.zeros(numel), torch.zeros(numel), exp_avg, exp_avg_sq, start,
                                   hyper._replace(lr=0.0), books)
        exp_avg, exp_avg_sq = (dequantize_piece(codes[3 * k], codes[3 * k + 1], start, books[k]) for k in (0, 1))
    reference_param = param.clone()
    expected = _step_and_quantise(reference_param, grad, exp_avg.clone(), exp_avg_sq.clone(), start, hyper, books)

    mine_param = param.clone()
    inputs = dict(moments=None, coded=tuple(t.clone() for t in (codes[0], codes[1], codes[3], codes[4]))) if coded \
        else dict(moments=(exp_avg.clone(), exp_avg_sq.clone()), coded=None)
    lr, beta1, beta2, eps, decay, correction1, correction2 = hyper
    result = interpreted.adam8bit_step(mine_param, grad, offset=blocks.offset, rows=blocks.rows, lr=lr, beta1=beta1,
                                       beta2=beta2, eps=eps, decay=decay, correction1=correction1,
                                       correction2=correction2, **inputs)
    torch.testing.assert_close(mine_param, reference_param, rtol=1e-6, atol=1e-8)
    for k in (0, 1):
        my_codes, my_absmax, my_edges = result[3 * k : 3 * k + 3]
        codes, absmax, edges = expected[3 * k : 3 * k + 3]
        differ = my_codes.int() - codes.int()
        assert differ.abs().max() <= 1 and (differ != 0).float().mean() < 0.01
        torch.testing.assert_close(my_absmax, absmax, rtol=1e-6, atol=0)
        # a moment that cancels (m·β1 against (1 − β1)·g) carries its inputs' rounding, so
        # the edge rows are compared at their own scale
        torch.testing.assert_close(my_edges, edges, rtol=1e-5, atol=1e-6 * edges.abs().max().item())


def test_8bit_adam_on_the_triton_kernels_trains_as_its_torch_path(interpreted, monkeypatch):
    """The optimizer takes the kernel for its coded tensors (the small ones keep fp32
    moments and their torch arithmetic): weights over three steps within the tolerance a
    code flip allows (tests/runtime/optim/test_adam8bit.py's WEIGHT_TOLERANCE)."""
    make = lambda params: AdamW8bit(params, lr=0.01, min_8bit_size=900)
    mine, _ = _run(make, 3, triton=True, monkeypatch=monkeypatch)
    reference, _ = _run(make, 3, triton=False, monkeypatch=monkeypatch)
    assert interpreted.calls == {"adam8bit_step": 9}  # 3 coded tensors x 3 steps
    for param, twin in zip(mine, reference):
        assert ((param - twin).norm() / twin.norm()).item() < 1e-3


def test_zero_pieces_on_the_triton_kernels_train_as_on_the_torch_path(interpreted, monkeypatch):
    """Pieces of two ranks cutting blocks (pieces.py: ranks as threads): the kernels' edge
    rows let the cut blocks be quantised again with the block's whole absmax."""
    generator = torch.Generator().manual_seed(1)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES[:3]]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES[:3]] for _ in range(3)]
    make = lambda params: AdamW8bit(params, lr=0.01, min_8bit_size=100)
    monkeypatch.setenv(triton_gate.ENABLE_VARIABLE, "1")
    mine, _ = train_in_pieces(make, initial, grads, [1000, 1300])
    monkeypatch.setenv(triton_gate.ENABLE_VARIABLE, "0")
    reference, _ = train_in_pieces(make, initial, grads, [1000, 1300])
    assert interpreted.calls["adam8bit_step"] == 3 * 5  # 5 pieces, every step (the first from fp32 moments)
    for param, twin in zip(mine, reference):
        assert ((param - twin).norm() / twin.norm()).item() < 1e-3


def test_a_nan_gradient_spoils_its_block_as_on_the_torch_path(interpreted):
    """A NaN gradient makes its block's absmax NaN, as torch's amax does (a GPU's max
    reduction alone would skip it), and leaves the other blocks alone."""
    generator = torch.Generator().manual_seed(2)
    param, grad = torch.randn(600, generator=generator), torch.randn(600, generator=generator)
    grad[300] = float("nan")  # block 1 of the piece's three
    moments = torch.zeros(600), torch.zeros(600)
    hyper = _Hyper(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, decay=0.0, correction1=0.1,
                   correction2=math.sqrt(1 - 0.999))
    reference_param = param.clone()
    expected = _step_and_quantise(reference_param, grad, *(t.clone() for t in moments), 0, hyper,
                                  (codebook(True), codebook(False)))
    mine_param = param.clone()
    result = interpreted.adam8bit_step(mine_param, grad, moments=tuple(t.clone() for t in moments), coded=None,
                                       offset=0, rows=3, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, decay=0.0,
                                       correction1=0.1, correction2=math.sqrt(1 - 0.999))
    torch.testing.assert_close(mine_param, reference_param, rtol=1e-6, atol=1e-8, equal_nan=True)
    for k in (0, 1):
        assert result[3 * k + 1].isnan().tolist() == expected[3 * k + 1].isnan().tolist() == [False, True, False]


@pytest.mark.parametrize("signed", [True, False])
def test_the_encoder_gives_the_lookups_codes_for_every_kind_of_value(interpreted, signed):
    """The kernel encodes by arithmetic (`_encode`, native_kernels.c's encoder) where the
    torch path looks each value up in its rounding cells: the same codes for values at and
    beside every code midpoint, random bit patterns (every exponent, subnormals, infinities,
    NaNs) and values spread over the code's range."""
    import triton
    import triton.language as tl

    global _ENCODE
    _ENCODE = interpreted._encode  # a jit function reads module globals, not closures

    @triton.jit
    def encode(values, codes, rounding, count, SIGNED: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        x = tl.load(values + offsets, mask=inside, other=0.0)
        tl.store(codes + offsets, _ENCODE(x, tl.full([], 1.0, tl.float32), rounding, SIGNED, TINY).to(tl.uint8),
                 mask=inside)

    book = codebook(signed)
    midpoints = (book.values[1:] + book.values[:-1]) / 2
    bits = midpoints.view(torch.int32)
    beside = torch.cat([(bits + step).view(torch.float32) for step in range(-3, 4)])
    generator = torch.Generator().manual_seed(int(signed))
    patterns = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=generator, dtype=torch.int64)
    values = torch.cat([beside, -beside, patterns.to(torch.int32).view(torch.float32),
                        torch.rand(1 << 16, generator=generator) * 3 - 1.5,
                        torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, float("inf"), -float("inf"), float("nan"), 1e-45])])
    values = torch.cat([values, torch.zeros(-len(values) % BLOCK)])
    codes = torch.empty(len(values), dtype=torch.uint8)
    encode[(triton.cdiv(len(values), 1024),)](values, codes, interpreted.decade_rounding(signed), len(values),
                                              SIGNED=signed, TINY=1e-38, BLOCK=1024)
    expected = quantize(values.view(-1, BLOCK), torch.ones(len(values) // BLOCK), book).reshape(-1)
    wrong = (codes != expected).nonzero().flatten()
    assert len(wrong) == 0, [(values[i].item(), codes[i].item(), expected[i].item()) for i in wrong[:5]]
