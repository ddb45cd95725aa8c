"""Frozen parameters at ZeRO stage 3 (LoRA / PEFT fine-tuning, a frozen encoder): they are
partitioned like trained ones, 1/N per rank with no master, gradient or optimizer state,
gathered for forward and for the input gradients backward computes through them, and
freed as soon as those are done. Training must equal plain PyTorch, with or without
activation recomputation; checkpoints carry the frozen weights across stages."""

import dataclasses

import pytest
import torch
from torch import nn

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.formulas.memory import placed_model_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch, model_loss

MICRO, STEPS, LR, RANK = 2, 3, 5e-2, 4


class LoraLinear(nn.Module):
    """PEFT's shape: the frozen layer as `base_layer`, beside trainable low-rank factors."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # PEFT starts B at zero; non-zero exercises more

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def build_lora(kind: str = "gpt") -> nn.Module:
    """shardwise's GPT (4 layers) with the adapters above, or a Hugging Face Llama made a
    PEFT model (`get_peft_model`, LoRA on every projection) with its own gradient
    checkpointing (reentrant, as `gradient_checkpointing_enable()` defaults to, with
    `enable_input_require_grads()` as PEFT scripts call it)."""
    if kind != "gpt":
        from peft import LoraConfig, get_peft_model

        model = build_model("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
        torch.manual_seed(4321)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=8, target_modules=targets,
                                                init_lora_weights="gaussian"))
    torch.manual_seed(1234)
    model = GPT(dataclasses.replace(GPTConfig.preset("tiny"), bias=False, n_layer=4))
    linears = [(parent, name, child) for block in model.blocks for parent in block.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in linears:
        setattr(parent, name, LoraLinear(child))
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    return model


def _config(stage: int, recompute: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    if recompute:
        config["activation_checkpointing"] = {"policy": "full"}
    return config


def train_parallel(rank: int, world_size: int, stage: int, recompute: bool, checkpoint_dir: str | None,
                   kind: str = "gpt") -> dict:
    model = build_lora(kind)
    total_bytes = sum(param.numel() for param in model.parameters()) * 4
    trained = [param for param in model.parameters() if param.requires_grad]
    engine = shardwise.initialize(model, _config(stage, recompute), optimizer=torch.optim.SGD(trained, lr=LR))
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * world_size)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = model_loss(engine, kind, x[rows].to(engine.device), y[rows].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    memory = engine.memory_breakdown()  # the training steps' peaks (gathering everything below is not one)
    if checkpoint_dir is not None:
        engine.save_checkpoint(checkpoint_dir, tag="lora")
    with shardwise.gathered_parameters(list(engine.module.parameters())):
        weights = {name: param.detach().to("cpu", copy=True) for name, param in engine.module.named_parameters()}
    units = [*engine.units, *engine.zero.params.frozen_units]
    formula = placed_model_state_bytes(  # the planner's, on the padded counts (docs/formulas.md#frozen-parameters-and-forward-only-engines)
        sum(unit.padded_numel for unit in engine.units), world_size, 3, dtype="fp32",
        optimizer_state_bytes_per_param=0, frozen_params=sum(u.padded_numel for u in engine.zero.params.frozen_units),
    )["gpu"]
    return {"losses": losses, "weights": weights, "memory": memory, "total_bytes": total_bytes, "formula": formula,
            "shard_bytes": sum(unit.chunk_numel for unit in units) * 4,
            "frozen_units": len(engine.zero.params.frozen_units)}


def load_parallel(rank: int, world_size: int, stage: int, checkpoint_dir: str) -> dict:
    torch.manual_seed(99)  # different starting weights: everything must come from the checkpoint
    model = build_lora()
    for param in model.parameters():
        param.data.normal_()
    trained = [param for param in model.parameters() if param.requires_grad]
    engine = shardwise.initialize(model, _config(stage, False), optimizer=torch.optim.SGD(trained, lr=LR))
    engine.load_checkpoint(checkpoint_dir, tag="lora")
    with shardwise.gathered_parameters(list(engine.module.parameters())):
        return {name: param.detach().clone() for name, param in engine.module.named_parameters()}


def train_reference(world_size: int, kind: str = "gpt") -> dict:
    model = build_lora(kind)
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * world_size)
        per_rank = [model_loss(model, kind, x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO])
                    for r in range(world_size)]
        optimizer.zero_grad()
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        losses.append([value.item() for value in per_rank])
    return {"losses": losses, "weights": {name: param.detach().clone() for name, param in model.named_parameters()}}


def _assert_equal_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, weight in expected.items():
        error = ((actual[name] - weight).norm() / weight.norm().clamp_min(1e-12)).item()
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("kind, recompute", [("gpt", False), ("gpt", True), ("llama", False)],
                         ids=["gpt", "gpt-recompute", "hf-llama-reentrant-checkpointing"])
def test_lora_at_stage_3_equals_plain_torch_with_frozen_weights_partitioned(kind, recompute):
    results = run_distributed(train_parallel, 2, 3, recompute, None, kind, timeout=240)
    expected = train_reference(2, kind)
    for rank, result in enumerate(results):
        for step in range(STEPS):
            want = expected["losses"][step][rank]
            assert abs(result["losses"][step] - want) < 1e-5 * abs(want), (step, result["losses"][step], want)
        _assert_equal_weights(result["weights"], expected["weights"])
        memory = result["memory"]
        assert result["frozen_units"] > 0
        # the frozen base is split like the trained adapters: 4(Ψ_trained + Ψ_frozen)/N, as padded
        assert memory["params"] == result["shard_bytes"] == result["formula"]["params"] < 0.6 * result["total_bytes"]
        assert memory["grads"] == result["formula"]["grads"]  # the adapters' gradient partition only
        # freed once backward has passed through them: never the whole model gathered at once
        assert memory["buffers"] < 0.5 * result["total_bytes"], memory


def test_frozen_weights_round_trip_through_a_checkpoint_into_another_stage(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(train_parallel, 2, 3, False, directory, timeout=240)[0]["weights"]
    for loaded in run_distributed(load_parallel, 2, 2, directory, timeout=240):
        for name, weight in saved.items():
            assert torch.equal(loaded[name], weight), name
    loaded_back = run_distributed(load_parallel, 2, 3, directory, timeout=240)[1]
    for name, weight in saved.items():
        assert torch.equal(loaded_back[name], weight), name
