"""Small per-rank checks for test_tensor_parallel_parts.py (module-level, so ranks can run them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.models.families import plan_for
from shardwise.runtime.parallel.tensor import TensorRegion, VocabShardedLogits, apply_tensor_parallel, gather_full, tensor_shard
from shardwise.runtime.parallel.tensor.cross_entropy import VocabShard
from tests.runtime.zero.workers import build_model, global_batch


def tensor_communicator(rank: int, world_size: int) -> Communicator:
    mesh = ParallelMesh(ParallelSizes(tensor=world_size), rank, torch.device("cpu"), collective_timeout())
    return Communicator(mesh["tensor"])


def cross_entropy_pieces(rank: int, world_size: int) -> dict:
    """Loss and logit gradients from vocabulary shards, for the full logits of every rank."""
    comm = tensor_communicator(rank, world_size)
    torch.manual_seed(0)
    logits = torch.randn(12, 10, dtype=torch.float64) * 3
    target = torch.randint(0, 10, (12,))
    target[[2, 7]] = -100
    local = logits.chunk(world_size, dim=1)[rank].clone().requires_grad_()
    sharded = VocabShardedLogits.wrap(local, VocabShard(comm, rank * local.shape[1], 10))
    losses = {}
    for reduction in ("mean", "sum", "none"):
        loss = F.cross_entropy(sharded.view(-1, sharded.size(-1)).contiguous().double(), target, reduction=reduction)
        losses[reduction] = loss.detach()
    (loss * torch.arange(12)).sum().backward()
    try:
        sharded.softmax(-1)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"logits": logits, "target": target, "losses": losses, "grad": local.grad, "softmax": refused}


def hf_labels_loss(rank: int, world_size: int, model_kind: str) -> dict:
    """`model(input_ids, labels=...).loss` under TP, with -100 labels and with num_items_in_batch."""
    model = build_model(model_kind)
    apply_tensor_parallel(model, TensorRegion(tensor_communicator(rank, world_size)), plan_for(model).tensor_plan())
    x, _ = global_batch(0, 3)
    labels = x.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        return {"loss": model(input_ids=x, labels=labels).loss,
                "summed": model(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(7)).loss}


def initialize_error(rank: int, world_size: int, config: dict) -> str:
    """The error message `initialize` raises for a GPT with 3 heads."""
    from shardwise.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=3, n_embd=48))
    try:
        shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as error:
        return str(error)
    return "no error"


class TwoLayers(torch.nn.Module):
    """A model no built-in plan knows: a user plan splits it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


def two_layer_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)


def train_with_user_plan(rank: int, world_size: int, plan: dict | None) -> dict:
    model = TwoLayers()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
              "tensor_parallel": {"size": world_size, "plan": plan}}
    try:
        engine = shardwise.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as error:
        return {"error": str(error)}
    losses = []
    for step in range(3):
        loss = engine(*two_layer_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    tensor = Communicator(engine.mesh["tensor"])
    params = {n: gather_full(p.detach(), tensor_shard(p), tensor) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}
