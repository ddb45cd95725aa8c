"""ShardwiseTrainer trains like plain transformers.Trainer (C27).

A random-init tiny Llama is fine-tuned with an HF-style "auto" config on 2 ranks at ZeRO
stages 0-3 (accumulation 2, every epoch ending in a short window, gradient clipping,
warm-up, weight decay groups, evaluation every 3 steps, a checkpoint every 2): the logged
losses, learning rates, gradient norms and eval losses equal those of the Trainer without
DeepSpeed in one process on the same batches (fp32, relative error < 1e-5), with the loss
normalised by the window's token count (num_items_in_batch) or, with the config's own
optimizer and scheduler blocks, divided by the window's length. Checkpoints
resume with the same losses at the same world size and from 2 ranks on 1; `save_model`
writes weights that `from_pretrained` loads with the reference's final weights and the
engine's logits.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

import shardwise.frontends.hf_trainer.trainer  # noqa: F401  (preloaded by the ranks' fork server)
from shardwise.tools.testing import run_distributed
from tests.frontends.hf_trainer.workers import (
    CONFIG_BLOCKS,
    LR,
    Run,
    probe_batch,
    train_reference,
    train_reference_with_blocks,
    train_shardwise,
)

TOLERANCE = 1e-5
STEPS = list(range(1, 7))  # 2 epochs of 3 updates (windows of 2, 2 and 1 micro-batches)


class Runs:
    """Each training run once per module, on demand, under one temporary directory."""

    def __init__(self, root):
        self.root = root
        self.done: dict[str, object] = {}

    def get(self, name: str, fn, world_size: int, **run) -> list[dict]:
        if name not in self.done:
            self.done[name] = run_distributed(fn, world_size, Run(out_dir=str(self.root / name), **run), timeout=240)
        return self.done[name]

    def reference(self) -> dict:
        return self.get("reference", train_reference, 1)[0]

    def shardwise(self, stage: int) -> list[dict]:
        # Stage 3 also recomputes activations (the model's own gradient checkpointing).
        return self.get(f"stage{stage}", train_shardwise, 2, stage=stage, activation_checkpointing=stage == 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("hf_trainer"))


def assert_logs_match(got: dict, want: dict, steps: list[int]) -> None:
    for key in ("loss", "learning_rate", "grad_norm"):
        assert set(steps) <= set(got[key]), f"{key} logged at steps {sorted(got[key])}, expected {steps}"
        for step in steps:
            a, b = got[key][step], want[key][step]
            assert abs(a - b) <= TOLERANCE * max(abs(a), abs(b)), f"step {step} {key}: {a} vs reference {b}"
    for step, value in got["eval_loss"].items():
        want_value = want["eval_loss"][step]
        assert abs(value - want_value) <= TOLERANCE * abs(want_value), f"step {step} eval_loss {value} vs {want_value}"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_losses_equal_plain_trainer(runs, stage):
    reference = runs.reference()
    assert sorted(reference["eval_loss"]) == [3, 6]
    for result in runs.shardwise(stage):
        assert (result["stage"], result["world_size"], result["recomputes"]) == (stage, 2, stage == 3)
        assert sorted(result["loss"]) == STEPS
        assert_logs_match(result, reference, STEPS)
        assert sorted(result["eval_loss"]) == [3, 6]


def test_windows_the_caller_ends_follow_the_trainers_windows(runs):
    """managed_gradient_accumulation false (every step() ends the window): the Trainer's
    own window ends step, its short last windows included, as with the engine's count."""
    reference = runs.reference()
    for result in runs.get("unmanaged", train_shardwise, 2, stage=2,
                           config={"managed_gradient_accumulation": False}):
        assert_logs_match(result, reference, STEPS)


def test_lora_at_stage_3_with_recomputation_equals_plain_trainer(runs):
    """PEFT's shape (frozen base layers, trainable adapters): ZeRO-3 partitions the frozen
    weights too; the Trainer's optimizer holds only the adapters."""
    reference = runs.get("lora_reference", train_reference, 1, lora=True)[0]
    for result in runs.get("lora_stage3", train_shardwise, 2, stage=3, lora=True, activation_checkpointing=True):
        assert_logs_match(result, reference, STEPS)
        assert relative_error(result["logits"], reference["logits"]) < TOLERANCE


BLOCKS = dict(load_best=True, mean_loss=True)  # and the Trainer divides each loss by the window's length


