"""Fine-tune a causal language model with Hugging Face's Trainer on shardwise's ZeRO.

    shardwise run --nproc 2 examples/hf_trainer.py --stage 3       # 2 CPU processes (gloo), nothing downloaded
    torchrun --nproc-per-node 8 examples/hf_trainer.py --model meta-llama/Llama-3.2-1B --bf16 --stage 3

The switch from DeepSpeed is one line: `Trainer(..., args=TrainingArguments(deepspeed=cfg))`
becomes `ShardwiseTrainer(..., shardwise_config=cfg)` (a `TrainingArguments(deepspeed=cfg)`
is read too, where DeepSpeed is installed). The config below is Hugging Face's ZeRO
template: every "auto" is filled from TrainingArguments. Logging, evaluation, checkpoints
(`--resume` continues from the last one, at any number of processes), `save_model` and
the progress bar are the Trainer's own.

Without `--model`, a randomly initialised tiny Llama learns the bytes of a few Python
standard-library files (vocabulary 256), so the example runs offline in a minute on CPU.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

from shardwise.frontends.hf_trainer.trainer import ShardwiseTrainer

STDLIB_FILES = ("textwrap.py", "shlex.py", "fractions.py", "difflib.py")


def ds_config(stage: int) -> dict:
    """Hugging Face's ds_config_zero2.json / ds_config_zero3.json."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


class ByteChunks(torch.utils.data.Dataset):
    """Consecutive `length`-byte windows of some text; the model shifts the labels itself."""

    def __init__(self, data: bytes, length: int):
        tokens = torch.tensor(list(data), dtype=torch.long)
        self.chunks = tokens[: len(tokens) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.chunks[index], "labels": self.chunks[index]}


def byte_datasets(length: int) -> tuple[ByteChunks, ByteChunks]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in STDLIB_FILES)
    split = len(data) * 9 // 10
    return ByteChunks(data[:split], length), ByteChunks(data[split:], length)


def tiny_llama(length: int) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights on every process
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=length,
    ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face causal LM (name or folder); default: a tiny random Llama")
    parser.add_argument("--config", help="a DeepSpeed JSON config; default: Hugging Face's ZeRO template")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="per process")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    options = parser.parse_args()

    train, evaluation = byte_datasets(options.seq_len)
    model = (AutoModelForCausalLM.from_pretrained(options.model) if options.model else tiny_llama(options.seq_len))
    several_cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=options.output_dir, max_steps=options.steps, per_device_train_batch_size=options.batch,
        per_device_eval_batch_size=options.batch, gradient_accumulation_steps=options.accumulation,
        learning_rate=3e-3, warmup_steps=0.1, weight_decay=0.01, bf16=options.bf16,
        logging_steps=10, eval_strategy="steps", eval_steps=30, save_strategy="steps", save_steps=30,
        save_total_limit=2, report_to="none",
        use_cpu=several_cpu_processes,  # accelerate's switch for several processes without GPUs
    )
    trainer = ShardwiseTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                               shardwise_config=options.config or ds_config(options.stage))
    trainer.train(resume_from_checkpoint=options.resume or None)
    trainer.save_model(os.path.join(options.output_dir, "final"))
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        held = trainer.engine.memory_breakdown()
        print(f"eval loss {metrics['eval_loss']:.3f}; model states on rank 0: "
              + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in held.items()))
        print(f"Hugging Face weights: {os.path.join(options.output_dir, 'final')} (from_pretrained loads them)")


if __name__ == "__main__":
    main()
