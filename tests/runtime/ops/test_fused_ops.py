"""Each fused operator equals the unfused torch code it replaces, forward and gradients (C19).

The fused bodies run eagerly here (`kernel_fusion(False)`): the autograd.Functions with
their hand-written backward are what is under test, and Inductor's compile time stays out
of the fast suite. One test runs a compiled body against the eager one.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.ops.activations import LinearGeLU, bias_gelu, swiglu
from shardwise.runtime.ops.fused_linear_cross_entropy import FusedLMHead, fused_linear_cross_entropy
from shardwise.runtime.ops.kernel import kernel_fusion
from shardwise.runtime.ops.linear_bn_act import FusedLinearBatchNormAct
from shardwise.runtime.ops.norms import FusedLayerNorm, FusedRMSNorm, layer_norm, rms_norm


@pytest.fixture(autouse=True)
def eager_bodies():
    with kernel_fusion(False):
        yield


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def leaves(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, requires_grad=True) for shape in shapes]


def assert_same_values_and_grads(fused_fn, reference_fn, inputs, tolerance=1e-5):
    fused_out = fused_fn(*inputs)
    reference_out = reference_fn(*inputs)
    grad = torch.sin(torch.arange(fused_out.numel(), dtype=torch.float32)).view_as(fused_out)
    fused_grads = torch.autograd.grad(fused_out, inputs, grad)
    reference_grads = torch.autograd.grad(reference_out, inputs, grad)
    assert relative_error(fused_out, reference_out) < tolerance
    for index, (got, want) in enumerate(zip(fused_grads, reference_grads)):
        assert relative_error(got, want) < tolerance, f"gradient of input {index}"


def reference_rms_norm(x, weight, eps=1e-6):
    """Llama's LlamaRMSNorm.forward."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def test_rms_norm_equals_llamas():
    assert_same_values_and_grads(rms_norm, reference_rms_norm, leaves((3, 5, 16), (16,)))


def test_layer_norm_equals_torchs():
    assert_same_values_and_grads(lambda x, w, b: layer_norm(x, w, b, 1e-5),
                                 lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-5), leaves((3, 5, 16), (16,), (16,)))
    assert_same_values_and_grads(lambda x: layer_norm(x, None, None), lambda x: F.layer_norm(x, (16,)),
                                 leaves((4, 16)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_equals_add_then_gelu(approximate):
    assert_same_values_and_grads(lambda x, b: bias_gelu(x, b, approximate),
                                 lambda x, b: F.gelu(x + b, approximate=approximate), leaves((4, 6, 32), (32,)))


def test_swiglu_equals_silu_times_up():
    assert_same_values_and_grads(swiglu, lambda a, b: F.silu(a) * b, leaves((4, 6, 32), (4, 6, 32)))


def test_fused_modules_keep_the_parameters_they_replace():
    linear = nn.Linear(8, 16)
    fused_linear = LinearGeLU.from_linear(linear, "tanh")
    assert fused_linear.weight is linear.weight and list(fused_linear.state_dict()) == ["weight", "bias"]
    x = leaves((5, 8))[0]
    assert relative_error(fused_linear(x), F.gelu(linear(x), approximate="tanh")) < 1e-6
    norm = FusedLayerNorm(8)
    assert list(norm.state_dict()) == list(nn.LayerNorm(8).state_dict())
    assert list(FusedRMSNorm(8).state_dict()) == ["weight"]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_fused_linear_cross_entropy_equals_linear_then_cross_entropy(bias, chunk_rows):
    hidden, weight, b = leaves((3, 10, 16), (50, 16), (50,))
    targets = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(1))
    targets[0, :4] = -100  # ignored positions, as padding in a batch
    inputs = [hidden, weight, b] if bias else [hidden, weight]

    def fused(h, w, b=None):
        return fused_linear_cross_entropy(h, w, targets, bias=b, chunk_rows=chunk_rows)

    def reference(h, w, b=None):
        return F.cross_entropy(F.linear(h, w, b).float().view(-1, 50), targets.view(-1))

    assert_same_values_and_grads(fused, reference, inputs)
    total = fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", chunk_rows=chunk_rows)
    expected = F.cross_entropy(F.linear(hidden, weight).view(-1, 50), targets.view(-1), reduction="sum")
    assert relative_error(total, expected) < 1e-5


def test_fused_linear_cross_entropy_in_bf16_sums_the_weight_gradient_in_fp32():
    """bf16 h and W: the chunks' weight-gradient products are summed in an fp32 buffer;
    loss and gradients agree with the unfused bf16 code to bf16's precision."""
    torch.manual_seed(0)
    hidden, weight = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for shape in ((37, 16), (50, 16)))
    targets = torch.randint(0, 50, (37,))
    targets[:3] = -100
    fused = fused_linear_cross_entropy(hidden, weight, targets, chunk_rows=8)
    fused_grads = torch.autograd.grad(fused, (hidden, weight))
    reference = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    for got, want in zip(fused_grads, torch.autograd.grad(reference, (hidden, weight))):
        assert got.dtype == torch.bfloat16 and relative_error(got.float(), want.float()) < 1e-2
    assert relative_error(fused, reference) < 1e-5


