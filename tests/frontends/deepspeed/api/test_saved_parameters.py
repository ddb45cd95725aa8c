"""A backward that reads ZeRO-3's attributes of a parameter its forward saved, as TRL's
chunked log-probability reads the LM head's `ds_status` to gather it. Under any torch
saved-tensor hook a backward gets aliases, not the saved parameters, so
`deepspeed.initialize`'s engine counts no saved activations at stage 3
(ActivationPolicy.count_saved; docs/memory.md#measuring-activations); shardwise's own
`initialize` keeps counting them, and its backward gets the alias."""

import torch

from shardwise.tools.testing import run_distributed


class ReadsSavedWeight(torch.autograd.Function):
    """`x @ weight.T`, whose backward gathers the saved weight as TRL does (GatheredParameters
    over it when its `ds_status` is not AVAILABLE) to compute the input's gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        import shardwise.frontends.deepspeed.api as deepspeed
        from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import ZeroParamStatus

        x, weight = ctx.saved_tensors
        ReadsSavedWeight.saw = type(weight).__name__
        with deepspeed.zero.GatheredParameters([weight] if weight.ds_status != ZeroParamStatus.AVAILABLE else []):
            return grad @ weight, None


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3, bias=False)
        self.head.weight.requires_grad_(False)  # a frozen head: partitioned at stage 3 all the same

    def forward(self, x):
        import shardwise.frontends.deepspeed.api as deepspeed

        hidden = self.body(x)
        with deepspeed.zero.GatheredParameters([self.head.weight]):  # read outside the head's own forward
            return ReadsSavedWeight.apply(hidden, self.head.weight)


def _train(rank: int, world_size: int) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = Head()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    return {"saw": ReadsSavedWeight.saw, "counts": engine.policies.activation.count_saved}


def test_a_backward_reads_the_saved_parameter_itself_at_zero3():
    for result in run_distributed(_train, 2):
        assert result == {"saw": "PartitionedParameter", "counts": False}
