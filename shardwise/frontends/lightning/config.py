"""What Lightning's Trainer strategy and Fabric strategy both take: a DeepSpeed config
(dict or JSON path) with a `stage` shortcut, and their names in Lightning's registries
("shardwise", "shardwise_stage_1/2/3", as Lightning names "deepspeed_stage_3")."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any


def strategy_config(config: dict | str | os.PathLike | None, stage: int | None, owner: str) -> dict:
    """The config as a dict of the strategy's own (the caller's is never changed), with
    `stage` (1-3), when given, as its ZeRO stage."""
    if config is None:
        resolved: dict = {}
    elif isinstance(config, dict):
        resolved = copy.deepcopy(config)
    elif os.path.isfile(config):
        resolved = json.loads(Path(config).read_text())
    else:
        raise FileNotFoundError(f"{owner}(config={str(config)!r}): no such file; pass a DeepSpeed config dict or "
                                "the path of its JSON file")
    if stage is not None:
        if stage not in (1, 2, 3):
            raise ValueError(f"{owner}(stage={stage!r}): the ZeRO stage is 1, 2 or 3")
        resolved.setdefault("zero_optimization", {})["stage"] = stage
    return resolved


def register_shortcuts(registry: Any, strategy: type) -> None:
    """`strategy` under "shardwise" (the config's stage) and "shardwise_stage_N"."""
    registry.register("shardwise", strategy, description="shardwise's ZeRO engine (the config's stage)")
    for stage in (1, 2, 3):
        registry.register(f"shardwise_stage_{stage}", strategy,
                          description=f"shardwise's ZeRO engine at stage {stage}", stage=stage)
