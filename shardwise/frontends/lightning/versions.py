"""The Lightning releases ShardwiseStrategy and ShardwiseFabricStrategy are tested against.

The Trainer's strategy overrides the hooks Lightning's loops call on a strategy
(backward, optimizer_step, the checkpoint hooks) and relies on how the automatic
optimization loop divides the loss for accumulation; the Fabric strategy overrides the
methods Fabric calls on its strategy (setup, backward, optimizer_step, the checkpoint and
backward-sync hooks) and relies on how Fabric's wrappers route `optimizer.step()`. Those
are internal to Lightning and change between minor releases, so a release outside the
tested range would fail inside a step, or train differently. Each check runs when its
strategy's module is imported, before Lightning is; the same range is pinned in
pyproject.toml's `lightning` extra.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardwise.frontends.releases import require_releases

# Tested: lightning 2.6.6. Widen only after running tests/frontends/lightning with the new release.
SUPPORTED = {"lightning": ">=2.6,<2.7"}
EXTRA = "pip install 'shardwise[lightning]'"


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError unless Lightning is installed at a version ShardwiseStrategy
    supports. `installed` (package -> version, None for missing) defaults to this
    environment's."""
    require_releases(SUPPORTED, user="ShardwiseStrategy", extra=EXTRA, installed=installed,
                     reason="The strategy overrides Lightning's internal loop hooks, which change between releases")


def check_fabric_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """The same for ShardwiseFabricStrategy."""
    require_releases(SUPPORTED, user="ShardwiseFabricStrategy", extra=EXTRA, installed=installed,
                     reason="The strategy overrides the methods Fabric calls on its strategy, which change between "
                            "releases")
