"""A stock `transformers.Trainer` script with its DeepSpeed config in
`TrainingArguments(deepspeed=...)`, nothing of shardwise in it: tests run it under
`shardwise run --as-deepspeed` (tests/frontends/hf_trainer/test_stock_trainer.py).

    python stock_trainer.py CONFIG.json OUTPUT_DIR [--resume CHECKPOINT] [--lora]

Four steps, a checkpoint every two (`save_strategy="steps"`), `save_model` at the end;
`--resume` resumes from a checkpoint (`train(resume_from_checkpoint=...)`); `--lora` trains
a PEFT LoRA adapter on the frozen model. The logged losses go to OUTPUT_DIR/losses.json.
"""

import argparse
import json

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self) -> None:
        self.rows = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("output_dir")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--lora", action="store_true")
    options = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    if options.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    args = TrainingArguments(output_dir=options.output_dir, per_device_train_batch_size=2, max_steps=4,
                             logging_steps=1, report_to=[], save_strategy="steps", save_steps=2,
                             learning_rate=1e-2 if options.lora else 1e-3,
                             deepspeed=json.loads(open(options.config).read()))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=options.resume)
    trainer.save_model(f"{options.output_dir}/final")
    if trainer.is_world_process_zero():
        with open(f"{options.output_dir}/losses.json", "w") as file:
            json.dump([entry["loss"] for entry in trainer.state.log_history if "loss" in entry], file)


if __name__ == "__main__":
    main()
