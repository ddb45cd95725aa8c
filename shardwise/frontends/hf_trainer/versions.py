"""The `transformers` and `accelerate` releases `ShardwiseTrainer` is tested against.

`ShardwiseTrainer` keeps the Trainer's own loop and replaces a handful of its methods
(model preparation, checkpoint hooks, the backward call through `accelerate`). Those are
internal methods whose names and arguments move between releases, so a release outside
the tested range would fail deep inside a training step, or worse, train differently. The
check runs when `shardwise.frontends.hf_trainer.trainer` is imported, before it imports the
Trainer, and says which version was found and which to install. The same ranges are
pinned in pyproject.toml's `transformers` extra.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardwise.frontends.releases import require_releases

# Tested: transformers 5.17.0 (the GPU image's), 5.18.0 and 5.23.0 (the Trainer methods replaced here first exist
# together in 5.x releases around 5.12; 5.0 lacks them); accelerate 1.10.1 and 1.15.0,
# whose Accelerator methods used here are public. Widen only after running
# tests/integrations with the new release.
SUPPORTED = {
    "transformers": ">=5.17,<5.24",
    "accelerate": ">=1.10,<2",
}
EXTRA = "pip install 'shardwise[transformers]'"


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError unless every package in SUPPORTED is installed at a supported
    version. `installed` (package -> version, None for missing) defaults to what is
    installed in this environment."""
    require_releases(SUPPORTED, user="ShardwiseTrainer", extra=EXTRA, installed=installed,
                     reason="ShardwiseTrainer replaces internal Trainer methods that change between releases")
