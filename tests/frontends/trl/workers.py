"""Training runs shared by the TRL tests: each TRL trainer as TRL ships it in one process
(the reference), and the class `shardwise_trainer` makes of it on each rank, on the same
data and the same global batches.

The data are synthetic and the tokenizer is a word-level one built in memory ("t0".."t61"
plus <pad> and <eos>), so nothing is downloaded. Every sequence of a dataset has the same
length, so padding never depends on which samples share a micro-batch. Both runs read
the samples in order: the reference takes `GLOBAL_MICRO` samples per micro-batch, and
accelerate deals the ranks' `GLOBAL_MICRO / world` sample batches out in turn, so every
update sees the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB = 64
SAMPLES = 16
GLOBAL_MICRO = 4
ACCUMULATION = 2
LR = 1e-2
ADAM_EPS = 1e-4  # see tests/runtime/zero/workers.py: a smaller eps turns last-bit differences into failures
# Logged values that pass through a discontinuous op (argmax, a comparison), so a last-bit
# difference between two correct runs can flip them: compared only as being logged.
DISCONTINUOUS = {"mean_token_accuracy", "rewards/accuracies", "accuracy"}
# Logged values that are not the training's numbers.
NOT_COMPARED = {"epoch", "step", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                "total_flos", "train_loss"}


@dataclass(frozen=True)
class Run:
    out_dir: str
    trainer: str  # "sft", "dpo", "reward"
    stage: int = 2
    epochs: int = 2


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(VOCAB - 2)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def _words(generator: torch.Generator, count: int, length: int) -> list[str]:
    tokens = torch.randint(0, VOCAB - 2, (count, length), generator=generator)
    return [" ".join(f"t{int(token)}" for token in row) for row in tokens]


def dataset(kind: str):
    """SFT: plain text; DPO and reward: a prompt with a chosen and a rejected completion."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    if kind == "sft":
        return Dataset.from_dict({"text": _words(generator, SAMPLES, 10)})
    prompts = _words(generator, SAMPLES, 4)
    chosen = [" " + text for text in _words(generator, SAMPLES, 5)]
    rejected = [" " + text for text in _words(generator, SAMPLES, 5)]
    if kind == "reward":  # RewardTrainer: the whole texts, implicit prompt
        return Dataset.from_dict({"chosen": [p + c for p, c in zip(prompts, chosen)],
                                  "rejected": [p + r for p, r in zip(prompts, rejected)]})
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def build_model(kind: str, seed: int = 1234):
    """Random-init tiny Llama (a scalar-head classifier for the reward model), identical on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=kind != "reward", pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         num_labels=1)
    return (LlamaForSequenceClassification if kind == "reward" else LlamaForCausalLM)(config)


def trainer_class(kind: str):
    from trl import DPOTrainer, RewardTrainer, SFTTrainer

    return {"sft": SFTTrainer, "dpo": DPOTrainer, "reward": RewardTrainer}[kind]


def arguments(run: Run, world_size: int, **extra):
    from trl import DPOConfig, RewardConfig, SFTConfig

    config_class = {"sft": SFTConfig, "dpo": DPOConfig, "reward": RewardConfig}[run.trainer]
    return config_class(
        output_dir=run.out_dir, per_device_train_batch_size=GLOBAL_MICRO // world_size,
        gradient_accumulation_steps=ACCUMULATION, num_train_epochs=run.epochs, learning_rate=LR,
        adam_epsilon=ADAM_EPS, weight_decay=0.01, warmup_steps=0, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", train_sampling_strategy="sequential", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=world_size > 1 and not torch.cuda.is_available(),  # accelerate's switch for several CPU processes
        dataset_num_proc=None, bf16=False, **extra,
    )


def hf_style_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:  # every parameter of the tiny models partitioned (the default threshold would keep them all whole)
        zero.update(stage3_gather_16bit_weights_on_model_save="auto", stage3_param_persistence_threshold=0)
    return {"zero_optimization": zero, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"}}


def logged(trainer) -> dict[int, dict[str, float]]:
    """Per step, every number the trainer logged during training."""
    return {entry["step"]: {key: value for key, value in entry.items() if isinstance(value, (int, float))}
            for entry in trainer.state.log_history if "loss" in entry}


def probe_ref_logps(trainer) -> list[torch.Tensor]:
    """DPO's reference log-probabilities of the first 4 pairs, through `trainer.ref_model`."""
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(4)])
    device = getattr(trainer.ref_model, "device", torch.device("cpu"))
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    return [values.detach().cpu() for values in trainer.compute_ref_log_probs(trainer.ref_model, batch)]


def _make(kind: str, cls, args, **extra):
    models = {"model": build_model(kind)}
    if kind == "dpo":
        models["ref_model"] = build_model(kind, seed=99)  # a reference that differs from the policy
    return cls(**models, args=args, train_dataset=dataset(kind), processing_class=tokenizer(), **extra)


def train_reference(rank: int, world_size: int, run: Run) -> dict:
    """The TRL trainer as shipped, in one process, the micro-batches of all ranks at once."""
    trainer = _make(run.trainer, trainer_class(run.trainer), arguments(run, 1))
    result = {}
    if run.trainer == "dpo":
        result["ref_logps_before"] = probe_ref_logps(trainer)
    trainer.train()
    result["logs"] = logged(trainer)
    return result


def train_shardwise(rank: int, world_size: int, run: Run) -> dict:
    """The same trainer made by `shardwise_trainer`, on this rank; the one-line change."""
    from shardwise.frontends.trl.trainers import shardwise_trainer

    trainer = _make(run.trainer, shardwise_trainer(trainer_class(run.trainer)), arguments(run, world_size),
                    shardwise_config=hf_style_config(run.stage))
    result = {}
    if run.trainer == "dpo":
        result["ref_logps_before"] = probe_ref_logps(trainer)
        result["ref_is_engine"] = type(trainer.ref_model).__name__
    trainer.train()
    result.update(logs=logged(trainer), stage=trainer.engine.stage, world_size=trainer.engine.world_size)
    return result
