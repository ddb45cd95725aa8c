"""In the shape of DeepSpeedExamples' applications/DeepSpeed-Chat step 3 (dschat/rlhf/
rlhf_engine.py `_init_ref`, ppo_trainer.py `generate_experience`): the actor trains through
one engine while a frozen reference copy of it runs forward only through a second engine
built from `get_eval_ds_config`, with no optimizer (`ref_engine, *_ =
deepspeed.initialize(model=ref_model, config=ds_config)`), at ZeRO stage 3 when the actor
uses stage 3 and stage 0 otherwise; each step reads the reference's log-probabilities
under `torch.no_grad()`, as DeepSpeed-Chat does for its KL penalty.

Changed for a test: the actor's objective is the sequences' likelihood with a KL-style
penalty towards the reference (no generation, reward or critic models, no PPO clipping);
tiny random OPT models and random token sequences (dschat_step1_sft.py's helpers); the
plain-PyTorch reference (`--plain-torch`, reference.py).
"""

import argparse

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.ops.adam import FusedAdam
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, default_data_collator

from dschat_step1_sft import (
    create_hf_model,
    create_prompt_dataset,
    get_optimizer_grouped_parameters,
    get_train_ds_config,
    set_random_seed,
)
from reference import add_reference_arguments, clip_, write_losses

KL_CTL = 0.5


# -- dschat/utils/ds_utils.py ------------------------------------------------------------
def get_eval_ds_config(offload, dtype, stage=0):
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "stage3_param_persistence_threshold": 1e4,
        "offload_param": {"device": device},
        "memory_efficient_linear": False,
    }
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


# -- dschat/utils/utils.py -----------------------------------------------------------------
def gather_log_probs(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    log_probs_labels = log_probs.gather(dim=-1, index=labels.unsqueeze(-1))
    return log_probs_labels.squeeze(-1)


def penalised_loss(logits, ref_logits, seq):
    log_probs = gather_log_probs(logits[:, :-1, :], seq[:, 1:])
    ref_log_probs = gather_log_probs(ref_logits[:, :-1, :], seq[:, 1:])
    return -log_probs.mean() + KL_CTL * (log_probs - ref_log_probs).square().mean()


def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-Chat step 3's actor and reference engines")
    parser.add_argument("--per_device_training_batch_size", type=int, default=2)
    parser.add_argument("--max_seq_len", type=int, default=16)
    parser.add_argument("--actor_learning_rate", type=float, default=1e-3)
    parser.add_argument("--actor_weight_decay", type=float, default=0.1)
    parser.add_argument("--actor_zero_stage", type=int, default=2)
    parser.add_argument("--offload_reference_model", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--local_rank", type=int, default=-1)
    add_reference_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.plain_torch:
        return train_plain_torch(args)
    deepspeed.init_distributed()
    world = torch.distributed.get_world_size()
    micro = args.per_device_training_batch_size

    set_random_seed(args.seed)
    actor_model = create_hf_model(AutoModelForCausalLM, "actor")
    set_random_seed(args.seed)  # the reference starts as the same model, as both load the SFT checkpoint
    ref_model = create_hf_model(AutoModelForCausalLM, "actor")

    actor_config = get_train_ds_config(offload=False, dtype=args.dtype, stage=args.actor_zero_stage)
    actor_config["train_micro_batch_size_per_gpu"] = micro
    actor_config["train_batch_size"] = micro * world
    optimizer = FusedAdam(get_optimizer_grouped_parameters(actor_model, args.actor_weight_decay),
                          lr=args.actor_learning_rate, betas=(0.9, 0.95))
    actor, *_ = deepspeed.initialize(model=actor_model, optimizer=optimizer, config=actor_config)

    ref_stage = args.actor_zero_stage if args.actor_zero_stage == 3 else 0  # rlhf_engine.py `_init_ref`
    ref_config = get_eval_ds_config(args.offload_reference_model, args.dtype, ref_stage)
    ref_config["train_micro_batch_size_per_gpu"] = micro
    ref_config["train_batch_size"] = micro * world
    ref, ref_optimizer, _, ref_scheduler = deepspeed.initialize(model=ref_model, config=ref_config)
    assert ref_optimizer is None and ref_scheduler is None, "a reference engine has no optimizer"

    dataset = create_prompt_dataset(args.samples, args.max_seq_len, args.seed)
    loader = DataLoader(dataset, collate_fn=default_data_collator, sampler=DistributedSampler(dataset),
                        batch_size=micro)
    losses = []
    for batch in loader:
        seq = batch["input_ids"].to(actor.device)
        mask = batch["attention_mask"].to(actor.device)
        ref.eval()
        with torch.no_grad():
            ref_logits = ref(seq, attention_mask=mask).logits
        actor.train()
        logits = actor(seq, attention_mask=mask, use_cache=False).logits
        loss = penalised_loss(logits.float(), ref_logits.float(), seq)
        actor.backward(loss)
        actor.step()
        losses.append(loss.item())
    write_losses(args.loss_file, torch.distributed.get_rank(), losses)


def train_plain_torch(args):
    """The reference: one process, torch alone, each simulated rank's share of the data."""
    world, micro = args.world_size, args.per_device_training_batch_size
    set_random_seed(args.seed)
    actor = create_hf_model(AutoModelForCausalLM, "actor")
    set_random_seed(args.seed)
    ref = create_hf_model(AutoModelForCausalLM, "actor").eval()
    optimizer = torch.optim.AdamW(get_optimizer_grouped_parameters(actor, args.actor_weight_decay),
                                  lr=args.actor_learning_rate, betas=(0.9, 0.95))
    dataset = create_prompt_dataset(args.samples, args.max_seq_len, args.seed)
    loaders = [DataLoader(dataset, collate_fn=default_data_collator,
                          sampler=DistributedSampler(dataset, num_replicas=world, rank=rank), batch_size=micro)
               for rank in range(world)]
    losses = [[] for _ in range(world)]
    actor.train()
    for batches in zip(*loaders):
        total = 0
        for rank, batch in enumerate(batches):
            seq, mask = batch["input_ids"], batch["attention_mask"]
            with torch.no_grad():
                ref_logits = ref(seq, attention_mask=mask).logits
            loss = penalised_loss(actor(seq, attention_mask=mask, use_cache=False).logits, ref_logits, seq)
            losses[rank].append(loss.item())
            total = total + loss / world
        total.backward()
        clip_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for rank in range(world):
        write_losses(args.loss_file, rank, losses[rank])


if __name__ == "__main__":
    main()
