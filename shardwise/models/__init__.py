"""Models and what shardwise knows about them: shardwise's GPT, and per model family
(gpt/, hf/llama.py, hf/gpt2.py) a `ModelPlan` (core/plan.py) that `parallelize`
(parallelize.py) applies in the fixed order tensor -> sequence -> recomputation -> kernels
and compile -> pipeline (core/steps.py), before the engine's ZeRO."""

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.core.plan import ModelPlan

__all__ = ["GPT", "GPTConfig", "ModelPlan", "parallelize", "plan_for"]


def __getattr__(name: str):
    """`parallelize` and `plan_for` import the runtime's parallelisms: on first use only."""
    if name == "parallelize":
        from shardwise.models.families import parallelize

        return parallelize
    if name == "plan_for":
        from shardwise.models.families import plan_for

        return plan_for
    raise AttributeError(f"module 'shardwise.models' has no attribute {name!r}")
