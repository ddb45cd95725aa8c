"""`deepspeed.utils.torch`: `required_torch_version`, which scripts and tests use to gate
features on the running torch."""

from __future__ import annotations

from packaging.version import Version

from shardwise.runtime.base.torch_compat import release_info

__all__ = ["required_torch_version"]


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the running torch is at least `min_version` and at most `max_version`."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version")
    running = Version(release_info()["torch"].split("+")[0])
    if min_version is not None and Version(str(min_version)) > running:
        return False
    return max_version is None or Version(str(max_version)) >= running
