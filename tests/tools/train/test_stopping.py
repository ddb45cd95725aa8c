"""The ranks' side of an interrupt: a signal is noted, not acted on, until the ranks agree
(`StopRequest`), and the launcher recognises ranks that stopped that way (`stopped_by`)."""

import signal

import pytest

from shardwise.tools.train.stopping import StopRequest, exit_code, stopped_by


@pytest.fixture
def stop():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield StopRequest().install()
    for signum, action in saved.items():
        signal.signal(signum, action)


def test_the_first_signal_is_noted_and_later_ones_change_nothing(stop):
    assert stop.signum == 0
    signal.raise_signal(signal.SIGTERM)  # neither ends the process nor raises here
    signal.raise_signal(signal.SIGINT)
    assert stop.signum == signal.SIGTERM


def test_ranks_that_stopped_for_a_signal_are_told_from_ranks_that_failed():
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143
    assert stopped_by([130, 130]) == signal.SIGINT
    assert stopped_by([143]) == signal.SIGTERM
    assert stopped_by([130, 1]) == 0  # one rank failed for its own reasons
    assert stopped_by([1]) == 0 and stopped_by([-9]) == 0
