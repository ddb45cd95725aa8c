"""In the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py: the same imports,
argument parsing, config, network and loop, run by `shardwise run --as-deepspeed`.

Changed for a test: random images instead of the CIFAR-10 download, a seed, a step
limit, and the plain-PyTorch reference (`--plain-torch`, reference.py).
"""

import argparse
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from reference import add_reference_arguments, clip_, warmup_lr, write_losses


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=48, help="size of the random training set")
    parser.add_argument("--seed", type=int, default=1234)
    add_reference_arguments(parser)
    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


def create_moe_param_groups(model):
    """Create separate parameter groups for each expert."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


WARMUP = {"warmup_min_lr": 0.0002, "warmup_max_lr": 0.001, "warmup_num_steps": 4}
ADAM = {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    ds_config = {
        "train_batch_size": args.train_batch_size,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": ADAM},
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }
    return ds_config


class Net(nn.Module):
    def __init__(self, args):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # Create moe layers based on the number of experts.
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def random_cifar(samples, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(samples, 3, 32, 32, generator=generator) * 2 - 1
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    """Test the network on the test data."""
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            if target_dtype != None:  # noqa: E711 (as the original)
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total : .0f} %")


def main(args):
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    if torch.distributed.get_rank() != 0:
        # Might be downloading cifar data, let rank 0 download first.
        torch.distributed.barrier()
    trainset = random_cifar(args.samples, args.seed)
    testset = random_cifar(8, args.seed + 1)
    if torch.distributed.get_rank() == 0:
        # Cifar data is downloaded, indicate other ranks can proceed.
        torch.distributed.barrier()

    torch.manual_seed(args.seed)
    net = Net(args)

    # Get list of parameters that require gradients.
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # If using MoE, create separate param groups for each expert.
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)

    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype != None:  # noqa: E711 (as the original)
                inputs = inputs.to(target_dtype)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()

            losses.append(loss.item())
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    print("Finished Training")
    write_losses(args.loss_file, torch.distributed.get_rank(), losses)

    test(model_engine, testset, local_device, target_dtype)


def train_plain_torch(args):
    """The reference: one process, torch alone, the same global batches."""
    world = args.world_size
    trainset = random_cifar(args.samples, args.seed)
    torch.manual_seed(args.seed)
    net = Net(args)
    optimizer = torch.optim.AdamW(net.parameters(), lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                                  weight_decay=ADAM["weight_decay"])
    micro = args.train_batch_size // world
    loaders = [
        torch.utils.data.DataLoader(trainset, batch_size=micro,
                                    sampler=torch.utils.data.DistributedSampler(trainset, num_replicas=world, rank=r))
        for r in range(world)
    ]
    criterion = nn.CrossEntropyLoss()
    losses = [[] for _ in range(world)]
    updates = 0
    for _epoch in range(args.epochs):
        for batches in zip(*loaders):
            for group in optimizer.param_groups:
                group["lr"] = warmup_lr(updates, **WARMUP)
            total = 0
            for rank, (inputs, labels) in enumerate(batches):
                loss = criterion(net(inputs), labels)
                losses[rank].append(loss.item())
                total = total + loss / world
            total.backward()
            clip_(net.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            updates += 1
    for rank in range(world):
        write_losses(args.loss_file, rank, losses[rank])


if __name__ == "__main__":
    args = add_argument()
    if args.plain_torch:
        train_plain_torch(args)
    else:
        main(args)
