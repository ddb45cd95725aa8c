"""A small GPT (nanoGPT-shaped) used by the main job, the tests and the benchmarks.

It is a plain `nn.Module` with no knowledge of parallelism: shardwise's parallelisms are
applied to models from the outside, and this model is just a realistic subject for them
(embedding tied to the output layer, pre-norm blocks, fused attention).

With `moe_experts` > 0, every `moe_every`-th block's MLP is a mixture of that many
MLP experts (the runtime's layer, shardwise/runtime/parallel/expert/layer.py: top-1 or
top-2 gating with a capacity, tokens over it dropped), and the load-balancing losses of
those layers, times `moe_aux_loss_coef`, are added to the loss. The model always holds
every expert; `moe_ep_size` P > 1 asks `parallelize` to keep 1/P of them on each rank of
an expert group (models/gpt/parallelize.py), so the same config, unsplit, is the
every-expert reference. Routing is deterministic (no Random Token Selection, no sampled
second expert), so a split model routes exactly as the every-expert one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.parallel.expert.gating import TopKGate
from shardwise.runtime.parallel.expert.layer import ExpertList, MixtureOfExperts


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    moe_experts: int = 0  # experts per MoE block; 0: every block dense
    moe_top_k: int = 1  # experts per token (1 or 2)
    moe_every: int = 1  # blocks n-1, 2n-1, ... are MoE (1: every block)
    moe_capacity_factor: float = 1.0  # expert capacity: ceil(tokens / experts * factor) (x k), per rank
    moe_min_capacity: int = 4
    moe_aux_loss_coef: float = 0.01  # times the load-balancing losses, added to the loss
    moe_ep_size: int = 1  # expert-parallel size parallelize splits the experts over

    def __post_init__(self) -> None:
        if self.moe_experts < 0 or self.moe_every < 1 or self.moe_top_k not in (1, 2):
            raise ValueError(f"GPTConfig: moe_experts {self.moe_experts} (>= 0), moe_every {self.moe_every} (>= 1) "
                             f"and moe_top_k {self.moe_top_k} (1 or 2) are out of range")
        if self.moe_experts and (self.moe_ep_size < 1 or self.moe_experts % self.moe_ep_size):
            raise ValueError(f"GPTConfig: moe_ep_size {self.moe_ep_size} must divide moe_experts "
                             f"{self.moe_experts} (each rank of an expert group holds experts / ep_size)")

    def is_moe_block(self, index: int) -> bool:
        return self.moe_experts > 0 and (index + 1) % self.moe_every == 0

    @staticmethod
    def preset(name: str) -> "GPTConfig":
        """Byte-level presets by approximate parameter count."""
        presets = {
            "tiny": GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32),
            "1m": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
            "10m": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
            "25m": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
            "100m": GPTConfig(block_size=256, n_layer=14, n_head=12, n_embd=768),
        }
        if name not in presets:
            raise ValueError(f"unknown GPT preset {name!r}; choose from {sorted(presets)}")
        return presets[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


def mixture_of_mlps(config: GPTConfig) -> MixtureOfExperts:
    """`moe_experts` MLPs behind a router, each initialised on its own."""
    gate = TopKGate(config.n_embd, config.moe_experts, k=config.moe_top_k, capacity_factor=config.moe_capacity_factor,
                    eval_capacity_factor=config.moe_capacity_factor, min_capacity=config.moe_min_capacity,
                    use_rts=False, top2_2nd_expert_sampling=False)
    experts = ExpertList(MLP(config) for _ in range(config.moe_experts))
    return MixtureOfExperts(gate, experts, num_experts=config.moe_experts, ep_size=config.moe_ep_size)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, moe: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = mixture_of_mlps(config) if moe else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_block(index)) for index in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self.init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """Initialise one module's own parameters; also usable as `param_init_fn` for a
        model built on the meta device."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when `targets` are given."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        if targets is not None and getattr(self.lm_head, "computes_loss", False):
            # a fused output layer + loss (shardwise.runtime.ops) skips the logits
            return self.lm_head(hidden, targets) + self.auxiliary_loss()
        logits = self.lm_head(hidden)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1)) + self.auxiliary_loss()

    def auxiliary_loss(self) -> torch.Tensor | float:
        """`moe_aux_loss_coef` times the sum of the MoE blocks' load-balancing losses of the
        last forward (0 for a dense model). Found among all modules, not by block: a block
        may be wrapped (random-LTD, activation checkpointing)."""
        if not self.config.moe_experts:
            return 0.0  # a dense model: no walk over the modules in every forward
        losses = [module.l_aux for module in self.modules() if isinstance(module, MixtureOfExperts)]
        return self.config.moe_aux_loss_coef * torch.stack(losses).sum() if losses else 0.0

    def flops_per_token(self) -> int:
        """Training FLOPs per token (6N + attention), as in the PaLM appendix; N counts the
        parameters a token goes through (an MoE block's router and top-k of its experts)."""
        n_params = sum(p.numel() for p in self.parameters())
        for moe in (module for module in self.modules() if isinstance(module, MixtureOfExperts)):
            per_expert = sum(p.numel() for p in moe.experts.local[0].parameters())
            n_params -= per_expert * (moe.num_local_experts - self.config.moe_top_k)
        layers, embd, time = self.config.n_layer, self.config.n_embd, self.config.block_size
        return 6 * n_params + 12 * layers * embd * time

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :].float() / temperature
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx
