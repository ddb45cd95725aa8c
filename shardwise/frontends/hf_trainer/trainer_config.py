"""The DeepSpeed-style config a `ShardwiseTrainer` trains with, and the values its
`TrainingArguments` give the config's "auto" entries.

Hugging Face's DeepSpeed integration fills "auto" in two passes: from `TrainingArguments`
when they are created (batch sizes, accumulation, clipping, optimizer hyper-parameters,
fp16/bf16) and once the number of training steps is known (the scheduler's warm-up and
total steps). A key the config sets to a number must then equal the Trainer's value, or
training stops with the list of disagreements. The same happens here, with the same
keys, so a config written for `TrainingArguments(deepspeed=...)` trains identically.

Two differences, both because the Trainer's loop decides what happens at every
micro-batch: the batch keys may also be left out (they then take the Trainer's values:
any other value would make the engine accumulate over a different number of
micro-batches than the Trainer feeds it), and model-parallel sizes above 1 are refused
(the Trainer's data loader gives every process different samples, while tensor, sequence
and pipeline groups need the same ones).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.frontends.deepspeed.config import ConfigError

AUTO = "auto"
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
MODEL_PARALLEL_KEYS = ("tensor_parallel", "sequence_parallel", "pipeline_parallel")


@dataclass(frozen=True)
class TrainerValue:
    """The value the Trainer gives config key `key`; `argument` names where it comes from.
    `must_match`: a number written in the config must equal it (Hugging Face's fill_match);
    otherwise it only replaces "auto" (fill_only)."""

    key: str
    value: Any
    argument: str
    must_match: bool = True


def read_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A copy of the config as a dict: `source` is a dict or the path of a JSON file."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"shardwise_config must be a dict or the path of a JSON file, got {type(source).__name__}")
    path = Path(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read config file {path} as JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, not a {type(data).__name__}")
    return data


def trainer_values(args: Any, num_training_steps: int | None = None) -> list[TrainerValue]:
    """What `TrainingArguments` `args` put in the config, key by key, as Hugging Face's
    `HfTrainerDeepSpeedConfig.trainer_config_process` (and, with `num_training_steps`,
    `trainer_config_finalize`) does."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    values = [
        TrainerValue("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
        TrainerValue("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps"),
        TrainerValue("train_batch_size", args.world_size * micro * accumulation,
                     "world_size * per_device_train_batch_size * gradient_accumulation_steps"),
        TrainerValue("gradient_clipping", args.max_grad_norm, "max_grad_norm"),
        TrainerValue("optimizer.params.lr", args.learning_rate, "learning_rate"),
        TrainerValue("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]"),
        TrainerValue("optimizer.params.eps", args.adam_epsilon, "adam_epsilon"),
        TrainerValue("optimizer.params.weight_decay", args.weight_decay, "weight_decay"),
        TrainerValue("scheduler.params.warmup_min_lr", 0, "(no argument: 0)", must_match=False),
        TrainerValue("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate"),
        TrainerValue("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval"),
        TrainerValue("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval"),
        # Hugging Face leaves this "auto" in the config, which DeepSpeed reads as true.
        TrainerValue("zero_optimization.stage3_gather_16bit_weights_on_model_save", True,
                     "(no argument: DeepSpeed reads 'auto' as true)", must_match=False),
    ]
    if num_training_steps is not None:
        values += [
            TrainerValue("scheduler.params.total_num_steps", num_training_steps,
                         "max_steps (or the steps num_train_epochs makes)"),
            # DeepSpeed's schedulers refuse 0 warm-up steps; Hugging Face passes at least 1.
            TrainerValue("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                         "warmup_steps"),
        ]
    return values


def complete_batch_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The config with absent batch keys set to "auto", so they take the Trainer's values."""
    completed = copy.deepcopy(config)
    for key in BATCH_KEYS:
        completed.setdefault(key, AUTO)
    return completed


def check_config(config: dict[str, Any], values: list[TrainerValue]) -> None:
    """Raise ConfigError listing every key the config sets to a number other than the
    Trainer's, and any model-parallel size above 1."""
    problems = []
    for entry in values:
        given = _lookup(config, entry.key)
        if isinstance(given, tuple):  # a dict config may spell betas as a tuple
            given = list(given)
        if entry.must_match and given is not None and given != AUTO and given != entry.value:
            problems.append(
                f"{entry.key}: the config says {given!r} but TrainingArguments.{entry.argument} gives "
                f"{entry.value!r}; set it to \"auto\" (filled from TrainingArguments) or make them equal"
            )
    for block in MODEL_PARALLEL_KEYS:
        size = _lookup(config, f"{block}.size")
        if size not in (None, 1, AUTO):
            problems.append(
                f"{block}.size: {size!r} is not supported by ShardwiseTrainer: the Trainer's data loader gives "
                "every process different samples, while a model-parallel group needs the same ones; "
                "remove the block (data parallel + ZeRO only), or train with shardwise.initialize"
            )
    if problems:
        raise ConfigError(problems)


def auto_values(values: list[TrainerValue]) -> dict[str, Any]:
    """The dotted-key mapping `shardwise.initialize(auto_values=...)` fills "auto" from."""
    return {entry.key: entry.value for entry in values}


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
