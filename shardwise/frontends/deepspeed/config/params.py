"""The `params` of the `optimizer` and `scheduler` blocks, one model per `type`.

DeepSpeed passes `params` straight to the optimizer or scheduler constructor, so
which keys are valid depends on `type`.

Optimizers: each registered optimizer declares its params beside its class
(shardwise/runtime/optim/params.py), with the defaults of the code DeepSpeed runs or,
for optimizers DeepSpeed does not build itself, of the implementation shardwise matches;
`declared_params_model` turns a declaration into a model with this config's strict
scalars. Schedules: the classes in deepspeed/runtime/lr_schedules.py (whose constructor
defaults differ from its argparse defaults; the constructors win).
"""

import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import AfterValidator, Field, ValidationError, create_model, model_validator

from shardwise.frontends.deepspeed.config.errors import describe_validation_error
from shardwise.frontends.deepspeed.config.fields import Bool, Float, Int, Section
from shardwise.runtime.optim.params import BOUNDS
from shardwise.runtime.optim.registry import optimizer_spec, optimizer_specs
from shardwise.runtime.optim.torch_by_name import check_torch_scheduler, constructor_arguments, torch_scheduler_class

# A declaration's plain scalar types, as this config reads them (fields.py).
_STRICT_SCALARS: dict[Any, Any] = {float: Float, int: Int, bool: Bool}


def _strict(annotation: Any) -> Any:
    """`annotation` with float, int and bool replaced by the config's strict scalars, inside
    tuples and unions too."""
    if annotation in _STRICT_SCALARS:
        return _STRICT_SCALARS[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is tuple:
        return tuple[tuple(_strict(arg) for arg in args)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_strict(arg) for arg in args)]
    return annotation


@functools.cache
def declared_params_model(declaration: type) -> type[Section]:
    """The model that validates `params` for an optimizer whose params `declaration` (a
    dataclass: optim/params.py) states: its fields with their defaults, bounds, checks and
    documented defaults; checks of several fields (the declaration's `__post_init__`) run
    on the validated whole. One model per declaration, so types sharing one (Adam and
    AdamW) share their rows in the defaults table."""
    hints = get_type_hints(declaration)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(declaration):
        meta = field.metadata
        annotation = _strict(hints[field.name])
        if "check" in meta:
            annotation = Annotated[annotation, AfterValidator(meta["check"])]
        options = {bound: meta[bound] for bound in BOUNDS if bound in meta}
        if "default_doc" in meta:
            options["json_schema_extra"] = {"default_doc": meta["default_doc"]}
        default = ... if field.default is dataclasses.MISSING else field.default
        fields[field.name] = (annotation, Field(default, description=meta.get("description"), **options))

    def declared_checks(model: Section) -> Section:
        declaration(**dict(model))
        return model

    return create_model(declaration.__name__, __base__=Section, __doc__=declaration.__doc__,
                        __module__=declaration.__module__,
                        __validators__={"_declared_checks": model_validator(mode="after")(declared_checks)},
                        **fields)


class _RegisteredOptimizerParams(Mapping[str, type[Section]]):
    """Each registered optimizer's params model by its config name, in registration order,
    read from the registry when asked (an optimizer registered later is known too)."""

    def __getitem__(self, type_name: str) -> type[Section]:
        try:
            spec = optimizer_spec(type_name)
        except ValueError:
            raise KeyError(type_name) from None
        return declared_params_model(spec.params_declaration)

    def __iter__(self) -> Iterator[str]:
        return iter([spec.name for spec in optimizer_specs()])

    def __len__(self) -> int:
        return len(optimizer_specs())


OPTIMIZER_PARAMS: Mapping[str, type[Section]] = _RegisteredOptimizerParams()


# A learning rate for every param group, or one per group (DeepSpeed's `_format_param`).
LearningRate = Annotated[Float, Field(ge=0)] | list[Annotated[Float, Field(ge=0)]]


class WarmupLRParams(Section):
    """Warm up from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: LearningRate = 0.0
    warmup_max_lr: LearningRate | None = Field(None, json_schema_extra={"default_doc": "the optimizer's lr"})
    warmup_num_steps: Int = Field(1000, ge=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(-1, ge=-1)

    @model_validator(mode="after")
    def _min_below_max(self) -> "WarmupLRParams":
        low, high = self.warmup_min_lr, self.warmup_max_lr
        if isinstance(low, float) and isinstance(high, float) and low > high:
            raise ValueError(f"warmup_min_lr {low} is above warmup_max_lr {high}")
        return self


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR, then linear decay to zero at total_num_steps (DeepSpeed only warns when
    total_num_steps < warmup_num_steps, and so does shardwise's schedule)."""

    total_num_steps: Int = Field(ge=1)
    warmup_max_lr: LearningRate | None = 0.001


