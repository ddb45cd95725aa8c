"""`deepspeed.pipe`: `PipelineModule` and `LayerSpec` on shardwise's pipeline.

    net = PipelineModule(layers=[*features, lambda x: torch.flatten(x, 1), *classifier],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, training_data=dataset)
    loss = engine.train_batch()

A `PipelineModule` is shardwise's `SequentialStages` (a list of layers run in order, split
into stages by the pipeline step) that also tells `initialize` its number of stages and how
to split: `initialize` sets `pipeline_parallel.size` to `num_stages` (data parallelism over
the rest of the world) and, for `partition_method="type:REGEX"`, the split points that
balance the layers whose class name matches. `LayerSpec`s are built when the module is,
with `seed_layers` seeding each from `base_seed + index` as DeepSpeed does.

Built once the job's world is known (the process group exists), a `PipelineModule` holds
only this rank's stage's layers, as DeepSpeed's does: the split is decided in the
constructor (by the same rule `initialize` applies, then handed to it as split points),
and every other layer is replaced by a parameter-free `OtherStageLayer`, so `parameters()`
summed over the stages counts each layer once. Each rank still builds every layer first
(DeepSpeed builds only its own), to weigh them for the split. A module that several
layers share (`TiedLayerSpec`) keeps every layer on every rank until `initialize`, which
resolves the tie. Before the process group exists (a single process), every layer is kept.

Recomputation
uses `torch.utils.checkpoint` whatever `activation_checkpoint_func` names; `dynamic_shape`
needs nothing (every activation travels with a header of its shapes).

`TiedLayerSpec(key, ...)`: every spec with the same key is one module, built once (at
its first place) and used again wherever the key recurs, through `forward_fn(module,
inputs)` when given (an embedding reused as the output layer). On one stage that is plain
weight sharing; across stages the first stage using it owns the parameters and the later
ones get their values every batch and send their gradients back (parallel/pipeline/
shared.py), which sums the gradients of every use before the step, as DeepSpeed's tied
all-reduce does. The whole module is shared (DeepSpeed synchronises only
`tied_weight_attr`; the other parameters of its copies would otherwise drift apart).

Not supported, each refused with its reason: `topology` (the config's parallel sizes
define the mesh) and `checkpointable_layers` (every run of `activation_checkpoint_interval`
layers is recomputed).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.runtime.parallel.pipeline.sequential import SequentialStages
from shardwise.runtime.parallel.pipeline.split import partition

__all__ = ["LayerSpec", "OtherStageLayer", "PipelineModule", "TiedLayerSpec"]


class LayerSpec:
    """A layer to build later: `typename(*args, **kwargs)`."""

    def __init__(self, typename: type, *args: Any, **kwargs: Any):
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a class to build, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared with every other `TiedLayerSpec` of the same `key` (see the module docstring)."""

    def __init__(self, key: str, typename: type, *args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **kwargs: Any):
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


class PipelineModule(SequentialStages):
    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False):
        refused = {"topology": topology is not None, "checkpointable_layers": checkpointable_layers is not None}
        for name, given in refused.items():
            if given:
                raise ValueError(f"PipelineModule({name}=...) is not supported: give num_stages (the pipeline "
                                 "size; the rest of the world is data-parallel) and activation_checkpoint_interval "
                                 "(every run of that many layers is recomputed)")
        if num_stages is None or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages >= 1, got {num_stages!r}")
        layers = list(layers)
        super().__init__(_build(layers, seed_layers, seed_fn, base_seed), loss_fn, activation_checkpoint_interval)
        self.num_stages = num_stages
        self.partition_method = partition_method
        self.dynamic_shape = dynamic_shape
        self._split_points: list[int] | None = None  # decided here once the world is known
        self._keep_local_stage()

    def _keep_local_stage(self) -> None:
        """Replace the layers of other stages by `OtherStageLayer`s (module docstring)."""
        if self.num_stages == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        layers = list(self.layers)
        if world % self.num_stages or len(layers) < self.num_stages or _shared_between_layers(layers):
            return  # initialize names a world the stages do not divide; a shared module is tied there
        wanted = self.pipeline_config()
        runs = partition([sum(param.numel() for param in layer.parameters()) for layer in layers], self.num_stages,
                         rule=wanted.get("partition", "parameters"), split_points=wanted.get("split_points"))
        self._split_points = [run[0] for run in runs[1:]]
        stage = dist.get_rank() // (world // self.num_stages)  # the pipeline is the mesh's outermost dimension
        stage_of = {index: run_stage for run_stage, run in enumerate(runs) for index in run}
        self.layers = nn.ModuleList(layer if stage_of[index] == stage else OtherStageLayer(index, stage_of[index])
                                    for index, layer in enumerate(layers))

    def pipeline_config(self) -> dict[str, Any]:
        """The config's `pipeline_parallel` block this module asks for."""
        if self._split_points is not None:
            return {"size": self.num_stages, "split_points": list(self._split_points)}
        method = self.partition_method.lower()
        if method in ("parameters", "uniform"):
            return {"size": self.num_stages, "partition": method}
        if method.startswith("type:"):
            pattern = re.compile(method.removeprefix("type:"), re.IGNORECASE)
            weights = [1 if pattern.search(type(layer).__name__) else 0 for layer in self.layers]
            if self.num_stages == 1:
                return {"size": 1}
            runs = partition(weights, self.num_stages)
            return {"size": self.num_stages, "split_points": [run[0] for run in runs[1:]]}
        raise ValueError(f"PipelineModule(partition_method={self.partition_method!r}): use 'parameters', 'uniform' "
                         "or 'type:REGEX'")


class OtherStageLayer(nn.Module):
    """Layer `index`, which pipeline stage `stage` holds: this rank keeps none of its
    parameters, and the pipeline never runs it here."""

    def __init__(self, index: int, stage: int):
        super().__init__()
        self.index, self.stage = index, stage

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(f"layer {self.index} of this PipelineModule belongs to pipeline stage {self.stage}, "
                           "held by other ranks: run the module through the engine deepspeed.initialize "
                           "returns (train_batch, eval_batch)")

    def extra_repr(self) -> str:
        return f"index={self.index}, stage={self.stage}"


def _shared_between_layers(layers: list[nn.Module]) -> bool:
    """Whether two layers hold the same parameter (a TiedLayerSpec used twice)."""
    seen: set[int] = set()
    for layer in layers:
        mine = {id(param) for param in layer.parameters()}
        if mine & seen:
            return True
        seen |= mine
    return False


class TiedForward(nn.Module):
    """A tied module used through its spec's `forward_fn(module, inputs)`."""

    def __init__(self, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any]):
        super().__init__()
        self.module = module
        self.forward_fn = forward_fn

    def forward(self, inputs: Any) -> Any:
        return self.forward_fn(self.module, inputs)


def _build(layers: list[Any], seed_layers: bool, seed_fn: Callable[[int], None] | None, base_seed: int) -> list:
    built, tied = [], {}
    for index, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec) and layer.key in tied:
            module = tied[layer.key]
        elif isinstance(layer, LayerSpec):
            if seed_layers:
                (seed_fn or torch.manual_seed)(base_seed + index)
            module = layer.build()
            if isinstance(layer, TiedLayerSpec):
                tied[layer.key] = module
        else:
            built.append(layer)
            continue
        built.append(TiedForward(module, layer.forward_fn) if getattr(layer, "forward_fn", None) else module)
    return built
