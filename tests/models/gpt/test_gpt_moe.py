"""shardwise's GPT with MoE blocks (models/gpt/model.py, the runtime's mixture of experts):
with its experts split over an expert group of 2 (parallelize's expert step), at ZeRO 1
and 3, every step's loss and every final weight equal the single-process model holding
every expert, trained on the same global batch (each rank's rows routed on their own:
the capacity is per rank)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.runtime.parallel.expert import MixtureOfExperts
from shardwise.tools.testing import run_distributed

ROWS, STEPS, LR, EPS = 2, 3, 1e-2, 1e-4  # eps: tests/runtime/zero/workers.py ADAM_EPS says why
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, moe_experts=4, moe_every=2,
                   moe_min_capacity=0, moe_aux_loss_coef=0.1, moe_ep_size=2)


def tokens(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.block_size + 1),
                         generator=torch.Generator().manual_seed(70 + step))
    return data[:, :-1], data[:, 1:]


def gpt(config: GPTConfig) -> GPT:
    torch.manual_seed(11)
    return GPT(config)


def engine_config(stage: int, fp16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
            "fp16": {"enabled": fp16, "initial_scale_power": 8, "hysteresis": 1},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def every_expert_params(model: torch.nn.Module, engine) -> dict[str, torch.Tensor]:
    """The model's weights under the every-expert model's names (fp32 masters of experts)."""
    names = {key: place.name for key, place in engine.experts.global_places.items()} \
        if engine.experts is not None else {}
    with shardwise.gathered_parameters(list(model.parameters())):
        return {names.get(id(param), name): param.detach().float().clone() for name, param in model.named_parameters()}


def train_steps(engine, rank: int, world_size: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = tokens(step, ROWS * world_size)
        loss = engine(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_split(rank: int, world_size: int, stage: int, top_k: int) -> dict:
    model = gpt(replace(CONFIG, moe_top_k=top_k))
    engine = shardwise.initialize(model, engine_config(stage))
    losses = train_steps(engine, rank, world_size, range(STEPS))
    layer = next(module for module in model.modules() if isinstance(module, MixtureOfExperts))
    return {"losses": losses, "params": every_expert_params(model, engine), "local": layer.num_local_experts}


def train_every_expert(world_size: int, top_k: int, steps: int = STEPS) -> dict:
    model = gpt(replace(CONFIG, moe_top_k=top_k))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = tokens(step, ROWS * world_size)
        per_rank = [model(x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]) for r in range(world_size)]
        optimizer.zero_grad()
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "params": {name: param.detach().clone() for name, param in model.named_parameters()}}


def assert_equal_runs(results: list[dict], expected: dict, tolerance: float) -> None:
    for rank, result in enumerate(results):
        for step in range(STEPS):
            want = expected["losses"][step][rank]
            assert abs(result["losses"][step] - want) < tolerance * abs(want), (step, result["losses"], want)
        experts = [name for name in expected["params"] if ".experts.members." in name]
        held = [name for name in result["params"] if ".experts.members." in name]
        member = rank % 2  # of its expert group: it holds experts 2·member and 2·member + 1 of the four
        assert held == [name for name in experts if int(name.split(".members.")[1].split(".")[0]) // 2 == member]
        assert set(result["params"]) - set(held) == set(expected["params"]) - set(experts)
        for name, weight in result["params"].items():
            reference = expected["params"][name]
            error = ((weight - reference).norm() / reference.norm()).item()
            assert error < tolerance, (name, error)


def test_moe_blocks_add_their_load_balancing_loss():
    model = gpt(CONFIG)
    assert isinstance(model.blocks[1].mlp, MixtureOfExperts) and not isinstance(model.blocks[0].mlp, MixtureOfExperts)
    assert "blocks.1.mlp.experts.members.3.fc.weight" in dict(model.named_parameters())
    x, y = tokens(0, 2)
    loss = model(x, y)
    cross_entropy = F.cross_entropy(model(x).view(-1, CONFIG.vocab_size), y.reshape(-1))
    aux = model.blocks[1].mlp.l_aux
    assert aux.item() > 0 and torch.allclose(loss, cross_entropy + 0.1 * aux)
    with pytest.raises(ValueError, match="moe_ep_size 3 must divide"):
        GPTConfig(moe_experts=4, moe_ep_size=3)


@pytest.mark.parametrize("world_size, stage, top_k", [(2, 1, 1), (2, 3, 2), pytest.param(4, 1, 1,
                         marks=pytest.mark.slow)], ids=["ep2-stage1-top1", "ep2-stage3-top2", "ep2xdp2-stage1-top1"])
def test_expert_parallel_gpt_equals_every_expert_gpt(world_size, stage, top_k):
    """3 steps of a tiny model: short enough that no routing decision (top-k, capacity)
    sits within rounding of a tie, so the discontinuous routing is the same in both runs."""
    expected = train_every_expert(world_size, top_k)
    results = run_distributed(train_split, world_size, stage, top_k, timeout=240)
    assert all(result["local"] == 2 for result in results)  # 2 of the 4 experts on each rank
    assert_equal_runs(results, expected, 1e-5)


def train_split_fp16(rank: int, world_size: int, stage: int) -> dict:
    model = gpt(CONFIG)
    engine = shardwise.initialize(model, engine_config(stage, fp16=True))
    losses = train_steps(engine, rank, world_size, range(STEPS))
    return {"losses": losses, "params": every_expert_params(model, engine), "skipped": engine.skipped_steps}


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["stage1", "stage3"])
def test_fp16_expert_parallel_gpt_equals_every_expert_gpt(stage):
    """fp16 with loss scaling: the experts' gradients carry the scale and are unscaled with
    the dense ones, their fp32 masters stepped; equal to the fp32 every-expert model within
    fp16's tolerance."""
    expected = train_every_expert(2, 1)
    results = run_distributed(train_split_fp16, 2, stage, timeout=240)
    assert all(result["skipped"] == 0 for result in results)
    assert_equal_runs(results, expected, 2e-2)


