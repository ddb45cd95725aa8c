"""`deepspeed.runtime.pipe.schedule`: the instruction streams equal DeepSpeed 0.19.8's (two
written out below as DeepSpeed prints them; with DEEPSPEED_PYTHON set, every schedule of
up to 8 micro-batches and 4 stages is compared with DeepSpeed's own), and the training
schedule pairs every send with the neighbour's receive of the same micro-batch at the same step."""

import os
import subprocess
import sys

import pytest

from shardwise.frontends.deepspeed.api.runtime.pipe import schedule

DEEPSPEED_TRAIN_2_2 = {  # TrainSchedule(micro_batches=2, stages=2, stage_id) under DeepSpeed 0.19.8
    0: [["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"], ["SendActivation(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
        ["RecvGrad(buffer_id=0)", "SendActivation(buffer_id=1)", "BackwardPass(buffer_id=0)"], [],
        ["RecvGrad(buffer_id=1)", "BackwardPass(buffer_id=1)", "ReduceTiedGrads()", "ReduceGrads()",
         "OptimizerStep()"]],
    1: [[], ["RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["BackwardPass(buffer_id=0)"],
        ["SendGrad(buffer_id=0)", "RecvActivation(buffer_id=1)", "LoadMicroBatch(buffer_id=1)",
         "ForwardPass(buffer_id=1)"], ["BackwardPass(buffer_id=1)"],
        ["SendGrad(buffer_id=1)", "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]],
}
DEEPSPEED_INFERENCE_2_2 = {
    0: [["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "SendActivation(buffer_id=0)", "ForwardPass(buffer_id=1)"],
        ["SendActivation(buffer_id=1)"]],
    1: [[], ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "RecvActivation(buffer_id=1)", "ForwardPass(buffer_id=1)"]],
}

DUMP = """
import sys
if sys.argv[1] == "deepspeed":
    import deepspeed.runtime.pipe.schedule as s
else:
    import shardwise.frontends.deepspeed.api.runtime.pipe.schedule as s
for kind in ("TrainSchedule", "InferenceSchedule", "DataParallelSchedule"):
    for micro_batches in (1, 2, 3, 5, 8):
        for stages in (1, 2, 3, 4):
            for stage in range(stages):
                sched = getattr(s, kind)(micro_batches=micro_batches, stages=stages, stage_id=stage)
                print(kind, micro_batches, stages, stage, sched.num_pipe_buffers(), [[repr(c) for c in step] for step in sched])
"""


def streams(kind, micro_batches, stages):
    return {stage: [[repr(command) for command in step]
                    for step in kind(micro_batches=micro_batches, stages=stages, stage_id=stage)]
            for stage in range(stages)}


def test_two_stage_streams_are_deepspeed_s():
    assert streams(schedule.TrainSchedule, 2, 2) == DEEPSPEED_TRAIN_2_2
    assert streams(schedule.InferenceSchedule, 2, 2) == DEEPSPEED_INFERENCE_2_2


@pytest.mark.parametrize("micro_batches,stages", [(1, 3), (4, 3), (7, 4)])
def test_every_send_meets_a_receive_and_every_micro_batch_runs_once(micro_batches, stages):
    per_stage = [list(schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage))
                 for stage in range(stages)]
    assert {len(steps) for steps in per_stage} == {2 * (micro_batches + stages - 1)}
    for stage, steps in enumerate(per_stage):
        buffers = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).num_pipe_buffers()
        flat = [command for step in steps for command in step]
        assert sum(isinstance(c, schedule.ForwardPass) for c in flat) == micro_batches
        assert sum(isinstance(c, schedule.BackwardPass) for c in flat) == micro_batches
        assert all(0 <= c.buffer_id < buffers for c in flat if isinstance(c, schedule.BufferOpInstruction))
        assert isinstance(flat[-1], schedule.OptimizerStep)
    for step in range(2 * (micro_batches + stages - 1)):
        for stage in range(stages - 1):
            here, there = per_stage[stage][step], per_stage[stage + 1][step]
            assert (sum(isinstance(c, schedule.SendActivation) for c in here)
                    == sum(isinstance(c, schedule.RecvActivation) for c in there))
            assert (sum(isinstance(c, schedule.RecvGrad) for c in here)
                    == sum(isinstance(c, schedule.SendGrad) for c in there))


def test_a_schedule_outside_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="0 <= stage_id < stages"):
        schedule.TrainSchedule(micro_batches=2, stages=2, stage_id=2)


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare every schedule with DeepSpeed's own")
def test_every_small_schedule_equals_deepspeed_s():
    def dump(python, which):
        return subprocess.run([python, "-c", DUMP, which], capture_output=True, text=True, check=True, timeout=300,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"}).stdout

    assert dump(os.environ["DEEPSPEED_PYTHON"], "deepspeed") == dump(sys.executable, "shardwise")
