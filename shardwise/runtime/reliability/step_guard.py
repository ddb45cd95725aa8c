"""The check every optimizer step passes before it may change a weight.

One small all-reduce over the data-parallel ranks carries, per rank:

    the squared norm of its gradient partition   -> the global norm, for clipping
    1 if its loss was not finite                  -> which ranks produced NaN/inf
    how many micro-batches it ran since the step  -> ranks that skipped a batch
    how many forward/backward passes raised       -> ranks that caught an exception alone
    which call it is in (step, or a new forward /  -> a rank that skipped step()
      backward before step)
    the learning rate of each param group         -> a scheduler that differs per rank

so ranks agree on everything below without a second collective. Reading this rank's norm
and loss flag for it is the one device synchronisation of a step (`_read_local`).

- A non-finite global norm skips the step on every rank, in every precision (before, only
  fp16 skipped: with fp32/bf16, clipping computed min(1, max_norm / nan) = 1 and NaN
  reached every weight). fp16's dynamic loss scaling expects a few such steps while it
  finds its scale; any other non-finite step counts towards
  `max_consecutive_skipped_steps`, after which training stops with an error naming the
  ranks whose loss was not finite.
- Ranks that ran a different number of micro-batches, or where a forward/backward raised
  on some ranks only, raise `DivergentExecutionError` before the update: their gradients
  were averaged over different batches, so applying them would silently mix data. A rank
  that ran one micro-batch more or less than the others has windows of the same length
  that hold different batches: the count since the start names it at the next step.
- A rank that calls forward or backward again without step() while another is in
  step() enters the same check (`check_call`), so both see the difference at once rather
  than waiting out the collective timeout in collectives that no longer pair up.
- Learning rates that differ per rank (a scheduler built from a rank-dependent value)
  would update each replica, or each partition, with its own rate: refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.precision import LossScaler
from shardwise.runtime.reliability.errors import DivergentExecutionError, NonFiniteGradientError

log = logging.getLogger("shardwise")

# The call a rank is in when it enters the check, and its row's fields (then one learning
# rate per param group).
STEP, FORWARD, BACKWARD = 1, 2, 3
CALL_NAMES = {STEP: "step", FORWARD: "forward", BACKWARD: "backward"}
CALL, LOSS_FLAG, WINDOW, FAILED = range(4)
FIELDS = 4


@dataclass(frozen=True)
class StepVerdict:
    norm: float  # global gradient norm, unscaled (nan/inf when not finite)
    apply: bool  # False: skip the update
    nonfinite_ranks: tuple[int, ...]  # global ranks whose loss was not finite


class StepGuard:
    def __init__(self, replicas: Communicator, replicate_size: int, max_consecutive_skips: int):
        """`replicas`: every rank with the same model. Partitions are identical across the
        `replicate_size` copies of each shard, so each rank contributes 1/replicate_size
        of its squared norm."""
        self.replicas = replicas
        self.replicate_size = replicate_size
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.nonfinite_steps = 0
        self.loss_nonfinite: torch.Tensor | None = None  # on the loss's device; None: no loss since the step
        self.micro_batches = 0
        self.failed_passes = 0

    # -- what a rank notes between steps ----------------------------------------------------
    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember whether this micro-batch's loss was finite (no device sync here: the
        flag stays where the loss is, and is read with the norm at the step)."""
        nonfinite = ~torch.isfinite(loss.detach()).all()
        if self.loss_nonfinite is not None:
            nonfinite = nonfinite | self.loss_nonfinite.to(nonfinite.device)
        self.loss_nonfinite = nonfinite
        self.micro_batches += 1

    def note_failed_pass(self) -> None:
        self.failed_passes += 1

    def forget_window(self) -> None:
        """The window's gradients were discarded (a backward raised): so is what we noted."""
        self.loss_nonfinite = None
        self.micro_batches = 0

    # -- the check ---------------------------------------------------------------------------
    def check(self, norm_squared: torch.Tensor, scaler: LossScaler, step: int,
              learning_rates: Sequence[float]) -> StepVerdict:
        """Agree with every rank on this step; raise if they ran different work, apply
        different learning rates, or if too many steps in a row were not finite."""
        local_norm_squared, loss_nonfinite = self._read_local(norm_squared)
        total_norm_squared, rows = self._exchange(STEP, local_norm_squared / self.replicate_size, loss_nonfinite,
                                                  learning_rates)
        members = self.replicas.handle.ranks
        self._require_same_call(STEP, rows, members)
        self._require_same_work(step, members, rows, learning_rates)
        self.micro_batches = 0
        self.failed_passes = 0
        nonfinite_ranks = tuple(members[r] for r, row in enumerate(rows) if row[LOSS_FLAG] > 0)
        self.loss_nonfinite = None
        norm = math.sqrt(total_norm_squared) / scaler.scale if math.isfinite(total_norm_squared) else math.nan
        if math.isfinite(norm):
            self.consecutive_skips = 0
            return StepVerdict(norm, True, nonfinite_ranks)
        self.nonfinite_steps += 1
        if not scaler.can_absorb_overflow:
            self.consecutive_skips += 1
            self._report(step, nonfinite_ranks)
        return StepVerdict(norm, False, nonfinite_ranks)

    def check_call(self, call: int, learning_rates: Sequence[float]) -> None:
        """A forward (`FORWARD`) or backward (`BACKWARD`) that starts while this rank's last
        backward has not been stepped: legitimate when every rank does it (several losses
        per step), a skipped step() when another rank is in the step check meanwhile. The
        same exchange as the step check, so the two pair up and both ranks can tell."""
        _, rows = self._exchange(call, 0.0, 0.0, learning_rates)
        self._require_same_call(call, rows, self.replicas.handle.ranks)

    def _exchange(self, call: int, norm_squared: float, loss_nonfinite: float,
                  learning_rates: Sequence[float]) -> tuple[float, list[list[float]]]:
        """One all-reduce of [norm] + a row per rank (zeros in the others' rows, so the
        sum gathers them); returns the summed norm and every rank's row."""
        n, width = self.replicas.size, FIELDS + len(learning_rates)
        payload = torch.zeros(1 + n * width, dtype=torch.float64)
        payload[0] = norm_squared
        payload[1 + self.replicas.rank * width:1 + (self.replicas.rank + 1) * width] = torch.tensor(
            [call, loss_nonfinite, self.micro_batches, self.failed_passes, *learning_rates], dtype=torch.float64)
        self.replicas.control_all_reduce(
            payload, "the step check (gradient norm, finiteness, batch counts, learning rates)")
        total, *rest = payload.tolist()
        return total, [rest[r * width:(r + 1) * width] for r in range(n)]

    def _read_local(self, norm_squared: torch.Tensor) -> tuple[float, float]:
        """This rank's squared gradient norm and loss flag, in one device-to-host transfer.

        It is the one device synchronisation a step needs, and cannot do without: whether
        the update applies and how far it is clipped are decided on the host, and agreed
        over the control group, which works in host memory. Everything before it (loss
        checks, norms, reductions) stays queued on the device."""
        norm_squared = norm_squared.detach().double().reshape(())
        if self.loss_nonfinite is None:
            return norm_squared.item(), 0.0
        values = [norm_squared, self.loss_nonfinite.double().reshape(())]
        if values[0].device == values[1].device:
            first, second = torch.stack(values).tolist()
            return first, second
        return values[0].item(), values[1].item()  # an offloaded norm is in host memory already

    def _require_same_call(self, call: int, rows: list[list[float]], members: tuple[int, ...]) -> None:
        calls = [int(row[CALL]) for row in rows]
        if len(set(calls)) == 1:
            return
        stepping = [members[r] for r, c in enumerate(calls) if c == STEP]
        again = [(members[r], CALL_NAMES[c]) for r, c in enumerate(calls) if c != STEP]
        skipped = "; ".join(f"rank {rank} began a new {name} without calling step()" for rank, name in again)
        raise DivergentExecutionError(
            f"rank {self.replicas.global_rank}: {skipped} after its last backward, while rank(s) "
            f"{', '.join(map(str, stepping))} called step(). Every rank must call engine.step() after each "
            "engine.backward() (or all of them run several backwards before one step)."
        )

    def _require_same_work(self, step: int, members: tuple[int, ...], rows: list[list[float]],
                           learning_rates: Sequence[float]) -> None:
        counts = [row[WINDOW] for row in rows]
        failures = [row[FAILED] for row in rows]
        if len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {members[r]}: {int(c)}" for r, c in enumerate(counts))
            raise DivergentExecutionError(
                f"rank {self.replicas.global_rank}: at optimizer step {step} the ranks ran different "
                f"numbers of micro-batches since the last step ({per_rank}); their gradients were "
                "averaged over different batches, so the update is refused. Every rank must call "
                "engine(...) / engine.backward() / engine.step() for the same batches."
            )
        if len(set(failures)) > 1:
            per_rank = ", ".join(f"rank {members[r]}: {int(c)}" for r, c in enumerate(failures))
            raise DivergentExecutionError(
                f"rank {self.replicas.global_rank}: at optimizer step {step} a forward or backward "
                f"raised on some ranks only (passes that raised: {per_rank}); the ranks that caught "
                "it went on with a different batch than the others, so the update is refused. "
                "Skip a bad batch on every rank (e.g. agree on it first), or let the error end the run."
            )
        for group in range(len(learning_rates)):
            rates = [row[FIELDS + group] for row in rows]
            if len(set(rates)) > 1:
                per_rank = ", ".join(f"rank {members[r]}: {rate:g}" for r, rate in enumerate(rates))
                raise DivergentExecutionError(
                    f"rank {self.replicas.global_rank}: at optimizer step {step} the ranks would apply different "
                    f"learning rates to param group {group} ({per_rank}), so the replicas (or the partitions) "
                    "would drift apart and the update is refused. The learning-rate scheduler and the "
                    "optimizer's param groups must set the same rate on every rank (no rank-dependent value)."
                )

    def _report(self, step: int, ranks: tuple[int, ...]) -> None:
        where = (f"the loss was not finite on rank(s) {', '.join(map(str, ranks))}" if ranks
                 else "every loss was finite, so the gradients overflowed in backward")
        if self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"optimizer step {step} is the {self.consecutive_skips}th in a row with a non-finite "
                f"gradient norm ({where}); stopping instead of training on. Look for a bad batch or "
                "a diverging run (lower the learning rate, enable gradient_clipping, check inputs); "
                "max_consecutive_skipped_steps sets how many are tolerated."
            )
        if self.replicas.global_rank == 0:
            log.warning("shardwise: skipped optimizer step %d: non-finite gradient norm (%s); %d in a row",
                        step, where, self.consecutive_skips)
