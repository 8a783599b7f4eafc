"""convert/signals.py in-process: the first signal raises, later ones are dropped; a deferred section
holds a signal and raises it at its end (drops it on the way out of a failure); settle ignores signals
for good (SIG_IGN, which Python keeps through its shutdown)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from convert import signals


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this (main) thread at the next bytecode


def test_the_first_signal_raises_and_a_second_is_dropped() -> None:
    old = signals.install()
    try:
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
            _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)  # the run is stopping: dropped
        signals.settle()
        assert [signal.getsignal(s) for s in (signal.SIGINT, *signals.stop_signals())] == [signal.SIG_IGN] * 3
    finally:
        signals.restore(old)
    assert signal.getsignal(signal.SIGINT) is old[0][1]


def test_a_deferred_section_holds_the_signal_until_it_ends() -> None:
    old = signals.install()
    try:
        done = []
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGHUP)}"):
            with signals.deferred():
                with signals.deferred():
                    _deliver(signal.SIGHUP)
                done.append("inner")  # the inner end is not the outermost: still held
                done.append("outer")
        assert done == ["inner", "outer"]
        signals.install()
        with pytest.raises(ValueError):  # a failing section drops the held signal: the failure is reported
            with signals.deferred():
                _deliver(signal.SIGINT)
                raise ValueError("the run failed")
        with signals.deferred(drop=True):  # clean-up on the way out: dropped too
            _deliver(signal.SIGINT)
    finally:
        signals.restore(old)
