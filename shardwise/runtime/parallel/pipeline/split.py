"""Splitting a model into pipeline stages: which layers each rank keeps, and pruning the rest.

Layers are assigned in contiguous runs, one run per virtual stage (p * v of them), by one
of four rules (`pipeline_parallel.partition`):

    parameters   balanced by parameter count, the embedding counted with the first run
                 and the output layer with the last (default; minimises the largest stage)
    time         the same balance of forward + backward time measured per layer, the
                 embedding and the output layer with its loss (timing.py)
    uniform      the same number of layers per run (the count must divide)
    split_points explicit: the index of the first layer of every run after the first

The model is pruned *in place*: each layer list becomes an `nn.ModuleDict` keyed by the
original indices, a layer that is no list's item (an encoder's final norm between two
stacks) is set to None where it does not run, and the first stage's and last stage's
modules are set to None elsewhere, so every parameter a rank keeps has its original fully-qualified name
("blocks.3.attn.qkv.weight") and checkpoints, optimizer groups and Hugging Face exports
keep matching the unsplit model.

An embedding tied to the output layer lives on the first stage. The last stage's output
layer gets a plain tensor in its place, refreshed from the first stage every batch
(runner.py); its accumulated gradient goes back and is added to the embedding's in the
first stage's last backward, so the pair is summed once, as one parameter would be.

The same holds for any module that layers of several stages share (DeepSpeed's
`TiedLayerSpec`: one module object in several places of the layer list): the first stage
using it owns its parameters; on every other rank using it they become plain tensors,
views of one buffer received from the owner every batch, whose gradient goes back to the
owner's last backward (`SharedParameters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.runtime.parallel.pipeline.adapter import Adapter


@dataclass
class LayerCosts:
    """What the balanced split weighs: each layer, and what the first and the last stage
    run besides their layers (embedding; final norm, output layer and loss)."""

    layers: list[int]
    first: int
    last: int


@dataclass
class StageLayout:
    """This rank's share: layer indices per chunk, whether it embeds and/or computes the loss."""

    rank: int
    size: int
    virtual: int
    chunks: list[list[int]]  # indices into `paths`
    first: bool
    last: bool
    tied: bool = False  # the first stage's embedding is the last stage's output weight
    tied_shape: torch.Size | None = None  # the tied output weight the last stage receives
    runs: list[list[int]] = field(default_factory=list)  # every virtual stage's layers
    shared: "SharedParameters | None" = None  # parameters of layers on several ranks
    paths: list[str] = field(default_factory=list)  # every layer's path in the model (Adapter.layer_paths)

    def stage(self, chunk: int) -> int:
        return chunk * self.size + self.rank

    @property
    def last_stage(self) -> int:
        return self.size * self.virtual - 1


@dataclass
class SharedParameters:
    """Parameters that layers on several ranks use, per pair of stages: this rank sends
    the values of `sends[user stage]` (paths in its model, in order) to that stage every
    batch and adds the gradients coming back; it receives `receives[owner stage]` (paths
    and shapes) into one buffer whose views replace those parameters here."""

    sends: dict[int, list[str]] = field(default_factory=dict)
    receives: dict[int, list[tuple[str, torch.Size]]] = field(default_factory=dict)
    requires_grad: dict[int, bool] = field(default_factory=dict)  # per peer stage: whether gradients return


def find_shared_parameters(layers: list[nn.Module], runs: list[list[int]], size: int, rank: int,
                           paths: list[str]) -> SharedParameters | None:
    """Which parameters cross ranks, and this rank's part in moving them (see above)."""
    stage_of = {index: stage for stage, run in enumerate(runs) for index in run}
    uses: dict[int, dict[int, str]] = {}  # parameter -> {virtual stage: its path in that stage's first layer}
    params: dict[int, nn.Parameter] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            params[id(param)] = param
            uses.setdefault(id(param), {}).setdefault(stage_of[index], f"{paths[index]}.{name}")
    crossing = {key: by_stage for key, by_stage in uses.items() if len({stage % size for stage in by_stage}) > 1}
    if crossing and len(runs) != size:
        raise ValueError("pipeline_parallel.virtual_stages > 1 with a module that layers of several ranks share "
                         "(DeepSpeed's TiedLayerSpec) is not supported; use one stage per rank")
    shared = SharedParameters()
    for key, by_stage in crossing.items():
        owner = min(by_stage)
        for stage, path in sorted(by_stage.items()):
            if stage == owner:
                continue
            if owner == rank:
                shared.sends.setdefault(stage, []).append(by_stage[owner])
                shared.requires_grad[stage] = shared.requires_grad.get(stage, False) or params[key].requires_grad
            elif stage == rank:
                shared.receives.setdefault(owner, []).append((path, params[key].shape))
                shared.requires_grad[owner] = shared.requires_grad.get(owner, False) or params[key].requires_grad
    return shared if shared.sends or shared.receives else None


