"""A TRL trainer as TRL ships it, with the DeepSpeed config in its `TrainingArguments`
(`deepspeed=`), nothing of shardwise in it: tests run it under `shardwise run
--as-deepspeed` (tests/frontends/trl/test_stock_trl.py).

    python stock_trl.py sft|dpo STAGE OUTPUT_DIR

The logged numbers go to OUTPUT_DIR/logs.json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository, for tests.frontends.trl.workers

from tests.frontends.trl.workers import Run, _make, arguments, hf_style_config, logged, trainer_class  # noqa: E402


def main() -> None:
    kind, stage, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    run = Run(out_dir=out_dir, trainer=kind, stage=stage)
    args = arguments(run, 2, deepspeed=hf_style_config(stage))
    args.use_cpu = False  # a DeepSpeed launch (the tests' gloo_for_nccl.py stands in for the GPUs)
    trainer = _make(kind, trainer_class(kind), args)
    trainer.train()
    if trainer.is_world_process_zero():
        Path(out_dir, "logs.json").write_text(json.dumps(logged(trainer)))


if __name__ == "__main__":
    main()
