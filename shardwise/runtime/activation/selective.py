"""Which operator outputs a selectively checkpointed layer keeps (torch's selective
activation checkpointing decides per aten operator, in forward).

Recomputation is worth it where an output is large and cheap to make again: norms,
activations, dropout, the attention core (its a·s² scores cost few flops per byte kept).
Matmuls are the expensive operators, so selective policies keep their outputs and
recompute everything else from them. Per GPT block (e bytes per element, s·b·h = sbh):

    "linear_outputs" (the default)  keep every linear layer's output: QKV (3 sbh),
        attention projection (1), MLP up (4) and down (1) projections, 9e·sbh besides the
        kept input. The recomputation runs no linear layer at all, only the norms, the
        activation function, dropout and the attention core. Measured on the 25M GPT on
        CPU (dropout 0.1, one thread), it costs a third of full recomputation's CPU time
        (BENCHMARKS.md, issue 12).
    "widening_matmuls"  keep a linear layer's output only when it is wider than its input
        (QKV and MLP up-projection, 7e·sbh): one sbh less per layer, but the attention and
        MLP down-projections (5 of the block's 12 h² of matmul) are recomputed, about half
        of full recomputation's time on the same run.
    "matmuls"  every matmul and attention output (torchtitan's op-level policy without its
        every-other-matmul rule): with the unfused attention this includes the a·s² scores,
        so the block keeps about two thirds of what it would without checkpointing.

A rule is `rule(func, args, output) -> bool` (True: keep), so a caller can pass its own. On
torch 2.9 the rule is asked before the operator runs, and reading `output` raises
(shardwise/runtime/base/torch_compat.py); the named rules decide from `func` and `args` alone.
What the named rules keep is the planner's `selective_kept_bytes` (shardwise.formulas.activation.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten
SaveRule = Callable[[Any, tuple, Any], bool]

# (operator, index of its first matrix argument): out = a @ b with a = args[index]
LINEAR_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}
MATMULS = {**LINEAR_MATMULS, aten.bmm.default: 0, aten.baddbmm.default: 1}
ATTENTION = {
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


def linear_outputs(func: Any, args: tuple, output: Any) -> bool:
    return func in LINEAR_MATMULS


def widening_matmuls(func: Any, args: tuple, output: Any) -> bool:
    index = LINEAR_MATMULS.get(func)
    if index is None:
        return False
    return args[index + 1].shape[-1] > args[index].shape[-1]  # a @ b: the output is b's width


def matmuls(func: Any, args: tuple, output: Any) -> bool:
    return func in MATMULS or func in ATTENTION


SAVE_RULES: dict[str, SaveRule] = {
    "linear_outputs": linear_outputs,
    "widening_matmuls": widening_matmuls,
    "matmuls": matmuls,
}


def save_rule(rule: str | SaveRule) -> SaveRule:
    if callable(rule):
        return rule
    if rule not in SAVE_RULES:
        raise ValueError(f"unknown selective rule {rule!r}; choose one of {sorted(SAVE_RULES)} or pass a function")
    return SAVE_RULES[rule]