def overflow_in_one_expert(rank: int, world_size: int) -> dict:
    """Rank 1 makes one of its experts' gradients infinite in the first step: every rank
    must skip that step (dense weights and every expert unchanged, the scale lowered) and
    apply the next."""
    model = gpt(CONFIG)
    engine = shardwise.initialize(model, engine_config(1, fp16=True))
    before = every_expert_params(model, engine)
    scale = engine.loss_scaler.scale
    layer = next(module for module in model.modules() if isinstance(module, MixtureOfExperts))
    poisoned = layer.experts.local[1].fc.weight
    hook = poisoned.register_hook(lambda grad: grad * float("inf")) if rank == 1 else None
    x, y = tokens(0, ROWS * world_size)
    engine.backward(engine(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]))
    engine.step()
    after_overflow = every_expert_params(model, engine)
    if hook is not None:
        hook.remove()
    engine.backward(engine(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]))
    engine.step()
    unchanged = all(torch.equal(after_overflow[name], value) for name, value in before.items())
    moved = [name for name, value in every_expert_params(model, engine).items() if not torch.equal(value, before[name])]
    return {"skipped": engine.skipped_steps, "unchanged": unchanged, "moved": moved,
            "scales": (scale, engine.loss_scaler.scale), "names": list(before)}


def test_fp16_overflow_in_one_expert_on_one_rank_skips_the_step_everywhere():
    for result in run_distributed(overflow_in_one_expert, 2, timeout=240):
        assert result["skipped"] == 1 and result["unchanged"]
        assert sorted(result["moved"]) == sorted(result["names"])  # the next step updates every weight
        assert result["scales"][1] < result["scales"][0]


def checkpoints_across_ep_sizes(rank: int, world_size: int, stage: int, tmp: str) -> dict:
    """Two steps at ep=2 saved, resumed at ep=1 (every expert on every rank, trained among
    the dense parameters) for two more; and the other way round."""
    losses = {}
    for saving, loading in ((2, 1), (1, 2)):
        folder = f"{tmp}/ep{saving}"
        engine = shardwise.initialize(gpt(replace(CONFIG, moe_ep_size=saving)), engine_config(stage))
        train_steps(engine, rank, world_size, range(2))
        engine.save_checkpoint(folder)
        engine = shardwise.initialize(gpt(replace(CONFIG, moe_ep_size=loading)), engine_config(stage))
        engine.load_checkpoint(folder)
        assert (engine.experts is None) == (loading == 1)
        losses[f"{saving}->{loading}"] = train_steps(engine, rank, world_size, range(2, 4))
    return losses


def test_checkpoints_move_between_expert_parallel_and_every_expert(tmp_path):
    """Experts are saved under their every-expert names with their Adam moments, so a
    checkpoint of ep=2 resumes at ep=1 and one of ep=1 at ep=2 (ZeRO 2), the two steps
    after equal to the every-expert model's 3rd and 4th (fp32, 1e-5)."""
    expected = train_every_expert(2, 1, steps=4)
    for rank, result in enumerate(run_distributed(checkpoints_across_ep_sizes, 2, 2, str(tmp_path), timeout=240)):
        for direction, losses in result.items():
            for step, got in zip((2, 3), losses):
                want = expected["losses"][step][rank]
                assert abs(got - want) < 1e-5 * abs(want), (direction, step, losses, want)
