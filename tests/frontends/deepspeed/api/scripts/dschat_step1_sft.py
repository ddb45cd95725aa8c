"""In the shape of DeepSpeedExamples' applications/DeepSpeed-Chat/training/
step1_supervised_finetuning/main.py (with the dschat helpers it calls inlined): supervised
fine-tuning of a causal LM with the client's FusedAdam over weight-decay param groups and
Hugging Face's scheduler, passed to `deepspeed.initialize`, run by `shardwise run --as-deepspeed`.

Changed for a test: a tiny randomly initialised OPT model and random token sequences
instead of a downloaded model, tokenizer and prompt datasets; an "fp32" dtype choice;
no final save (DeepSpeed-Chat's stage-3 save reads DeepSpeed's own parameter attributes);
the plain-PyTorch reference (`--plain-torch`, reference.py).
"""

import argparse
import math
import random
import time

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, SchedulerType, default_data_collator, get_scheduler, set_seed

from reference import add_reference_arguments, clip_, write_losses

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


# -- dschat/utils/ds_utils.py ------------------------------------------------------------
def get_train_ds_config(offload, dtype, stage=2, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512, enable_tensorboard=False, tb_path="", tb_name=""):
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    config = {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
        },
        "tensorboard": {
            "enabled": enable_tensorboard,
            "output_path": f"{tb_path}/ds_tensorboard_logs/",
            "job_name": f"{tb_name}_tensorboard",
        },
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        config["bfloat16"] = {"enabled": True}
    return config


# -- dschat/utils/utils.py -----------------------------------------------------------------
def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)


def to_device(batch, device):
    output = {}
    for k, v in batch.items():
        try:
            output[k] = v.to(device)
        except AttributeError:
            output[k] = v
    return output


def set_random_seed(seed):
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    tensor = tensor / torch.distributed.get_world_size()
    return tensor


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay_name_list=["bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight"],
                                     lora_name_list=["lora_right_weight", "lora_left_weight"]):
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters()
                    if (not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                        and not any(nd in n.lower() for nd in lora_name_list))],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if (not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                        and any(nd in n.lower() for nd in lora_name_list))],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in model.named_parameters()
                    if (any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad)],
         "weight_decay": 0.0},
    ]
    return [group for group in optimizer_grouped_parameters if group["params"]]


def print_throughput(hf_model, args, e2e_time, rank=0):
    if rank <= 0:
        hf_config = hf_model.config
        samples_per_second = args.per_device_train_batch_size * dist.get_world_size() / e2e_time
        print(f"Model Parameters: {sum(p.numel() for p in hf_model.parameters())}, layers: "
              f"{hf_config.num_hidden_layers}, Samples/sec: {samples_per_second:.2f}")


# -- dschat/utils/model/model_utils.py and data ---------------------------------------------
def create_hf_model(model_class, model_name_or_path, ds_config=None, dropout=None):
    """A tiny random OPT in place of `from_pretrained(model_name_or_path)`."""
    model_config = AutoConfig.for_model("opt", vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                        ffn_dim=64, num_attention_heads=4, max_position_embeddings=64,
                                        word_embed_proj_dim=32, dropout=dropout or 0.0, attention_dropout=0.0)
    model = model_class.from_config(model_config)
    model.config.end_token_id = 2
    model.config.pad_token_id = model.config.eos_token_id
    return model


def create_prompt_dataset(size, seq_len, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 96, (size, seq_len), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
    parser.add_argument("--model_name_or_path", type=str, default="tiny-opt")
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--max_seq_len", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine",
                        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                 "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="Enable HF gradient checkpointing")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true", help="Enable ZeRO Offload techniques.")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--print_loss", action="store_true")
    add_reference_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.plain_torch:
        return train_plain_torch(args)
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    set_random_seed(args.seed)
    torch.distributed.barrier()

    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, ds_config, dropout=args.dropout)
    train_dataset = create_prompt_dataset(args.samples, args.max_seq_len, args.seed)
    eval_dataset = create_prompt_dataset(8, args.max_seq_len, args.seed + 1)
    if args.local_rank == -1:
        train_sampler = RandomSampler(train_dataset)
        eval_sampler = SequentialSampler(eval_dataset)
    else:
        train_sampler = DistributedSampler(train_dataset)
        eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=eval_sampler,
                                 batch_size=args.per_device_eval_batch_size)

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = losses / (step + 1)
        losses = get_all_reduce_mean(losses)
        return torch.exp(losses).item(), losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)

    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    perplexity, eval_loss = evaluation(model, eval_dataloader)
    print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
    losses = []
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            start = time.time()
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = {loss}")
            model.backward(loss)
            model.step()
            losses.append(loss.item())
            end = time.time()
            if torch.distributed.get_rank() == 0:
                print_throughput(model.model, args, end - start, args.global_rank)
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
        model.tput_timer.update_epoch_count()
    write_losses(args.loss_file, args.global_rank, losses)


def train_plain_torch(args):
    """The reference: one process, torch alone, each simulated rank's share of the data."""
    world, accumulation = args.world_size, args.gradient_accumulation_steps
    set_random_seed(args.seed)
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, dropout=args.dropout)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    train_dataset = create_prompt_dataset(args.samples, args.max_seq_len, args.seed)
    loaders = [DataLoader(train_dataset, collate_fn=default_data_collator,
                          sampler=DistributedSampler(train_dataset, num_replicas=world, rank=rank),
                          batch_size=args.per_device_train_batch_size) for rank in range(world)]
    groups = get_optimizer_grouped_parameters(model, args.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * math.ceil(len(loaders[0]) / accumulation))
    losses = [[] for _ in range(world)]
    model.train()
    for _epoch in range(args.num_train_epochs):
        for step, batches in enumerate(zip(*loaders)):
            total = 0
            for rank, batch in enumerate(batches):
                loss = model(**batch, use_cache=False).loss
                losses[rank].append(loss.item())
                total = total + loss / (world * accumulation)
            total.backward()
            if (step + 1) % accumulation == 0:
                clip_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    for rank in range(world):
        write_losses(args.loss_file, rank, losses[rank])


if __name__ == "__main__":
    main()
