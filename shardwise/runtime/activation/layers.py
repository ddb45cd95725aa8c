"""Finding a model's repeated layers (the units recomputation works on), without a plan.

Transformers keep their layers in one `nn.ModuleList` of identical blocks: shardwise's
GPT (`blocks`), Hugging Face Llama / Mistral / Qwen (`model.layers`), GPT-2 (`transformer.h`),
BERT (`encoder.layer`), OPT (`decoder.layers`). The stack is the list of same-class
modules holding the most parameters; a model with several (an encoder-decoder) or an
unusual layout names its stacks explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, list) of the model's layer stack."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        numel = sum(param.numel() for param in module.parameters())
        if best is None or numel > best[0]:
            best = (numel, name, module)
    if best is None:
        raise ValueError(
            f"activation checkpointing found no stack of layers in {type(model).__name__} (an nn.ModuleList "
            "of modules of one class); pass the layers explicitly: apply_activation_checkpointing(model, "
            "policy, layers=model.my_layers)"
        )
    return best[1], best[2]


def resolve_layers(model: nn.Module, layers: Sequence[nn.Module] | str | None) -> list[nn.Module]:
    """`layers` as modules: given, a dotted submodule name, or found."""
    if layers is None:
        return list(find_layers(model)[1])
    if isinstance(layers, str):
        return list(model.get_submodule(layers))
    return list(layers)
