"""`deepspeed.profiling.flops_profiler`: what it counts per module (torch's FlopCounterMode:
the matrix products, 2 flops per MAC), DeepSpeed's number formats, and, with
DEEPSPEED_PYTHON, the same MACs, parameters and printed profile as DeepSpeed 0.19.8's own
profiler on a small GPT block (its FLOPs add element-wise estimates: docs/deepspeed.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.frontends.deepspeed.api.profiling.flops_profiler import (
    FlopsProfiler,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    get_module_flops,
    macs_to_string,
    number_to_string,
    params_to_string,
)

needs_deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 to compare with it")

# a GPT block, written once and run by both profilers (the DeepSpeed side execs this text)
MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(width), Attention(width, heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, width=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x) @ torch.ones(x.shape[-1] * 2, 3)  # a bare matmul in the root module
'''
namespace: dict = {}
exec(MODEL, namespace)
TinyGPT, Block = namespace["TinyGPT"], namespace["Block"]
BATCH, SEQ, VOCAB, WIDTH, HEADS = 2, 8, 64, 32, 4


def _profiled(model: nn.Module, ids: torch.Tensor, ignore_list: list | None = None) -> tuple[FlopsProfiler, dict]:
    profiler = FlopsProfiler(model)
    profiler.start_profile(ignore_list=ignore_list)
    model(ids)
    profiler.stop_profile()
    return profiler, {name: (m.__flops__, m.__macs__, m.__params__) for name, m in model.named_modules()}


def test_each_module_holds_its_own_matrix_products():
    torch.manual_seed(0)
    model, ids = TinyGPT(), torch.randint(0, VOCAB, (BATCH, SEQ))
    profiler, counts = _profiled(model, ids)
    tokens = BATCH * SEQ
    assert counts["blocks.0.attn.qkv"] == (2 * tokens * WIDTH * 3 * WIDTH, tokens * WIDTH * 3 * WIDTH,
                                           WIDTH * 3 * WIDTH + 3 * WIDTH)
    # the attention's own products (CPU kernel included): QK^T and AV, its Linears' are theirs
    assert counts["blocks.0.attn"][1] == 2 * BATCH * HEADS * SEQ * SEQ * (WIDTH // HEADS)
    assert counts["blocks.0.mlp"][:2] == (0, 0) and counts["blocks.0.mlp.1"][:2] == (0, 0)  # GELU: not a product
    assert counts[""][1] == tokens * VOCAB * 3  # the bare matmul, in the module that ran it
    assert counts[""][2] == sum(p.numel() for p in model.parameters())  # parameters count with submodules'
    assert all(flops == 2 * macs for flops, macs, _ in counts.values())
    linear_macs = sum(tokens * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    attention_macs = len(model.blocks) * counts["blocks.0.attn"][1]
    assert profiler.get_total_macs() == linear_macs + attention_macs + tokens * VOCAB * 3
    assert profiler.get_total_flops() == 2 * profiler.get_total_macs() == get_module_flops(model)
    assert profiler.get_total_params() == counts[""][2]
    assert model.blocks[0].__duration__ > 0 and profiler.get_total_duration() >= model.blocks[0].__duration__


def test_an_ignored_module_counts_as_its_parents_and_end_profile_cleans_up():
    torch.manual_seed(0)
    model, ids = TinyGPT(), torch.randint(0, VOCAB, (BATCH, SEQ))
    _, counts = _profiled(model, ids)
    profiler, ignoring = _profiled(model, ids, ignore_list=[nn.Sequential])
    assert ignoring["blocks.0.mlp"][:2] == (0, 0) and ignoring["blocks.0.mlp.0"] == counts["blocks.0.mlp.0"]
    assert profiler.get_total_macs() == sum(macs for _, macs, _ in counts.values())
    profiler.end_profile()
    assert not any(hasattr(m, "__flops__") or hasattr(m, "__duration__") for m in model.modules())
    model(ids)  # no hooks or counter left behind
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_get_model_profile_returns_numbers_or_deepspeeds_strings(tmp_path, capsys):
    torch.manual_seed(0)
    model, ids = TinyGPT(), torch.randint(0, VOCAB, (BATCH, SEQ))
    flops, macs, params = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    assert (flops, params) == (2 * macs, sum(p.numel() for p in model.parameters()))
    assert not model.training  # profiled in eval mode, as DeepSpeed does
    assert get_model_profile(model, args=[ids], print_profile=False) == (number_to_string(flops),
                                                                         macs_to_string(macs), params_to_string(params))
    linear = nn.Linear(6, 5)
    assert get_model_profile(linear, input_shape=(4, 6), print_profile=False, as_string=False) == (240, 120, 35)
    report = tmp_path / "profiles" / "profile.txt"
    get_model_profile(model, args=[ids], top_modules=2, output_file=str(report))
    assert capsys.readouterr().out == ""
    text = report.read_text()
    assert "Profile Summary at step 1:" in text and f"fwd MACs per GPU: {' ' * 54}{macs_to_string(macs)}" in text
    assert "depth 1:\n    params      - {'ModuleList': '25.41 K', 'Embedding': '2.05 K'}" in text
    assert "(qkv): Linear(3.17 K = 10.74% Params, 49.15 KMACs = 11.03% MACs, " in text
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(model)


def test_number_formats_are_deepspeeds():
    """Strings DeepSpeed 0.19.8 printed for the same values."""
    values = [0, 0.5, 999, 1000, 1234567, 2.5e9, 7.77e12, 0.0005, 3e-7]
    assert [number_to_string(v) for v in values] == ["0 ", "500 m", "999 ", "1 K", "1.23 M", "2.5 G", "7.77 T",
                                                     "500 u", "0.3 u"]
    assert [params_to_string(v) for v in values] == ["0", "500 m", "999", "1 K", "1.23 M", "2.5 B", "7.77 T",
                                                     "500 u", "0.3 u"]
    assert (params_to_string(1.5e9, units="B"), params_to_string(123456, units="M")) == ("1.5 B", "0.12 M")
    assert [flops_to_string(1.23456e9, precision=3), macs_to_string(5e5), duration_to_string(0.0123),
            bytes_to_string(2048), number_to_string(1e9, units="K"), number_to_string(5, units="X")] == [
        "1.235 GFLOPS", "500 KMACs", "12.3 ms", "2.05 KB", "1e+06 K", "5 X"]


PROFILE_BOTH = MODEL + '''
import json, sys
if sys.argv[1] == "deepspeed":
    from deepspeed.profiling.flops_profiler import FlopsProfiler
else:
    from shardwise.frontends.deepspeed.api.profiling.flops_profiler import FlopsProfiler
torch.manual_seed(0)
model = TinyGPT()
ids = torch.randint(0, 64, (2, 8))
profiler = FlopsProfiler(model)
profiler.start_profile()
model(ids)
counts = {name: [m.__flops__, m.__macs__, m.__params__] for name, m in model.named_modules()}
profiler.print_model_profile(profile_step=3, top_modules=3, output_file=sys.argv[2])
profiler.end_profile()
print(json.dumps(counts))
'''


def _profile_with(python: str, flavour: str, report: Path) -> dict:
    ran = subprocess.run([python, "-c", PROFILE_BOTH, flavour, str(report)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def _without_timings(report: Path) -> list[str]:
    """The profile's lines less the timings and the FLOPs (compared on their own)."""
    kept = []
    for line in report.read_text().splitlines():
        if line.lstrip().startswith(("fwd flops", "fwd latency", "fwd FLOPS")):
            continue
        kept.append(re.sub(r"[\d.e+]+ [TGMKmu]?s = [\d.]+% latency, [\d.e+]+ [TGMKmu]?FLOPS", "<timing>", line))
    return kept


@needs_deepspeed
def test_same_macs_parameters_and_profile_as_deepspeed(tmp_path):
    ours = _profile_with(sys.executable, "shardwise", tmp_path / "ours.txt")
    theirs = _profile_with(os.environ["DEEPSPEED_PYTHON"], "deepspeed", tmp_path / "theirs.txt")
    assert {name: c[1:] for name, c in ours.items()} == {name: c[1:] for name, c in theirs.items()}
    # their flops: 2 per MAC plus LayerNorm's 5 and GELU's 1 per element, which torch does not count
    elementwise = {name: 5 * 2 * 8 * 32 for name in ours if name.endswith(("ln1", "ln2"))}
    elementwise |= {name: 2 * 8 * 128 for name in ours if name.endswith("mlp.1")}
    assert {name: c[0] + elementwise.get(name, 0) for name, c in ours.items()} == {
        name: c[0] for name, c in theirs.items()}
    assert _without_timings(tmp_path / "ours.txt") == _without_timings(tmp_path / "theirs.txt")
