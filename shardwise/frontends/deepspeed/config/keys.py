"""Which keys a config may contain, and what to tell the user about the others.

A key is one of: supported (a field of the schema), an older DeepSpeed name for a
supported key (renamed), a DeepSpeed key that changes nothing shardwise computes or is
switched off (accepted, ignored with a warning, or translated to shardwise's key:
deepspeed_keys.py), a feature DeepSpeed 0.19.8 has removed (refused when on), a comment,
a DeepSpeed key shardwise does not implement (rejected by name, so the user knows it was
understood), or unknown. An unknown top-level key is ignored with a warning naming the
closest known key, as DeepSpeed ignores it; inside a block it is most likely a typo and
an error naming the closest key of that block, as DeepSpeed's pydantic models refuse it.
Accepted-but-ignored keys go into `ignored`, one line each, which `load_config` logs
as one warning. The lists of DeepSpeed keys come
from deepspeed/runtime/constants.py, runtime/config.py and the section models under
deepspeed/runtime; they name what DeepSpeed accepts, not what it documents.
"""

import copy
import difflib
import importlib
import json
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel

from shardwise.frontends.deepspeed.config.deepspeed_keys import (
    Accepted,
    AcceptedWhen,
    Ignored,
    RULES,
    KeyRule,
    Removed,
    Translated,
    classification_rows,
    is_comment,
    rule_for,
)
from shardwise.frontends.deepspeed.config.defaults_table import section_model
from shardwise.frontends.deepspeed.config.errors import join_key
from shardwise.frontends.deepspeed.config.fields import Section
from shardwise.frontends.deepspeed.config.params import (
    DEEPSPEED_OPTIMIZERS_UNSUPPORTED,
    DEEPSPEED_SCHEDULERS_UNSUPPORTED,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
)
from shardwise.frontends.deepspeed.config.resolve import AUTO
from shardwise.frontends.deepspeed.config.schema import OptimizerConfig, SchedulerConfig, ShardwiseConfig

log = logging.getLogger("shardwise")
COUNT_SUFFIXES = ("_size", "_threshold", "_parameters", "_distance")

# Older names DeepSpeed still accepts. The zero_optimization ones are its pydantic field
# names, which it accepts beside the stage3_-prefixed aliases.
ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
    },
}

# Older names DeepSpeed reads only where the current name is absent: beside it, ignored.
SHADOWED_ALIASES = frozenset({("", "bfloat16")})

DEEPSPEED_KEYS_NOT_SUPPORTED: dict[str, frozenset[str]] = {
    "": frozenset({
        "vocabulary_size",
    }),
    "expert_parallel": frozenset({  # DeepSpeed's AutoEP beyond `enabled` and `autoep_size`
        "async_split_plan", "combine_impl", "comm_backend", "comm_max_tokens_per_rank", "comm_num_sm",
        "comm_qp_margin", "disable_triton_grouped_mm", "expert_activation", "expert_pattern",
        "expert_tensor_parallel_size", "expert_w1", "expert_w2", "expert_w3", "gate_up_impl",
        "has_shared_experts", "load_balance_coeff", "moe_layer_pattern", "num_expert_groups", "num_experts_attr",
        "num_limited_groups", "preset_model", "route_norm", "route_scale", "routed_scaling_factor",
        "router_pattern", "row_weighting_impl", "score_apply", "score_func", "shared_experts_gate_pattern",
        "shared_experts_pattern", "top_k", "top_k_attr", "use_grouped_mm", "validate_folding_routing",
    }),
    "optimizer.params": frozenset({"max_grad_norm"}),
}

# Where shardwise has the capability under another key, say which.
KEY_HINTS: dict[str, str] = {
    "optimizer.params.max_grad_norm": "use the top-level 'gradient_clipping' (DeepSpeed rejects it too)",
}


def deepspeed_key_table() -> list[tuple[str, str, str]]:
    """(dotted key, treatment, why) for every DeepSpeed key without a schema field: the
    accepted and translated ones, then those still rejected (docs/reference/config.md's table)."""
    rows = classification_rows()
    for path, keys in DEEPSPEED_KEYS_NOT_SUPPORTED.items():
        for key in sorted(keys):
            full = join_key(path, key)
            rows.append((full, "rejected: not supported yet", KEY_HINTS.get(full, "")))
    return rows


