"""Values the config leaves open: "auto" entries and the three batch sizes.

"auto" comes from Hugging Face's DeepSpeed integration, which fills such keys in
from its trainer's arguments and the model before DeepSpeed sees the config. In
shardwise the caller's values come first (`auto_values`: `initialize(auto_values=...)`,
the flags of `shardwise train`, the HF Trainer integration); what they leave open
becomes what can be derived without them: the batch sizes from each other, bucket
sizes from the model's hidden size (with HF's formulas), the scheduler's peak from the
optimizer's lr, and DeepSpeed's default otherwise. Where nothing sensible can be
derived (the learning rate, step counts) "auto" is an error naming the argument that
fills it.
"""

import copy
from collections.abc import Callable, Mapping
from typing import Any

from shardwise.frontends.deepspeed.config.errors import join_key

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


_USE_DEFAULT = object()
"""What a rule returns to drop the key, so that the schema's default applies."""

AutoRule = Callable[[dict[str, Any], int | None], object]


def _default(cfg: dict[str, Any], hidden_size: int | None) -> object:
    return _USE_DEFAULT


def _from_hidden_size(formula: Callable[[int], int]) -> AutoRule:
    return lambda cfg, hidden_size: _USE_DEFAULT if hidden_size is None else formula(hidden_size)


def _optimizer_lr(cfg: dict[str, Any], hidden_size: int | None) -> object:
    """A number when the config's optimizer has one; else None, read by the engine as the lr of
    whichever optimizer it is given, as DeepSpeed's WarmupLR does with warmup_max_lr unset."""
    lr = _lookup(cfg, "optimizer.params.lr")
    return lr if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


_FILL = "{key}: 'auto' needs the caller's value: pass auto_values={{'{key}': ...}} to initialize(){where}, or write it"
_STEPS_UNKNOWN = " (shardwise train fills it from --steps)"

