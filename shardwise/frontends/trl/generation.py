"""Generation from the trained policy in TRL's online trainers (GRPO, RLOO, on-policy
distillation), gathered once per generation at ZeRO-3.

TRL generates inside `unwrap_model_for_generation(...)` and
`self._dist.summon_full_params(model)`, where `self._dist` is TRL's `DistributedBackend`:
it reads the backend from accelerate's state, and under DeepSpeed ZeRO-3 it is
`unwrap_model_for_generation` that gathers every parameter once for the whole `generate`
call (`ds3_gather_for_generation=True`, TRL's default). Under shardwise accelerate runs no
DeepSpeed, so TRL would take the plain path: `generate` on the engine's module, whose
stage-3 hooks gather every layer again for every new token, with a rank check per
forward that breaks as soon as two ranks' sequences end at different lengths.
`EngineGenerationBackend` takes `self._dist`'s place and gathers the policy once at the
generation's start (`gathered_for_generation`), its hooks standing aside until the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from trl.distributed import DistributedBackend

from shardwise.runtime.zero.gathered import gathered_for_generation


class EngineGenerationBackend(DistributedBackend):
    """TRL's `DistributedBackend` for a trainer whose policy a shardwise engine trains.
    Only `summon_full_params`, which TRL enters around every `generate` of the policy,
    differs: at stage 3 it holds the whole policy for the block."""

    def __init__(self, trainer: Any):
        super().__init__(trainer.accelerator)
        self.trainer = trainer

    @contextmanager
    def summon_full_params(self, module: nn.Module, **kwargs: Any) -> Iterator[None]:
        engine = self.trainer.engine  # None until training starts: then nothing is partitioned yet
        if engine is None or module not in (engine, engine.module) or not engine.policies.zero.partitions_parameters:
            with super().summon_full_params(module, **kwargs):
                yield
            return
        with gathered_for_generation(engine.module.parameters()):
            yield
