"""Random layer-wise token dropping (random-LTD; Yao et al., 2022), as DeepSpeed 0.19.8 runs
it (deepspeed/runtime/data_pipeline/data_routing/basic_layer.py, ops/random_ltd/).

Each chosen layer runs on a random subset of every sequence's tokens; the others pass the
layer unchanged:

    kept = sorted random subset of the positions, per sample and per layer (size: the
           schedule's current value, token_schedule.py)
    out  = hidden.clone();  out[b, kept[b]] = layer(hidden[b, kept[b]])

The kept positions stay in their original order, so a decoder's causal mask over them is
the top-left `kept x kept` corner of the full one (DeepSpeed slices it so); an encoder's
mask is gathered by rows and columns per sample. The first chosen layer draws the indices
of all of them, as DeepSpeed's first layer does, and stores them in the state the layers
share. Gradients: the kept positions get the gradient through the layer and the dropped
ones the gradient that passed them by, which is what DeepSpeed's GatherTokens /
ScatterTokens kernels compute (its scatter's backward overwrites the pass-by gradient at
the kept positions).

DeepSpeed draws with the process's global generator (torch.multinomial). shardwise draws
from a generator seeded by (seed, data-parallel rank, step, draw within the step), so a
run is reproducible, a resumed run draws what the uninterrupted one would, the ranks of a
tensor-parallel group (one data slice) drop the same tokens, and a single-process
reference can draw each rank's indices (`draw_kept_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn

from shardwise.runtime.data.token_schedule import RandomLTDScheduler

# (layer kwargs, kept indices [batch, kept], batch_first) -> kwargs for the kept tokens
KeptInputs = Callable[[dict[str, Any], torch.Tensor, bool], dict[str, Any]]

_MIX = 1_000_003  # an odd prime: mixes the seed's parts into one generator seed


@dataclass(frozen=True)
class RandomLTDPolicy:
    """`data_efficiency.data_routing.random_ltd` as typed settings.

    `layer_ids`: indices of the token-dropping layers among the model's `total_layer_num`
    repeated layers; `min_value` / `max_value`: kept tokens at step 0 / at the end of the
    schedule, which rises linearly over `require_steps` in multiples of `seq_per_step`;
    `global_batch_size`: samples per optimizer step (the consumed layer-token count);
    `mask_name`: the layer's keyword argument holding the attention mask (None: the layer
    has none, or the model family slices its inputs itself); `seed`: the draws' seed."""

    total_layer_num: int
    layer_ids: tuple[int, ...]
    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int
    global_batch_size: int
    model_type: Literal["decoder", "encoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    mask_name: str | None = None
    seed: int = 1234

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.total_layer_num:
            raise ValueError(f"random_ltd_layer_id {list(ids)}: give distinct layer indices in "
                             f"[0, total_layer_num={self.total_layer_num})")
        if not 0 < self.min_value <= self.max_value:
            raise ValueError(f"random_ltd_schedule: need 0 < min_value <= max_value, got min_value {self.min_value}, "
                             f"max_value {self.max_value}")
        if self.require_steps < 1 or self.seq_per_step < 1:
            raise ValueError(f"random_ltd_schedule.schedule_config: require_steps ({self.require_steps}) and "
                             f"seq_per_step ({self.seq_per_step}) must be at least 1")
        if self.model_type not in ("decoder", "encoder"):
            raise ValueError(f"random_ltd.model_type {self.model_type!r}: DeepSpeed runs 'decoder' or 'encoder'")
        if self.hidden_state_order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"random_ltd.hidden_state_order {self.hidden_state_order!r}: DeepSpeed runs "
                             "'batch_seq_dim' or 'seq_batch_dim'")
        if self.model_type == "encoder" and self.mask_name is None:
            raise ValueError("random_ltd.model_type 'encoder' needs model_mask_name: an encoder's mask is gathered "
                             "for the kept tokens (DeepSpeed asserts it is given)")

    @property
    def batch_first(self) -> bool:
        return self.hidden_state_order == "batch_seq_dim"

    def scheduler_config(self) -> dict[str, Any]:
        """DeepSpeed's `random_ltd` dict, as RandomLTDScheduler reads it."""
        return {
            "total_layer_num": self.total_layer_num,
            "random_ltd_layer_num": len(self.layer_ids),
            "global_batch_size": self.global_batch_size,
            "random_ltd_schedule": {
                "min_value": self.min_value, "max_value": self.max_value, "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": self.require_steps, "seq_per_step": self.seq_per_step},
            },
        }


def draw_kept_indices(*, seed: int, data_rank: int, step: int, draw: int, layers: int, batch: int,
                      seq: int, kept: int) -> torch.Tensor:
    """[layers, batch, kept] sorted positions, each row a uniform random `kept`-subset of
    range(seq) (DeepSpeed: multinomial without replacement, then token_sort_), from a
    generator seeded by what identifies the draw."""
    generator = torch.Generator().manual_seed((((seed * _MIX + data_rank) * _MIX + step) * _MIX + draw) % 2**63)
    order = torch.rand(layers * batch, seq, generator=generator).argsort(dim=-1)
    return order[:, :kept].sort(dim=-1).values.reshape(layers, batch, kept)


