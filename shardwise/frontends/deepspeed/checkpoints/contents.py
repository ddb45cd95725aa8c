"""What a DeepSpeed checkpoint holds, once its files are read: the same facts whatever
layout (ZeRO stage, precision, pipeline, universal) DeepSpeed wrote them in.

Trained parameters come as pieces (a parameter name, an element range, and the fp32 master
values and per-element optimizer state of those elements), which is exactly how shardwise's
checkpoints store them, so its loader reads them into any world size and stage. Everything
else is whole: frozen parameters and buffers, the optimizer's per-group hyper-parameters
and step, the scheduler, the loss scaler, the counters and the caller's client_state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    group: int | None  # the optimizer param group training it; None: frozen


@dataclass
class Piece:
    """Elements [start, stop) of the flattened parameter `name`: `tensors["value"]` holds
    their fp32 master values, the other entries their per-element optimizer state (Adam's
    `exp_avg`, `exp_avg_sq`, ...), each a flat tensor of stop - start elements."""

    name: str
    start: int
    stop: int
    tensors: dict[str, torch.Tensor]
    rank: int  # the DeepSpeed data-parallel rank whose file held it


@dataclass
class DeepSpeedContents:
    directory: Path  # the tag's folder
    layout: str  # how DeepSpeed wrote it, for messages: "ZeRO-2 (bf16)", "universal", ...
    stage: int
    world_size: int  # the data-parallel size that wrote it
    dtype: torch.dtype  # of the model's weights while training
    parameters: list[Parameter]  # in the model's order
    pieces: list[Piece]
    whole: dict[str, torch.Tensor]  # frozen parameters and persistent buffers, whole
    buffers: list[str]
    param_groups: list[dict[str, Any]]  # each group's hyper-parameters (lr, betas, eps, weight_decay, ...)
    group_steps: list[int | None]  # each group's optimizer step count (None: it has not stepped)
    optimizer_type: str | None  # the config's optimizer.type, when the config had one
    lr_scheduler: dict | None
    loss_scaler: dict | None  # as shardwise's LossScaler.state_dict(); None: no dynamic scaling
    global_steps: int
    skipped_steps: int
    global_samples: int | None
    gradient_accumulation_steps: int | None
    client_state: dict[str, Any]
    ds_config: dict[str, Any] = field(default_factory=dict)
    random_ltd: dict[str, int] | None = None  # the random-LTD scheduler's counters; None: not trained with it

    @property
    def state_names(self) -> list[str]:
        """The per-element optimizer states the pieces carry (Adam: exp_avg, exp_avg_sq)."""
        names: dict[str, None] = {}
        for piece in self.pieces:
            names.update(dict.fromkeys(key for key in piece.tensors if key != "value"))
        return list(names)
