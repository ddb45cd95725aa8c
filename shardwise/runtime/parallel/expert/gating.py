"""The router of a mixture-of-experts layer: which experts each token goes to, and how
much of each expert's output it takes back.

Per token, the gate's softmax over E experts picks the top 1 or 2; each expert takes at
most `capacity` tokens, ⌈S/E · capacity_factor⌉ (× k for top-2) but no fewer than
`min_capacity`, of the S tokens this rank holds. Tokens over capacity are dropped (their
output is zero): in arrival order for top-2, chosen at random for top-1 with Random Token
Selection (`use_rts`), or none with `drop_tokens=False` (capacity = the fullest expert's
count). The gate gives dense one-hot masks (DeepSpeed's form): dispatch (S, E, C) sends
tokens into per-expert slots, and the combine weights (the gate probabilities, top-2
renormalised over the pair) bring the experts' outputs back (routing.py moves the tokens
along them). The auxiliary load-balancing loss is E · Σ_e mean_s(gate_e) · fraction routed
to e (top-2: the mean, × E²), for the model to add to its loss.

Capacity is per rank: it counts the tokens this rank routes, so a layer whose experts are
split over ranks drops exactly the tokens the every-expert layer would drop for the same
rank's tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

JITTER_EPSILON = 1e-2  # the Switch Transformer's multiplicative input noise (noisy_gate_policy "Jitter")


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens / experts * factor), min_capacity)


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    uniform = torch.rand(shape, device=device).clamp(1e-20, 1.0)
    return -torch.log(-torch.log(uniform) + 1e-20)


def _slots(locations: torch.Tensor, mask: torch.Tensor, slots: int) -> torch.Tensor:
    """(S, C) one-hot of each token's slot in its expert's buffer (zero where dropped)."""
    return F.one_hot((locations * mask).sum(dim=1), num_classes=slots).float()


def top1_gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None,
                noisy_gate_policy: str | None, drop_tokens: bool, use_rts: bool):
    """(l_aux, combine_weights (S, E, C), dispatch_mask, exp_counts) for top-1 routing."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    slots = capacity(tokens, experts, capacity_factor, min_capacity)
    scores = logits + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(scores.argmax(dim=1), num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.unsqueeze(1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        slots = min(int(exp_counts.max()), tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
    ranked = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    if tokens < slots:
        raise ValueError(f"MoE: {tokens} tokens on this rank, fewer than the expert capacity {slots} "
                         "(min_capacity); lower min_capacity or give each rank more tokens")
    kept = torch.zeros_like(mask).scatter_(0, torch.topk(ranked, k=slots, dim=0).indices, 1)
    mask = mask * kept
    locations = torch.cumsum(mask, dim=0) - 1
    combine = torch.einsum("se,sc->sec", gates * mask.float(), _slots(locations, mask, slots))
    return l_aux, combine, combine.bool(), exp_counts


def top2_gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool,
                second_expert_sampling: bool):
    """Top-2 routing: the best expert, and a second one (sampled with Gumbel noise by
    default); the pair's probabilities renormalised to sum to one."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    mask1 = F.one_hot(gates.argmax(dim=1), num_classes=experts)
    noisy = logits + gumbel_noise(logits.shape, logits.device) if second_expert_sampling else logits
    mask2 = F.one_hot(noisy.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1), num_classes=experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # after every first choice
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        slots = capacity(tokens, experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < slots)
        mask2 = mask2 * (locations2 < slots)
    else:
        slots = int(exp_counts.max())
    gates1 = (gates * mask1.float()).sum(dim=1)
    gates2 = (gates * mask2.float()).sum(dim=1)
    denominator = (gates1 + gates2).clamp(min=torch.finfo(gates.dtype).eps)
    combine = (torch.einsum("s,se,sc->sec", gates1 / denominator, mask1.float(), _slots(locations1, mask1, slots))
               + torch.einsum("s,se,sc->sec", gates2 / denominator, mask2.float(), _slots(locations2, mask2, slots)))
    return l_aux, combine, combine.bool(), exp_counts


class Fp32Linear(nn.Linear):
    """A linear layer computed in fp32 whatever its weights' dtype (the router's logits
    decide routing; 16-bit rounding would flip near-ties). Its own forward, so ZeRO-3
    gathers its weight like any module's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class TopKGate(nn.Module):
    """The router: a bias-free linear layer in fp32 from the model width to the experts."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"MoE: k={k}; top-1 and top-2 gating are provided")
        self.wg = Fp32Linear(model_dim, num_experts, bias=False).float()
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy, self.drop_tokens = min_capacity, noisy_gate_policy, drop_tokens
        self.use_rts, self.top2_2nd_expert_sampling = use_rts, top2_2nd_expert_sampling

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None):
        hidden = hidden.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            hidden = hidden * torch.empty_like(hidden).uniform_(1 - JITTER_EPSILON, 1 + JITTER_EPSILON)
        logits = self.wg(hidden)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1_gating(logits, factor, self.min_capacity, used_token, policy, self.drop_tokens, self.use_rts)
        return top2_gating(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling)
