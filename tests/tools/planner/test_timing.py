"""The planner's step-time work (shardwise/tools/planner/timing.py): what full recomputation
and partitioned activations (Pa) add to the tensor group, stage 3's messages per module,
and the pipeline on a host with fewer cores than ranks."""

from dataclasses import replace

import pytest

from shardwise.formulas.model_shape import ModelShape
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.formulas.step_time import Link
from shardwise.tools.planner.devices import datasheet
from shardwise.tools.planner.timing import Plan, plan_work, predict

SHAPE = ModelShape("test", 12 * 4 * 256**2 + 1000 * 256, 256, 4, 8, 1000)
TP2 = ModelParallel(tensor=2)
ONE_MICRO_BATCH = 2 * 128 * 256 * 2  # b·s·h·2 bytes (bf16)


def tensor_bytes(plan: Plan) -> dict[str, float]:
    work = plan_work(SHAPE, plan, datasheet("a100"), num_gpus=2, gpus_per_node=8, seq_len=128, dtype="bf16",
                     optimizer_state_bytes=12)
    return {f"{term.group} {term.op}": term.bytes_per_rank for term in work.comm if term.group.startswith("tensor")}


def test_full_recompute_issues_the_layers_forward_all_reduces_again() -> None:
    plain = tensor_bytes(Plan(1, parallel=TP2, micro_batch=2))
    full = tensor_bytes(Plan(1, recompute="full", parallel=TP2, micro_batch=2))
    ring_all_reduce = 2 * ONE_MICRO_BATCH // 2  # 2·X·(T−1)/T
    assert plain["tensor all_reduce"] == (2 + 4 * 4) * ring_all_reduce
    assert full["tensor recompute all_reduce"] == 2 * 4 * ring_all_reduce  # 2 of each layer's 4, 4 layers
    assert "tensor recompute all_reduce" not in tensor_bytes(Plan(1, recompute="selective", parallel=TP2,
                                                                  micro_batch=2))


def test_megatron_sp_recompute_gathers_and_scatters_the_forwards_share() -> None:
    sp = ModelParallel(tensor=2, megatron_sp=True)
    full = tensor_bytes(Plan(1, recompute="full", parallel=sp, micro_batch=2))
    ring = ONE_MICRO_BATCH // 2
    assert full["tensor recompute all_gather"] == 2 * 4 * ring  # 2 of each layer's 6 gathers
    assert full["tensor recompute reduce_scatter"] == 2 * 4 * ring  # 2 of its 4 reduce-scatters


def test_partitioned_activations_gather_each_layers_input_before_recomputing_it() -> None:
    pa = tensor_bytes(Plan(1, recompute="full", parallel=TP2, micro_batch=2, accumulation=3,
                           partition_activations=True))
    assert pa["tensor Pa all_gather"] == 3 * 4 * ONE_MICRO_BATCH / 2  # A·L·X·(T−1)/T
    with pytest.raises(ValueError, match="prices it with recompute 'full'"):
        Plan(1, recompute="selective", parallel=TP2, partition_activations=True)


def test_oversubscribed_host_shrinks_the_pipeline_bubble_and_nothing_else() -> None:
    """4 ranks on a 2-core host: the ramps of a 2-stage pipeline run on the idle stage's
    cores; on GPUs (host_cores 0) and with a core per rank the bubble stays (p−1)/m."""
    cpu = replace(datasheet("a100"), host_cores=2, intra_node=Link(1e-4, 1e9), inter_node=Link(1e-4, 1e9))
    kwargs = dict(gpus_per_node=4, seq_len=128, dtype="fp32", optimizer_state_bytes=8)
    pipe = Plan(1, parallel=ModelParallel(pipeline=2), micro_batch=2, accumulation=4)
    on_cpu = predict(SHAPE, pipe, cpu, num_gpus=4, **kwargs).time
    assert on_cpu.bubble == 0.0
    on_gpu = predict(SHAPE, pipe, datasheet("a100"), num_gpus=4, **kwargs).time
    assert on_gpu.bubble == pytest.approx(on_gpu.compute / 4)
    two_ranks = predict(SHAPE, pipe, cpu, num_gpus=2, **kwargs).time
    assert two_ranks.bubble == pytest.approx(two_ranks.compute / 4)
    flat = Plan(1, micro_batch=2)  # no pipeline: the same with or without the host's cores
    assert predict(SHAPE, flat, cpu, num_gpus=4, **kwargs).step_s == \
        predict(SHAPE, flat, replace(cpu, host_cores=0), num_gpus=4, **kwargs).step_s