def partition(weights: list[int], parts: int, first_extra: int = 0, last_extra: int = 0,
              rule: str = "parameters", split_points: list[int] | None = None) -> list[list[int]]:
    """Contiguous runs of layer indices, one per part."""
    n = len(weights)
    if n < parts:
        raise ValueError(f"pipeline_parallel: the model has {n} layers, fewer than the {parts} stages asked for "
                         "(pipeline_parallel.size x virtual_stages); lower them")
    if split_points is not None:
        points = list(split_points)
        if len(points) != parts - 1 or points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n:
            raise ValueError(f"pipeline_parallel.split_points {points}: give {parts - 1} increasing layer indices "
                             f"between 1 and {n - 1} (the first layer of every stage after the first)")
        bounds = [0, *points, n]
    elif rule == "uniform":
        if n % parts:
            raise ValueError(f"pipeline_parallel.partition 'uniform': {n} layers do not divide into {parts} stages; "
                             "use partition 'parameters' or give split_points")
        bounds = [i * n // parts for i in range(parts + 1)]
    else:
        bounds = _balanced_bounds(weights, parts, first_extra, last_extra)
    return [list(range(bounds[i], bounds[i + 1])) for i in range(parts)]


def _balanced_bounds(weights: list[int], parts: int, first_extra: int, last_extra: int) -> list[int]:
    """Minimise the heaviest run (dynamic programming over cut positions; n and p are small)."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)

    def cost(lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first_extra if lo == 0 else 0) + (last_extra if hi == n else 0)

    best = {(0, 0): (0, -1)}  # (parts used, layers used) -> (heaviest run, previous cut)
    for used in range(1, parts + 1):
        for end in range(used, n - (parts - used) + 1):
            options = [(max(best[(used - 1, start)][0], cost(start, end)), start)
                       for start in range(used - 1, end) if (used - 1, start) in best]
            best[(used, end)] = min(options)
    bounds = [n]
    for used in range(parts, 0, -1):
        bounds.append(best[(used, bounds[-1])][1])
    return bounds[::-1]


def split_model(model: nn.Module, adapter: Adapter, *, rank: int, size: int, virtual: int, rule: str,
                split_points: list[int] | None, costs: "LayerCosts | None" = None) -> StageLayout:
    """Prune `model` to this rank's layers (`rank` of `size` stages, `virtual` chunks
    each); returns what the schedule needs to run it. `costs` (rule "time"): measured
    per-layer weights instead of parameter counts."""
    paths = adapter.layer_paths(model)
    layers = [model.get_submodule(path) for path in paths]
    first = [model.get_submodule(path) for path in adapter.first_modules]
    last = [model.get_submodule(path) for path in adapter.last_modules]
    embedding, head = model.get_submodule(adapter.embedding_path), model.get_submodule(adapter.head_path)
    tied = getattr(head, "weight", None) is not None and head.weight is getattr(embedding, "weight", None)
    if costs is None:
        costs = LayerCosts([_numel(layer) for layer in layers], _numel(*first),
                           _numel(*last) - (_numel(head) if tied else 0))
    runs = partition(costs.layers, size * virtual, first_extra=costs.first, last_extra=costs.last,
                     rule="parameters" if rule == "time" else rule, split_points=split_points)
    chunks = [runs[chunk * size + rank] for chunk in range(virtual)]
    layout = StageLayout(rank, size, virtual, chunks, rank == 0, rank == size - 1, tied, runs=runs, paths=paths)
    layout.shared = find_shared_parameters(layers, runs, size, rank, paths)
    _prune_layers(model, paths, kept={paths[index] for chunk in chunks for index in chunk})
    for paths in (layout.shared.receives.values() if layout.shared else ()):
        for path, _ in paths:  # the owner's values arrive every batch (runner.py)
            module_path, _, name = path.rpartition(".")
            module = model.get_submodule(module_path)
            del module._parameters[name]
            setattr(module, name, torch.empty(0))
    if tied and layout.last:
        layout.tied_shape = head.weight.shape
        del head._parameters["weight"]
        head.weight = torch.empty(0)  # replaced by the first stage's weight every batch
    for path in (() if layout.first else adapter.first_modules) + (() if layout.last else adapter.last_modules):
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, None)
    return layout


def _prune_layers(model: nn.Module, paths: list[str], kept: set[str]) -> None:
    """Drop the layers this rank does not run, keeping every name: a layer list becomes an
    nn.ModuleDict of its kept items under their original indices; a layer of its own
    becomes None."""
    lists: dict[str, nn.ModuleDict] = {}
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if isinstance(parent, nn.ModuleList):
            kept_items = lists.setdefault(parent_path, nn.ModuleDict())
            if path in kept:
                kept_items[name] = parent[int(name)]
        elif path not in kept:
            setattr(parent, name, None)
    for list_path, kept_items in lists.items():
        owner_path, _, name = list_path.rpartition(".")
        setattr(model.get_submodule(owner_path) if owner_path else model, name, kept_items)


def _numel(*modules: nn.Module) -> int:
    """Parameters of `modules`, one tied between them (T5's shared embedding and each
    stack's embed_tokens) counted once."""
    unique = {id(param): param for module in modules for param in module.parameters()}
    return sum(param.numel() for param in unique.values())
