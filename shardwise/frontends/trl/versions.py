"""The TRL releases the shardwise TRL trainers are tested against.

They keep TRL's own training step and change two things TRL decides inside its
constructors: the reference model (prepared by TRL for DeepSpeed with `prepare_deepspeed`)
and, through `ShardwiseTrainer`, the Trainer's internal methods. Both move between TRL
releases (1.x renamed and re-laid-out the trainers more than once), so a release outside
the tested range would fail inside a step, or train differently. The check runs when
`shardwise.frontends.trl.trainers` is imported, before TRL is; the same range is pinned in
pyproject.toml's `trl` extra.
"""

from __future__ import annotations

import importlib.metadata

# Tested: trl 1.16.0 with transformers 5.23.0 and accelerate 1.15.0. Widen only after
# running tests/frontends/trl with the new release.
SUPPORTED = {"trl": ">=1.16,<1.17"}
EXTRA = "pip install 'shardwise[trl]'"


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise ImportError unless TRL is installed at a supported version. `installed`
    (package -> version, None for missing) defaults to this environment's."""
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
            problems.append(f"{package} is not installed (the shardwise TRL trainers need {package}{wanted})")
        elif Version(version) not in SpecifierSet(wanted):
            problems.append(f"{package} {version} is installed; the shardwise TRL trainers support {package}{wanted}")
    if problems:
        raise ImportError("; ".join(problems) + ". They replace how TRL prepares its reference model, which changes "
                          f"between releases, so only tested releases are accepted: {EXTRA}, or "
                          + " ".join(f"pip install '{package}{wanted}'" for package, wanted in SUPPORTED.items()))
