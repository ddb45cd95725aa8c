"""Which operator outputs a selectively checkpointed layer keeps (torch's selective
activation checkpointing decides per aten operator, in forward).

Recomputation is worth it where an output is large and cheap to make again: norms,
activations, dropout, attention (its flops grow with the sequence but its outputs are
re-made in one fused call). Matmuls are the expensive operators, so selective policies
keep some of their outputs and recompute everything else from them:

    "widening_matmuls" (the default)  keep a linear layer's output when it is wider than
        its input: the QKV and MLP up-projections, from which attention, the activation
        function and the norms are recomputed. The down-projections (attention output,
        MLP output) are recomputed too: in a GPT block that costs one h×h matmul of
        twelve, and halves what the block keeps.
    "matmuls"  keep every matmul and attention output (torchtitan's op-level policy
        without its every-other-matmul rule): the least recomputation, but the block
        keeps about two thirds of what it would without checkpointing.

A rule is `rule(func, args, output) -> bool` (True: keep), so a caller can pass its own.
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


def widening_matmuls(func: Any, args: tuple, output: Any) -> bool:
    index = LINEAR_MATMULS.get(func)
    if index is None:
        return False
    return output.shape[-1] > args[index].shape[-1]


def matmuls(func: Any, args: tuple, output: Any) -> bool:
    return func in MATMULS or func in ATTENTION


SAVE_RULES: dict[str, SaveRule] = {"widening_matmuls": widening_matmuls, "matmuls": matmuls}


def save_rule(rule: str | SaveRule) -> SaveRule:
    if callable(rule):
        return rule
    if rule not in SAVE_RULES:
        raise ValueError(f"unknown selective rule {rule!r}; choose one of {sorted(SAVE_RULES)} or pass a function")
    return SAVE_RULES[rule]
