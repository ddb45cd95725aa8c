"""In the shape of DeepSpeedExamples' training/gan/gan_deepspeed_train.py (with gan_model.py
and utils.py inlined): a DCGAN whose generator and discriminator each have their own
engine; the discriminator's loss is back-propagated twice before its step, the
generator's loss flows through the discriminator's parameters, and the script calls
`netD.zero_grad()` / `netG.zero_grad()` on the modules. Run by `shardwise run --as-deepspeed`.

Changed for a test: random images instead of a dataset folder, tiny widths, the CPU
when there is no GPU, no image or TensorBoard output, and the plain-PyTorch reference
(`--plain-torch`: the loop of the original gan_baseline_train.py). As in the original,
every rank reads the same batches and draws the same noise.
"""

import argparse
import random

import deepspeed
import numpy as np
import torch
import torch.nn as nn
import torch.utils.data

from reference import add_reference_arguments, write_losses


# -- gan_model.py ---------------------------------------------------------------------------
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, ngpu, ngf, nc, nz):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu, ndf, nc):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


# -- utils.py ---------------------------------------------------------------------------------
def get_argument_parser():
    parser = argparse.ArgumentParser(description="GAN")
    parser.add_argument("--dataset", default="fake", help="fake: random images")
    parser.add_argument("--workers", type=int, help="number of data loading workers", default=0)
    parser.add_argument("--batchSize", type=int, default=4, help="input batch size")
    parser.add_argument("--imageSize", type=int, default=64, help="the height / width of the input image")
    parser.add_argument("--nz", type=int, default=8, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=4)
    parser.add_argument("--ndf", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train for")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate, default=0.0002")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam. default=0.5")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--samples", type=int, default=8, help="size of the random image set")
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus")
    add_reference_arguments(parser)
    return parser


def set_seed(value):
    random.seed(value)
    torch.manual_seed(value)
    np.random.seed(value)


def get_dataset(args):
    generator = torch.Generator().manual_seed(args.manualSeed)
    images = torch.rand(args.samples, 3, args.imageSize, args.imageSize, generator=generator) * 2 - 1
    return torch.utils.data.TensorDataset(images, torch.zeros(args.samples)), 3


def build(args):
    set_seed(args.manualSeed)
    dataset, nc = get_dataset(args)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True,
                                             num_workers=int(args.workers))
    device = torch.device("cuda", args.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    netG = Generator(0, args.ngf, nc, args.nz).to(device)
    netG.apply(weights_init)
    netD = Discriminator(0, args.ndf, nc).to(device)
    netD.apply(weights_init)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    return dataloader, device, netG, netD, optimizerD, optimizerG


def train(args):
    dataloader, device, netG, netD, optimizerD, optimizerG = build(args)
    criterion = nn.BCELoss()
    real_label = 1
    fake_label = 0
    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                           optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                           optimizer=optimizerG)
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            noise = torch.randn(batch_size, args.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            errD = errD_real + errD_fake
            model_engineD.step()
            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
            losses += [errD.item(), errG.item()]
            print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f" % (epoch, args.epochs, i, len(dataloader),
                                                              errD.item(), errG.item()))
    write_losses(args.loss_file, torch.distributed.get_rank(), losses)


def train_plain_torch(args):
    """gan_baseline_train.py: the same loop with optimizer steps."""
    dataloader, device, netG, netD, optimizerD, optimizerG = build(args)
    criterion = nn.BCELoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), 1, dtype=real.dtype, device=device)
            errD_real = criterion(netD(real), label)
            errD_real.backward()
            noise = torch.randn(batch_size, args.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(0)
            errD_fake = criterion(netD(fake.detach()), label)
            errD_fake.backward()
            optimizerD.step()
            netG.zero_grad()
            label.fill_(1)
            errG = criterion(netD(fake), label)
            errG.backward()
            optimizerG.step()
            losses += [(errD_real + errD_fake).item(), errG.item()]
    for rank in range(args.world_size):
        write_losses(args.loss_file, rank, losses)


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.plain_torch:
        train_plain_torch(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
