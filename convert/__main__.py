"""The ``convert-bnb`` command (the console script) and ``python -m convert``."""

import os
import sys

from convert import BLAS_THREADS, signals

__all__ = ["main"]


def main() -> int:
    """The ``convert-bnb`` console script (and ``python -m convert``).

    OpenBLAS gets one thread unless ``OPENBLAS_NUM_THREADS`` is set (see below). SIGINT, SIGTERM and
    SIGHUP are handled (:mod:`convert.signals`) before anything heavy is imported, and held while the
    command line (with NumPy) is imported: a signal then ends the process with exit 130 and one line, as
    it does later in :func:`convert.cli.main`, instead of a traceback (SIGINT), an ``ImportError`` from
    inside NumPy's import, or exit 143 (SIGTERM).
    """
    # One BLAS thread (unless the user chose): the workers of --threads are the parallelism, and
    # OpenBLAS's own pool on top of them oversubscribes the cores (its threads spin while they wait:
    # a rank-16 merge of 7 layers took 1.45x as long) and makes a product's bits depend on how many
    # cores the machine has. Set before NumPy loads OpenBLAS.
    os.environ.setdefault(*BLAS_THREADS)
    signals.install()
    try:
        with signals.deferred():
            # (imported once the signals are handled: it loads NumPy and the code of every target)
            from convert.cli import main as cli_main
        return cli_main()
    except KeyboardInterrupt:  # while importing, or after the command line returned (its output is final)
        signals.settle()
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    finally:  # the run is over: a late signal no longer kills the process while it exits with its code
        signals.settle()


if __name__ == "__main__":
    sys.exit(main())
