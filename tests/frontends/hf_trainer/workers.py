"""Training runs shared by the ShardwiseTrainer tests: plain `transformers.Trainer` in one
process (the reference) and `ShardwiseTrainer` on each rank, on the same data.

Both see the same global batches: the samples are read in order (sequential sampler),
the reference takes `world * micro` samples per micro-batch, and accelerate deals the
`micro`-sample batches of the distributed run out to the ranks in turn, so each window
holds the same samples. 20 samples in micro-batches of 4 make 5 per epoch: with
accumulation 2, every epoch ends with a short window of one micro-batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SEQ_LEN = 16
VOCAB = 64
SAMPLES = 20
LR = 1e-2


@dataclass(frozen=True)
class Run:
    """One training run. `micro`: samples per rank per micro-batch; `global_micro`: per
    micro-batch over all ranks (what the 1-process reference uses as its micro-batch)."""

    out_dir: str
    stage: int = 2
    global_micro: int = 4
    accumulation: int = 2
    epochs: int = 2
    save_steps: int = 2
    eval_steps: int = 3
    resume: str | None = None
    activation_checkpointing: bool = False
    load_best: bool = False  # evaluate at every save and end with the best checkpoint's model
    deepspeed_argument: bool = False  # the config as TrainingArguments(deepspeed=...) (needs DeepSpeed installed)
    # The loss as a per-micro-batch mean, which the Trainer divides by the window's length,
    # instead of normalised by the window's token count (num_items_in_batch).
    mean_loss: bool = False
    config: dict = field(default_factory=dict)  # laid over the HF-style config
    lora: bool = False  # a PEFT LoRA model: only the adapters train

    def micro(self, world_size: int) -> int:
        return self.global_micro // world_size


def hf_style_config(stage: int) -> dict:
    """The shape of Hugging Face's ds_config_zero{2,3}.json: everything the Trainer knows is "auto"."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": "auto"})
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


class TokenDataset(torch.utils.data.Dataset):
    """Random tokens, the same on every rank; the model shifts the labels itself."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def build_model(mean_loss: bool = False, lora: bool = False):
    """Random-init tiny Llama, identical on every rank; nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=True,
    ))
    if mean_loss:
        model.accepts_loss_kwargs = False  # what the Trainer reads to pass num_items_in_batch or not
    if lora:  # a PEFT model: LoRA on every projection, the rest frozen
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(4321)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 init_lora_weights="gaussian"))
    return model


def probe_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))


def arguments(run: Run, world_size: int, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=run.out_dir, per_device_train_batch_size=run.micro(world_size),
        per_device_eval_batch_size=run.micro(world_size), gradient_accumulation_steps=run.accumulation,
        num_train_epochs=run.epochs, learning_rate=LR, weight_decay=0.01, warmup_steps=2,
        logging_steps=1, eval_strategy="steps", eval_steps=run.save_steps if run.load_best else run.eval_steps,
        save_strategy="steps", save_steps=run.save_steps, load_best_model_at_end=run.load_best,
        train_sampling_strategy="sequential", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=world_size > 1 and not torch.cuda.is_available(),  # accelerate's switch for several CPU processes
        **extra,
    )


def history(trainer) -> dict:
    """Per step: training loss, lr and grad norm; eval losses; the final train_loss."""
    logs = trainer.state.log_history
    steps = {entry["step"]: entry for entry in logs if "loss" in entry}
    return {
        "loss": {step: entry["loss"] for step, entry in steps.items()},
        "learning_rate": {step: entry["learning_rate"] for step, entry in steps.items()},
        "grad_norm": {step: entry["grad_norm"] for step, entry in steps.items()},
        "eval_loss": {entry["step"]: entry["eval_loss"] for entry in logs if "eval_loss" in entry},
        "best_checkpoint": trainer.state.best_model_checkpoint,
    }


