"""`deepspeed.runtime.compiler`: `is_compiling` is true only while torch.compile traces;
a `disable`d function runs eagerly inside a compiled one (a graph break: two graphs);
`enable` outside compilation leaves the function as it is; `compile()` is torch.compile."""

from __future__ import annotations

import torch

from shardwise.frontends.deepspeed.api.runtime import compiler


def test_is_compiling_and_disable_inside_a_compiled_function():
    seen = []

    @compiler.disable
    def eager(x):
        seen.append(compiler.is_compiling())
        return x * 2

    graphs = []

    def count_graphs(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    @torch.compile(backend=count_graphs)
    def compiled(x):
        traced = torch.tensor(float(compiler.is_compiling()))
        return eager(x + 1) + traced

    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 5.0))  # (1 + 1) * 2 + 1 (traced)
    assert seen == [False] and len(graphs) == 2 and not compiler.is_compiling()


def test_enable_outside_compilation_and_compile():
    def f(x):
        return x

    assert compiler.enable(f) is f and compiler.enable("2.7.0")(f) is f
    assert compiler.compile() is torch.compile and compiler.dummy_decorator(f) is f
    assert compiler.is_compile_supported()
    with compiler.compiled_autograd(False, {}):
        assert not compiler.is_compiling()
