"""The release check the front ends share: each range is checked, every problem is named,
and the error says what to install."""

from __future__ import annotations

import pytest

from shardwise.frontends.releases import require_releases

SUPPORTED = {"alpha": ">=1.2,<1.3", "beta": ">=2"}
ARGUMENTS = dict(user="TheStrategy", reason="It overrides alpha's private hooks", extra="pip install 'pkg[alpha]'")


def test_versions_inside_every_range_pass():
    require_releases(SUPPORTED, installed={"alpha": "1.2.9", "beta": "2.0.0"}, **ARGUMENTS)


def test_every_problem_is_named_with_what_to_install():
    with pytest.raises(ImportError) as raised:
        require_releases(SUPPORTED, installed={"alpha": "1.3.0", "beta": None}, **ARGUMENTS)
    assert str(raised.value) == (
        "alpha 1.3.0 is installed; TheStrategy supports alpha>=1.2,<1.3; beta is not installed (TheStrategy needs "
        "beta>=2). It overrides alpha's private hooks, so only tested releases are accepted: pip install "
        "'pkg[alpha]', or pip install 'alpha>=1.2,<1.3' 'beta>=2'")


def test_this_environment_is_read_when_nothing_is_given():
    with pytest.raises(ImportError, match="no-such-package-for-shardwise is not installed"):
        require_releases({"no-such-package-for-shardwise": ">=1"}, **ARGUMENTS)
    require_releases({"torch": ">=2"}, **ARGUMENTS)
