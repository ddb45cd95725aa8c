"""An engine without an optimizer (DeepSpeed-Chat's and OpenRLHF's reference and reward
models, Hugging Face's evaluation-only runs): forward only, the parameters held as ZeRO
holds trained ones (1/N each at stage 3) and nothing else.

The run is an RLHF-shaped step: an actor engine trains on its loss plus a penalty towards
a frozen reference copy whose logits come from the forward-only engine. It must equal
plain PyTorch on the same global batch at every stage, the reference engine must hold
no optimizer state or gradients, and at stage 3 only its 1/N share of the weights."""

import copy

import pytest
import torch

import shardwise
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch

MICRO, STEPS, BETA, LR = 2, 3, 0.5, 1e-2


def _penalised_loss(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    task = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return task + BETA * (logits - reference).square().mean()


def _config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64,
                                  "reduce_bucket_size": 3000},
            "bf16": {"enabled": dtype == "bf16"}}


def rlhf_parallel(rank: int, world_size: int, stage: int, dtype: str) -> dict:
    actor = build_model("gpt")
    reference_model = copy.deepcopy(actor)
    numel = sum(param.numel() for param in reference_model.parameters())
    config = _config(stage, dtype)
    actor_engine = shardwise.initialize(actor, config, optimizer=torch.optim.SGD(actor.parameters(), lr=LR))
    reference = shardwise.initialize(reference_model, config)
    reference.eval()
    losses, reference_logits = [], []
    for step in range(STEPS):
        x, y = (tensor.to(actor_engine.device) for tensor in global_batch(step, MICRO * world_size))
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        with torch.no_grad():
            ref = reference(x[rows])
        reference_logits.append(ref.float().cpu())
        loss = _penalised_loss(actor_engine(x[rows]).float(), ref.float(), y[rows])
        actor_engine.backward(loss)
        actor_engine.step()
        losses.append(loss.item())
    reference.reset_comm_volume()
    with torch.no_grad():
        reference(x[rows])
    forward_volume = reference.comm_volume()
    partitioned = [unit for unit in reference.units if unit.index in reference.zero.params.sharded.flats] \
        if stage == 3 else []
    expected_volume = sum(unit.padded_numel for unit in partitioned) * reference.dtype.itemsize * (world_size - 1) \
        // world_size
    refused = []
    for call in (lambda: reference.backward(ref.sum()), reference.step):
        try:
            call()
        except RuntimeError as error:
            refused.append(str(error))
    with shardwise.gathered_parameters(list(reference.module.parameters())):
        reference_weights = {name: param.detach().to("cpu", torch.float32, copy=True)
                             for name, param in reference.module.named_parameters()}
    breakdown = reference.memory_breakdown()
    return {"losses": losses, "reference_logits": torch.cat(reference_logits), "refused": refused,
            "memory": breakdown, "numel": numel, "reference_weights": reference_weights,
            "optimizer": reference.optimizer, "forward_volume": forward_volume, "expected_volume": expected_volume}


def rlhf_reference(world_size: int) -> dict:
    actor = build_model("gpt")
    reference_model = copy.deepcopy(actor).eval()
    optimizer = torch.optim.SGD(actor.parameters(), lr=LR)
    losses, reference_logits = [], []
    for step in range(STEPS):
        x, y = global_batch(step, MICRO * world_size)
        with torch.no_grad():
            ref = reference_model(x)
        reference_logits.append(ref)
        per_rank = [_penalised_loss(actor(x[r * MICRO:(r + 1) * MICRO]), ref[r * MICRO:(r + 1) * MICRO],
                                    y[r * MICRO:(r + 1) * MICRO]) for r in range(world_size)]
        loss = torch.stack(per_rank).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append([value.item() for value in per_rank])
    return {"losses": losses, "reference_logits": torch.cat(reference_logits),
            "reference_weights": {name: param.detach().clone() for name, param in reference_model.named_parameters()}}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reference_engine_equals_plain_torch(stage):
    world = 2
    results = run_distributed(rlhf_parallel, world, stage, "fp32", timeout=240)
    expected = rlhf_reference(world)
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert abs(result["losses"][step] - expected["losses"][step][rank]) < 1e-5 * abs(expected["losses"][step][rank])
        rows = torch.cat([expected["reference_logits"][s * MICRO * world + rank * MICRO:][:MICRO]
                          for s in range(STEPS)])
        assert _relative(result["reference_logits"], rows) < 1e-5
        for name, weight in expected["reference_weights"].items():  # never updated, identical on every rank
            assert torch.equal(result["reference_weights"][name], weight), name
        assert len(result["refused"]) == 2
        assert all("no optimizer, so it only runs forward" in text for text in result["refused"])
        assert result["optimizer"] is None
        # stage 3: one all-gather of every partitioned unit per forward, b·Ψ(N-1)/N, and the
        # forward's 16-byte check that every rank runs it (zero/gather_schedule.py); nothing else
        sent = {key: value for key, value in result["forward_volume"].items() if value}
        volume = {"all_gather": result["expected_volume"], "control": 16} if stage == 3 else {}
        assert sent == volume, result["forward_volume"]
        memory = result["memory"]
        assert not memory.get("optimizer_states") and not memory.get("gradients"), memory
        if stage == 3:  # 1/N of the weights, plus alignment padding and the small persistent ones
            assert memory["params"] < 0.6 * result["numel"] * 4, memory
        else:
            assert memory["params"] >= result["numel"] * 4


def test_reference_engine_in_bf16_holds_16_bit_shards():
    results = run_distributed(rlhf_parallel, 2, 3, "bf16", timeout=240)
    expected = rlhf_reference(2)
    for rank, result in enumerate(results):
        rows = torch.cat([expected["reference_logits"][s * MICRO * 2 + rank * MICRO:][:MICRO] for s in range(STEPS)])
        assert _relative(result["reference_logits"], rows) < 2e-2
        assert result["memory"]["params"] < 0.6 * result["numel"] * 2, result["memory"]


def load_into_reference(rank: int, world_size: int, stage: int, directory: str) -> dict:
    trained_model = build_model("gpt")
    trainer = shardwise.initialize(trained_model, _config(2, "fp32"),
                                   optimizer=torch.optim.SGD(trained_model.parameters(), lr=LR))
    for step in range(2):
        x, y = global_batch(step, MICRO * world_size)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        trainer.backward(_penalised_loss(trainer(x[rows]).float(), torch.zeros(()), y[rows]))
        trainer.step()
    trainer.save_checkpoint(directory, tag="trained")
    probe = global_batch(9, MICRO)[0]
    trainer.eval()
    with torch.no_grad():
        expected = trainer(probe)
    torch.manual_seed(rank + 50)
    fresh = build_model("gpt")
    for param in fresh.parameters():
        param.data.normal_()  # nothing of these survives the load
    reference = shardwise.initialize(fresh, _config(stage, "fp32"))
    reference.eval()
    client_state = reference.load_checkpoint(directory, tag="trained")
    with torch.no_grad():
        loaded = reference(probe)
    return {"expected": expected, "loaded": loaded, "client_state": client_state}


@pytest.mark.parametrize("stage", [0, 3])
def test_reference_engine_loads_the_weights_of_a_training_checkpoint(stage, tmp_path):
    for result in run_distributed(load_into_reference, 2, stage, str(tmp_path / "ckpt"), timeout=240):
        assert torch.equal(result["loaded"], result["expected"])
        assert result["client_state"] == {}
