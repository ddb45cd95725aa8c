"""The Lightning releases ShardwiseStrategy is tested against.

The strategy overrides the hooks Lightning's loops call on a strategy (backward,
optimizer_step, the checkpoint hooks) and relies on how the automatic optimization loop
divides the loss for accumulation; those are internal to Lightning and change between
minor releases, so a release outside the tested range would fail inside a step, or train
differently. The check runs when `shardwise.frontends.lightning.strategy` is imported,
before Lightning is; the same range is pinned in pyproject.toml's `lightning` extra.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardwise.frontends.releases import require_releases

# Tested: lightning 2.6.6. Widen only after running tests/frontends/lightning with the new release.
SUPPORTED = {"lightning": ">=2.6,<2.7"}
EXTRA = "pip install 'shardwise[lightning]'"


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError unless Lightning is installed at a supported version.
    `installed` (package -> version, None for missing) defaults to this environment's."""
    require_releases(SUPPORTED, user="ShardwiseStrategy", extra=EXTRA, installed=installed,
                     reason="The strategy overrides Lightning's internal loop hooks, which change between releases")