def test_optimizer_and_scheduler_from_the_config(runs):
    """Hugging Face's ds_config_zero2.json shape: AdamW and WarmupDecayLR blocks, all "auto"."""
    reference = runs.get("blocks_reference", train_reference_with_blocks, 1, **BLOCKS)[0]
    results = runs.get("blocks_stage2", train_shardwise, 2, stage=2, config=CONFIG_BLOCKS, **BLOCKS)
    for result in results:
        assert_logs_match(result, reference, STEPS)
        assert sorted(result["eval_loss"]) == [2, 4, 6]
    params = results[0]["config"]["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"], params["warmup_max_lr"]) == (6, 2, LR)
    assert results[0]["config"]["optimizer"]["params"]["weight_decay"] == 0.01


def test_load_best_model_at_end_loads_the_best_checkpoint(runs):
    """The engine ends with the weights of the checkpoint with the lowest eval loss (here
    not the last one: the tiny model overfits its 20 samples)."""
    from transformers import LlamaForCausalLM

    reference = runs.get("blocks_reference", train_reference_with_blocks, 1, **BLOCKS)[0]
    result = runs.get("blocks_stage2", train_shardwise, 2, stage=2, config=CONFIG_BLOCKS, **BLOCKS)[0]
    best_step = min(reference["eval_loss"], key=reference["eval_loss"].get)
    assert best_step != 6, "the test needs a best checkpoint before the end"
    assert result["best_checkpoint"].endswith(f"checkpoint-{best_step}")
    best = LlamaForCausalLM.from_pretrained(result["best_checkpoint"])
    with torch.no_grad():
        logits = best(input_ids=probe_batch()).logits
    assert relative_error(result["logits"], logits) < TOLERANCE


def test_training_arguments_deepspeed_trains_the_same(runs):
    """Where DeepSpeed is installed, TrainingArguments(deepspeed=config) can be created, and
    ShardwiseTrainer takes the config over from it (accelerate stays a plain one)."""
    try:  # transformers checks DeepSpeed's installed distribution, not an importable module of that name
        importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("DeepSpeed is not installed (TrainingArguments(deepspeed=...) requires its distribution)")
    results = runs.get("deepspeed_argument", train_shardwise, 2, stage=3, deepspeed_argument=True)
    for result in results:
        assert (result["stage"], result["world_size"]) == (3, 2)
        assert_logs_match(result, runs.reference(), STEPS)


def test_auto_config_filled_from_training_arguments(runs):
    config = runs.shardwise(3)[0]["config"]
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)
    assert config["train_batch_size"] == 8
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # hidden_size squared, as HF fills it
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 32
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_round_trip(runs, stage):
    """save_model -> from_pretrained: the reference's final weights (gathered from the
    ZeRO-3 shards) and the engine's own logits."""
    from transformers import LlamaForCausalLM

    reference = runs.reference()
    engine_logits = runs.shardwise(stage)[0]["logits"]
    loaded = LlamaForCausalLM.from_pretrained(str(runs.root / f"stage{stage}" / "final"))
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    weights = loaded.state_dict()
    assert set(weights) == set(reference["weights"])
    for name, want in reference["weights"].items():
        assert relative_error(weights[name], want) < TOLERANCE, name
    assert not torch.allclose(weights["model.norm.weight"], torch.ones(32))  # trained (initialised to ones)
    with torch.no_grad():
        logits = loaded(input_ids=probe_batch()).logits
    assert relative_error(logits, engine_logits) < TOLERANCE
    assert relative_error(logits, reference["logits"]) < TOLERANCE


def test_checkpoint_folder_holds_trainer_and_engine_state(runs):
    runs.shardwise(3)
    folder = runs.root / "stage3" / "checkpoint-4"
    names = set(os.listdir(folder))
    assert {"model.safetensors", "config.json", "trainer_state.json", "latest", "global_step4"} <= names
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= names
    assert (folder / "latest").read_text().strip() == "global_step4"


def test_resume_at_the_same_world_size_continues_the_losses(runs):
    """Stage 2, 2 ranks, from step 2 (inside the first epoch: 4 micro-batches skipped)."""
    runs.shardwise(2)
    checkpoint = str(runs.root / "stage2" / "checkpoint-2")
    resumed = runs.get("resume2", train_shardwise, 2, stage=2, resume=checkpoint)
    for result in resumed:
        assert_logs_match(result, runs.reference(), STEPS[2:])


def test_resume_from_two_ranks_on_one_continues_the_losses(runs):
    """Stage 3 checkpoint of 2 ranks, resharded onto 1 rank (its micro-batch holds both
    ranks' samples), from step 4 (one micro-batch into the second epoch)."""
    runs.shardwise(3)
    checkpoint = str(runs.root / "stage3" / "checkpoint-4")
    (result,) = runs.get("resume3_on_1", train_shardwise, 1, stage=3, resume=checkpoint)
    assert result["world_size"] == 1
    assert_logs_match(result, runs.reference(), STEPS[4:])
    assert relative_error(result["logits"], runs.reference()["logits"]) < TOLERANCE
