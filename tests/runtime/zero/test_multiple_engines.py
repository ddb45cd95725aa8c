"""Several engines in one script, as DeepSpeedExamples' GAN trains: a generator and a
discriminator each in their own engine, the generator's loss back-propagating through the
discriminator's parameters, and the script zeroing gradients between updates. The run
must equal plain PyTorch on the same global batch at every ZeRO stage."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.tools.testing import run_distributed

NOISE, FEATURES, ROWS_PER_RANK, STEPS = 4, 6, 4, 3


def build_gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    generator = nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, FEATURES))
    discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    return generator, discriminator


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    real = torch.randn(rows, FEATURES, generator=generator) * 0.5 + 1.0
    noise = torch.randn(rows, NOISE, generator=generator)
    return real, noise


def gan_step(net_g, net_d, real, noise, backward_d, backward_g, step_d, step_g,
             zero_d: bool = True) -> tuple[float, float]:
    """One iteration of DeepSpeedExamples' training/gan loop, written once for both runs.
    Without `zero_d`, the generator loss's gradients on the discriminator are kept and
    join the discriminator's next update, as plain PyTorch does."""
    criterion = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    if zero_d:
        net_d.zero_grad()
    error_real = criterion(net_d(real), ones)
    backward_d(error_real)
    fake = net_g(noise)
    error_fake = criterion(net_d(fake.detach()), zeros)
    backward_d(error_fake)
    step_d()
    net_g.zero_grad()
    error_g = criterion(net_d(fake), ones)  # flows through the discriminator's parameters
    backward_g(error_g)
    step_g()
    return (error_real + error_fake).item(), error_g.item()


def train_parallel(rank: int, world_size: int, stage: int, zero_d: bool) -> dict:
    net_g, net_d = build_gan()
    config = {"train_micro_batch_size_per_gpu": ROWS_PER_RANK,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine_d = shardwise.initialize(net_d, config, optimizer=torch.optim.Adam(net_d.parameters(), lr=2e-3,
                                                                              betas=(0.5, 0.999)))
    engine_g = shardwise.initialize(net_g, config, optimizer=torch.optim.Adam(net_g.parameters(), lr=2e-3,
                                                                              betas=(0.5, 0.999)))
    losses = []
    for step in range(STEPS):
        real, noise = batch(step, world_size * ROWS_PER_RANK)
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        losses.append(gan_step(net_g, net_d, real[rows], noise[rows], engine_d.backward, engine_g.backward,
                               engine_d.step, engine_g.step, zero_d))
    with shardwise.gathered_parameters([*net_g.parameters(), *net_d.parameters()]):
        params = {f"g.{n}": p.detach().clone() for n, p in net_g.named_parameters()}
        params |= {f"d.{n}": p.detach().clone() for n, p in net_d.named_parameters()}
    return {"losses": losses, "params": params}


def train_reference(world_size: int, zero_d: bool) -> dict:
    net_g, net_d = build_gan()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    losses = []

    def consuming(optimizer):  # engine.step() consumes the gradients it applied, as DeepSpeed's does
        return lambda: (optimizer.step(), optimizer.zero_grad())

    for step in range(STEPS):
        real, noise = batch(step, world_size * ROWS_PER_RANK)
        losses.append(gan_step(net_g, net_d, real, noise, torch.Tensor.backward, torch.Tensor.backward,
                               consuming(opt_d), consuming(opt_g), zero_d))
    params = {f"g.{n}": p.detach().clone() for n, p in net_g.named_parameters()}
    params |= {f"d.{n}": p.detach().clone() for n, p in net_d.named_parameters()}
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("zero_d", [True, False], ids=["zero_grad", "no_zero_grad"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gan_with_two_engines_trains_as_plain_torch(stage, zero_d):
    results = run_distributed(train_parallel, 2, stage, zero_d)
    reference = train_reference(2, zero_d)
    for name, want in reference["params"].items():
        for result in results:
            error = ((result["params"][name] - want).norm() / want.norm()).item()
            assert error < 1e-5, (stage, name, error)
    # each rank's loss is its own half of the batch; their mean is the reference's loss
    for step, (want_d, want_g) in enumerate(reference["losses"]):
        got_d = sum(result["losses"][step][0] for result in results) / 2
        got_g = sum(result["losses"][step][1] for result in results) / 2
        assert abs(got_d - want_d) < 1e-5 * abs(want_d) and abs(got_g - want_g) < 1e-5 * abs(want_g), step


def test_another_loss_into_an_already_reduced_buffer_is_refused():
    _, net_d = build_gan()
    engine = shardwise.initialize(net_d, {"train_micro_batch_size_per_gpu": 2},
                                  optimizer=torch.optim.SGD(net_d.parameters(), lr=0.1))
    x = torch.randn(2, FEATURES)
    engine.backward(net_d(x).sum())
    with pytest.raises(RuntimeError, match="received a gradient from another backward after this engine reduced"):
        net_d(x).sum().backward()
