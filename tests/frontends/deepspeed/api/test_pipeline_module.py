"""A `PipelineModule` built once the process group exists holds only its rank's stage's
layers, as DeepSpeed's does (DeepSpeed's unit/pipe/test_pipe_module.py sums `parameters()`
over the ranks), and trains exactly as the whole model in one process, through the
`PipelineEngine` DeepSpeed returns for one, with its stage accessors."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.pipe import OtherStageLayer, PipelineModule, TiedLayerSpec
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.test_pipeline_sequential import (MICRO_BATCH, MICRO_BATCHES, assert_stages_equal_reference,
                                                             build_layers, global_batches, micro_batches,
                                                             train_reference)


def _count(module: nn.Module) -> int:
    return sum(param.numel() for param in module.parameters())


def _split_and_train(rank: int, world_size: int) -> dict:
    model = PipelineModule(layers=build_layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    held = [index for index, layer in enumerate(model.layers) if not isinstance(layer, OtherStageLayer)]
    total = torch.tensor([_count(model)])
    dist.all_reduce(total)
    try:
        model.layers[0 if rank >= 2 else -1](torch.zeros(1))
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data_rank, data_size = engine.comm.rank, engine.comm.size
    losses = [engine.train_batch(iter(micro_batches(images, labels, MICRO_BATCH, data_size, data_rank))).item()
              for images, labels in global_batches(data_size)]
    params = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    stage = [isinstance(engine, deepspeed.PipelineEngine), engine.stage_id, engine.get_pipeline_parallel_rank(),
             engine.num_stages, engine.micro_batches, engine.is_first_stage(), engine.is_last_stage()]
    return {"held": held, "total": total.item(), "refused": refused, "losses": losses, "params": params,
            "stage": stage}


def test_each_rank_builds_its_stage_and_the_split_trains_as_one_process():
    results = run_distributed(_split_and_train, 4, timeout=300)  # 2 stages x 2 data-parallel ranks
    whole = nn.ModuleList(layer for layer in build_layers() if isinstance(layer, nn.Module))
    # the pipeline is the outermost dimension: ranks 0-1 hold stage 0, ranks 2-3 stage 1
    assert results[0]["held"] == results[1]["held"] and results[2]["held"] == results[3]["held"]
    assert sorted(results[0]["held"] + results[2]["held"]) == list(range(len(build_layers())))
    assert results[0]["held"][0] == 0 and results[2]["held"][-1] == len(build_layers()) - 1
    # each parameter counted once per data-parallel replica of its stage
    assert results[0]["total"] == 2 * _count(whole)
    assert "belongs to pipeline stage 1" in results[0]["refused"] and "stage 0" in results[2]["refused"]
    for rank, result in enumerate(results):
        stage = rank // 2
        assert result["stage"] == [True, stage, stage, 2, MICRO_BATCHES, stage == 0, stage == 1]
    want = run_distributed(train_reference, 1, 2, timeout=120)[0]
    assert_stages_equal_reference(results, want)


def _tied(rank: int, world_size: int) -> list[bool]:
    torch.manual_seed(0)
    model = PipelineModule(layers=[TiedLayerSpec("shared", nn.Linear, 4, 4), nn.Tanh(), nn.Linear(4, 4),
                                   TiedLayerSpec("shared", nn.Linear, 4, 4)], num_stages=2)
    return [isinstance(layer, OtherStageLayer) for layer in model.layers]


def test_a_module_several_layers_share_keeps_every_layer_until_initialize():
    for stand_ins in run_distributed(_tied, 2, timeout=120):
        assert not any(stand_ins)