class WarmupCosineLRParams(Section):
    """Warm up from warmup_min_ratio x lr to lr, then cosine decay to cos_min_ratio x lr."""

    total_num_steps: Int = Field(ge=1)
    warmup_min_ratio: Float = Field(0.0, ge=0, le=1)
    warmup_num_steps: Int = Field(1000, ge=1)
    cos_min_ratio: Float = Field(0.0001, ge=0, le=1)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: Int = Field(-1, ge=-1)


class OneCycleParams(Section):
    """1Cycle: up from cycle_min_lr to cycle_max_lr and back, then an optional decay; beta1
    cycles the opposite way (runtime/optim/schedulers.py)."""

    cycle_min_lr: LearningRate
    cycle_max_lr: LearningRate
    decay_lr_rate: Float = 0.0
    cycle_first_step_size: Int = Field(2000, gt=0)
    cycle_second_step_size: Int | None = Field(None, ge=0, json_schema_extra={"default_doc": "cycle_first_step_size"})
    cycle_first_stair_count: Int = Field(0, ge=0)
    cycle_second_stair_count: Int | None = Field(None, ge=0,
                                                 json_schema_extra={"default_doc": "cycle_first_stair_count"})
    decay_step_size: Int = Field(0, ge=0)
    cycle_momentum: Bool = True
    cycle_min_mom: Float | list[Float] = 0.8
    cycle_max_mom: Float | list[Float] = 0.9
    decay_mom_rate: Float = 0.0
    last_batch_iteration: Int = Field(-1, ge=-1)


class LRRangeTestParams(Section):
    """The learning-rate range test: from lr_range_test_min_lr, growing by step_rate x min
    every lr_range_test_step_size steps."""

    lr_range_test_min_lr: LearningRate = 1e-3
    lr_range_test_step_size: Int = Field(2000, gt=0)
    lr_range_test_step_rate: Float = 1.0
    lr_range_test_staircase: Bool = False
    last_batch_iteration: Int = Field(-1, ge=-1)


DEEPSPEED_SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


@functools.cache
def torch_scheduler_params_model(type_name: str) -> type[Section]:
    """The params of `torch.optim.lr_scheduler.<type_name>`: its constructor's keyword
    arguments, required where it has no default; values are checked by building it
    (optim/torch_by_name.py `check_torch_scheduler`)."""
    cls = torch_scheduler_class(type_name)
    fields: dict[str, Any] = {argument.name: (Any, ... if argument.default is argument.empty else argument.default)
                              for argument in constructor_arguments(cls)}
    return create_model(f"{type_name}Params", __base__=Section, __doc__=f"torch.optim.lr_scheduler.{type_name}'s "
                        "arguments and defaults, passed as given.", **fields)


class _SchedulerParams(Mapping[str, type[Section]]):
    """DeepSpeed's schedules' params models by name, in the reference's order; a
    `torch.optim.lr_scheduler` class's by its exact name too (not iterated: the reference
    documents DeepSpeed's)."""

    def __getitem__(self, type_name: str) -> type[Section]:
        if type_name in DEEPSPEED_SCHEDULER_PARAMS:
            return DEEPSPEED_SCHEDULER_PARAMS[type_name]
        if torch_scheduler_class(type_name) is None:
            raise KeyError(type_name)
        return torch_scheduler_params_model(type_name)

    def __iter__(self) -> Iterator[str]:
        return iter(DEEPSPEED_SCHEDULER_PARAMS)

    def __len__(self) -> int:
        return len(DEEPSPEED_SCHEDULER_PARAMS)


SCHEDULER_PARAMS: Mapping[str, type[Section]] = _SchedulerParams()

# Types DeepSpeed builds itself that no shardwise capability covers.
DEEPSPEED_OPTIMIZERS_UNSUPPORTED = ("MuAdam", "MuAdamW", "MuSGD")
DEEPSPEED_SCHEDULERS_UNSUPPORTED: tuple[str, ...] = ()


def resolve_params(block: str, type_name: str, params: dict[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """`params` validated for `type_name` with every default filled in, or None after reporting why not.
    `block` is "optimizer" or "scheduler"; `type_name` is already canonical."""
    model = (OPTIMIZER_PARAMS if block == "optimizer" else SCHEDULER_PARAMS)[type_name]
    try:
        resolved = model.model_validate(params).model_dump()
    except ValidationError as error:
        problems.extend(describe_validation_error(error, prefix=f"{block}.params"))
        return None
    check = optimizer_spec(type_name).check_params if block == "optimizer" else (
        None if type_name in DEEPSPEED_SCHEDULER_PARAMS else functools.partial(check_torch_scheduler, type_name))
    if check is not None:
        try:
            check(resolved)
        except ValueError as error:  # the message starts with the key it concerns, or ": " for them all
            problems.append(f"{block}.params{'' if str(error).startswith(':') else '.'}{error}")
            return None
    return resolved
