"""convert-bnb's conversion side: kernels, planning, the streaming pipeline, LoRA, Hub and the CLI.

Reads through :mod:`formats`; ``formats`` never imports ``convert``.
"""

#: The version: the one source (pyproject.toml reads it; ``--version``, model cards and job keys use it).
__version__ = "0.1.0"

#: OpenBLAS's thread count when the user sets none: one (see :func:`main`); Ray tasks get it too
#: (:func:`convert.batch_ray.task_options`), as their workers start with NumPy loaded.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "1")

#: Signals that stop a run as SIGINT does (exit 130, the temporary removed): SIGTERM, and SIGHUP where it
#: exists (the terminal closed), by name so that importing this package stays light.
STOP_SIGNALS = ("SIGTERM", "SIGHUP")


def stop_signals() -> list[int]:
    """The :data:`STOP_SIGNALS` this platform has (Windows has no SIGHUP)."""
    import signal

    return [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]


def main() -> int:
    """The ``convert-bnb`` console script (and ``python -m convert``).

    OpenBLAS gets one thread unless ``OPENBLAS_NUM_THREADS`` is set (see below). SIGINT and
    :data:`STOP_SIGNALS` are handled before anything heavy is imported (NumPy and the command line take a second or more
    to import on a loaded machine): a signal then ends the process with exit 130 and one line, as it
    does later in :func:`convert.cli.main`, instead of a traceback (SIGINT) or exit 143 (SIGTERM).
    """
    import os
    import signal
    import sys
    import threading

    # One BLAS thread (unless the user chose): the workers of --threads are the parallelism, and
    # OpenBLAS's own pool on top of them oversubscribes the cores (its threads spin while they wait:
    # a rank-16 merge of 7 layers took 1.45x as long) and makes a product's bits depend on how many
    # cores the machine has. Set before NumPy loads OpenBLAS.
    os.environ.setdefault(*BLAS_THREADS)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    stops = stop_signals()
    if threading.current_thread() is threading.main_thread():
        for sig in stops:
            signal.signal(sig, _stop)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from .cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:  # while importing, or after the command line returned (its output is final)
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    finally:  # the run is over: a late signal no longer kills the process while it exits with its code
        if threading.current_thread() is threading.main_thread():
            for sig in [signal.SIGINT, *stops]:
                signal.signal(sig, signal.SIG_IGN)
