"""How a run stops on a signal: SIGINT, SIGTERM and SIGHUP (:data:`STOP_SIGNALS`) raise
``KeyboardInterrupt`` in the main thread, which the command line turns into exit 130 and one line.

Three places must not be cut by that exception, and hold a signal instead (:func:`deferred`):

- imports of C extensions: NumPy's import turns a ``KeyboardInterrupt`` raised inside it into an
  ``ImportError`` (``PyCapsule_Import could not import module "datetime"``), which would read as a bug;
- the renames of an output's commit (:meth:`convert.output.OutputClaim.commit`): cut between the two
  renames of an ``--overwrite``, the new output would be left staged and the old one set aside, and
  the message would not say which is in place;
- the clean-up after a run stopped or failed (a second Ctrl-C would cut the release of the claim).

A signal held there is raised as ``KeyboardInterrupt`` when the outermost section ends, unless the
section ends by an exception or is clean-up on the way out (the run is already stopping or failing:
the signal is dropped). Once one signal has been raised, later ones are dropped: the run is stopping,
and a second Ctrl-C would only cut its clean-up (a thread pool's shutdown, the claim's release) or its
one-line report. :func:`settle` ignores them for good once the run has ended (Python resets its own
handlers to the default while it shuts down, where SIGTERM would kill the process without a word).

Worker processes are started inside :func:`blocked`: they inherit a mask holding SIGINT and
:data:`STOP_SIGNALS` from their first instruction, so a terminal's Ctrl-C (sent to the whole process
group) reaches only this process, which stops the workers itself. Ignoring the signal in the worker
once it runs is too late: a spawned worker imports NumPy and this package first, and a signal there
printed a ``KeyboardInterrupt`` traceback per worker and could leave the pool waiting for ever on the
dead worker (CPython gh-94777, Python 3.11.2).

The state is process-wide because signal handlers are: one :class:`_Gate`, used only from the main
thread (Python runs handlers there). Only the standard library is imported: the handlers are
installed before anything heavy is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "blocked", "deferred", "install", "on_bus_error", "restore", "settle", "stop_signals"]

#: Signals that stop a run as SIGINT does (exit 130, the temporary removed): SIGTERM, and SIGHUP where it
#: exists (the terminal closed), by name (Windows has no SIGHUP).
STOP_SIGNALS = ("SIGTERM", "SIGHUP")


class _Gate:
    """``depth``: :func:`deferred` sections entered; ``pending``: a signal held in one; ``settled``: an
    interrupt is being reported (later signals are dropped)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.settled = False


_GATE = _Gate()


def stop_signals() -> list[int]:
    """The :data:`STOP_SIGNALS` this platform has."""
    return [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]


def _handler(signum: int, frame: FrameType | None) -> None:
    if _GATE.settled:
        return
    if _GATE.depth:
        _GATE.pending = signum
        return
    _GATE.settled = True  # the run is stopping: a second signal would only cut its clean-up
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> list[tuple[int, Any]]:
    """Handle SIGINT and :data:`STOP_SIGNALS` as above (SIGINT too: a shell starts background jobs with
    SIGINT ignored, and a run must stay stoppable), with a fresh state; from the main thread only
    (elsewhere nothing is installed).

    Returns:
        ``(signal, previous handler)`` pairs for :func:`restore`.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    _GATE.depth, _GATE.pending, _GATE.settled = 0, None, False
    return [(sig, signal.signal(sig, _handler)) for sig in (signal.SIGINT, *stop_signals())]


def restore(old: list[tuple[int, Any]]) -> None:
    """Put back the handlers :func:`install` replaced."""
    for sig, handler in old:
        signal.signal(sig, handler)


def settle() -> None:
    """Drop every later signal: the run is reporting its interrupt, or has ended. The signals are
    ignored (``SIG_IGN``), which Python keeps through its shutdown (a handler of ours would be reset to
    the default there, and a signal in the last milliseconds would kill the process without a word)."""
    _GATE.settled = True
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *stop_signals()):
            signal.signal(sig, signal.SIG_IGN)


@contextmanager
def deferred(drop: bool = False) -> Iterator[None]:
    """Hold SIGINT and :data:`STOP_SIGNALS` during the block; raise the held one as ``KeyboardInterrupt``
    when the outermost block ends normally, drop it when the block ends by an exception or ``drop`` is
    true (the caller is already stopping: clean-up on the way out). Outside the main thread the block
    runs as it is (the handlers run in the main thread, whatever it is doing).

    Raises:
        KeyboardInterrupt: a signal arrived during the block (``"signal N"``).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _GATE.depth += 1
    try:
        yield
    except BaseException:
        if _GATE.depth == 1:
            _GATE.pending = None
        raise
    finally:
        _GATE.depth -= 1
    if _GATE.depth == 0 and _GATE.pending is not None:
        signum, _GATE.pending = _GATE.pending, None
        if not drop:
            raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def blocked() -> Iterator[None]:
    """Block SIGINT and :data:`STOP_SIGNALS` in the calling thread during the block (the kernel holds them
    for the process: another thread, the main one, takes a process-wide signal at once). A process
    started in the block inherits the mask through ``fork`` and ``exec`` and never receives them (the
    way CPython starts its resource tracker); nothing is blocked where ``pthread_sigmask`` is missing."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *stop_signals()})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: The C-callable SIGBUS handler :func:`on_bus_error` installed (kept alive for as long as it is installed).
_BUS_HANDLER: Any = None


def on_bus_error(report: Callable[[], None]) -> None:
    """On ``SIGBUS`` (a page of a memory-mapped input vanished: the file was cut shorter while it was
    read), call ``report`` and end the process with exit code 2, instead of dying without a word.

    Python's own handlers cannot do this: they run between bytecodes, and the faulting read would fault
    again for ever on return. The handler is a C function (a ``ctypes`` callback installed with libc's
    ``signal``) that runs in the faulting thread, reports, and leaves with ``os._exit(2)``; it never
    returns to the read. ``report`` should only format and write a message (it runs inside a signal
    handler; the fault is synchronous, in a read of mapped data, so the interpreter is in a consistent
    state). The output's temporary is left for the next run to remove, as after a kill. Installed from
    the main thread on platforms with SIGBUS and a C library ctypes can load; a no-op elsewhere.
    """
    global _BUS_HANDLER
    if not hasattr(signal, "SIGBUS") or threading.current_thread() is not threading.main_thread():
        return
    proto = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def handler(signum: int) -> None:
        try:
            report()
        finally:
            os._exit(2)

    try:
        libc = ctypes.CDLL(None)
        set_handler = libc.signal
    except (OSError, AttributeError):  # pragma: no cover - no C library to install it with
        return
    set_handler.restype = ctypes.c_void_p
    set_handler.argtypes = [ctypes.c_int, proto]
    callback = proto(handler)
    set_handler(int(signal.SIGBUS), callback)
    _BUS_HANDLER = callback
