"""The one-pass native kernels (optim/native.py) against each optimizer's torch path, step
by step from the same state: the same arithmetic but for two things the rules allow to
differ in the last bit. The squared norms (LAMB, LARS) are summed in double here, in
float by torch's `_foreach_norm`; and torch's vectorised `sqrt` on a CPU is not correctly
rounded (about 20% of fp32 results differ by one ulp from the exact square root, which
the kernels compute). So moments, momentum buffers and 8-bit codes are compared exactly
where they do not depend on either, and each step's weights to two ulps (2.5e-7
relative) of the weight plus a share of the step's change: two ulps of it for 8-bit Adam
(one ulp of the update moves a weight near zero by much more than one ulp of the weight),
NORM_RTOL where a trust ratio scales the step (torch's fp32 norm of n elements is off by
about √n · 2⁻²⁴ relative, 1e-5 at the 21,000 elements here; the kernels' double sums are
exact to fp32)."""

import os
import warnings

import pytest
import torch

from shardwise.runtime.base.native_build import CACHE_VARIABLE
from shardwise.runtime.optim import native
from shardwise.runtime.optim.adafactor import Adafactor
from shardwise.runtime.optim.adam8bit import Adam8bit, AdamW8bit, _native_codebook
from shardwise.runtime.optim.lamb import Lamb
from shardwise.runtime.optim.lars import Lars
from shardwise.runtime.optim.onebit_adam import OneBitAdam
from shardwise.runtime.optim.onebit_lamb import OneBitLamb
from shardwise.runtime.optim.sharded import ParameterShard
from shardwise.runtime.optim.quantization import codebook, dynamic_code, quantize

SHAPES = [(300, 70), (33,), (64, 40), (5000,), (7, 3, 11)]
ULPS = 2.5e-7  # two fp32 ulps, relative
NORM_RTOL = 2e-5
ADAFACTOR_SHAPES = [(300, 70), (33,), (3, 160, 150), (5000,), (7, 3, 11), ()]
ADAFACTOR_RTOL = 1e-6

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels cannot be built here")


def _steps(build, compare, step_rtol: float, steps: int = 3, shapes: list[tuple[int, ...]] = SHAPES) -> None:
    """`steps` steps of a native and a torch-path optimizer, each from the native one's
    weights and state (copied to the other before the step)."""
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    mine = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
    reference = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
    native_optimizer, torch_optimizer = build(mine), build(reference)
    for step in range(steps):
        before = [param.detach().clone() for param in mine]
        for param, twin in zip(mine, reference):
            param.grad = torch.randn(param.shape, generator=generator) * 10.0 ** -(step % 3)
            twin.grad = param.grad.clone()
            twin.data.copy_(param.data)
            torch_optimizer.state[twin] = {key: value.clone() if torch.is_tensor(value) else value
                                           for key, value in native_optimizer.state[param].items()}
        _step(native_optimizer, on=True)
        _step(torch_optimizer, on=False)
        compare(native_optimizer, torch_optimizer, mine, reference)
        _assert_steps(mine, reference, before, step_rtol)


def _step(optimizer: torch.optim.Optimizer, on: bool) -> None:
    previous = os.environ.get(native.ENABLE_VARIABLE)
    os.environ[native.ENABLE_VARIABLE] = "1" if on else "0"
    try:
        optimizer.step()
    finally:
        if previous is None:
            del os.environ[native.ENABLE_VARIABLE]
        else:
            os.environ[native.ENABLE_VARIABLE] = previous


def _assert_steps(mine: list[torch.Tensor], reference: list[torch.Tensor], before: list[torch.Tensor],
                  step_rtol: float) -> None:
    for param, twin, start in zip(mine, reference, before):
        allowed = ULPS * twin.detach().abs() + step_rtol * (twin.detach() - start).abs()
        assert ((param.detach() - twin.detach()).abs() <= allowed).all()


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_lamb_kernels_take_the_torch_paths_step(weight_decay, eps_inside_sqrt):
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(native_optimizer.state[param][key], torch_optimizer.state[twin][key]), key
        torch.testing.assert_close(native_optimizer.last_trust_ratios, torch_optimizer.last_trust_ratios,
                                   rtol=NORM_RTOL, atol=0)

    _steps(lambda params: Lamb(params, lr=0.01, weight_decay=weight_decay, eps_inside_sqrt=eps_inside_sqrt), compare,
           NORM_RTOL)


