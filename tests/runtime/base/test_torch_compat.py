"""shardwise/runtime/base/torch_compat.py: both ways of selective checkpointing give the same cache and
gradients on whichever torch runs the suite, the older way is refused where it cannot
compile, the launcher's signal handlers survive an old torchrun, mesh groups get the
collective timeout, and no other module looks at torch's version. The renamed collectives are
exercised by every ZeRO test (scripts/test_torch.py runs them on the oldest torch)."""

from __future__ import annotations

import datetime
import re
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from shardwise.runtime.base import torch_compat
from shardwise.models.core.plan import ModelPlan
from shardwise.models.core.steps import apply_kernel_and_compile_step
from shardwise.runtime.activation.policy import ActivationPolicy, RecomputePolicy
from shardwise.runtime.compile.policy import CompilePolicy
from shardwise.runtime.engine.policies import Policies

PACKAGE = Path(torch_compat.__file__).resolve().parents[2]  # shardwise/
ADDMM = torch.ops.aten.addmm.default
WAYS = ["after_the_operator", "before_the_operator"]


def _keep_addmm(func, args, output) -> bool:
    return func is ADDMM


def _run(way: str, monkeypatch, rule=_keep_addmm) -> tuple[list[tuple], list[torch.Tensor], int]:
    """Checkpoint two linears; return the shapes cached, the gradients and how many addmm
    the recomputation ran."""
    if way == "after_the_operator" and not torch_compat.SELECTIVE_POLICY_SEES_OUTPUT:
        pytest.skip(f"torch {torch.__version__} asks the selective policy before the operator runs")
    monkeypatch.setattr(torch_compat, "SELECTIVE_POLICY_SEES_OUTPUT", way == "after_the_operator")
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
    x = torch.randn(5, 4, requires_grad=True)
    kept, calls = [], []

    def body(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return second(first(a).tanh()).sin()

    output = checkpoint(body, x, use_reentrant=False, context_fn=lambda: torch_compat.selective_checkpoint_contexts(
        rule, on_kept=lambda out: kept.append(tuple(out.shape))))
    output.sum().backward()
    return kept, [x.grad, first.weight.grad, second.weight.grad], len(calls)


@pytest.mark.parametrize("way", WAYS)
def test_selective_contexts_cache_the_kept_outputs_and_give_plain_gradients(way, monkeypatch):
    kept, grads, calls = _run(way, monkeypatch)
    assert kept == [(5, 8), (5, 3)]  # once each, in forward only
    assert calls == 2  # the recomputation ran
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
    x = torch.randn(5, 4, requires_grad=True)
    second(first(x).tanh()).sin().sum().backward()
    for got, want in zip(grads, [x.grad, first.weight.grad, second.weight.grad]):
        assert torch.equal(got, want)


def test_a_rule_reading_the_output_before_it_exists_is_told_why(monkeypatch):
    with pytest.raises(RuntimeError, match=r"read the operator's output \(\.shape\).*torch 2\.12"):
        _run("before_the_operator", monkeypatch, rule=lambda func, args, output: output.shape[-1] > 4)


def test_compiled_blocks_under_selective_checkpointing_are_refused_before_torch_2_12(monkeypatch):
    monkeypatch.setattr(torch_compat, "SELECTIVE_POLICY_SEES_OUTPUT", False)
    policies = Policies(compile=CompilePolicy(enabled=True), activation=ActivationPolicy(RecomputePolicy("selective")))
    with pytest.raises(ValueError, match=r'activation_checkpointing.policy "selective" needs torch 2\.12 or newer'):
        apply_kernel_and_compile_step(torch.nn.Linear(2, 2), ModelPlan(), policies=policies)


def test_no_module_but_torch_compat_reads_torch_version():
    readers = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if re.search(r"torch\.(__version__|version\b)", path.read_text()) and path.name != "torch_compat.py"]
    assert readers == [], "detect moved torch APIs in shardwise/runtime/base/torch_compat.py, not by version"


def test_torchrun_before_2_10_installs_the_launchers_own_handlers(monkeypatch):
    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.setattr(torch_compat, "TORCHRUN_HANDLES_CHOSEN_SIGNALS", False)
    assert torch_compat.torchrun_signal_options("SIGQUIT") == []
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        agents = api._terminate_process_handler
        with torch_compat.torchrun_leaves_signals((signal.SIGTERM,)):
            api._terminate_process_handler(signal.SIGTERM, None)  # what the agent would install
            with pytest.raises(api.SignalException):
                api._terminate_process_handler(signal.SIGQUIT, None)  # not the launcher's: the agent's
        assert seen == [signal.SIGTERM] and api._terminate_process_handler is agents
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_mesh_groups_get_the_collective_timeout_and_torchs_default_comes_back():
    from torch.distributed import distributed_c10d

    before = distributed_c10d._get_default_timeout(distributed_c10d.Backend.GLOO)
    with torch_compat.mesh_groups_time_out_after(datetime.timedelta(seconds=7)):
        assert distributed_c10d._get_default_timeout(distributed_c10d.Backend.GLOO).total_seconds() == 7
    assert distributed_c10d._get_default_timeout(distributed_c10d.Backend.GLOO) == before
