"""ZenFlow's `overlap_step`: the CPU AdamW runs on a background thread while the device
trains on, and its result reaches the device one update later. This is DeepSpeed
0.19.8's ZenFlowZeroOptimizerParallel (runtime/zenflow/zenflow_stage_1_and_2.py) and its
native ZenFlowAdam (ops/csrc/adam/cpu_adam_impl.cpp), which runs the step in a separate
process; here a thread does (torch's CPU kernels release the GIL). What DeepSpeed does:

- two gradient buffers and two sets of Adam moments, picked by the update's "state":
  m & 1 during warm-up, (m // update_interval) & 1 after it, and for "auto" its
  `zenflow_state`, (m + 1) & 1. A CPU step copies the window's sum into its buffer and
  updates the fp32 masters with that buffer, its own moments, step number m + 1 and the
  hyperparameters of step m;
- during warm-up each CPU step is waited for at once, so the device gets it that step;
- after warm-up the device gets the last step's result (the whole parameters, as the
  masters were after it) just before the next step is submitted; the first update after
  warm-up has nothing to wait for (with `full_warm_up_rounds` 0 the first two, since the
  first submission starts DeepSpeed's process and its first wait is skipped).

DeepSpeed leaves two races to timing: its wait is a counting semaphore that lags one step
behind when warm-up is 0, and a selection copies the device parameters into the masters
while a step may still run. Both are settled here as they fall whenever a CPU step takes
less than a window: the device always gets the latest finished step, and a selection
first waits for the running step, keeps its result for the device, then takes the masters
from the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.zero.sharded_optimizer import ShardedOptimizer
from shardwise.runtime.zero.strategy import ParameterStrategy

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


class OverlappedCpuStep:
    """The two-state CPU AdamW of `overlap_step` and when its results land on the device."""

    def __init__(self, *, optimizer: ShardedOptimizer, params: ParameterStrategy, shard: Communicator,
                 ledger: MemoryLedger, device: torch.device, windows: list[torch.Tensor]):
        self.optimizer = optimizer
        self.device = device
        self.store = optimizer.store
        self.params = params
        self.shard = shard
        torch_optimizer = optimizer.optimizer
        groups = [{**group, "params": list(group["params"])} for group in torch_optimizer.param_groups]
        # one AdamW per state, over the same masters: each keeps its own moments
        self.adams = [type(torch_optimizer)([dict(group) for group in groups])  # each group has every setting
                      for _ in range(2)]
        self.buffers = [[torch.zeros_like(window) for window in windows] for _ in range(2)]
        position = {unit.index: index for index, unit in enumerate(self.store.units)}
        self.grads = [[(segment.master, buffers[position[segment.unit]][segment.start : segment.stop])
                       for segment in self.store.segments] for buffers in self.buffers]
        masters = sum(segment.numel for segment in self.store.segments)
        ledger.hold("grads", 2 * sum(tensor_bytes(window) for window in windows), tier="host")
        ledger.hold("optimizer_states", 2 * 2 * 4 * masters, tier="host")  # two moment sets, fp32
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-cpu-adam")
        self.running: Future | None = None
        self.running_state = -1
        self.started = False
        self.kept: list[torch.Tensor] | None = None  # a finished step's masters, taken over by a selection

    def submit(self, m: int, state: int, windows: list[torch.Tensor], *, grad_scale: float, max_norm: float) -> None:
        """Step number m + 1 on the window's sum (which this empties), in the background."""
        if self.running_state == state:  # its buffer and moments are still in use
            self.wait()
        buffers = self.buffers[state]
        for buffer, window in zip(buffers, windows):
            buffer.copy_(window)
            window.zero_()
        if max_norm > 0:
            norm_squared = torch.stack([torch.linalg.vector_norm(b) for b in buffers]).square().sum()
            norm_squared = norm_squared.to(self.device)
            self.shard.all_reduce(norm_squared, "zenflow window gradient norm").wait()
            grad_scale *= min(1.0, max_norm / (float(norm_squared.sqrt()) * grad_scale + 1e-6))
        if grad_scale != 1.0:
            for buffer in buffers:
                buffer.mul_(grad_scale)
        adam = self.adams[state]
        for mine, theirs in zip(adam.param_groups, self.optimizer.optimizer.param_groups):
            mine.update({key: theirs[key] for key in HYPERPARAMETERS})
        self.started = True
        self.kept = None  # this step's masters are the ones the device gets next
        self.running = self.executor.submit(self._run, adam, self.grads[state], m)
        self.running_state = state

    @staticmethod
    @torch.no_grad()
    def _run(adam: torch.optim.Optimizer, grads: list[tuple[torch.Tensor, torch.Tensor]], m: int) -> None:
        for master, grad in grads:
            master.grad = grad
            state = adam.state[master]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["step"].fill_(m)  # AdamW adds 1: DeepSpeed's step_id = micro_step + 1
        try:
            adam.step()
        finally:
            for master, _ in grads:
                master.grad = None

    def wait(self) -> None:
        if self.running is not None:
            self.running.result()
            self.running, self.running_state = None, -1

    def close(self) -> None:
        """The engine is destroyed: let a step in flight finish, then end the thread."""
        try:
            self.wait()
        finally:
            self.executor.shutdown(wait=True)

    def keep_before_refresh(self) -> None:
        """A selection is about to take the masters from the device: the finished step's
        result still goes to the device at the next update."""
        if not self.started:
            return
        self.wait()
        self.kept = [self.store.master_chunk(unit).clone() for unit in self.store.units]

    def land(self) -> None:
        """The last CPU step's parameters become the device's (the whole parameters)."""
        self.wait()
        masters = [self.store.master_chunk(unit) for unit in self.store.units]
        if self.kept is None:
            self.store.publish()
        else:
            current = [master.clone() for master in masters]
            for master, kept in zip(masters, self.kept):
                master.copy_(kept)
            self.store.publish()
            for master, value in zip(masters, current):
                master.copy_(value)
            self.kept = None
        self.params.after_update()
