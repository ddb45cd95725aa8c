"""Random-LTD's token-count schedule (DeepSpeed's data efficiency library,
`data_efficiency.data_routing.random_ltd`): how many tokens the layers that drop tokens
keep at each step, and how many layer-tokens the run has processed.

Random layer-wise token dropping (Yao et al., 2022) runs the middle layers of a model on a
random subset of each sequence's tokens and the first and last layers on all of them. The
kept count rises with the step, as DeepSpeed 0.19.8 computes it
(deepspeed/runtime/data_pipeline/data_routing/scheduler.py), `fixed_linear` only:

    kept(s) = min(floor(s / require_steps · (max − min) + min) rounded down to a multiple
                  of seq_per_step, max)

(unlike curriculum learning's schedule it is not raised back to `min` after rounding), and
is no longer recomputed once it reaches `max_value`. Each new step adds
global_batch_size · (kept · dropping layers + max · other layers) to the consumed
layer-tokens, what the layer-token learning-rate schedule and the benchmarks count.
"""

from __future__ import annotations

from typing import Any

from shardwise.formulas.data_efficiency import random_ltd_kept_tokens, random_ltd_layer_tokens


class RandomLTDScheduler:
    """DeepSpeed's interface: built from the `random_ltd` block plus `global_batch_size`;
    `state` is what a checkpoint keeps (`state_dict` / `load_state_dict`)."""

    def __init__(self, config: dict[str, Any]):
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_schedule", "global_batch_size"):
            if key not in config:
                raise ValueError(f"random-LTD needs {key!r} (got keys {sorted(config)})")
        if config.get("layer_token_lr_schedule", {}).get("enabled", False):
            raise ValueError("random_ltd.layer_token_lr_schedule.enabled is not supported (DeepSpeed 0.19.8 raises "
                             "NotImplementedError for it too): set it to false")
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        kind = self.config_schedule.get("schedule_type")
        if kind != "fixed_linear":
            raise ValueError(f"random_ltd_schedule.schedule_type {kind!r} is not supported: DeepSpeed 0.19.8 "
                             "computes 'fixed_linear' only")
        needed = ("seq_per_step", "require_steps")
        if any(key not in self.config_schedule.get("schedule_config", {}) for key in needed):
            raise ValueError(f"random_ltd_schedule.schedule_config needs {', '.join(needed)}")
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        self.state.update(min_value=schedule["min_value"], max_value=schedule["max_value"],
                          current_value=schedule["min_value"], schedule_config=schedule["schedule_config"],
                          schedule_type=schedule["schedule_type"], consumed_layer_tokens=0, current_steps=-1)

    def get_value(self, global_steps: int) -> int:
        schedule = self.state["schedule_config"]
        return random_ltd_kept_tokens(global_steps, min_value=self.state["min_value"],
                                      max_value=self.state["max_value"], require_steps=schedule["require_steps"],
                                      seq_per_step=schedule["seq_per_step"])

    def update_seq(self, global_steps: int) -> None:
        """The kept count for `global_steps` (the engine calls it before each forward); a new
        step adds its layer-tokens."""
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            self.state["consumed_layer_tokens"] += random_ltd_layer_tokens(
                self.state["current_value"], max_value=self.state["max_value"], layers=self.model_layer_num,
                dropping_layers=self.random_ltd_layer_num, global_batch=self.global_batch_size)
            self.state["current_steps"] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        keys = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")
        return {key: self.state[key] for key in keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.update({key: state_dict[key] for key in self.state_dict()})
