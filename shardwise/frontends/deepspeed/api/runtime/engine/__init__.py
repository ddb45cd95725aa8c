"""`deepspeed.runtime.engine`: `DeepSpeedEngine`, the engine `deepspeed.initialize` returns
(deepspeed_engine.py), where scripts import it from for type hints and isinstance checks;
the checkpoint calls' argument checks beside it (checkpoint_arguments.py)."""

from shardwise.frontends.deepspeed.api.runtime.engine.deepspeed_engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
