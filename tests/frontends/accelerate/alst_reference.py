"""The model, data and optimizer of scripts/alst_accelerate.py, and the single-process
reference its ALST loop must equal."""

from __future__ import annotations

import torch

SEQUENCES = torch.arange(1, 32 * 4 + 1).view(4, 32) * 7 % 509  # four sequences of 32 tokens


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)  # eps: ADAM_EPS's reason


def reference_losses() -> list[float]:
    """Whole sequences in one process, one step each, in the order the sequence group
    trains them: accelerate gives rank 0 sequences 0 and 2, rank 1 sequences 1 and 3, and
    each refill of the adapter trains rank 0's, then rank 1's."""
    model, optimizer = build_model()
    losses = []
    for ids in SEQUENCES:
        loss = model(input_ids=ids[None], labels=ids[None], position_ids=torch.arange(ids.shape[0])[None]).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses
