"""`data_efficiency.data_routing`: random-LTD's block, read as DeepSpeed 0.19.8 reads it
(deepspeed/runtime/data_pipeline/config.py, constants.py, data_routing/), and the typed
policy it becomes (shardwise/runtime/data/random_ltd.py).

DeepSpeed's engine runs random-LTD when `random_ltd.enabled` is true, whatever
`data_efficiency.enabled` and `data_routing.enabled` say (it reads only that flag), and
reads the other keys only then: they are required when it is on and ignored when it is
off. It adds `global_batch_size` (the config's `train_batch_size`) and `micro_batch_size`
itself. `layer_token_lr_schedule.enabled` true raises NotImplementedError in DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from shardwise.frontends.deepspeed.config.fields import Bool, Int, Section

if TYPE_CHECKING:
    from shardwise.runtime.data.random_ltd import RandomLTDPolicy

# the keys DeepSpeed's RandomLayerTokenDrop and RandomLTDScheduler read (KeyError when absent)
REQUIRED = ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name", "model_type",
            "hidden_state_order", "random_ltd_schedule")


class RandomLTDStepsConfig(Section):
    """`random_ltd_schedule.schedule_config`: the kept count reaches max_value after
    `require_steps` steps, rising in multiples of `seq_per_step`."""

    require_steps: Int = Field(ge=1)
    seq_per_step: Int = Field(ge=1)


class RandomLTDScheduleConfig(Section):
    """`random_ltd_schedule`: tokens kept at step 0 (`min_value`) up to `max_value`;
    DeepSpeed 0.19.8 computes `fixed_linear` only."""

    min_value: Int = Field(ge=1)
    max_value: Int = Field(ge=1)
    schedule_type: Literal["fixed_linear"]
    schedule_config: RandomLTDStepsConfig

    @model_validator(mode="after")
    def _ordered(self) -> "RandomLTDScheduleConfig":
        if self.min_value > self.max_value:
            raise ValueError(f"random_ltd_schedule.min_value {self.min_value} is above max_value {self.max_value}: "
                             "the kept-token count rises from min_value to max_value")
        return self


class LayerTokenLRScheduleConfig(Section):
    """`layer_token_lr_schedule`: a learning rate by consumed layer-tokens, which DeepSpeed
    0.19.8 does not run (NotImplementedError); accepted only switched off."""

    enabled: Bool = False
    # its settings (DeepSpeed's constants.py), unused while it is off
    total_layer_tokens: Int | None = None
    warmup_type: str | None = None
    warmup_layer_tokens: Int | None = None

    @model_validator(mode="after")
    def _off(self) -> "LayerTokenLRScheduleConfig":
        if self.enabled:
            raise ValueError("random_ltd.layer_token_lr_schedule.enabled: DeepSpeed 0.19.8 raises NotImplementedError "
                             "for the layer-token learning-rate schedule; set it to false and use a `scheduler` block")
        return self


class RandomLTDConfig(Section):
    """`data_routing.random_ltd`: which layers drop tokens and how many tokens they keep."""

    enabled: Bool = False
    total_layer_num: Int | None = Field(None, ge=1, json_schema_extra={"default_doc": "required when enabled"})
    random_ltd_layer_num: Int | None = Field(None, ge=1, json_schema_extra={"default_doc": "required when enabled"})
    random_ltd_layer_id: list[Int] | None = Field(None, json_schema_extra={"default_doc": "required when enabled"})
    model_mask_name: str | None = Field(None, json_schema_extra={"default_doc": "required when enabled (may be null)"})
    model_type: Literal["decoder", "encoder"] | None = Field(
        None, json_schema_extra={"default_doc": "required when enabled"})
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] | None = Field(
        None, json_schema_extra={"default_doc": "required when enabled"})
    random_ltd_schedule: RandomLTDScheduleConfig | None = Field(
        None, json_schema_extra={"default_doc": "required when enabled"})
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = Field(default_factory=LayerTokenLRScheduleConfig)

    @model_validator(mode="after")
    def _complete_when_on(self) -> "RandomLTDConfig":
        if not self.enabled:
            return self
        missing = [key for key in REQUIRED if key not in self.model_fields_set]
        if missing:
            raise ValueError(f"random_ltd.enabled needs {', '.join(missing)} (DeepSpeed 0.19.8 reads each of "
                             f"{', '.join(REQUIRED)}; model_mask_name may be null)")
        ids = self.random_ltd_layer_id
        if len(ids) != self.random_ltd_layer_num:
            raise ValueError(f"random_ltd.random_ltd_layer_num {self.random_ltd_layer_num} must equal the number of "
                             f"random_ltd_layer_id {ids} ({len(ids)}), as DeepSpeed checks")
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.total_layer_num:
            raise ValueError(f"random_ltd.random_ltd_layer_id {ids}: give distinct layer indices in "
                             f"[0, total_layer_num={self.total_layer_num})")
        if self.model_type == "encoder" and self.model_mask_name is None:
            raise ValueError("random_ltd.model_type 'encoder' needs model_mask_name: its attention mask is gathered "
                             "for the kept tokens (DeepSpeed asserts a mask is given)")
        return self


class DataRoutingConfig(Section):
    """`data_efficiency.data_routing`: its `enabled` is read by DeepSpeed and used for
    nothing; random-LTD runs when `random_ltd.enabled` is true."""

    enabled: Bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


def random_ltd_policy(routing: DataRoutingConfig, *, seed: int, global_batch_size: int) -> "RandomLTDPolicy | None":
    """The runtime's RandomLTDPolicy for an enabled `random_ltd` block, else None.
    `seed`: `data_efficiency.seed`, which seeds the kept-token draws."""
    block = routing.random_ltd
    if not block.enabled:
        return None
    from shardwise.runtime.data.random_ltd import RandomLTDPolicy  # torch loads only for configs that use it

    schedule = block.random_ltd_schedule
    return RandomLTDPolicy(
        total_layer_num=block.total_layer_num, layer_ids=tuple(block.random_ltd_layer_id),
        min_value=schedule.min_value, max_value=schedule.max_value,
        require_steps=schedule.schedule_config.require_steps, seq_per_step=schedule.schedule_config.seq_per_step,
        global_batch_size=global_batch_size, model_type=block.model_type,
        hidden_state_order=block.hidden_state_order, mask_name=block.model_mask_name, seed=seed,
    )