class _TypedBlock(NamedTuple):
    """A block whose `params` keys depend on its `type`, with DeepSpeed's types it cannot have."""

    model: type[BaseModel]
    params_by_type: Mapping[str, type[Section]]
    deepspeed_types_unsupported: tuple[str, ...]
    torch_module: str  # where DeepSpeed looks for a type that is not its own

    def torch_names(self) -> list[str]:
        module = importlib.import_module(self.torch_module)
        return [name for name in dir(module) if not name.startswith("_") and name in self.params_by_type]


_TYPED_BLOCKS = {
    "optimizer": _TypedBlock(OptimizerConfig, OPTIMIZER_PARAMS, DEEPSPEED_OPTIMIZERS_UNSUPPORTED, "torch.optim"),
    "scheduler": _TypedBlock(SchedulerConfig, SCHEDULER_PARAMS, DEEPSPEED_SCHEDULERS_UNSUPPORTED,
                             "torch.optim.lr_scheduler"),
}


def expand_dotted_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A top-level key written as a path ("zero_optimization.reduce_bucket_size", as TRL's
    `prepare_deepspeed` adds for its reference model) set at that path, over the nested
    value: what its writer meant (DeepSpeed itself skips such keys; they only size
    buckets and prefetching, never change results). An element count given there as a
    product with a fraction (TRL's 0.9·h² prefetch size) is rounded down. A path whose
    parent is not a block stays as written, for check_keys to report."""
    expanded = copy.deepcopy(dict(raw))
    blocks = {name for name, field in ShardwiseConfig.model_fields.items() if section_model(field.annotation)}
    for key in [key for key in raw if isinstance(key, str) and key.split(".")[0] in blocks and "." in key]:
        *parents, leaf = key.split(".")
        block = expanded
        for name in parents:
            block = block.setdefault(name, {}) if isinstance(block.get(name, {}), dict) else None
            if block is None:
                break
        if block is not None:
            value = expanded.pop(key)
            counts = isinstance(value, float) and leaf.endswith(COUNT_SUFFIXES) and math.isfinite(value)
            block[leaf] = math.floor(value) if counts else value
            log.info("config key '%s' read as that path", key)
    return expanded


def check_keys(raw: Mapping[str, Any], problems: list[str], ignored: list[str] | None = None) -> dict[str, Any]:
    """A copy of `raw` holding only supported keys under their current names; every key
    refused becomes a line in `problems`, every key accepted but ignored one in `ignored`.
    Sections given as null count as absent (DeepSpeed 0.19.8 fails on most of them inside its
    config classes: a relaxation, docs/deepspeed.md)."""
    ignored = [] if ignored is None else ignored
    return _check_section(_read_zero_switch(raw, ignored), ShardwiseConfig, "", problems, ignored)


def _read_zero_switch(raw: Mapping[str, Any], ignored: list[str]) -> Mapping[str, Any]:
    """`"zero_optimization": true / false`, DeepSpeed's oldest form, as DeepSpeed 0.19.8 reads
    it (runtime/zero/config.py `read_zero_config_deprecated`): stage 1, its all-gather bucket
    from the top-level `allgather_size`, or stage 0. DeepSpeed reads `allgather_size` in
    this form only."""
    switch = raw.get("zero_optimization")
    if not isinstance(switch, bool):
        return raw
    block: dict[str, Any] = {"stage": int(switch)}
    rest = {key: value for key, value in raw.items() if key != "allgather_size"}
    if switch and "allgather_size" in raw:
        block["allgather_bucket_size"] = raw["allgather_size"]
    ignored.append(f"'zero_optimization' {json.dumps(switch)}: DeepSpeed's deprecated form, read as DeepSpeed 0.19.8 "
                   f"reads it: {json.dumps(block)}")
    return {**rest, "zero_optimization": block}


def _check_section(
    raw: Mapping[str, Any], model: type[BaseModel], path: str, problems: list[str], ignored: list[str]
) -> dict[str, Any]:
    aliases = ALIASES.get(path, {})
    cleaned: dict[str, Any] = {}
    translations: dict[str, tuple[str, Any]] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name != key and value == AUTO:
            # Hugging Face fills "auto" under the current names only; under the other one
            # DeepSpeed's config models drop it for the default (axolotl's
            # "prefetch_bucket_size": "auto"), so it is left out here, never filled.
            continue
        if name != key and raw.get(name) is not None and (path, key) in SHADOWED_ALIASES:
            ignored.append(f"'{join_key(path, key)}': '{join_key(path, name)}' is set too, and DeepSpeed 0.19.8 "
                           f"reads '{name}' first and never looks at '{key}'")
        elif name != key and name in raw and (path, key) not in SHADOWED_ALIASES:
            problems.append(
                f"'{join_key(path, key)}' and '{join_key(path, name)}' are both set; "
                f"'{key}' is DeepSpeed's other name for '{name}', keep one"
            )
        elif name in model.model_fields:
            checked = _check_value(value, model, name, join_key(path, name), problems, ignored)
            if checked is not None or section_model(model.model_fields[name].annotation) is None:
                cleaned[name] = checked
        elif rule_for(path, name) is not None:  # under DeepSpeed's other name, the rule of the name it stands for
            translations.update(_apply_rule(rule_for(path, name), name, value, path, raw, problems, ignored))
        elif path == "" and key not in DEEPSPEED_KEYS_NOT_SUPPORTED[""] and not is_comment(key, path):
            ignored.append(_describe_unknown_top_level(key))
        elif not is_comment(key, path):
            problems.append(_describe_unsupported(key, model, path))
    _merge_translations(cleaned, translations, path, problems)
    return cleaned


def _apply_rule(rule: KeyRule, key: str, value: Any, path: str, given: Mapping[str, Any], problems: list[str],
                ignored: list[str]) -> dict[str, Any]:
    """Accept, ignore, refuse or translate a DeepSpeed key without a schema field
    (deepspeed_keys.py); `given` is the block that holds it, as written."""
    full = join_key(path, key)
    wrong = rule.wrong(value) if isinstance(rule, (Accepted, Ignored)) and rule.wrong else ""
    if wrong:
        problems.append(f"'{full}' {json.dumps(value)}: {wrong}")
    elif isinstance(rule, Ignored) and not rule.quiet(value):
        ignored.append(f"'{full}' {json.dumps(value)}: {rule.why}")
    elif isinstance(rule, Removed):
        problems.append(f"'{full}' is a feature DeepSpeed 0.19.8 has removed (it refuses the key at any value, "
                        f"switched off too): {rule.why}")
    elif isinstance(rule, AcceptedWhen) and not rule.harmless(value):
        if isinstance(value, Mapping) and "enabled" in value:
            full, value = f"{full}.enabled", value["enabled"]
        problems.append(f"'{full}' {json.dumps(value)} is not supported: {rule.why_not} "
                        f"(accepted: {rule.harmless_doc})")
    elif isinstance(rule, Translated) and rule.replaced_by and rule.replaced_by in given:
        problems.append(f"'{full}' and '{join_key(path, rule.replaced_by)}' are both set: '{key}' is DeepSpeed's "
                        f"deprecated spelling of '{rule.replaced_by}', and DeepSpeed 0.19.8 refuses the two together "
                        f"(\"Cannot provide deprecated parameter\"); keep '{rule.replaced_by}'")
    elif isinstance(rule, Translated):
        converted = rule.convert(value)
        if isinstance(converted, str):
            problems.append(f"'{full}' {converted}")
            return {}
        return {target: (full, setting) for target, setting in converted.items()}
    return {}


def _merge_translations(cleaned: dict[str, Any], translations: dict[str, tuple[str, Any]], path: str,
                        problems: list[str]) -> None:
    """Move translated values to shardwise's keys unless the config also sets those keys
    (then they must agree)."""
    for dotted, (source, value) in translations.items():
        *parents, leaf = dotted.split(".")
        node = cleaned
        for part in parents:
            node = node.setdefault(part, {})
        if leaf in node and node[leaf] != value:
            problems.append(f"'{source}' asks for {join_key(path, dotted)} {json.dumps(value)} but "
                            f"'{join_key(path, dotted)}' is {json.dumps(node[leaf])}; keep one")
        else:
            node[leaf] = value


def _check_value(value: Any, model: type[BaseModel], name: str, path: str, problems: list[str],
                 ignored: list[str]) -> Any:
    if not isinstance(value, Mapping):
        return value
    if path in _TYPED_BLOCKS:
        return _check_typed_block(value, path, problems, ignored)
    nested = section_model(model.model_fields[name].annotation)
    return _check_section(value, nested, path, problems, ignored) if nested is not None else value


def _check_typed_block(raw: Mapping[str, Any], path: str, problems: list[str],
                       ignored: list[str]) -> dict[str, Any] | None:
    """optimizer / scheduler: the valid `params` keys depend on `type`, so resolve `type` first.
    A type shardwise cannot build drops the whole block after reporting it."""
    block = _TYPED_BLOCKS[path]
    cleaned = _check_section(raw, block.model, path, problems, ignored)
    given = cleaned.get("type")
    if not isinstance(given, str):
        return cleaned
    # DeepSpeed's names in any letter case, torch's classes by their exact name
    canonical = _canonical_type(given, block.params_by_type) or (given if given in block.params_by_type else None)
    if canonical is None:
        problems.append(_describe_bad_type(given, path, block))
        return None
    cleaned["type"] = canonical
    if isinstance(cleaned.get("params"), Mapping):
        params_model = block.params_by_type[canonical]
        cleaned["params"] = _check_section(cleaned["params"], params_model, f"{path}.params", problems, ignored)
    return cleaned


def _canonical_type(given: str, names: Iterable[str]) -> str | None:
    """DeepSpeed matches its own optimizer names case-insensitively; shardwise does so for all."""
    return next((name for name in names if name.lower() == given.lower()), None)


def _describe_bad_type(given: str, path: str, block: _TypedBlock) -> str:
    choices = ", ".join(block.params_by_type) + f", or a {block.torch_module} class by its exact name"
    if _canonical_type(given, block.deepspeed_types_unsupported) is not None:
        return f"{path}.type '{given}' is a DeepSpeed {path} that shardwise does not support yet: use one of {choices}"
    # torch's names are suggested in their right case only: there are many, and few configs misspell them
    closest = _canonical_type(given, block.torch_names()) or _closest(given, list(block.params_by_type))
    if closest:
        return f"{path}.type '{given}' is unknown; did you mean '{closest}'? (choices: {choices})"
    return f"{path}.type '{given}' is unknown; use one of {choices}"


def _describe_unknown_top_level(key: str) -> str:
    """DeepSpeed reads the top-level keys it knows and never looks at the others (tools
    leave their own there: `cuda_visible_devices`, `comms_config`...), so shardwise ignores
    them too; a misspelt known key is the likely mistake, hence the closest one."""
    known = list(ShardwiseConfig.model_fields) + [key for key, _, _ in classification_rows() if "." not in key]
    closest = _closest(key, known)
    hint = f"; did you mean '{closest}'?" if closest else ""
    return f"unknown top-level key '{key}' ignored (DeepSpeed ignores it too){hint}"


def _describe_unsupported(key: str, model: type[BaseModel], path: str) -> str:
    full = join_key(path, key)
    if key in DEEPSPEED_KEYS_NOT_SUPPORTED.get(path, frozenset()):
        hint = KEY_HINTS.get(full)
        return f"'{full}' is a DeepSpeed key that shardwise does not support yet" + (f": {hint}" if hint else "")
    # the block's own fields, then the DeepSpeed keys it accepts without one (not the removed ones)
    known = list(model.model_fields) + [name for name, rule in RULES.get(path, {}).items()
                                        if not isinstance(rule, Removed) and name not in model.model_fields]
    closest = _closest(key, known)
    if closest:
        return f"unknown key '{full}'; did you mean '{join_key(path, closest)}'?"
    where = f"in '{path}'" if path else "at the top level"
    return f"unknown key '{full}'; the keys accepted {where} are: {', '.join(known)}"


def _closest(key: str, choices: list[str]) -> str | None:
    by_lower = {choice.lower(): choice for choice in choices}
    matches = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[matches[0]] if matches else None
