"""The pieces of tensor parallelism, one at a time: the vocabulary-parallel loss against
F.cross_entropy, the loss Hugging Face models compute from labels=, and the errors for
models and configs that cannot be split."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.unit_workers import (
    TwoLayers,
    cross_entropy_pieces,
    hf_labels_loss,
    initialize_error,
    train_with_user_plan,
    two_layer_batch,
)
from tests.runtime.zero.workers import build_model, global_batch


def test_vocab_parallel_cross_entropy_equals_full_cross_entropy_with_ignored_targets():
    results = run_distributed(cross_entropy_pieces, 2)
    logits = results[0]["logits"].clone().requires_grad_()
    target = results[0]["target"]
    expected = {r: F.cross_entropy(logits, target, reduction=r) for r in ("mean", "sum", "none")}
    (expected["none"] * torch.arange(12)).sum().backward()
    for rank, result in enumerate(results):
        for reduction, loss in result["losses"].items():
            torch.testing.assert_close(loss, expected[reduction].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["grad"], logits.grad.chunk(2, dim=1)[rank], rtol=1e-12, atol=1e-12)
        assert f"this rank holds vocabulary rows {5 * rank}-{5 * rank + 5} of 10 only" in result["softmax"]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hugging_face_labels_loss_is_right_under_tensor_parallelism(model):
    results = run_distributed(hf_labels_loss, 2, model)
    reference = build_model(model)
    x, _ = global_batch(0, 3)
    labels = x.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        expected = reference(input_ids=x, labels=labels).loss
        summed = reference(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    for result in results:
        torch.testing.assert_close(result["loss"], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(result["summed"], summed, rtol=1e-6, atol=0)


def test_heads_not_divisible_by_the_tensor_size_is_an_error_naming_the_key():
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 2}}
    message = run_distributed(initialize_error, 2, config)[0]
    assert "tensor_parallel.size 2 must divide" in message
    assert "attention heads (n_head) 3" in message


@pytest.mark.parametrize("config, expected", [
    ({"tensor_parallel": {"sequence_parallel": True}}, "tensor_parallel.sequence_parallel needs tensor_parallel.size > 1"),
    ({"tensor_parallel": {"size": 2}, "sequence_parallel": {"size": 2, "mode": "megatron"}},
     "sequence_parallel.size 2 with Megatron sequence parallelism"),
    ({"tensor_parallel": {"size": 3}}, "world size 4 is not divisible by tensor_parallel.size 3"),
])
def test_contradictory_parallel_settings_are_errors(config, expected):
    with pytest.raises(ConfigError) as error:
        load_config({"train_micro_batch_size_per_gpu": 1, **config}, world_size=4)
    assert expected in str(error.value)


def test_a_user_plan_splits_a_model_without_a_built_in_plan():
    results = run_distributed(train_with_user_plan, 2, {"fc1": "colwise", "fc2": "rowwise"})
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = model(*two_layer_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["params"][name], param.detach(), rtol=1e-5, atol=1e-7)


def test_no_plan_and_bad_plans_are_errors_naming_the_key():
    missing, typo, style = (run_distributed(train_with_user_plan, 2, plan)[0]["error"] for plan in (
        None, {"fc1": "colwise", "fc3": "rowwise"}, {"fc1": "columnwise"}))
    assert "tensor_parallel.plan: shardwise has no tensor-parallel plan for TwoLayers" in missing
    assert "no module of TwoLayers matches 'fc3'" in typo
    assert "unknown tensor-parallel style 'columnwise'" in style


def test_a_fused_projection_of_unequal_parts_splits_each_part():
    """q of 8 rows, k and v of 4 (grouped key/value heads): rank r keeps its half of each,
    and its placement maps every local element back to where it is in the whole."""
    from shardwise.runtime.parallel.tensor.placement import shard_parameter, tensor_shard

    full = torch.arange(16 * 3).reshape(16, 3).float()
    for rank, rows in ((0, [*range(0, 4), 8, 9, 12, 13]), (1, [*range(4, 8), 10, 11, 14, 15])):
        local = shard_parameter(torch.nn.Parameter(full.clone()), 0, (8, 4, 4), rank, 2)
        assert torch.equal(local.data, full[rows])
        shard = tensor_shard(local)
        assert shard.parts == (8, 4, 4) and shard.local_shape == (8, 3)
        flat = [index for first, last, _ in shard.global_runs(0, local.numel()) for index in range(first, last)]
        assert flat == full[rows].reshape(-1).long().tolist()
    with pytest.raises(ValueError, match="do not make up"):
        shard_parameter(torch.nn.Parameter(full.clone()), 0, (8, 4, 2), 0, 2)