def train_reference(rank: int, world_size: int, run: Run) -> dict:
    """Plain transformers.Trainer in one process (world_size 1), the micro-batches of all ranks at once."""
    from transformers import Trainer

    model = build_model(lora=run.lora)
    trainer = Trainer(model=model, args=arguments(run, 1), train_dataset=TokenDataset(SAMPLES, 0),
                      eval_dataset=TokenDataset(8, 1))
    trainer.train(resume_from_checkpoint=run.resume)
    with torch.no_grad():
        logits = model(input_ids=probe_batch()).logits
    return {**history(trainer), "logits": logits, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def train_shardwise(rank: int, world_size: int, run: Run) -> dict:
    """ShardwiseTrainer on this rank; then save_model (final weights, HF format)."""
    from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer

    config = hf_style_config(run.stage)
    for key, value in run.config.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    model = build_model(run.mean_loss, run.lora)
    if run.activation_checkpointing:  # the model's own recomputation (newer releases renamed the method)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if run.deepspeed_argument:  # the one-line switch: only Trainer -> ShardwiseTrainer changes
        given = {"args": arguments(run, world_size, deepspeed=config)}
    else:
        given = {"args": arguments(run, world_size), "shardwise_config": config}
    trainer = ShardwiseTrainer(model=model, train_dataset=TokenDataset(SAMPLES, 0), eval_dataset=TokenDataset(8, 1),
                               **given)
    trainer.train(resume_from_checkpoint=run.resume)
    final = os.path.join(run.out_dir, "final")
    trainer.save_model(final)
    trainer.engine.eval()
    with torch.no_grad():
        logits = trainer.engine(input_ids=probe_batch().to(trainer.engine.device)).logits.cpu()
    result = {**history(trainer), "logits": logits, "stage": trainer.engine.stage,
              "world_size": trainer.engine.world_size, "recomputes": model.is_gradient_checkpointing}
    if rank == 0:
        result["config"] = json.loads(trainer.engine.config.model_dump_json())
    return result


# Hugging Face's ds_config_zero2.json shape: the optimizer and scheduler come from the config.
CONFIG_BLOCKS = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def train_reference_with_blocks(rank: int, world_size: int, run: Run) -> dict:
    """Plain Trainer given what CONFIG_BLOCKS describe with the Trainer's values: AdamW
    over every parameter (DeepSpeed decays all of them) and DeepSpeed's WarmupDecayLR."""
    from transformers import Trainer

    from shardwise.runtime.optim.schedulers import WarmupDecayLR

    model = build_model(run.mean_loss)
    args = arguments(run, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=args.weight_decay)
    total = 6  # 2 epochs of 3 updates
    scheduler = WarmupDecayLR(optimizer, total_num_steps=total, warmup_min_lr=0, warmup_max_lr=LR,
                              warmup_num_steps=args.get_warmup_steps(total))
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(SAMPLES, 0),
                      eval_dataset=TokenDataset(8, 1), optimizers=(optimizer, scheduler))
    trainer.train()
    return history(trainer)


def refusals(rank: int, world_size: int, out_dir: str) -> dict:
    """The messages ShardwiseTrainer stops with, for each misuse (key: the misuse)."""
    from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer

    run = Run(out_dir=out_dir)
    data = TokenDataset(SAMPLES, 0)
    config = hf_style_config(2)
    messages = {}

    def attempt(name: str, **kwargs) -> None:
        if "args" not in kwargs:  # built only when needed: each TrainingArguments sets accelerate's process state
            kwargs["args"] = arguments(run, world_size)
        try:
            ShardwiseTrainer(model=build_model(), train_dataset=data, eval_dataset=data, **kwargs)
        except (ValueError, TypeError) as error:
            messages[name] = str(error)

    if world_size > 1:
        from transformers import TrainingArguments

        attempt("cpu processes", shardwise_config=config, args=TrainingArguments(output_dir=out_dir, use_cpu=False))
        return messages
    attempt("no config")
    attempt("accumulation mismatch", shardwise_config={**config, "gradient_accumulation_steps": 4})
    attempt("tensor parallel", shardwise_config={**config, "tensor_parallel": {"size": 2}})
    attempt("optimizer twice", shardwise_config={**config, **CONFIG_BLOCKS},
            optimizers=(torch.optim.SGD(build_model().parameters(), lr=0.1), None))
    with_deepspeed = arguments(run, world_size)
    with_deepspeed.deepspeed = config  # as TrainingArguments(deepspeed=...) leaves it where DeepSpeed is installed
    attempt("both configs", shardwise_config=config, args=with_deepspeed)
    return messages


def train_from_deepspeed_argument(rank: int, world_size: int, out_dir: str) -> dict:
    """TrainingArguments.deepspeed, read when shardwise_config is not given: one update."""
    from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer

    args = arguments(Run(out_dir=out_dir), world_size)
    args.max_steps = 1
    args.deepspeed = hf_style_config(3)  # as TrainingArguments(deepspeed=...) leaves it where DeepSpeed is installed
    trainer = ShardwiseTrainer(model=build_model(), args=args, train_dataset=TokenDataset(SAMPLES, 0),
                               eval_dataset=TokenDataset(8, 1))
    trainer.train()
    return {"stage": trainer.engine.stage, "deepspeed_left": args.deepspeed, "loss": history(trainer)["loss"]}
