"""A causal-LM fine-tuning script written for `accelerate launch`, in the shape of
Hugging Face's `run_clm_no_trainer.py` examples: an `Accelerator` with gradient
accumulation, `accelerator.prepare`, the plain loop (`accumulate`, `backward`,
`optimizer.step`, `lr_scheduler.step`, `zero_grad`), `save_state` every few updates and
`load_state` + `skip_first_batches` to resume. Nothing in it names DeepSpeed or
shardwise: DDP, DeepSpeed or shardwise is the launch's choice. The model is a random tiny
Llama and the data random tokens (offline); each rank writes the loss of every
micro-batch it trained on to `--losses PREFIX.rank<R>.json`.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N updates")
    parser.add_argument("--resume_from_checkpoint", default=None, help="a step_<N> folder under --output_dir")
    parser.add_argument("--losses", required=True)
    parser.add_argument("--state_dict", default=None, help="write accelerator.get_state_dict(model) here (JSON)")
    parser.add_argument("--compiled", default=None, help="write whether the prepared model runs compiled (JSON)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (args.samples, 16), generator=torch.Generator().manual_seed(0))
    train_dataset = [{"input_ids": row, "labels": row} for row in tokens]
    train_dataloader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size, shuffle=False)

    no_decay = ["bias", "norm.weight"]
    grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped_parameters, lr=args.learning_rate, eps=1e-4)
    updates_per_epoch = -(-len(train_dataloader) // accelerator.num_processes // args.gradient_accumulation_steps)
    max_train_steps = updates_per_epoch * args.num_train_epochs
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=1,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    updates_per_epoch = -(-len(train_dataloader) // args.gradient_accumulation_steps)

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).removeprefix("step_"))
        starting_epoch = completed_steps // updates_per_epoch
        resume_step = (completed_steps % updates_per_epoch) * args.gradient_accumulation_steps

    losses = []
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        batches = train_dataloader
        if resume_step is not None and epoch == starting_epoch:
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                losses.append(loss.item())
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
    with open(f"{args.losses}.rank{accelerator.process_index}.json", "w") as file:
        json.dump(losses, file)
    if args.compiled and accelerator.is_main_process:  # a DeepSpeed engine answers is_compiled
        with open(args.compiled, "w") as file:
            json.dump(getattr(model, "is_compiled", None), file)
    if args.state_dict:
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            with open(args.state_dict, "w") as file:  # with whether each tensor owns just its elements
                json.dump({name: [tensor.flatten().tolist(),
                                  tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()]
                           for name, tensor in state.items()}, file)
    accelerator.end_training()


if __name__ == "__main__":
    main()
