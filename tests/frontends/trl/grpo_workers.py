"""GRPO runs shared by tests/frontends/trl/test_grpo.py: TRL's GRPOTrainer as TRL ships
it under plain DDP (the reference), and the class `shardwise_trainer` makes of it, each on
2 ranks, from the same saved tiny Llama, prompts and seeds.

Generation samples (temperature 1), so completions are equal in both runs only when the
policy's weights are equal to the bit: a sampled token flips where a last-bit difference
moves a probability across the uniform draw. So the runs generate once, from the
initial weights (identical in both), and then train `ITERATIONS` optimizer steps on that
one generation batch (GRPO's `num_iterations`), which also exercises the clipped ratio to
the old policy. Each rank of both runs generates the same prompts with the same random
state, so the completions, rewards and advantages are equal exactly, and the losses to
the fp32 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.frontends.trl.workers import ADAM_EPS, LR, VOCAB, _words, build_model, hf_style_config, logged, tokenizer

WORLD = 2
PROMPTS = 8
PER_DEVICE_BATCH = 2
ACCUMULATION = 2
NUM_GENERATIONS = 4  # completions per prompt; a generation batch is 2 * 2 * 2 = 8 = two prompts' groups
COMPLETION_LENGTH = 6
ITERATIONS = 3  # optimizer steps on the one generation batch
BETA = 0.04  # > 0: TRL keeps a reference model, a forward-only engine under shardwise
# Logged values that count comparisons (clipped ratios): a last-bit difference can flip them.
DISCONTINUOUS = {"clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                 "clip_ratio/region_mean"}
NOT_COMPARED = {"epoch", "step", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                "total_flos", "train_loss", "step_time"}


@dataclass(frozen=True)
class GrpoRun:
    out_dir: str
    model_dir: str  # the saved tiny Llama: GRPOTrainer loads its reference model from the policy's path
    stage: int = 3


def save_policy(model_dir: str) -> None:
    """The random-init tiny Llama, saved where both runs load policy and reference from."""
    build_model("sft").save_pretrained(model_dir)


def prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": _words(torch.Generator().manual_seed(0), PROMPTS, 4)})


def token_reward(completions: list[str], **kwargs) -> list[float]:
    """A plain Python reward: the completion's mean token number, over the vocabulary."""
    rewards = []
    for completion in completions:
        numbers = [int(word[1:]) for word in completion.split() if word.startswith("t")]
        rewards.append(sum(numbers) / (VOCAB * COMPLETION_LENGTH))
    return rewards


def arguments(run: GrpoRun, **changes):
    """`changes`: GRPOConfig arguments that replace these (a DeepSpeed launch's `deepspeed`, `use_cpu`)."""
    from trl import GRPOConfig

    settings = dict(
        output_dir=run.out_dir, per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=ACCUMULATION, num_generations=NUM_GENERATIONS,
        max_completion_length=COMPLETION_LENGTH, num_iterations=ITERATIONS, max_steps=ITERATIONS, beta=BETA,
        temperature=1.0, learning_rate=LR, adam_epsilon=ADAM_EPS, weight_decay=0.01, warmup_steps=0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available(), bf16=False, shuffle_dataset=False,
    )
    return GRPOConfig(**{**settings, **changes})


def record_generations(trainer, record: dict) -> None:
    """Wrap this trainer's generation: keep its completions and, on shardwise, the bytes
    the engine all-gathered while generating."""
    generate = trainer._generate_single_turn

    def recorded(*args, **kwargs):
        engine = getattr(trainer, "engine", None)
        before = engine.comm_volume()["all_gather"] if engine is not None else 0
        completion_ids, logprobs = generate(*args, **kwargs)
        if engine is not None:
            record["generation_gather_bytes"].append(engine.comm_volume()["all_gather"] - before)
        record["completions"].append([list(ids) for ids in completion_ids])
        return completion_ids, logprobs

    record.update(completions=[], generation_gather_bytes=[])
    trainer._generate_single_turn = recorded


def per_token_gather_bytes(trainer, new_tokens: int) -> int:
    """Bytes all-gathered by a generation of exactly `new_tokens` tokens outside
    `ds3_gather_for_generation`'s block: each forward gathers the layers itself."""
    engine = trainer.engine
    ids = torch.tensor([[5, 6, 7, 8]])
    before = engine.comm_volume()["all_gather"]
    with torch.no_grad():
        engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return engine.comm_volume()["all_gather"] - before


def _make(cls, run: GrpoRun, **extra):
    return cls(model=run.model_dir, reward_funcs=token_reward, args=arguments(run), train_dataset=prompts(),
               processing_class=tokenizer(), **extra)


def train_reference(rank: int, world_size: int, run: GrpoRun) -> dict:
    """TRL's GRPOTrainer as shipped, under plain DDP."""
    from trl import GRPOTrainer

    trainer = _make(GRPOTrainer, run)
    result: dict = {}
    record_generations(trainer, result)
    trainer.train()
    result["logs"] = logged(trainer)
    return result


def train_shardwise(rank: int, world_size: int, run: GrpoRun) -> dict:
    """The same trainer made by `shardwise_trainer`; the one-line change."""
    from trl import GRPOTrainer

    from shardwise.frontends.trl.trainers import shardwise_trainer

    trainer = _make(shardwise_trainer(GRPOTrainer), run, shardwise_config=hf_style_config(run.stage))
    result: dict = {"ref_is_engine": type(trainer.ref_model).__name__}
    record_generations(trainer, result)
    trainer.train()
    engine = trainer.engine
    result.update(logs=logged(trainer), stage=engine.stage, world_size=engine.world_size,
                  padded_params=engine.num_parameters() + engine.padding_elements(),
                  persistent_params=engine.persistent_numel() if run.stage == 3 else 0)
    if run.stage == 3:
        result["per_token_gather_bytes"] = {tokens: per_token_gather_bytes(trainer, tokens) for tokens in (1, 3)}
    return result
