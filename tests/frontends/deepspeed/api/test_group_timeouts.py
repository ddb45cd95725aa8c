"""Process groups the DeepSpeed API builds for scripts (`deepspeed.comm.new_group`, ALST's
mpu, the pipeline topology's) time out after shardwise's collective timeout, not gloo's
30-minute default: a rank that died is reported, not waited for half an hour."""

import torch

from shardwise.tools.testing import run_distributed


def group_timeouts(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from shardwise.frontends.deepspeed.api import comm
    from shardwise.frontends.deepspeed.api.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from shardwise.frontends.deepspeed.api.runtime.sequence_parallel import parallel_state_sp
    from shardwise.runtime.distributed.setup import collective_timeout

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    parallel_state_sp.initialize_sequence_parallel(2)
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    return {"wanted": collective_timeout().total_seconds(), "world": seconds(dist.group.WORLD),
            "comm.new_group": seconds(comm.new_group([0, 1])),
            "mpu sequence": seconds(parallel_state_sp.get_sequence_parallel_group()),
            "mpu sequence-data": seconds(parallel_state_sp.get_sequence_data_parallel_group()),
            "pipeline": seconds(grid.get_pipe_parallel_group())}


def test_groups_for_scripts_time_out_with_the_collectives():
    for report in run_distributed(group_timeouts, 2):
        wanted = report.pop("wanted")
        assert wanted < 30 * 60
        assert report == {name: wanted for name in report}, report
