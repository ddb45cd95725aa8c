"""The release check every front end that overrides another framework's internals runs.

A front end that replaces private methods of Hugging Face's Trainer, TRL or Lightning is
only correct on the releases it was tested with: outside them it fails inside a step, or
trains differently. Each front end's `versions.py` names its tested ranges, the extra
that installs them and why they are pinned, and calls `require_releases` when the front
end is imported, before the framework itself is, so an unsupported release fails at once
with the version found and what to install.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping


def require_releases(supported: Mapping[str, str], *, user: str, reason: str, extra: str,
                     installed: Mapping[str, str | None] | None = None) -> None:
    """Raise ImportError unless every package in `supported` (package -> specifier, e.g.
    ">=2.6,<2.7") is installed at a version inside its range.

    `user` names what needs the packages ("ShardwiseTrainer"), `reason` says why only tested
    releases are accepted, `extra` is the command that installs them. `installed`
    (package -> version, None for missing) defaults to this environment's.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = _installed_versions(supported) if installed is None else installed
    problems = []
    for package, wanted in supported.items():
        version = installed.get(package)
        if version is None:
            problems.append(f"{package} is not installed ({user} needs {package}{wanted})")
        elif Version(version) not in SpecifierSet(wanted):
            problems.append(f"{package} {version} is installed; {user} supports {package}{wanted}")
    if problems:
        pins = " ".join(f"'{package}{wanted}'" for package, wanted in supported.items())
        raise ImportError("; ".join(problems) + f". {reason}, so only tested releases are accepted: {extra}, or "
                          f"pip install {pins}")


def _installed_versions(packages: Mapping[str, str]) -> dict[str, str | None]:
    """The installed version of each package (None where it is not installed)."""
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
