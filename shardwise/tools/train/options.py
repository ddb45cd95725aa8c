"""What one `shardwise train` run is: the model, the steps, the DeepSpeed config, the paths.

The parent process builds a `TrainOptions` from the command line and writes it into the
run directory as `options.json`; every rank reads it back. One file rather than a long
command line keeps the ranks' arguments identical by construction and documents the
run next to its results.

The default config is tuned for the main job: ≈2 minutes on two CPU cores with the loss
falling visibly. A user's `--config` is laid over it (see `merge_config`), then flags
over that.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardwise.runtime.optim.registry import optimizer_spec, optimizer_specs

# The names of GPTConfig.preset, repeated so that `shardwise --help` need not import the models.
MODEL_SIZES = ("tiny", "1m", "10m", "25m", "100m")
DEFAULT_MODEL_SIZE = "10m"
DEFAULT_STAGE = 3
DEFAULT_STEPS = 200
DEFAULT_COMPARE_STEPS = 3
DEFAULT_SEQ_LEN = 128
DEFAULT_GLOBAL_BATCH = 8
DEFAULT_LR = 2e-3
DEFAULT_SEED = 1234
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 200
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Blocks a user's config replaces whole: merging an SGD block into the default AdamW one
# would hand SGD Adam's betas.
REPLACED_BLOCKS = ("optimizer", "scheduler")
# `--optimizer NAME`: any registered optimizer, in lower case, with settings for this job
# (BENCHMARKS.md, optimizer convergence): AdamW's below, adjusted by its registry entry
# (`OptimizerSpec.main_job_params`).
DEFAULT_OPTIMIZER_PARAMS = {"lr": DEFAULT_LR, "betas": [0.9, 0.95], "weight_decay": 0.1}
# `--activation-checkpointing POLICY`: the config's activation_checkpointing.policy
# (shardwise/runtime/activation/policy.py's names, repeated so that --help need not import it).
RECOMPUTE_POLICIES = ("none", "full", "every_k", "selective", "sqrt")


@dataclass
class TrainOptions:
    """Everything a rank needs to run its part of the job."""

    run_dir: str
    corpus_path: str
    config: dict[str, Any]
    model_size: str = DEFAULT_MODEL_SIZE
    steps: int = DEFAULT_STEPS
    seq_len: int = DEFAULT_SEQ_LEN
    seed: int = DEFAULT_SEED
    profile: bool = False
    compare_stages: bool = False
    save_every: int | None = None  # optimizer steps between checkpoints; None: only the final one
    resume_tag: str | None = None  # continue from this checkpoint of the run (`--resume`); None: a new run
    moe_experts: int = 0  # experts of each MoE block (GPTConfig.moe_experts); 0: a dense GPT
    moe_top_k: int = 1
    moe_every: int = 1
    ep_size: int = 1  # expert-parallel size (GPTConfig.moe_ep_size)
    sample_prompt: str = SAMPLE_PROMPT
    sample_tokens: int = SAMPLE_TOKENS

    @property
    def path(self) -> Path:
        return Path(self.run_dir)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainOptions":
        return cls(**json.loads(Path(path).read_text()))


def default_config(steps: int, stage: int = DEFAULT_STAGE) -> dict[str, Any]:
    """The main job's DeepSpeed config.

    Bucket sizes and the stage-3 persistence threshold are "auto", i.e. scaled to the
    model's hidden size as Hugging Face's integration does; DeepSpeed's fixed defaults
    (500M-element buckets, 100k-element persistence) would make a 10M model one bucket
    and mostly persistent. `stage3_max_reuse_distance` 0 releases every gathered layer
    after use, as ZeRO-3 does for models that do not fit: with DeepSpeed's default
    (1e9 elements) a small model would stay gathered for the whole step.
    """
    return {
        "train_batch_size": DEFAULT_GLOBAL_BATCH,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": copy.deepcopy(DEFAULT_OPTIMIZER_PARAMS)},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": steps,
                "warmup_num_steps": max(1, steps // 10),
                "warmup_min_ratio": 0.1,
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_reuse_distance": 0,
        },
    }


def optimizer_names() -> list[str]:
    """`--optimizer`'s choices: the registered optimizers, lower case, in the registry's order."""
    return [spec.name.lower() for spec in optimizer_specs()]


def optimizer_block(name: str, steps: int) -> dict[str, Any]:
    """The config's optimizer block for `--optimizer NAME` in a run of `steps` steps."""
    try:
        spec = optimizer_spec(name, any_case=True)
    except ValueError:
        raise ValueError(f"--optimizer {name!r} is not one of {', '.join(optimizer_names())}") from None
    params = spec.params_for_main_job(copy.deepcopy(DEFAULT_OPTIMIZER_PARAMS), steps)
    return {"type": spec.name, "params": copy.deepcopy(params)}


def optimizer_stage(name: str) -> int | None:
    """The ZeRO stage `--optimizer NAME` needs when neither --stage nor the config sets one:
    None where it runs at the default stage, else the highest it runs at (1-bit Adam /
    LAMB: 2)."""
    stages = optimizer_spec(name, any_case=True).zero_stages
    return None if DEFAULT_STAGE in stages else max(stages)


def merge_config(defaults: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """`user` laid over `defaults`: sections merge key by key, except that the user's
    optimizer or scheduler block replaces the default one, and any batch key the user sets
    replaces all default batch keys (so theirs cannot contradict ours)."""
    merged = copy.deepcopy(defaults)
    if any(key in user for key in BATCH_KEYS):
        for key in BATCH_KEYS:
            merged.pop(key, None)
    for key, value in user.items():
        if key not in REPLACED_BLOCKS and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def auto_values(steps: int, lr: float | None) -> dict[str, Any]:
    """What `shardwise train` fills a user config's "auto" entries with, as Hugging Face's
    Trainer fills them from its arguments: its learning rate, step counts and batch."""
    return {
        "optimizer.params.lr": lr or DEFAULT_LR,
        "optimizer.params.betas": [0.9, 0.95],
        "optimizer.params.weight_decay": 0.1,
        "scheduler.params.total_num_steps": steps,
        "scheduler.params.total_num_iters": steps,
        "scheduler.params.warmup_num_steps": max(1, steps // 10),
        "train_batch_size": DEFAULT_GLOBAL_BATCH,
    }


def apply_flags(config: dict[str, Any], stage: int | None, bf16: bool, seed: int, *,
                lr: float | None = None, compile_blocks: bool = False,
                optimizer: dict[str, Any] | None = None, recompute: str | None = None) -> dict[str, Any]:
    """Command-line flags win over the config file (`optimizer`: the block `--optimizer`
    chose, replacing the config's; `--lr` then sets its learning rate; `recompute`: the
    activation_checkpointing policy, the block's other keys kept)."""
    config = copy.deepcopy(config)
    if optimizer is not None:
        config["optimizer"] = copy.deepcopy(optimizer)
    if recompute is not None:
        config.setdefault("activation_checkpointing", {})["policy"] = recompute
    if compile_blocks:
        config.setdefault("compile", {})["enabled"] = True
    if stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = stage
    if lr is not None and isinstance(config.get("optimizer"), dict):
        config["optimizer"].setdefault("params", {})["lr"] = lr
    if bf16:
        config.setdefault("bf16", {})["enabled"] = True
    config["seed"] = seed
    return config


def dtype_name(config: dict[str, Any]) -> str:
    """The training dtype a (merged, unresolved) config selects."""
    if config.get("bf16", {}).get("enabled") is True:
        return "bf16"
    if config.get("fp16", {}).get("enabled") is True:
        return "fp16"
    return "fp32"
