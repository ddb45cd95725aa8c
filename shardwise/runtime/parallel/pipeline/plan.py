"""Which point-to-point messages travel at each step of a pipeline batch, in an order both
ends of every message agree on.

Why: NCCL pairs the sends and receives between two ranks by their order alone (it ignores
tags), and two neighbours that each send to the other before receiving can block each
other unless both operations are in one batch. So the runner executes the schedule on
steps common to every rank (`schedules.timeline`): at each step a rank runs its pass, then
exchanges everything it sends and receives at that step in one batch
(`dist.batch_isend_irecv`, p2p.py). Every rank derives a step's messages from the same
timeline and sorts them by the same key, so rank a's operations with rank b come in the
same order as b's with a: the k-th send from a to b is b's k-th receive from a, with no tag
involved. A message is exchanged in the step of the pass that produces it and taken by a
pass of a later step (the timeline places every pass after those it needs).

    before step 0      tied weight        stage 0's embedding weight to the last stage
                       shared weights     an owner's shared parameters to each user stage
    forward s          activation         to stage s + 1 (none from the last stage)
    backward s         gradient           to stage s - 1 (none from stage 0)
    backward of the    tied gradient      the last stage's tied weight gradient to stage 0
    last micro-batch   shared gradients   a user stage's gradient of shared parameters to their owner

A rank knows only its own part of the shared parameters (split.py), which is all it needs:
it lists only the messages it sends or receives.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.runtime.parallel.pipeline.schedules import Action
from shardwise.runtime.parallel.pipeline.split import SharedParameters

KINDS = ("tied weight", "shared weights", "activation", "gradient", "tied gradient", "shared gradients")


@dataclass(frozen=True)
class Message:
    """One message between two virtual stages (a tensor or a tuple of them)."""

    kind: str
    source: int  # virtual stage that sends it
    target: int  # virtual stage that receives it
    micro_batch: int = 0

    def order(self) -> tuple[int, int, int, int]:
        """The key every rank sorts a step's messages by."""
        return KINDS.index(self.kind), self.source, self.target, self.micro_batch


class MessagePlan:
    """This rank's messages, step by step, for one batch of the timeline `steps` (every
    rank's passes per common step, schedules.timeline)."""

    def __init__(self, steps: list[list[Action | None]], rank: int, virtual: int, micro_batches: int, tied: bool,
                 shared: SharedParameters | None = None):
        self.steps = steps
        self.rank = rank
        self.size = len(steps)
        self.virtual = virtual
        self.micro_batches = micro_batches
        self.tied = tied
        self.last_stage = self.size * virtual - 1
        # shared parameters exist with one stage per rank only (split.py): stage == rank
        self.shared_weights: list[tuple[int, int]] = []  # (owner, user) pairs this rank is one of
        self.shared_gradients: dict[int, list[int]] = {}  # user stage -> owners it sends gradients to
        if shared is not None:
            for user in shared.sends:
                self.shared_weights.append((rank, user))
                if shared.requires_grad[user]:
                    self.shared_gradients.setdefault(user, []).append(rank)
            for owner in shared.receives:
                self.shared_weights.append((owner, rank))
                if shared.requires_grad[owner]:
                    self.shared_gradients.setdefault(rank, []).append(owner)

    @property
    def mine(self) -> list[Action | None]:
        """This rank's passes, one per step."""
        return self.steps[self.rank]

    def rank_of(self, stage: int) -> int:
        """Pipeline rank that holds virtual stage `stage`."""
        return stage % self.size

    def prologue(self) -> list[Message]:
        """The weights that move before the first pass."""
        messages = [Message("shared weights", owner, user) for owner, user in self.shared_weights]
        if self.tied:
            messages.append(Message("tied weight", 0, self.last_stage))
        return self._mine(messages)

    def at(self, step: int) -> list[Message]:
        """The messages this rank sends or receives in the exchange that ends `step`."""
        messages = []
        for rank, column in enumerate(self.steps):
            if column[step] is not None:
                messages += self.produced(rank, column[step])
        return self._mine(messages)

    def produced(self, rank: int, action: Action) -> list[Message]:
        """What `action` on pipeline rank `rank` sends (as far as this rank can know)."""
        stage, i = action.chunk * self.size + rank, action.micro_batch
        if action.kind == "forward":
            return [Message("activation", stage, stage + 1, i)] if stage < self.last_stage else []
        messages = [Message("gradient", stage, stage - 1, i)] if stage > 0 else []
        if i == self.micro_batches - 1:
            if self.tied and stage == self.last_stage:
                messages.append(Message("tied gradient", stage, 0))
            messages += [Message("shared gradients", stage, owner) for owner in self.shared_gradients.get(stage, ())]
        return messages

    def _mine(self, messages: list[Message]) -> list[Message]:
        ours = [m for m in messages if self.rank in (self.rank_of(m.source), self.rank_of(m.target))]
        return sorted(ours, key=Message.order)
