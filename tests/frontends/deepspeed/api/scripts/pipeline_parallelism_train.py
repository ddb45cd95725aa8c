"""In the shape of DeepSpeedExamples' training/pipeline_parallelism/train.py: AlexNet
flattened into a list of layers (a lambda among them), a `PipelineModule` of
`--pipeline-parallel-size` stages, `deepspeed.initialize(training_data=...)` and
`engine.train_batch()` pulling micro-batches from the engine's own loader; run by
`shardwise run --as-deepspeed`.

Changed for a test: a smaller AlexNet for 32x32 images (same layer kinds), random images
instead of the CIFAR-10 download, dropout off by default (so the reference can draw the
same numbers), `get_accelerator().set_device` instead of `torch.cuda.set_device` (this
machine has no GPU), and the plain-PyTorch reference (`--plain-torch`): the same layers
trained by torch alone on the same micro-batches, their losses averaged per global
batch as the pipeline engine reports them.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader

from reference import add_reference_arguments, write_losses


class AlexNet(nn.Module):
    def __init__(self, num_classes=10, dropout=0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(32, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(32 * 2 * 2, 64), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(64, 64), nn.ReLU(inplace=True),
            nn.Linear(64, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def cifar_trainset(samples, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(samples, 3, 32, 32, generator=generator) * 2 - 1
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--partition", type=str, default="parameters", help="PipelineModule partition_method")
    parser.add_argument("--samples", type=int, default=96, help="size of the random training set")
    add_reference_arguments(parser)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)

    trainset = cifar_trainset(args.samples, args.seed)
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    losses = []
    for step in range(args.steps):
        loss = engine.train_batch()
        losses.append(loss.item())
    write_losses(args.loss_file, torch.distributed.get_rank(), losses)


def train_plain(args):
    """One process: the data-parallel ranks' loaders rebuilt as the engine builds them,
    each global batch's micro-batch losses averaged and back-propagated together."""
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = nn.Sequential(*[layer if isinstance(layer, nn.Module) else Lambda(layer)
                          for layer in join_layers(AlexNet(num_classes=10))])
    with open(args.deepspeed_config) as handle:
        config = json.load(handle)
    data_size = args.world_size // args.pipeline_parallel_size
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    params = config["optimizer"]["params"]
    optimizer = torch.optim.Adam(net.parameters(), lr=params["lr"], betas=params["betas"], eps=params["eps"])
    trainset = cifar_trainset(args.samples, args.seed)
    loaders = [iter(RepeatingLoader(torch.utils.data.DataLoader(
        trainset, batch_size=micro,
        sampler=torch.utils.data.DistributedSampler(trainset, num_replicas=data_size, rank=rank))))
        for rank in range(data_size)]
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step in range(args.steps):
        batch_losses = [criterion(net(images), labels) for _ in range(accumulation)
                        for images, labels in (next(loader) for loader in loaders)]
        loss = torch.stack(batch_losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    for rank in range(args.world_size):
        write_losses(args.loss_file, rank, losses)


class Lambda(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


if __name__ == "__main__":
    args = get_args()
    if args.plain_torch:
        train_plain(args)
    else:
        deepspeed.init_distributed(dist_backend=args.backend)
        args.local_rank = int(os.environ["LOCAL_RANK"])
        get_accelerator().set_device(args.local_rank)
        train_pipe(args, args.partition)