@pytest.mark.parametrize("options", [
    {}, {"momentum": 0.9, "weight_decay": 0.01}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    {"momentum": 0.9, "dampening": 0.1, "exclude_vectors": False},
])
def test_lars_kernels_take_the_torch_paths_step(options):
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            if "momentum_buffer" in torch_optimizer.state[twin]:  # a sum of terms that may cancel: to their scale
                buffer = torch_optimizer.state[twin]["momentum_buffer"]
                torch.testing.assert_close(native_optimizer.state[param]["momentum_buffer"], buffer, rtol=NORM_RTOL,
                                           atol=NORM_RTOL * buffer.abs().max().item())
            if param.dim() < 2 and options.get("exclude_vectors", True):  # trust 1: no norm involved, exact
                assert torch.equal(param, twin)
        torch.testing.assert_close(native_optimizer.last_trust_ratios, torch_optimizer.last_trust_ratios,
                                   rtol=NORM_RTOL, atol=0)

    _steps(lambda params: Lars(params, lr=0.1, **options), compare, NORM_RTOL)


def _identity_shards(optimizer: Adafactor) -> Adafactor:
    """Whole parameters declared as ZeRO's pieces with a shard group of one: the batched
    order of the step (every pass over all parameters, a sum between passes)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    shards = {param: ParameterShard(f"p{index}", tuple(param.shape), 0, param.numel(), index)
              for index, param in enumerate(params)}
    optimizer.attach_shards(shards, len(params), lambda tensor: tensor)
    return optimizer


@pytest.mark.parametrize(("sharded", "threads"), [(False, 1), (True, 2)])
@pytest.mark.parametrize(("weight_decay", "maximize", "eps1"), [(0.0, False, None), (0.1, True, 1e-4)])
def test_adafactor_kernels_take_the_torch_paths_step(weight_decay, maximize, eps1, sharded, threads):
    """Row and column statistics and V of unfactored tensors from double sums (torch's
    are fp32 norms, squared), U as g x row factor x column factor (three roundings where
    torch has two): the statistics to ADAFACTOR_RTOL (1e-6). Each step is scaled by
    RMS(w) and RMS(U), which torch takes from fp32 norms of the whole tensor, so the
    steps agree to NORM_RTOL, as LAMB's and LARS's do (measured here: 1.2e-6 of the step
    at most). Gradients of 1, 0.1 and 0.01 over four steps; one 3-D parameter is large
    enough for two threads to split its rows."""
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            for key, value in torch_optimizer.state[twin].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    torch.testing.assert_close(native_optimizer.state[param][key], value, rtol=ADAFACTOR_RTOL, atol=0)

    def build(params):
        optimizer = Adafactor(params, lr=0.05, weight_decay=weight_decay, maximize=maximize, eps=(eps1, 1e-3))
        return _identity_shards(optimizer) if sharded else optimizer

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _steps(build, compare, NORM_RTOL, steps=4, shapes=ADAFACTOR_SHAPES)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("weight_decay", "eps_inside_sqrt"), [(0.0, False), (0.01, True)])
def test_onebit_adam_kernels_take_the_torch_paths_step(weight_decay, eps_inside_sqrt):
    """1-bit Adam's momentum fold (after the warm-up) and its update, on one worker (the
    exchange's kernels: test_onebit_compression.py): the fold is the same fused
    multiply-add, so the momentum is equal bit for bit; the update differs by the square
    root's ulp (see above) and the kernel's unfused step, so the weights to two ulps of the
    step."""
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(native_optimizer.state[param][key], torch_optimizer.state[twin][key]), key

    _steps(lambda params: OneBitAdam(params, lr=0.01, freeze_step=1, weight_decay=weight_decay,
                                     eps_inside_sqrt=eps_inside_sqrt), compare, ULPS, steps=3)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_onebit_lamb_kernels_take_the_torch_paths_step(weight_decay):
    """1-bit LAMB after its warm-up, on one worker: the fresh variance from the
    reconstructed gradient (the same operations: to one ulp, where torch's vectorised
    multiply-add differs), the variance factor from square roots (torch's one ulp off) and
    the weight-decay share from norms (fp32 in torch), so the steps to NORM_RTOL."""
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            state, twin_state = native_optimizer.state[param], torch_optimizer.state[twin]
            assert torch.equal(state["exp_avg"], twin_state["exp_avg"])
            if "exp_avg_sq_fresh" in twin_state:
                torch.testing.assert_close(state["exp_avg_sq_fresh"], twin_state["exp_avg_sq_fresh"], rtol=ULPS, atol=0)
                assert state["last_factor"] == pytest.approx(twin_state["last_factor"], rel=NORM_RTOL)

    _steps(lambda params: OneBitLamb(params, lr=0.01, freeze_step=1, weight_decay=weight_decay), compare, NORM_RTOL,
           steps=3)


@pytest.mark.parametrize("cls", [Adam8bit, AdamW8bit])
def test_8bit_adam_kernel_codes_moments_exactly_as_the_torch_path(cls):
    """Codes and block scales do not involve the square root: equal bit for bit."""
    def compare(native_optimizer, torch_optimizer, mine, reference):
        for param, twin in zip(mine, reference):
            state, twin_state = native_optimizer.state[param], torch_optimizer.state[twin]
            assert state.keys() == twin_state.keys()
            for key, value in state.items():
                assert torch.equal(value, twin_state[key]) if torch.is_tensor(value) else value == twin_state[key], key

    _steps(lambda params: cls(params, lr=0.01, min_8bit_size=1000), compare, ULPS, steps=5)


@pytest.mark.parametrize("signed", [True, False])
def test_native_rounding_equals_the_table_lookup_at_every_midpoint(signed):
    """The kernel's one-lookup rounding against optim/quantization.py's `quantize` where it
    is hardest: at each midpoint between two code values (a tie goes to the smaller code),
    one ulp either side, at the codes, and at zeros, infinities and NaN."""
    code = dynamic_code(signed)
    midpoints = (code[:-1] + code[1:]) / 2
    specials = torch.tensor([0.0, -0.0, 1e-38, -1e-38, 1.0, -1.0, float("inf"), -float("inf"), float("nan")])
    values = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(2.0)),
                        torch.nextafter(midpoints, torch.tensor(-2.0)), code, -code, specials,
                        torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.rand(4096) ** 6])
    expected = quantize(values.view(1, -1), torch.ones(1), codebook(signed)).view(-1)
    codes = torch.empty(values.numel(), dtype=torch.uint8)
    native.library().quantize_values(values.data_ptr(), codes.data_ptr(), values.numel(), 1.0,
                                     _native_codebook(signed)[1].data_ptr())
    assert torch.equal(codes, expected)


@pytest.fixture
def portable_and_avx512():
    """Runs a test body on both 8-bit paths: yields a switch (True: AVX-512 blocks); skips
    where the CPU has no AVX-512 (the portable loops are then the only path, and the tests
    above check them)."""
    if not native.use_avx512(True):
        pytest.skip("this CPU has no AVX-512: the kernels take only their portable loops")
    try:
        yield native.use_avx512
    finally:
        native.use_avx512(True)


@pytest.mark.parametrize("signed", [True, False])
def test_avx512_rounding_equals_the_portable_loop(portable_and_avx512, signed):
    """Midpoints, one ulp either side, codes, specials and random values at several block
    scales, with lengths that leave every size of partial last vector."""
    code = dynamic_code(signed)
    midpoints = (code[:-1] + code[1:]) / 2
    generator = torch.Generator().manual_seed(1)
    values = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(2.0)),
                        torch.nextafter(midpoints, torch.tensor(-2.0)), code, -code,
                        torch.tensor([0.0, -0.0, 1e-38, -1e-38, float("inf"), -float("inf"), float("nan")]),
                        torch.randn(3000, generator=generator) * torch.rand(3000, generator=generator) ** 6])
    table = _native_codebook(signed)[1].data_ptr()
    for absmax in (1.0, 0.37, 3.0, 0.0):
        for count in (values.numel(), 17, 15, 1):
            scaled = (values * absmax)[:count].contiguous()
            codes = []
            for on in (False, True):
                portable_and_avx512(on)
                codes.append(torch.empty(count, dtype=torch.uint8))
                native.library().quantize_values(scaled.data_ptr(), codes[-1].data_ptr(), count, absmax, table)
            assert torch.equal(codes[0], codes[1]), (absmax, count)


def _codes_on_both_paths(switch, values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of `values` (block scale 1) by the portable table lookup and by the AVX-512
    encoder."""
    table = _native_codebook(signed)[1].data_ptr()
    codes = []
    for on in (False, True):
        switch(on)
        codes.append(torch.empty(values.numel(), dtype=torch.uint8))
        native.library().quantize_values(values.data_ptr(), codes[-1].data_ptr(), values.numel(), 1.0, table)
    return codes[0], codes[1]


@pytest.mark.parametrize("signed", [True, False])
def test_avx512_encoder_equals_the_table_near_every_midpoint_and_on_sampled_bit_patterns(portable_and_avx512,
                                                                                         signed):
    """The arithmetic encoder (no lookup but where a value is within its margin of a
    midpoint): every fp32 within 300 ulps of a midpoint or its negative (the decade
    thresholds among them), and every 1021st fp32 bit pattern, NaNs and infinities
    included."""
    midpoints = ((dynamic_code(signed)[:-1] + dynamic_code(signed)[1:]) / 2).view(torch.int32)
    near = (midpoints.unsqueeze(1) + torch.arange(-300, 301, dtype=torch.int32)).reshape(-1)
    sampled = torch.arange(-(1 << 31), 1 << 31, 1021, dtype=torch.int64).to(torch.int32)
    values = torch.cat([near, near ^ -(1 << 31), sampled]).view(torch.float32)  # and near's negatives
    portable, avx512 = _codes_on_both_paths(portable_and_avx512, values.contiguous(), signed)
    assert torch.equal(portable, avx512)


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False])
def test_avx512_encoder_equals_the_table_on_every_fp32(portable_and_avx512, signed):
    """All 2^32 bit patterns, in chunks of 2^24."""
    chunk = torch.arange(1 << 24, dtype=torch.int32)
    values = torch.empty_like(chunk)
    for start in range(-(1 << 31), 1 << 31, 1 << 24):
        torch.add(chunk, start, out=values)
        portable, avx512 = _codes_on_both_paths(portable_and_avx512, values.view(torch.float32), signed)
        assert torch.equal(portable, avx512), start