# A rule is either how to derive the value, or the reason it cannot be derived.
AUTO_RULES: dict[str, AutoRule | str] = {
    **{key: _default for key in BATCH_KEYS},
    "gradient_clipping": _default,
    "fp16.enabled": _default,
    "bf16.enabled": _default,
    "optimizer.params.lr": " (shardwise train fills it from --lr)",
    "optimizer.params.betas": _default,
    "optimizer.params.eps": _default,
    "optimizer.params.weight_decay": _default,
    "scheduler.params.warmup_min_lr": _default,
    "scheduler.params.warmup_max_lr": _optimizer_lr,
    "scheduler.params.warmup_num_steps": _STEPS_UNKNOWN,
    "scheduler.params.total_num_steps": _STEPS_UNKNOWN,
    "scheduler.params.total_num_iters": _STEPS_UNKNOWN,
    "scheduler.params.warmup_min_ratio": _default,
    "scheduler.params.cos_min_ratio": _default,
    "zero_optimization.stage": " (shardwise train fills it from --stage)",
    "fp16.loss_scale": _default,
    **{f"zero_optimization.{key}": _default for key in (
        "allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
        "stage3_gather_16bit_weights_on_model_save", "mics_shard_size",
    )},
    "zero_optimization.reduce_bucket_size": _from_hidden_size(lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": _from_hidden_size(lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": _from_hidden_size(lambda h: 10 * h),
}


# Values that let the rest of a block validate after its "auto" was reported as an error;
# the config is never returned while an error stands.
_STAND_INS = {
    "optimizer.params.lr": 1e-3,
    "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 1,
    "scheduler.params.total_num_iters": 1,
}


def _lookup(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def fill_auto(cfg: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` with each "auto" whose dotted key is in `values` replaced by that value, as Hugging
    Face's integration does with its trainer's arguments; keys the config sets are kept."""
    filled = copy.deepcopy(cfg)
    for dotted, value in values.items():
        parent_key, _, key = dotted.rpartition(".")
        parent = _lookup(filled, parent_key) if parent_key else filled
        if isinstance(parent, dict) and parent.get(key) == AUTO:
            parent[key] = value
    return filled


def resolve_auto(cfg: dict[str, Any], hidden_size: int | None, problems: list[str]) -> None:
    """Replace every "auto" in `cfg` in place, reporting those that cannot be derived."""
    for dotted, rule in AUTO_RULES.items():
        parent_key, _, key = dotted.rpartition(".")
        parent = _lookup(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, dict) or parent.get(key) != AUTO:
            continue
        if isinstance(rule, str):
            problems.append(_FILL.format(key=dotted, where=rule))
            if dotted in _STAND_INS:  # so the block's own validation does not report the key again
                parent[key] = _STAND_INS[dotted]
            else:
                del parent[key]
            continue
        outcome = rule(cfg, hidden_size)
        if outcome is _USE_DEFAULT:
            del parent[key]
        else:
            parent[key] = outcome
    _drop_remaining_auto(cfg, "", problems)


# The blocks DeepSpeed validates with its pydantic models (DeepSpeedConfigModel), which drop
# every "auto" they are given so that the field keeps its default (runtime/config_utils.py):
# there "auto" means DeepSpeed's default when no Trainer fills it, e.g. offload_param.buffer_size.
DEFAULT_WHEN_AUTO_BLOCKS = ("zero_optimization", "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet",
                            "compile", "comms_logger", "tensor_parallel")


def _drop_remaining_auto(node: dict[str, Any], path: str, problems: list[str]) -> None:
    """Drop "auto" on keys no rule covers: inside DeepSpeed's pydantic blocks it means the
    default; elsewhere it is reported, since nothing can fill it."""
    for key in list(node):
        value = node[key]
        if value == AUTO:
            if path.split(".")[0] not in DEFAULT_WHEN_AUTO_BLOCKS:
                problems.append(_FILL.format(key=join_key(path, key), where=""))
            del node[key]
        elif isinstance(value, dict):
            _drop_remaining_auto(value, join_key(path, key), problems)


MODEL_PARALLEL_SIZES = ("tensor_parallel.size", "sequence_parallel.size", "pipeline_parallel.size")


def resolve_data_parallel_size(cfg: dict[str, Any], world_size: int, problems: list[str]) -> int | None:
    """world / (tp * sp * pp): how many replicas of the model see different data.

    Sizes that are not positive integers are left to the schema to report; a product that
    does not divide the world is reported here with the numbers."""
    sizes = {key: _lookup(cfg, key) for key in MODEL_PARALLEL_SIZES}
    sizes = {key: (1 if value is None else _positive_int(value)) for key, value in sizes.items()}
    if any(size is None for size in sizes.values()):
        return world_size
    model_parallel = 1
    for size in sizes.values():
        model_parallel *= size
    if world_size % model_parallel:
        product = " * ".join(f"{key} {size}" for key, size in sizes.items())
        problems.append(f"world size {world_size} is not divisible by {product} = {model_parallel}: "
                        "the data-parallel size must be a whole number")
        return None
    return world_size // model_parallel


def batch_left_to_auto(cfg: dict[str, Any]) -> bool:
    """True when the config gives neither train_batch_size nor the micro-batch size, but
    says "auto" for at least one of them."""
    values = [cfg.get(key) for key in BATCH_KEYS[:2] if key in cfg]
    return AUTO in values and all(value == AUTO for value in values)


def resolve_batch(cfg: dict[str, Any], world_size: int, problems: list[str], processes: int | None = None,
                  auto: bool = False) -> bool:
    """Set all three batch keys in `cfg` following DeepSpeed's rules, or report why not.

    `world_size` is the data-parallel size; `processes`, when it differs, is the whole world
    (the messages then name the data-parallel size, which is what multiplies the batch).

    train = micro x accumulation x world: two of them give the third, train alone means no
    accumulation, micro alone means no accumulation either. Unlike DeepSpeed, a derivation
    that does not divide evenly is an error rather than a silently rounded-down batch.
    """
    given: dict[str, int] = {}
    invalid = False
    for key in BATCH_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        count = _positive_int(value)
        if count is None:
            problems.append(f"{key}: must be a positive integer (got {value!r})")
            invalid = True
        else:
            given[key] = count
    if invalid:
        return False
    label = "world_size" if processes in (None, world_size) else "data-parallel size"
    derived = _derive_batch(given.get(BATCH_KEYS[0]), given.get(BATCH_KEYS[1]), given.get(BATCH_KEYS[2]),
                            world_size, label)
    if isinstance(derived, str):
        problems.append(derived + (_BATCH_FILL if auto else ""))
        return False
    cfg.update(zip(BATCH_KEYS, derived))
    return True


def keep_global_batch(cfg: dict[str, Any], world_size: int) -> None:
    """Under `auto_resume` (an elastic job restarted at another size), keep
    train_batch_size and derive the rest at this data-parallel size `world_size`.

    A config written for one size gives all three batch keys; at another size they no
    longer multiply out. The global batch is what the run's learning-rate schedule and
    loss curve depend on, so it stays: the accumulation count is dropped (resolve_batch
    derives it again) and, if `auto_resume.adjust_micro_batch` allows it, the micro-batch
    is lowered to the largest that divides the global batch among the ranks. What still
    cannot be kept is reported by resolve_batch, as for any config.
    """
    resume = cfg.get("auto_resume")
    if not isinstance(resume, dict) or not resume.get("checkpoint_dir"):
        return
    train, micro = (_positive_int(cfg.get(key)) for key in BATCH_KEYS[:2])
    if train is None or micro is None:
        return
    accumulation = _positive_int(cfg.get(BATCH_KEYS[2]))
    if accumulation is not None and train == micro * accumulation * world_size:
        return
    cfg.pop(BATCH_KEYS[2], None)
    if train % (micro * world_size) and resume.get("adjust_micro_batch") is True:
        fitting = [size for size in range(micro, 0, -1) if train % (size * world_size) == 0]
        if fitting:
            cfg[BATCH_KEYS[1]] = fitting[0]


_BATCH_FILL = ("; the config says 'auto': pass auto_values={'train_micro_batch_size_per_gpu': ...} to initialize() "
               "(shardwise train fills train_batch_size from its default), or write it")


def _positive_int(value: Any) -> int | None:
    """JSON may spell an integer as a float (8.0); booleans are not integers here."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _derive_batch(
    train: int | None, micro: int | None, accumulation: int | None, world: int, label: str = "world_size"
) -> tuple[int, int, int] | str:
    """(train, micro, accumulation), or the line explaining why they cannot be had."""
    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * world:
            return (
                f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} * "
                f"gradient_accumulation_steps {accumulation} * {label} {world} = {micro * accumulation * world}"
            )
        return train, micro, accumulation
    if train is not None and micro is not None:
        if train % (micro * world):
            return (
                f"train_batch_size {train} is not divisible by train_micro_batch_size_per_gpu {micro} * "
                f"{label} {world} = {micro * world}, so gradient_accumulation_steps cannot be derived"
            )
        return train, micro, train // (micro * world)
    if train is not None:
        accumulation = accumulation or 1
        if train % (accumulation * world):
            return (
                f"train_batch_size {train} is not divisible by gradient_accumulation_steps {accumulation} * "
                f"{label} {world} = {accumulation * world}, so train_micro_batch_size_per_gpu cannot be derived"
            )
        return train, train // (accumulation * world), accumulation
    if micro is not None:
        accumulation = accumulation or 1
        return micro * accumulation * world, micro, accumulation
    return (
        "set train_batch_size or train_micro_batch_size_per_gpu (or both): "
        + ("gradient_accumulation_steps alone does not fix the batch size" if accumulation else "neither is given")
    )
