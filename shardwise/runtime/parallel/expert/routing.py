"""Moving tokens along the router's masks (gating.py) into the experts' slots and back."""

from __future__ import annotations

import torch


class Routes:
    """Where each routed token goes: the (token, expert, slot) triples of the dispatch mask
    and their gate weights. Moving tokens by index costs O(routes · d), where the dense
    einsum over the (S, E, C) mask costs O(S · E · C · d) to move the same values (the
    benchmark in BENCHMARKS.md measured it at half the layer's time); the results are the
    same (a slot holds one token, so each sum of the einsum has one term per route)."""

    def __init__(self, token: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, *, tokens: int,
                 experts: int, capacity: int):
        self.token, self.slot, self.weight = token, slot, weight
        self.tokens, self.experts, self.capacity = tokens, experts, capacity

    @classmethod
    def of(cls, dispatch: torch.Tensor, combine: torch.Tensor) -> "Routes":
        tokens, experts, capacity = dispatch.shape
        token, expert, slot = dispatch.nonzero(as_tuple=True)
        return cls(token, expert * capacity + slot, combine[token, expert, slot], tokens=tokens, experts=experts,
                   capacity=capacity)

    def dispatch(self, tokens: torch.Tensor) -> torch.Tensor:
        """(E, C, d): each slot's token, zeros where no token was routed."""
        source = torch.full((self.experts * self.capacity,), self.tokens, dtype=torch.long, device=tokens.device)
        source[self.slot] = self.token
        padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])  # row S: the empty slots' zeros
        return padded.index_select(0, source).view(self.experts, self.capacity, -1)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """(S, d): each token's expert outputs weighted by their gates, summed in fp32."""
        width = expert_out.shape[-1]
        routed = expert_out.reshape(-1, width).index_select(0, self.slot).float() * self.weight.float().unsqueeze(1)
        out = torch.zeros(self.tokens, width, dtype=torch.float32, device=expert_out.device)
        return out.index_add(0, self.token, routed).to(expert_out.dtype)
