"""`optimizer.zero_grad()` on what `deepspeed.initialize` returns clears the model's
gradients, as on DeepSpeed's optimizer: a GAN script clears the discriminator's gradients
left by the generator's loss with it."""

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed


def test_zero_grad_on_the_returned_optimizer_clears_the_model_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    )
    model(torch.randn(2, 4)).sum().backward()  # another loss's gradients, outside the engine
    assert all(p.grad is not None for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    engine.backward(model(torch.randn(2, 4)).sum())
    engine.step()
    assert isinstance(optimizer, torch.optim.Optimizer)