def test_fused_lm_head_returns_logits_without_targets_and_keeps_ties():
    embedding = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight
    fused_head = FusedLMHead.from_linear(head)
    assert fused_head.weight is embedding.weight
    hidden = torch.randn(2, 4, 16)
    assert torch.equal(fused_head(hidden), head(hidden))
    with torch.no_grad():  # loss only: no gradient is computed in the forward
        loss = fused_head(hidden, torch.zeros(2, 4, dtype=torch.long))
    assert relative_error(loss, F.cross_entropy(head(hidden).view(-1, 50), torch.zeros(8, dtype=torch.long))) < 1e-6


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_linear_batch_norm_activation_trains_and_evaluates_like_the_three_layers(activation):
    torch.manual_seed(0)
    linear, bn = nn.Linear(12, 24), nn.BatchNorm1d(24)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    reference_stack = nn.Sequential(linear, bn, {"relu": nn.ReLU(), "gelu": nn.GELU(), "silu": nn.SiLU()}[activation])
    reference = {name: t.clone() for name, t in reference_stack.state_dict().items()}
    fused_module = FusedLinearBatchNormAct(12, 24, activation)
    fused_module.linear.load_state_dict({k[2:]: v for k, v in reference.items() if k.startswith("0.")})
    fused_module.bn.load_state_dict({k[2:]: v for k, v in reference.items() if k.startswith("1.")})
    params = [p for p in fused_module.parameters()]
    x = leaves((32, 12), seed=3)[0]
    for step in range(2):  # training: batch statistics, running statistics updated the same way
        got, want = fused_module(x), reference_stack(x)
        assert relative_error(got, want) < 1e-5
        grad = torch.randn_like(got)
        names = ["x", *(name for name, _ in fused_module.named_parameters())]
        for name, a, b in zip(names, torch.autograd.grad(got, [x, *params], grad),
                              torch.autograd.grad(want, [x, *reference_stack.parameters()], grad)):
            if name == "linear.bias":  # batch norm subtracts it again: its true gradient is 0, both are rounding
                assert a.abs().max() < 1e-5 and b.abs().max() < 1e-5
            else:
                assert relative_error(a, b) < 1e-5, name
    assert torch.allclose(fused_module.bn.running_var, bn.running_var, rtol=1e-6)
    assert torch.allclose(fused_module.bn.running_mean, bn.running_mean, rtol=1e-6, atol=1e-7)
    fused_module.eval(), reference_stack.eval()
    assert relative_error(fused_module(x), reference_stack(x)) < 1e-5  # folded weights: one matrix multiply


def test_a_compiled_body_equals_the_eager_one():
    x, b = leaves((4, 32), (32,))
    eager = torch.autograd.grad(bias_gelu(x, b, "tanh").sum(), [x, b])
    with kernel_fusion(True):
        compiled_out = bias_gelu(x, b, "tanh")
        compiled = torch.autograd.grad(compiled_out.sum(), [x, b])
    assert relative_error(compiled_out, F.gelu(x + b, approximate="tanh")) < 1e-5
    for got, want in zip(compiled, eager):
        assert relative_error(got, want) < 1e-5
