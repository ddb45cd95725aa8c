"""A stock `transformers.Trainer` script with its DeepSpeed config in
`TrainingArguments(deepspeed=...)`, nothing of shardwise in it: tests run it under
`shardwise run --as-deepspeed` (tests/frontends/hf_trainer/test_stock_trainer.py).

    python stock_trainer.py CONFIG.json LOSSES.json
"""

import json
import sys

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
    config_path, losses_path = sys.argv[1:3]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    args = TrainingArguments(output_dir=str(losses_path) + ".out", per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3,
                             deepspeed=json.loads(open(config_path).read()))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    if trainer.is_world_process_zero():
        with open(losses_path, "w") as file:
            json.dump([entry["loss"] for entry in trainer.state.log_history if "loss" in entry], file)


if __name__ == "__main__":
    main()
