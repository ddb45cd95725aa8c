"""The launcher's stop signals, in this process: `Interrupted` with the signal's name and
the shell's exit status, log output off while the interrupt is handled, handlers restored."""

import logging
import signal

import pytest

from shardwise.tools.launcher.interrupts import Interrupted, interruptible


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_interrupted_and_everything_is_restored_after(signum):
    before = signal.getsignal(signum)
    with pytest.raises(Interrupted) as raised, interruptible():
        signal.raise_signal(signum)
    assert str(raised.value) == f"interrupted by {signal.Signals(signum).name}"
    assert raised.value.exit_code == 128 + signum
    assert signal.getsignal(signum) is before
    assert not logging.getLogger("torch.distributed.elastic").manager.disable


def test_log_output_is_off_once_interrupted():
    with pytest.raises(Interrupted), interruptible():
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            assert logging.getLogger().manager.disable == logging.CRITICAL
