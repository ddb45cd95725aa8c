"""Compilation as a policy: whether each repeated block is compiled, and torch.compile's
own settings for it (`backend`, `mode`, and the rest of its keyword arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# modes whose generated code replays CUDA graphs, which capture fixed memory addresses
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompilePolicy:
    enabled: bool = False
    backend: str | Callable[..., Any] = "inductor"  # a name, or a backend function (for tests: a counter)
    mode: str | None = None
    # more of torch.compile's arguments: fullgraph, dynamic, options (Inductor's), disable
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def cuda_graph_settings(self) -> list[str]:
        """The settings of this policy that make torch.compile capture CUDA graphs, which
        ZeRO-3 cannot run: a graph replays kernels on the addresses it captured, and stage 3
        frees each module's parameters after use and gathers them into new storage."""
        if not self.enabled:
            return []
        mode = self.kwargs.get("mode", self.mode)
        settings = [f"mode '{mode}'"] if mode in CUDA_GRAPH_MODES else []
        inductor = self.kwargs.get("options") or {}
        settings += [f"kwargs.options['{key}'] {value!r}" for key, value in inductor.items()
                     if key.split(".")[-1] == "cudagraphs" and value]
        if self.backend == "cudagraphs":
            settings.append("backend 'cudagraphs'")
        return settings