class RandomLTDState:
    """What the token-dropping layers of one model share (DeepSpeed keeps it in its
    scheduler's `state`): the schedule, and the indices the first layer drew."""

    def __init__(self, policy: RandomLTDPolicy, *, data_rank: int):
        self.policy = policy
        self.data_rank = data_rank
        self.scheduler = RandomLTDScheduler(policy.scheduler_config())
        self.layer_num = len(policy.layer_ids)
        self.indices: torch.Tensor | None = None  # [layers, batch, kept], drawn by the first layer
        self._draws_in_step = 0
        self._step = -1

    def update_seq(self, global_steps: int) -> None:
        """Before each training forward (DeepSpeed's engine calls it in _forward_prologue)."""
        self.scheduler.update_seq(global_steps)

    def kept(self) -> int:
        return self.scheduler.get_current_seq()

    def draw(self, *, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        step = self.scheduler.state["current_steps"]
        if step != self._step:
            self._step, self._draws_in_step = step, 0
        indices = draw_kept_indices(seed=self.policy.seed, data_rank=self.data_rank, step=step,
                                    draw=self._draws_in_step, layers=self.layer_num, batch=batch, seq=seq,
                                    kept=self.kept())
        self._draws_in_step += 1
        self.indices = indices.to(device)
        return self.indices

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """hidden[b, indices[b]] ([batch, kept, ...], or [kept, batch, ...] seq-first)."""
    if not batch_first:
        return gather_tokens(hidden.transpose(0, 1), indices, True).transpose(0, 1)
    index = indices.reshape(*indices.shape, *([1] * (hidden.dim() - 2))).expand(-1, -1, *hidden.shape[2:])
    return hidden.gather(1, index)


def scatter_tokens(hidden: torch.Tensor, kept: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """A copy of `hidden` with the kept positions replaced by `kept`."""
    if not batch_first:
        return scatter_tokens(hidden.transpose(0, 1), kept.transpose(0, 1), indices, True).transpose(0, 1)
    index = indices.reshape(*indices.shape, *([1] * (hidden.dim() - 2))).expand(-1, -1, *hidden.shape[2:])
    return hidden.scatter(1, index, kept.to(hidden.dtype))


def kept_mask(mask: torch.Tensor, indices: torch.Tensor, model_type: str) -> torch.Tensor:
    """The attention mask for the kept tokens, as DeepSpeed makes it: a decoder's
    [batch, 1, seq, seq] causal mask's top-left corner; an encoder's rows and columns of
    the kept positions, per sample."""
    kept = indices.shape[-1]
    if model_type == "decoder":
        return mask[:, :, :kept, :kept]
    rows = [mask[b:b + 1, :, indices[b], :][:, :, :, indices[b]] for b in range(indices.shape[0])]
    return torch.cat(rows, dim=0)


class RandomLayerTokenDrop(nn.Module):
    """DeepSpeed's wrapper: `random_ltd_layer` runs on the kept tokens while training, once
    `attach` has given it the model's shared state and its position among the dropping
    layers; otherwise (evaluation, not attached, nothing to drop) it runs on all of them."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None  # DeepSpeed's attribute
        self.random_ltd_state: RandomLTDState | None = None
        self.random_ltd_layer_id = -1
        self.kept_inputs: KeptInputs | None = None

    def attach(self, state: RandomLTDState, position: int, kept_inputs: KeptInputs | None = None) -> None:
        """`position`: this layer's place among the dropping layers (0 draws for all);
        `kept_inputs`: the model family's slicing of the layer's other inputs."""
        self.random_ltd_state = state
        self.random_ltd_scheduler = state.scheduler
        self.random_ltd_layer_id = position
        self.kept_inputs = kept_inputs

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = self.random_ltd_state
        if state is None or not self.training:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        policy = state.policy
        seq_dim = 1 if policy.batch_first else 0
        seq, batch = hidden_states.shape[seq_dim], hidden_states.shape[1 - seq_dim]
        if state.kept() >= seq:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        if self.random_ltd_layer_id == 0:
            state.draw(batch=batch, seq=seq, device=hidden_states.device)
        if state.indices is None:
            raise RuntimeError("random-LTD: a dropping layer ran before the first one drew the kept tokens; the "
                               "layers in random_ltd_layer_id must run in the model's order")
        indices = state.indices[self.random_ltd_layer_id].long()
        if self.kept_inputs is not None:
            kwargs = self.kept_inputs(kwargs, indices, policy.batch_first)
        elif policy.mask_name is not None and kwargs.get(policy.mask_name) is not None:
            kwargs = {**kwargs, policy.mask_name: kept_mask(kwargs[policy.mask_name], indices, policy.model_type)}
        outputs = self.random_ltd_layer(gather_tokens(hidden_states, indices, policy.batch_first), *args, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, indices, policy.batch_first)
        if isinstance(outputs, tuple):
            return (scatter_tokens(hidden_states, outputs[0], indices, policy.batch_first), *outputs[1:])
        raise TypeError(f"random-LTD: {type(self.random_ltd_layer).__name__} returned {type(outputs).__name__}; the "
                        "wrapped layer must return its hidden states as a tensor or as a tuple's first item "
                        "(as DeepSpeed requires)")


def wrap_layers(layers: nn.ModuleList, state: RandomLTDState, kept_inputs: KeptInputs | None = None) -> None:
    """Wrap `layers[i]` for each i in the policy's `layer_ids`, in order."""
    policy = state.policy
    if len(layers) != policy.total_layer_num:
        raise ValueError(f"random_ltd.total_layer_num is {policy.total_layer_num} but the model has {len(layers)} "
                         "layers: set it to the model's layer count")
    for position, index in enumerate(sorted(policy.layer_ids)):
        wrapper = RandomLayerTokenDrop(layers[index])
        wrapper.attach(state, position, kept_inputs)
        layers[index] = wrapper


def random_ltd_state(model: nn.Module) -> RandomLTDState | None:
    """The state the model's token-dropping layers share, if it has any attached."""
    for module in model.modules():
        if isinstance(module, RandomLayerTokenDrop) and module.random_ltd_state is not None:
            return module.random_ltd_state
    return None
