"""Named random streams (Megatron's RNG-states tracker), replayed by recomputation.

Tensor-parallel layers need two kinds of randomness: dropout on replicated activations
must draw the same mask on every rank of the tensor group (the default stream, seeded
alike), while dropout inside a parallel region must draw different masks per rank (a
stream seeded per rank). Megatron and DeepSpeed keep the second kind as named states
that `fork(name)` swaps in for a block. torch's checkpoint replays the default streams;
a checkpointed region also restores these named states for its recomputation (see
checkpoint.py), so a forked dropout draws the same mask again.

The states are those of the accelerator's default generator when CUDA is available,
else of the CPU generator.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new stream `name` starting from `seed`; both must be new."""
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already seeds another named random stream")
        if name in self.states:
            raise ValueError(f"random stream {name!r} already exists")
        outer = _get_state()
        manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(outer)
        self.seeds.add(seed)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default stream is untouched."""
        if name not in self.states:
            raise ValueError(f"random stream {name!r} was never added (model_parallel_cuda_manual_seed adds "
                             f"{MODEL_PARALLEL_RNG!r})")
        outer = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(outer)


_TRACKER = RNGStatesTracker()


def rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's and Megatron's `get_cuda_rng_tracker()`)."""
    return _TRACKER
