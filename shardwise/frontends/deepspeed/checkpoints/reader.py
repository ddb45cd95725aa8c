"""Read a DeepSpeed checkpoint folder (one tag) into `DeepSpeedContents`.

The layouts, as DeepSpeed 0.19.8 writes them (runtime/engine.py `_save_checkpoint`,
`_save_zero_checkpoint`; the optimizers' `state_dict`):

    mp_rank_00_model_states.pt        module state_dict (16-bit weights), counters, scheduler,
                                      `param_shapes` (each group's parameters, in flat order),
                                      client_state; at stage 0 also the optimizer's state
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                      rank R's partition: fp32 masters and optimizer state per
                                      group (ZeRO-1/2 and the BF16 optimizer; the loss scaler)
    zero_pp_rank_R_mp_rank_00_model_states.pt
                                      ZeRO-3: the same model file once per rank (its
                                      `frozen_param_fragments` are that rank's pieces)
    layer_LL-model_states.pt          a pipeline's layers, one file each (mp_rank_SS per stage)
    zero/NAME/fp32.pt, exp_avg.pt...  `ds_to_universal`'s output: every state whole, by name

Every file is read through pickles.py (no code runs). The pieces keep views into the
memory-mapped files, so reading costs address space rather than memory.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from shardwise.frontends.deepspeed.checkpoints.contents import DeepSpeedContents, Parameter, Piece
from shardwise.frontends.deepspeed.checkpoints.layout import zero12_spans, zero3_spans
from shardwise.frontends.deepspeed.checkpoints.pickles import DynamicLossScaler, load_pickle
from shardwise.runtime.checkpoint.format import CheckpointError

OPTIMIZER_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
ZERO3_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
MODEL_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")
EXPERT_FILE = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_.*")
# what DeepSpeed itself keeps in a model file; every other key is the caller's client_state
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "num_experts", "autoep_layers",
})
PER_ELEMENT_SKIP = frozenset({"step"})


def read_deepspeed_checkpoint(directory: Path, *, trusted: bool = False,
                              groups: dict[str, int] | None = None) -> DeepSpeedContents:
    """Everything the checkpoint in `directory` (one tag's folder) holds.

    `groups` (parameter name -> optimizer param group, in the model's order) places the
    optimizer state of a checkpoint without ZeRO, whose files do not name the parameters
    of each group; without it such a checkpoint must have one group."""
    files = {path.name: path for path in directory.iterdir() if path.is_file()}
    experts = sorted(name for name in files if EXPERT_FILE.fullmatch(name))
    if experts:
        raise CheckpointError(f"{directory} holds mixture-of-experts files ({experts[0]}, ...): DeepSpeed's MoE "
                              "checkpoints are not read yet; train the experts under shardwise from their weights "
                              "(DeepSpeed's zero_to_fp32) instead")
    if (directory / "zero").is_dir():
        return _Reader(directory, files, trusted, groups).universal()
    return _Reader(directory, files, trusted, groups).sharded()


class _Reader:
    def __init__(self, directory: Path, files: dict[str, Path], trusted: bool, groups: dict[str, int] | None):
        self.directory, self.files, self.trusted, self.groups = directory, files, trusted, groups

    def load(self, name: str) -> Any:
        return load_pickle(self.files[name], trusted=self.trusted)

    # -- the layouts --------------------------------------------------------------------------
    def sharded(self) -> DeepSpeedContents:
        optimizer_files = self._ranked(OPTIMIZER_FILE)
        layers = sorted((int(match.group(1)), name) for name in self.files if (match := LAYER_FILE.fullmatch(name)))
        model_files = sorted((int(match.group(1)), name) for name in self.files
                             if (match := MODEL_FILE.fullmatch(name)))
        zero3_models = self._ranked(ZERO3_MODEL_FILE)
        if zero3_models:
            return self._zero3(zero3_models, optimizer_files)
        if not model_files:
            raise CheckpointError(f"{self.directory} holds no DeepSpeed model file (mp_rank_00_model_states.pt); "
                                  f"found: {', '.join(sorted(self.files)) or 'nothing'}")
        if layers:
            return self._pipeline(model_files, layers, optimizer_files)
        if len(model_files) > 1:
            raise CheckpointError(
                f"{self.directory} was written with tensor parallelism ({len(model_files)} mp_rank files): convert it "
                "with DeepSpeed's ds_to_universal first, whose output (a universal checkpoint) shardwise reads")
        model = self.load(model_files[0][1])
        if not optimizer_files:
            return self._unpartitioned(model)
        return self._zero12(model, optimizer_files, prefix="")

    def _ranked(self, pattern: re.Pattern) -> dict[tuple[int, int], str]:
        """(mp rank, dp rank) -> file name, for files named by both ranks."""
        found = {}
        for name in self.files:
            match = pattern.fullmatch(name)
            if match:
                dp, mp = (int(match.group(match.lastindex - 1)), int(match.group(match.lastindex)))
                found[mp, dp] = name
        return found

    def _data_parallel(self, files: dict[tuple[int, int], str], mp: int) -> list[str]:
        ranks = sorted(dp for (stage, dp) in files if stage == mp)
        if ranks != list(range(len(ranks))):
            raise CheckpointError(f"{self.directory} lacks the optimizer files of some data-parallel ranks "
                                  f"(found ranks {ranks} for mp_rank {mp:02d}); copy the whole folder")
        return [files[mp, dp] for dp in ranks]

    def _zero12(self, model: dict, optimizer_files: dict[tuple[int, int], str], prefix: str,
                mp: int = 0) -> DeepSpeedContents:
        """ZeRO-1/2 and the BF16 optimizer: a flat partition per group and rank."""
        states = [self.load(name)["optimizer_state_dict"] for name in self._data_parallel(optimizer_files, mp)]
        first = states[0]
        lean = "zero_stage" in first  # ZeRO-1/2 drop the end padding from the masters; the BF16 optimizer keeps it
        shapes = model["param_shapes"]
        if shapes is None:
            raise CheckpointError(f"{self.directory}: its model file has no param_shapes; it was not written by a "
                                  "ZeRO-1/2 engine DeepSpeed 0.19.8 can load either")
        pieces: list[Piece] = []
        for group, group_shapes in enumerate(shapes):
            names = [prefix + name for name in group_shapes]
            numels = [math.prod(shape) for shape in group_shapes.values()]
            paddings = first.get("param_alignment_paddings", [None] * len(shapes))[group]
            for rank, state in enumerate(states):
                masters = state["single_partition_of_fp32_groups"][group]
                size = masters.numel() + (state["group_paddings"][group] if lean else 0)
                elements = _group_elements(state["base_optimizer_state"], group)
                for span in zero12_spans(names, numels, size, rank, paddings):
                    pieces.append(_piece(span, masters, elements, rank))
        stage = int(first["zero_stage"]) if lean else model["ds_config"].get("zero_optimization", {}).get("stage", 0)
        parameters = _parameters(model, shapes, prefix)
        return self._contents(model, stage=stage, world_size=len(states), parameters=parameters, pieces=pieces,
                              whole=self._whole(model, parameters, prefix),
                              optimizer=first["base_optimizer_state"], loss_scaler=first.get("loss_scaler"),
                              layout=f"ZeRO-{stage}" if lean else f"BF16 optimizer (ZeRO-{stage})")

    def _zero3(self, models: dict[tuple[int, int], str], optimizer_files: dict[tuple[int, int], str]
               ) -> DeepSpeedContents:
        """ZeRO-3: each parameter cut on its own; a flat buffer per sub-group and rank."""
        model_names = self._data_parallel(models, 0)
        model = self.load(model_names[0])
        states = [self.load(name)["optimizer_state_dict"] for name in self._data_parallel(optimizer_files, 0)]
        world = len(states)
        shapes = model["param_shapes"]  # one ordered dict per sub-group
        inner = states[0]["optimizer_state_dict"]
        group_of_sub_group = {index: group for group, entry in enumerate(inner["param_groups"])
                              for index in entry["params"]}
        pieces: list[Piece] = []
        for sub_group, sub_shapes in enumerate(shapes):
            names = list(sub_shapes)
            numels = [math.prod(shape) for shape in sub_shapes.values()]
            for rank, state in enumerate(states):
                masters = state["fp32_flat_groups"][sub_group]
                elements = _per_element(state["optimizer_state_dict"]["state"].get(sub_group, {}))
                for span in zero3_spans(names, numels, world, rank):
                    pieces.append(_piece(span, masters, elements, rank))
        parameters = [Parameter(name, tuple(shape), group_of_sub_group[sub_group])
                      for sub_group, sub_shapes in enumerate(shapes) for name, shape in sub_shapes.items()]
        parameters = _in_model_order(model, parameters, "")
        whole = self._whole(model, parameters, "", fragments=[self.load(name) for name in model_names[1:]])
        optimizer = {"state": _sub_groups_to_groups(inner, group_of_sub_group), "param_groups": inner["param_groups"]}
        return self._contents(model, stage=3, world_size=world, parameters=parameters, pieces=pieces, whole=whole,
                              optimizer=optimizer, loss_scaler=states[0].get("loss_scaler"), layout="ZeRO-3")

    def _unpartitioned(self, model: dict) -> DeepSpeedContents:
        """No ZeRO: the optimizer's state is in the model file, whole per parameter (fp32), or
        flat per group beside fp32 masters (DeepSpeed's fp16/bf16 optimizer)."""
        optimizer = model.get("optimizer")
        if optimizer is None:
            raise CheckpointError(f"{self.directory} holds no optimizer state (saved without an optimizer?); "
                                  "its weights alone can be loaded with load_module_only=True")
        module = model["module"]
        buffers = set(model.get("buffer_names") or ())
        flat = "fp32_groups_flat" in optimizer
        inner = optimizer["optimizer_state_dict"] if flat else optimizer
        counts = [len(group["params"]) for group in inner["param_groups"]]
        names_by_group = self._stage0_groups(module, buffers, inner, flat)
        pieces: list[Piece] = []
        parameters_in_groups = []
        for group, names in enumerate(names_by_group):
            numels = [module[name].numel() for name in names]
            parameters_in_groups += [Parameter(name, tuple(module[name].shape), group) for name in names]
            if flat:
                masters = optimizer["fp32_groups_flat"][group]
                if masters.numel() != sum(numels):
                    raise CheckpointError(f"{self.directory}: param group {group} holds {masters.numel()} elements, "
                                          f"its parameters {names} {sum(numels)}: the checkpoint was written for "
                                          "another model or optimizer")
                elements = _per_element(inner["state"].get(group, {}))
                for span in zero12_spans(names, numels, masters.numel(), 0):
                    pieces.append(_piece(span, masters, elements, 0))
            else:
                first_index = sum(counts[:group])
                for offset, name in enumerate(names):
                    state = inner["state"].get(first_index + offset, {})
                    value = module[name].detach().reshape(-1).float()
                    elements = {key: tensor.reshape(-1) for key, tensor in _per_element(state).items()}
                    tensors = {"value": value, **elements}
                    pieces.append(Piece(name, 0, value.numel(), tensors, 0))
        parameters = _in_model_order(model, parameters_in_groups, "")
        scaler = ({"cur_scale": optimizer["cur_scale"], "cur_iter": optimizer["cur_iter"],
                   "last_overflow_iter": optimizer.get("last_overflow_iter", -1), "dynamic": True}
                  if optimizer.get("dynamic_loss_scale") else None)
        group_steps = _steps_of_unflattened(inner) if not flat else None
        return self._contents(model, stage=0, world_size=model.get("dp_world_size", 1), parameters=parameters,
                              pieces=pieces, whole=self._whole(model, parameters, ""), optimizer=inner,
                              loss_scaler=scaler, layout="no ZeRO", group_steps=group_steps)

    def _stage0_groups(self, module: dict, buffers: set[str], inner: dict, flat: bool) -> list[list[str]]:
        """Which parameters each group trains, in order: the files hold the groups' state by
        position only, as DeepSpeed's own loader reads it."""
        counts = [len(group["params"]) for group in inner["param_groups"]]
        if self.groups is not None:
            names = [[name for name, group in self.groups.items() if group == index] for index in range(len(counts))]
        elif len(counts) == 1:
            names = [[name for name in module if name not in buffers]]
        else:
            raise CheckpointError(
                f"{self.directory} was saved without ZeRO by an optimizer with {len(counts)} param groups, and such a "
                "checkpoint does not record which parameters each group trains: load it with engine.load_checkpoint "
                "(the engine knows its groups) rather than converting it on its own")
        if not flat and [len(group) for group in names] != counts:
            raise CheckpointError(
                f"{self.directory}: its optimizer trains {counts} parameters per param group, the model "
                f"{[len(group) for group in names]}: the checkpoint was written for another model or optimizer")
        return names

    def _pipeline(self, model_files: list[tuple[int, str]], layers: list[tuple[int, str]],
                  optimizer_files: dict[tuple[int, int], str]) -> DeepSpeedContents:
        """A pipeline: each stage's parameters and optimizer files under its own mp_rank, the
        layers' weights in their own files. DeepSpeed names a layer's parameters by its
        index ("3.weight"); shardwise's PipelineModule (and SequentialStages) by its place in
        `layers` ("layers.3.weight"), which is the name used here."""
        module: OrderedDict[str, torch.Tensor] = OrderedDict()
        for index, layer_name in layers:
            for key, tensor in self.load(layer_name).items():
                module[f"{index}.{key}"] = tensor
        models = [self.load(name) for _, name in model_files]
        buffers = sorted({buffer for model in models for buffer in model.get("buffer_names") or ()})
        parts = []
        for (stage, _), model in zip(model_files, models):
            model["module"], model["buffer_names"] = module, buffers  # every stage sees every layer and buffer
            parts.append(self._zero12(model, optimizer_files, prefix="layers.", mp=stage))
        first = parts[0]
        trained = {parameter.name: parameter for part in parts for parameter in part.parameters
                   if parameter.group is not None}
        frozen = {parameter.name: parameter for part in parts for parameter in part.parameters}
        order = [f"layers.{name}" for name in module if name not in buffers]  # the layers' order
        first.parameters = [trained.get(name, frozen.get(name)) for name in order
                            if name in trained or name in frozen]
        first.pieces = [piece for part in parts for piece in part.pieces]
        first.whole = {name: tensor for part in parts for name, tensor in part.whole.items() if name not in trained}
        first.buffers = [f"layers.{name}" for name in buffers]
        first.layout = f"pipeline of {len(parts)} stages, {first.layout}"
        return first

    def universal(self) -> DeepSpeedContents:
        """`ds_to_universal`'s folder: every state of every parameter whole, by name."""
        model_files = sorted(name for name in self.files if MODEL_FILE.fullmatch(name))
        if not model_files:
            raise CheckpointError(f"{self.directory} has a zero/ folder but no mp_rank_00_model_states.pt: "
                                  "not a complete universal checkpoint")
        model = self.load(model_files[0])
        zero = self.directory / "zero"
        common = load_pickle(zero / "optimizer_state.pt", trusted=self.trusted)
        shapes = model["param_shapes"]
        if isinstance(shapes, dict):
            shapes = [shapes]
        pieces: list[Piece] = []
        steps: dict[int, int] = {}
        for group, group_shapes in enumerate(shapes):
            for name, shape in group_shapes.items():
                folder = zero / name
                tensors = {}
                for path in sorted(folder.glob("*.pt")):
                    value = load_pickle(path, trusted=self.trusted)
                    value = value["param"] if isinstance(value, dict) else value
                    if path.stem == "step":
                        steps[group] = int(value)
                    else:
                        tensors["value" if path.stem == "fp32" else path.stem] = value.reshape(-1)
                if "value" not in tensors:
                    raise CheckpointError(f"universal checkpoint {self.directory} lacks {folder / 'fp32.pt'}")
                pieces.append(Piece(name, 0, math.prod(shape), tensors, 0))
        parameters = _parameters(model, shapes, "")
        optimizer = {"param_groups": common.get("param_groups", []), "state": {}}
        contents = self._contents(model, stage=model["ds_config"].get("zero_optimization", {}).get("stage", 0),
                                  world_size=model.get("dp_world_size", 1), parameters=parameters, pieces=pieces,
                                  whole=self._whole(model, parameters, ""), optimizer=optimizer,
                                  loss_scaler=common.get("loss_scaler"), layout="universal",
                                  group_steps=[steps.get(group) for group in range(len(shapes))])
        return contents

    # -- what every layout shares ---------------------------------------------------------------
    def _whole(self, model: dict, parameters: list[Parameter], prefix: str,
               fragments: list[dict] | None = None) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers, whole. ZeRO-3 partitions frozen parameters too:
        each rank's model file holds its piece (`frozen_param_fragments`)."""
        module = model.get("module") or {}
        whole = {}
        for parameter in parameters:
            if parameter.group is not None:
                continue
            tensor = module.get(parameter.name.removeprefix(prefix))
            if fragments is not None or tensor is None or tensor.numel() != math.prod(parameter.shape):
                tensor = _joined_fragment(parameter, [model, *(fragments or [])])
            whole[parameter.name] = tensor.reshape(parameter.shape)
        for name in model.get("buffer_names") or ():
            if name in module:
                whole[prefix + name] = module[name]
        return whole

    def _contents(self, model: dict, *, stage: int, world_size: int, parameters: list[Parameter],
                  pieces: list[Piece], whole: dict[str, torch.Tensor], optimizer: dict, loss_scaler: Any,
                  layout: str, group_steps: list[int | None] | None = None) -> DeepSpeedContents:
        config = model.get("ds_config") or {}
        groups = optimizer.get("param_groups", [])
        if group_steps is None:
            group_steps = [_step_of(optimizer.get("state", {}).get(index, {})) for index in range(len(groups))]
        precision = ("bf16" if config.get("bf16", {}).get("enabled") else
                     "fp16" if config.get("fp16", {}).get("enabled") else "fp32")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        optimizer_block = config.get("optimizer") or {}
        return DeepSpeedContents(
            directory=self.directory,
            layout=f"{layout} ({precision})",
            stage=stage,
            world_size=int(world_size or 1),
            dtype=dtype,
            parameters=parameters,
            pieces=pieces,
            whole=whole,
            buffers=[name for name in whole if name not in {parameter.name for parameter in parameters}],
            param_groups=[{key: value for key, value in group.items() if key != "params"} for group in groups],
            group_steps=group_steps,
            optimizer_type=optimizer_block.get("type"),
            lr_scheduler=model.get("lr_scheduler"),
            loss_scaler=_loss_scaler_state(loss_scaler),
            global_steps=int(model.get("global_steps", 0)),
            skipped_steps=int(model.get("skipped_steps", 0)),
            global_samples=model.get("global_samples"),
            gradient_accumulation_steps=config.get("gradient_accumulation_steps"),
            client_state={key: value for key, value in model.items() if key not in DEEPSPEED_KEYS},
            ds_config=config,
            random_ltd=model.get("random_ltd"),
        )


# -- helpers ------------------------------------------------------------------------------------
def _piece(span: Any, masters: torch.Tensor, elements: dict[str, torch.Tensor], rank: int) -> Piece:
    count = span.stop - span.start
    tensors = {"value": masters[span.offset : span.offset + count]}
    for key, tensor in elements.items():
        tensors[key] = tensor[span.offset : span.offset + count]
    return Piece(span.name, span.start, span.stop, tensors, rank)


def _group_elements(base_state: Any, group: int) -> dict[str, torch.Tensor]:
    """Group `group`'s per-element optimizer state in one rank's file: a torch optimizer's
    state_dict (one flat tensor per group), or the elastic form (a list, one dict per group)."""
    if isinstance(base_state, list):
        return _per_element(base_state[group])
    index = base_state["param_groups"][group]["params"][0]
    return _per_element(base_state["state"].get(index, {}))


def _per_element(state: dict) -> dict[str, torch.Tensor]:
    return {key: value.reshape(-1) for key, value in state.items()
            if torch.is_tensor(value) and value.dim() > 0 and key not in PER_ELEMENT_SKIP}


def _step_of(state: dict) -> int | None:
    step = state.get("step")
    return None if step is None else int(step)


def _steps_of_unflattened(inner: dict) -> list[int | None]:
    """Each group's step without ZeRO. DeepSpeed's fused Adam counts in the last parameter
    that stepped (the others keep their first value) and steps the group from it, so the
    group's count is the largest."""
    steps = []
    for group in inner["param_groups"]:
        counts = [_step_of(inner["state"].get(index, {})) for index in group["params"]]
        counts = [count for count in counts if count is not None]
        steps.append(max(counts) if counts else None)
    return steps


def _sub_groups_to_groups(inner: dict, group_of_sub_group: dict[int, int]) -> dict[int, dict]:
    """ZeRO-3 keeps optimizer state per sub-group; the first sub-group of each group speaks
    for its step (they step together)."""
    state: dict[int, dict] = {}
    for sub_group, group in sorted(group_of_sub_group.items()):
        state.setdefault(group, inner["state"].get(sub_group, {}))
    return state


def _parameters(model: dict, shapes: list[dict], prefix: str) -> list[Parameter]:
    trained = [Parameter(prefix + name, tuple(shape), group)
               for group, group_shapes in enumerate(shapes) for name, shape in group_shapes.items()]
    return _in_model_order(model, trained, prefix)


def _in_model_order(model: dict, trained: list[Parameter], prefix: str) -> list[Parameter]:
    """Trained parameters, then the frozen ones DeepSpeed recorded, in the module's order
    where the module names them (buffers excluded)."""
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or ())
    by_name = {parameter.name: parameter for parameter in trained}
    frozen_shapes = model.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        by_name.setdefault(prefix + name, Parameter(prefix + name, tuple(shape), None))
    for name, tensor in module.items():
        if name not in buffers:
            by_name.setdefault(prefix + name, Parameter(prefix + name, tuple(tensor.shape), None))
    order = [prefix + name for name in module if name not in buffers]
    placed = set(order)
    return [by_name[name] for name in order if name in by_name] + [
        parameter for name, parameter in by_name.items() if name not in placed]


def _joined_fragment(parameter: Parameter, models: list[dict]) -> torch.Tensor:
    """A frozen ZeRO-3 parameter from every rank's fragment (rank order, padding dropped)."""
    pieces = []
    for model in models:
        fragment = (model.get("frozen_param_fragments") or {}).get(parameter.name)
        if fragment is None:
            raise CheckpointError(f"the frozen parameter {parameter.name} is in neither the module nor the "
                                  "frozen fragments of the checkpoint")
        pieces.append(fragment.reshape(-1))
    return torch.cat(pieces)[: math.prod(parameter.shape)]


def _loss_scaler_state(scaler: Any) -> dict | None:
    """DeepSpeed's dynamic loss scaler as shardwise's LossScaler.state_dict(); None when the
    scale is static (the engine's own config decides it, as it does DeepSpeed's)."""
    if scaler is None:
        return None
    attributes = scaler if isinstance(scaler, dict) else vars(scaler)
    if not attributes.get("dynamic", isinstance(scaler, DynamicLossScaler)):
        return None
    state = {"scale": float(attributes["cur_scale"]), "iteration": int(attributes["cur_iter"]),
             "last_overflow_iteration": int(attributes["last_overflow_iter"])}
    if "cur_hysteresis" in attributes:
        state["remaining_hysteresis"] = int(attributes["cur_hysteresis"])
    return state
