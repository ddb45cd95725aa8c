"""Each recomputation policy, applied from outside to shardwise's GPT and to Hugging Face
decoders, computes exactly what the model computes without it (dropout included), re-runs
the layers it should, and frees everything it counted."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.runtime.activation import RecomputePolicy, apply_activation_checkpointing
from shardwise.runtime.activation.checkpoint import NOT_COUNTED
from shardwise.runtime.activation.policy import sqrt_segment
from tests.runtime.activation.workers import VOCAB, batch, measure, tiny_gpt, with_policy

POLICIES = ["full", "every_k", "selective", "sqrt"]


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_equals_no_recomputation_with_dropout(policy):
    model = tiny_gpt(n_layer=5, dropout=0.2)
    loss, grads, plain = measure(with_policy(model, "none"))
    loss_r, grads_r, tracker = measure(with_policy(model, policy), count_ops=True)
    assert loss_r == loss
    for got, want in zip(grads_r, grads):
        assert torch.equal(got, want)
    regions = {"full": 5, "selective": 5, "every_k": 3, "sqrt": 2}[policy]  # every_k: 0, 2, 4; sqrt: 3 + 2
    assert (tracker.recomputed_regions, tracker.recomputed_layers) == (regions, 3 if policy == "every_k" else 5)
    assert tracker.recomputed_ops > 0
    assert plain.recomputed_ops == 0
    assert sum(tracker.current.values()) == 0 and sum(plain.current.values()) == 0  # all freed


def test_selective_recomputes_fewer_operators_than_full():
    model = tiny_gpt(n_layer=2, dropout=0.0)
    full = measure(with_policy(model, "full"), count_ops=True)[2]
    selective = measure(with_policy(model, "selective"), count_ops=True)[2]
    assert selective.recomputed_ops < full.recomputed_ops
    assert selective.breakdown()["checkpoints"] > full.breakdown()["checkpoints"]  # the cached matmul outputs


class _Ops(TorchDispatchMode):
    """Counts aten operators as the recomputation's counter does."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func not in NOT_COUNTED
        return func(*args, **(kwargs or {}))


def test_recompute_count_is_the_forward_ops_of_the_recomputed_layers():
    """Run to the end (early stop off), a recomputation re-runs exactly the forward's
    operators of its layers; selective serves its 4 linear outputs per block from the cache.
    torch's early stop skips the operators after the last tensor backward needs."""
    model = tiny_gpt(n_layer=3, dropout=0.1)
    counter, hidden = _Ops(), torch.randn(2, 16, 32, requires_grad=True)
    with counter:
        model.blocks[0](hidden)
    block = counter.count
    expected = {"full": 3 * block, "selective": 3 * (block - 4), "every_k": 2 * block, "sqrt": 3 * block}
    for policy, ops in expected.items():
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            assert measure(with_policy(model, policy), count_ops=True)[2].recomputed_ops == ops, policy
        early = measure(with_policy(model, policy), count_ops=True)[2].recomputed_ops
        assert ops - 3 * 2 <= early < ops, (policy, early)  # the block's last ops: dropout's mul, residual add


def test_every_k_and_sqrt_regions():
    assert [list(r) for r in RecomputePolicy("every_k", every_k=3).regions(7)] == [[0], [3], [6]]
    assert [list(r) for r in RecomputePolicy("sqrt").regions(10)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [sqrt_segment(n) for n in (1, 4, 5, 16, 64)] == [1, 2, 3, 4, 8]
    assert RecomputePolicy("none").regions(4) == []


def test_eval_and_no_grad_run_plainly():
    model = tiny_gpt(n_layer=4)
    checkpointed = with_policy(model, "sqrt").eval()
    x, _ = batch(0, 2)
    with torch.no_grad():
        assert torch.equal(checkpointed(x), model.eval()(x))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_hugging_face_decoder_layers_unmodified(build, policy):
    model = build().train()
    x, y = batch(1, 2)

    def run(m):
        torch.manual_seed(5)
        loss = m(input_ids=x, labels=y).loss
        loss.backward()
        return loss.item(), [p.grad.clone() for p in m.parameters()]

    loss, grads = run(with_policy(model, "none"))
    loss_r, grads_r = run(with_policy(model, policy))
    assert abs(loss_r - loss) <= 1e-6 * abs(loss)
    for got, want in zip(grads_r, grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_refusals_name_the_problem():
    model = tiny_gpt()
    apply_activation_checkpointing(model, "full")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="unknown recomputation policy 'half'"):
        RecomputePolicy("half")
    hf = _llama()
    hf.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        apply_activation_checkpointing(hf, "full")
    with pytest.raises(ValueError, match="found no stack of layers"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")
