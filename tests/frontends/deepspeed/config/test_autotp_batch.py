"""The batch arithmetic of a config with DeepSpeed's AutoTP (`tensor_parallel.autotp_size`):
DeepSpeed 0.19.8 counts every process in it (train_batch_size = micro x accumulation x
world), tensor-parallel ranks too, so the Hugging Face Trainer fills train_batch_size that
way (tests/frontends/hf_trainer/test_stock_trainer.py). shardwise's own
`tensor_parallel.size` keeps the data-parallel arithmetic. With DEEPSPEED_PYTHON, DeepSpeed
itself accepts and refuses the same configs on 2 ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config

AUTOTP = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "tensor_parallel": {"autotp_size": 2}}


def test_autotp_counts_every_process_in_the_batch():
    assert load_config({**AUTOTP, "train_batch_size": 4}, world_size=2).train_batch_size == 4
    with pytest.raises(ConfigError, match=r"train_batch_size 2 != .* world_size 2 = 4"):
        load_config({**AUTOTP, "train_batch_size": 2}, world_size=2)
    derived = load_config({"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    assert (derived.train_batch_size, derived.gradient_accumulation_steps) == (8, 1)


def test_shardwises_own_tensor_parallel_size_counts_data_parallel_ranks():
    config = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                          "tensor_parallel": {"size": 2}}, world_size=4)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (8, 2)


DEEPSPEED_SIDE = """
import json, os, sys, torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
deepspeed.init_distributed("gloo")
answers = {}
for train in (2, 4):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    config = {**json.loads(sys.argv[1]), "train_batch_size": train, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        answers[train] = engine.train_batch_size()
    except AssertionError:
        answers[train] = None
if int(os.environ["RANK"]) == 0:
    print(json.dumps(answers))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_decides_alike(tmp_path: Path):
    script = tmp_path / "autotp_batch.py"
    script.write_text(DEEPSPEED_SIDE)
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with socket.socket() as probe:  # a free port: two suites at once must not meet on one
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", port, str(script), json.dumps(AUTOTP)],
                         capture_output=True, text=True, timeout=300,
                         env={**environment, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    ours = {}
    for train in (2, 4):
        try:
            ours[str(train)] = load_config({**AUTOTP, "train_batch_size": train}, world_size=2).train_batch_size
        except ConfigError:
            ours[str(train)] = None
    assert ours == theirs == {"2": None, "4": 4}