def test_stage3_gathers_and_reduces_every_modules_unit() -> None:
    """Stage 3 partitions by module: a GPT block's four weight matrices and the two ends are
    gathered in forward, again in backward, and each reduce-scattered, every micro-batch."""
    work = plan_work(SHAPE, Plan(3, micro_batch=2, accumulation=3), datasheet("a100"), num_gpus=2, gpus_per_node=8,
                     seq_len=128, dtype="bf16", optimizer_state_bytes=12)
    messages = {(term.op, term.hides_behind): term.messages for term in work.comm if term.group == "shard"}
    units = 4 * 4 + 2
    assert messages == {("all_gather", "forward"): units * 3, ("all_gather", "backward"): units * 3,
                        ("reduce_scatter", "backward"): units * 3}
    stage2 = plan_work(SHAPE, Plan(2, micro_batch=2, accumulation=3), datasheet("a100"), num_gpus=2, gpus_per_node=8,
                       seq_len=128, dtype="bf16", optimizer_state_bytes=12)
    # one bucket: reduce-scattered every micro-batch, the updated parameters gathered once
    assert {term.op: term.messages for term in stage2.comm} == {"reduce_scatter": 3, "all_gather": 1}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_gradient_sums_are_priced_as_the_engine_streams_them(stage) -> None:
    """`grad_accum_dtype` fp32 beside bf16: each micro-batch's add into the fp32 sums, and
    at stage 1 the boundary's cast and the owned chunk written back, at the device's
    memory bandwidth (the host's for stages 2-3 offloaded); the update reads 4-byte
    gradients. Nothing without it, nor when training is fp32 already."""
    from shardwise.formulas.memory import Offload

    speeds = datasheet("a100")
    kwargs = dict(num_gpus=2, gpus_per_node=8, seq_len=128, dtype="bf16", optimizer_state_bytes=12)
    plan = Plan(stage, micro_batch=2, accumulation=3)
    plain = plan_work(SHAPE, plan, speeds, **kwargs)
    summed = plan_work(SHAPE, plan, speeds, grad_accum_dtype="fp32", **kwargs)
    local, partition = SHAPE.num_params, -(-SHAPE.num_params // 2)
    streamed = (3 * local * 10 + local * 6 + partition * 6) if stage == 1 else 3 * partition * 10
    assert plain.accumulation_bytes == 0 and summed.accumulation_bytes == streamed
    assert summed.optimizer_bytes - plain.optimizer_bytes == 2 * (4 - 2) * partition  # the gradient read twice
    time = predict(SHAPE, plan, speeds, grad_accum_dtype="fp32", **kwargs).time
    assert time.accumulation == pytest.approx(streamed / speeds.memory_bandwidth)
    assert time.total == pytest.approx(predict(SHAPE, plan, speeds, **kwargs).time.total + time.accumulation
                                       + 4 * partition / speeds.memory_bandwidth)
    offloaded = plan_work(SHAPE, replace(plan, offload=Offload(optimizer="cpu")), speeds, grad_accum_dtype="fp32",
                          **kwargs)
    assert offloaded.accumulation_on_host == (stage != 1)
    fp32 = plan_work(SHAPE, plan, speeds, grad_accum_dtype="fp32", **{**kwargs, "dtype": "fp32"})
    assert fp32.accumulation_bytes == 0
