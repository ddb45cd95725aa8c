"""tests/compat: DeepSpeed's API and unmodified DeepSpeed-shaped scripts (C26).

The script tests launch real jobs (`shardwise run --as-deepspeed`, several seconds each);
the default run covers every script at least at one ZeRO stage, and the rest of the
stage x script matrix is marked `slow`: it runs with `-m slow` or SHARDWISE_SLOW_TESTS=1.
"""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long multi-process runs, skipped unless -m slow or SHARDWISE_SLOW_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SHARDWISE_SLOW_TESTS") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or SHARDWISE_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords and item.path.is_relative_to(os.path.dirname(__file__)):
            item.add_marker(skip)
