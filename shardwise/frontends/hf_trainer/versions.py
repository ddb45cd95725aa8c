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

import importlib.metadata
from collections.abc import Mapping

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
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = _installed() if installed is None else installed
    problems = []
    for package, wanted in SUPPORTED.items():
        version = installed.get(package)
        if version is None:
            problems.append(f"{package} is not installed (ShardwiseTrainer needs {package}{wanted})")
        elif Version(version) not in SpecifierSet(wanted):
            problems.append(f"{package} {version} is installed; ShardwiseTrainer supports {package}{wanted}")
    if problems:
        raise ImportError(
            "; ".join(problems) + ". ShardwiseTrainer replaces internal Trainer methods that change between "
            f"releases, so only tested releases are accepted: {EXTRA}, or "
            + " ".join(f"pip install '{package}{wanted}'" for package, wanted in SUPPORTED.items())
        )


def _installed() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for package in SUPPORTED:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
