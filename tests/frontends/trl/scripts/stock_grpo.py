"""TRL's GRPOTrainer as TRL ships it, its DeepSpeed config in `GRPOConfig(deepspeed=...)`:
tests run it under `shardwise run --as-deepspeed` (tests/frontends/trl/test_stock_trl.py).

    python stock_grpo.py POLICY_DIR STAGE OUTPUT_DIR

Rank 0 writes the logged numbers and its completions to OUTPUT_DIR/logs.json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository, for tests.frontends.trl

from tests.frontends.trl.grpo_workers import GrpoRun, arguments, prompts, record_generations, token_reward  # noqa: E402
from tests.frontends.trl.workers import hf_style_config, logged, tokenizer  # noqa: E402


def main() -> None:
    from trl import GRPOTrainer

    policy, stage, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # a DeepSpeed launch (the tests' gloo_for_nccl.py stands in for the GPUs), not accelerate's CPU switch
    args = arguments(GrpoRun(out_dir=out_dir, model_dir=policy, stage=stage), use_cpu=False,
                     deepspeed=hf_style_config(stage))
    trainer = GRPOTrainer(model=policy, reward_funcs=token_reward, args=args, train_dataset=prompts(),
                          processing_class=tokenizer())
    record: dict = {}
    record_generations(trainer, record)
    trainer.train()
    if trainer.is_world_process_zero():
        Path(out_dir, "logs.json").write_text(json.dumps({"logs": logged(trainer),
                                                          "completions": record["completions"]}))


if __name__ == "__main__":
    main()
