"""Which device a process trains on: one GPU per process, refused with the counts when a
node has more processes than GPUs. CUDA is a stand-in here (this machine has none):
`torch.cuda.is_available`, `device_count` and `set_device` are monkeypatched. And the
process group is destroyed at exit whoever created it."""

import subprocess
import sys
import textwrap

import pytest
import torch

from shardwise.runtime.distributed import setup


@pytest.fixture
def two_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return chosen


def test_each_local_rank_gets_its_own_gpu(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert setup._pick_device(1) == torch.device("cuda", 1)
    assert two_gpus == [1]


def test_more_processes_per_node_than_gpus_is_refused_on_every_rank(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for local_rank in range(4):  # rank 0 too: no rank goes on to wait for the refused ones
        with pytest.raises(RuntimeError) as refused:
            setup._pick_device(local_rank)
        message = str(refused.value)
        assert message.startswith(f"4 processes on this node (LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE 4) but 2 "
                                  "visible GPU(s) (CUDA_VISIBLE_DEVICES=0,1): ranks would share a GPU")
        assert "shardwise run --nproc 2" in message and "make more GPUs visible (CUDA_VISIBLE_DEVICES)" in message
    assert two_gpus == []


def test_a_local_rank_past_the_gpus_is_refused_without_local_world_size(two_gpus):
    with pytest.raises(RuntimeError, match=r"^3 processes on this node \(LOCAL_RANK 2\) but 2 visible GPU"):
        setup._pick_device(2)


def test_without_cuda_every_rank_uses_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert setup._pick_device(5) == torch.device("cpu")


def test_one_gpu_bound_per_process_by_the_launcher_is_device_0(monkeypatch):
    """SLURM's --gpus-per-task (or a job script) gives each process its own GPU through
    CUDA_VISIBLE_DEVICES: local rank 3 sees one GPU, its device 0."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert setup._pick_device(3) == torch.device("cuda", 0)
    assert chosen == [0]


def test_two_ranks_of_one_host_on_the_same_gpu_are_named():
    """Rows as check_ranks_agree gathers them: config, model, host, pid, address, GPU."""
    from shardwise.runtime.distributed.agreement import RankMismatchError, _refuse_shared_gpus

    _refuse_shared_gpus([[1, 1, 7, 10, 0, 55], [1, 1, 7, 11, 0, 56], [1, 1, 8, 12, 0, 55]])  # other host: fine
    _refuse_shared_gpus([[1, 1, 7, 10, 0, 0], [1, 1, 7, 11, 0, 0]])  # CPU ranks share no GPU
    with pytest.raises(RankMismatchError, match="ranks 0 and 2 run on the same GPU of one host"):
        _refuse_shared_gpus([[1, 1, 7, 10, 0, 55], [1, 1, 7, 11, 0, 56], [1, 1, 7, 12, 0, 55]])


def test_a_group_someone_else_created_is_destroyed_at_exit(tmp_path):
    """A Lightning, Accelerate or Hugging Face run creates the group itself and never
    destroys it; once shardwise runs on that group, the group is destroyed before the
    interpreter tears down (a gloo group left to teardown can abort the process). The
    script's own exit handler, registered first, runs last and sees the group gone."""
    script = textwrap.dedent(f"""
        import atexit
        import torch.distributed as dist
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        from shardwise.runtime.distributed.setup import init_distributed
        init_distributed()
        init_distributed()  # the handler is registered once
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["initialized at exit: False"]
