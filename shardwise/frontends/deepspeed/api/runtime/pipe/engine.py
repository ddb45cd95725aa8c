"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, the engine `deepspeed.initialize` returns for a
`PipelineModule`, as DeepSpeed's does, so scripts' isinstance checks and type hints hold
and they find the stage accessors DeepSpeed's pipeline engine has.

The pipeline itself (`train_batch`, `eval_batch`, `set_dataiterator`, `is_first_stage`,
`is_last_stage`) is the base engine's (runtime/engine/deepspeed_engine.py): shardwise also
pipelines a model split by `pipeline_parallel.size` in the config, which is not a
PipelineModule, through the same engine.
"""

from __future__ import annotations

from shardwise.frontends.deepspeed.api.runtime.engine import DeepSpeedEngine


class PipelineEngine(DeepSpeedEngine):
    """The engine of a PipelineModule: DeepSpeed's names for this rank's place in the pipeline."""

    @property
    def stage_id(self) -> int:
        layout = self.pipeline_layout()
        return 0 if layout is None else layout.rank

    @property
    def num_stages(self) -> int:
        layout = self.pipeline_layout()
        return 1 if layout is None else layout.size

    @property
    def micro_batches(self) -> int:
        """Micro-batches per `train_batch`: the gradient accumulation steps."""
        return self.gradient_accumulation_steps()

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id
