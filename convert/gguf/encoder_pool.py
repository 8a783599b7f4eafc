"""The worker processes the GGUF writer encodes its search types in (:func:`convert.gguf.encode.write_gguf`):
how they start, take signals, are waited on and stop.

- **Start** (:func:`start`): ``spawn``, not ``fork`` (the converting process has threads: fork would copy
  their locks mid-use). The pool, the resource tracker CPython starts for its queues and every worker
  are made inside :func:`convert.signals.blocked`, so they hold SIGINT, SIGTERM and SIGHUP blocked from
  their first instruction: a terminal's Ctrl-C (sent to the whole process group) reaches only the
  converting process, which stops the pool (each worker finishes its chunk). Ignoring SIGINT once a
  worker runs is too late: it imports NumPy and this package first, and a signal there printed a
  traceback per worker and could hang the pool (CPython gh-94777 on Python 3.11.2); SIGHUP killed the
  tracker, whose relaunch printed tracebacks.
- **Orphans**: a worker exits as soon as its converting process is gone (killed with SIGKILL); it
  would otherwise wait for ever on queues it holds both ends of.
- **A worker killed from outside** (the OOM killer): the pool breaks, ends the other workers by
  SIGKILL (SIGTERM stays blocked in them), and :func:`call` raises
  :class:`~formats.errors.EncoderProcessError` (one line from the CLI, exit 2); two races
  of CPython 3.11's executor are worked around (:func:`call`, :func:`stop`), through its private
  attributes read defensively (where they differ, nothing is done).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing.connection
import multiprocessing.context
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from convert import signals
from formats.errors import EncoderProcessError

__all__ = ["call", "start", "stop"]

T = TypeVar("T")

# CPython's fix of gh-94777 (``terminate_broken`` closes the call queue's read end), in 3.11.5 and 3.12.
_TERMINATE_BROKEN_CLOSES_READER = sys.version_info >= (3, 11, 5)


class _EncoderProcess(multiprocessing.context.SpawnProcess):
    """A spawned worker started with the stop signals blocked, ended by SIGKILL, gone with its parent."""

    def start(self) -> None:
        with signals.blocked():
            super().start()

    def terminate(self) -> None:
        """SIGKILL: the pool terminates its other workers when one has died (a broken pool), and SIGTERM
        would stay blocked here, the pool waiting for ever to join them."""
        self.kill()

    def run(self) -> None:
        parent = multiprocessing.parent_process()
        if parent is not None:
            threading.Thread(target=_exit_with, args=(parent.sentinel,), name="convert-bnb-parent", daemon=True).start()
        super().run()


def _exit_with(sentinel: int) -> None:
    """End this process as soon as the process behind ``sentinel`` (its parent's, ready when the parent is gone)
    has ended."""
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


class _EncoderContext(multiprocessing.context.SpawnContext):
    """``spawn`` with :class:`_EncoderProcess` workers."""

    Process = _EncoderProcess


def start(processes: int) -> ProcessPoolExecutor:
    """A pool of ``processes`` workers (started as work is submitted), made with the stop signals blocked."""
    with signals.blocked():  # (the resource tracker CPython starts for the pool's queues inherits it too)
        return ProcessPoolExecutor(processes, mp_context=_EncoderContext())


def call(procs: ProcessPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker, waited for with the GIL released.

    The wait ends once ``procs`` is broken and the call is still not done a second later: on CPython 3.11
    a ``submit`` can race the pool's breakage (``terminate_broken`` fails the pending work without the
    lock ``submit`` holds) and leave a future that nothing completes.

    Raises:
        EncoderProcessError: a worker ended abruptly (killed from outside, out of memory), with what to
            do about it.
    """
    try:
        fut = procs.submit(fn, *args)
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if getattr(procs, "_broken", False) and not fut.done():
                    raise BrokenProcessPool("the encoder pool broke while this chunk was being submitted") from None
    except BrokenProcessPool as exc:  # killed from outside (the OOM killer, a signal): not a bug here
        raise EncoderProcessError("a GGUF encoder process ended abruptly (killed, or out of memory?)",
                                  hint="run again, with a lower --max-memory or --threads 1") from exc


def stop(procs: ProcessPoolExecutor) -> None:
    """Shut the pool down, waiting for its workers (each finishes its call; queued calls are cancelled).

    A broken pool (a worker killed) on Pythons without CPython's fix of gh-94777 (3.10, and 3.11 before
    3.11.5, e.g. Debian 12's 3.11.2): its manager thread waits for the call queue's feeder thread, which
    waits for ever to write a chunk into the pipe to the dead workers, whose read end this process still
    holds. There that end is closed first, so the write fails and the shutdown finishes. Where the fix is
    in, ``terminate_broken`` closes it on the manager thread, and a second close from here would race it:
    both threads close the same descriptor, one of them gets EBADF (a traceback from the manager thread)
    or closes whatever file reused the number in between.
    """
    if not _TERMINATE_BROKEN_CLOSES_READER and getattr(procs, "_broken", False):
        reader = getattr(getattr(procs, "_call_queue", None), "_reader", None)
        if reader is not None:
            reader.close()
    procs.shutdown(wait=True, cancel_futures=True)
