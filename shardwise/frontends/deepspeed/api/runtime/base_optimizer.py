"""`deepspeed.runtime.base_optimizer`: the classes DeepSpeed's optimizer wrappers derive
from, which libraries test against (Lightning's DeepSpeedStrategy.load_checkpoint:
`isinstance(item, (Optimizer, DeepSpeedOptimizer))`).

What `deepspeed.initialize` returns in DeepSpeed 0.19.8 (checked on CPU): at ZeRO stages
1-3 a ZeRO wrapper (`DeepSpeedZeroOptimizer`, `..._Stage3`), a `ZeROOptimizer` and so a
`DeepSpeedOptimizer`; at stage 0 with fp16 or bf16 a mixed-precision wrapper, a
`DeepSpeedOptimizer`; at stage 0 in fp32 the torch optimizer itself, neither.

shardwise returns the torch optimizer over the rank's fp32 partition (init_engine.py), of
its own class, since checkpoints record that class. `initialize` marks it with the
wrapper class DeepSpeed's would be (`mark_wrapped`): `DeepSpeedZeroOptimizer` at stages
1-2 (runtime/zero/stage_1_and_2.py), `DeepSpeedZeroOptimizer_Stage3` at stage 3
(runtime/zero/stage3.py), `BF16_Optimizer` (runtime/bf16_optimizer.py), `FP16_Optimizer`
and `FP16_UnfusedOptimizer` (runtime/fp16/) where DeepSpeed builds those. These classes count
a marked object as an instance of the class it is marked with and of that class's bases,
so the same `isinstance` checks answer as under DeepSpeed while `type(optimizer)` stays
the torch class.

The classes live in runtime/zero/optimizer_classes.py, beside the ZeRO modules that derive
from them (the runtime package imports zero, so zero may not import from here).
"""

from shardwise.frontends.deepspeed.api.runtime.zero.optimizer_classes import (
    DeepSpeedOptimizer,
    ZeROOptimizer,
    mark_wrapped,
)

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer", "mark_wrapped"]
