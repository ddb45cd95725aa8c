"""`engine.config` read as a dict is the config as the script passed it, as DeepSpeed's
`engine.config` is (the stock Hugging Face Trainer's `save_model` reads the ZeRO stage as
`engine.config.get("zero_optimization", {}).get("stage")`), while its attributes stay the
resolved config the engine runs by."""

import torch

from shardwise.tools.testing import run_distributed

WRITTEN = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _config_views(rank: int, world_size: int) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(WRITTEN))
    config = engine.config
    return {"stage": config.get("zero_optimization", {}).get("stage"), "missing": config.get("bf16", "absent"),
            "item": config["optimizer"], "has": ("zero_optimization" in config, "fp16" in config),
            "resolved": (config.train_batch_size, config.zero_optimization.stage)}


def test_engine_config_reads_as_written_and_as_resolved():
    (views,) = run_distributed(_config_views, 1)
    assert views == {"stage": 3, "missing": "absent", "item": WRITTEN["optimizer"], "has": (True, False),
                     "resolved": (2, 3)}
