"""The Lightning releases ShardwiseStrategy is tested against.

The strategy overrides the hooks Lightning's loops call on a strategy (backward,
optimizer_step, the checkpoint hooks) and relies on how the automatic optimization loop
divides the loss for accumulation; those are internal to Lightning and change between
minor releases, so a release outside the tested range would fail inside a step, or train
differently. The check runs when `shardwise.frontends.lightning.strategy` is imported,
before Lightning is; the same range is pinned in pyproject.toml's `lightning` extra.
"""

from __future__ import annotations

import importlib.metadata

# Tested: lightning 2.6.6. Widen only after running tests/frontends/lightning with the new release.
SUPPORTED = {"lightning": ">=2.6,<2.7"}
EXTRA = "pip install 'shardwise[lightning]'"


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise ImportError unless Lightning is installed at a supported version.
    `installed` (package -> version, None for missing) defaults to this environment's."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if installed is None:
        installed = {}
        for package in SUPPORTED:
            try:
                installed[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                installed[package] = None
    problems = []
    for package, wanted in SUPPORTED.items():
        version = installed.get(package)
        if version is None:
            problems.append(f"{package} is not installed (ShardwiseStrategy needs {package}{wanted})")
        elif Version(version) not in SpecifierSet(wanted):
            problems.append(f"{package} {version} is installed; ShardwiseStrategy supports {package}{wanted}")
    if problems:
        raise ImportError("; ".join(problems) + ". The strategy overrides Lightning's internal loop hooks, which "
                          f"change between releases, so only tested releases are accepted: {EXTRA}, or "
                          + " ".join(f"pip install '{package}{wanted}'" for package, wanted in SUPPORTED.items()))
