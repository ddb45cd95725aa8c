"""A model as the memory formulas see it: its parameter count, and the layout activations
and the stage-3 working set depend on. Built from a parameter count here, or from a model
family's config (shardwise/models/shapes.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A model as the memory formulas see it. Layout fields are None when only the
    parameter count is known; activations and the stage-3 working set then go uncounted.

    `largest_layer_params` is the biggest unit stage 3 gathers at once, taken as a whole
    transformer block or the embedding/output matrix, whichever is larger: engines that
    gather module by module need less, so this errs on the safe side.
    """

    name: str
    num_params: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    largest_layer_params: int | None = None
    trainable_params: int | None = None  # None: all of them; fewer: the rest is frozen (LoRA's base weights)

    def __post_init__(self) -> None:
        if self.num_params <= 0:
            raise ValueError(f"num_params must be positive, got {self.num_params}")
        if self.trainable_params is not None and not 0 < self.trainable_params <= self.num_params:
            raise ValueError(f"trainable_params must be in 1..num_params ({self.num_params:,}), "
                             f"got {self.trainable_params}")
        for field in ("hidden_size", "num_layers", "num_heads", "vocab_size", "intermediate_size", "largest_layer_params"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"{field} must be positive, got {value}")

    @property
    def replicated_params(self) -> int:
        """Parameters every tensor rank holds whole: the norms, (2L + 1)·h (biases of
        row-parallel layers and position tables, if any, are left out: small beside the
        rest). 0 when the layout is unknown."""
        if self.hidden_size is None or self.num_layers is None:
            return 0
        return (2 * self.num_layers + 1) * self.hidden_size

    def params_per_tensor_rank(self, tensor_size: int) -> int:
        """Ψ_T = ⌈(Ψ − Ψ_r)/T⌉ + Ψ_r: a 1/T block of every split parameter, every replicated one whole."""
        replicated = self.replicated_params
        return -(-(self.num_params - replicated) // tensor_size) + replicated

    @property
    def frozen_params(self) -> int:
        """Ψ_f: parameters held but not trained (no gradient, master or optimizer state)."""
        return 0 if self.trainable_params is None else self.num_params - self.trainable_params

    @property
    def has_layout(self) -> bool:
        """Whether activation memory can be computed (needs h, L and a)."""
        return None not in (self.hidden_size, self.num_layers, self.num_heads)

    def describe(self) -> str:
        layout = ""
        if self.has_layout:
            layout = f" (h={self.hidden_size}, L={self.num_layers}, a={self.num_heads}"
            layout += f", V={self.vocab_size})" if self.vocab_size else ")"
        frozen = (f", of which Ψ_t = {self.trainable_params:,} trained and Ψ_f = {self.frozen_params:,} frozen"
                  if self.frozen_params else "")
        return f"{self.name}: Ψ = {self.num_params:,} parameters{frozen}{layout}"

    @classmethod
    def from_params(
        cls,
        num_params: int | float,
        hidden_size: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        vocab_size: int | None = None,
    ) -> "ModelShape":
        """A bare parameter count, optionally with the layout for activations. The largest
        gathered unit is then taken as a GPT block, 12h², or the V·h embedding."""
        if float(num_params) != int(num_params):
            raise ValueError(f"num_params must be a whole number, got {num_params}")
        count = int(num_params)
        largest = None
        if hidden_size:
            largest = max(12 * hidden_size * hidden_size, (vocab_size or 0) * hidden_size)
        return cls("model", count, hidden_size, num_layers, num_heads, vocab_size, None, largest)