@pytest.mark.parametrize("decay", [0.0, 0.01])
@pytest.mark.parametrize("vbmi", [False, True], ids=["gathers", "vbmi"])
def test_avx512_8bit_adam_steps_equal_the_portable_loops(portable_and_avx512, decay, vbmi):
    """Each step from the same state (fresh fp32 moments at the first, codes after): the
    AVX-512 blocks' weights, codes and scales equal the portable loops' bit for bit, on
    sizes that cut blocks and vectors, with a NaN gradient in one block; the codes decoded
    by gathers, and by byte permutes (VBMI)."""
    if vbmi and not native.use_avx512_vbmi(True):
        pytest.skip("this CPU has no AVX-512 VBMI: the blocks decode by gathers only")
    generator = torch.Generator().manual_seed(2)
    shapes = [(300, 70), (5000,), (1031,), (4096,)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    optimizer = AdamW8bit(params, lr=0.01, weight_decay=decay, min_8bit_size=1000)
    for step in range(4):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * 10.0 ** -(step % 3)
        if step == 3:
            params[1].grad[700] = float("nan")
        start = ([p.detach().clone() for p in params],
                 [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()} for p in params])
        results = []
        for on in (False, True):
            for param, weights, state in zip(params, *start):
                param.data.copy_(weights)
                optimizer.state[param] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            portable_and_avx512(on)
            assert not on or native.use_avx512_vbmi(vbmi) == vbmi
            _step(optimizer, on=True)
            results.append(([p.detach().clone() for p in params], [dict(optimizer.state[p]) for p in params]))
        for before, after in zip(results[0][0], results[1][0]):
            torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
        for before, after in zip(results[0][1], results[1][1]):
            assert before.keys() == after.keys()
            for key, value in before.items():
                if torch.is_tensor(value):
                    torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
                else:
                    assert after[key] == value, key


def test_8bit_adam_kernel_keeps_a_nan_in_the_block_scale_as_torch_does():
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(2048, generator=generator)
    results = []
    for on in (True, False):
        param = torch.nn.Parameter(initial.clone())
        optimizer = Adam8bit([param], lr=0.01, min_8bit_size=1000)
        for step in range(2):
            param.grad = torch.randn(2048, generator=torch.Generator().manual_seed(step))
            if step == 1:
                param.grad[300] = float("nan")
            _step(optimizer, on)
        results.append(optimizer.state[param])
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax", "exp_avg_codes", "exp_avg_sq_codes"):
        torch.testing.assert_close(results[0][key], results[1][key], rtol=0, atol=0, equal_nan=True)
    assert results[0]["exp_avg_absmax"][1].isnan() and not results[0]["exp_avg_absmax"][0].isnan()


def test_without_a_compiler_the_optimizers_warn_once_and_take_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(native._compiled, "library", None)
    monkeypatch.setattr(native._compiled, "tried", False)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.enabled()
    param = torch.nn.Parameter(torch.ones(4, 4))
    param.grad = torch.full((4, 4), 0.5)
    Lamb([param], lr=0.1).step()
    assert torch.all(param < 1)
