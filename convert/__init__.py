"""convert-bnb's conversion side: kernels, planning, the streaming pipeline, LoRA, Hub and the CLI.

Reads through :mod:`formats`; ``formats`` never imports ``convert``.
"""

#: The version: the one source (pyproject.toml reads it; ``--version``, model cards and job keys use it).
__version__ = "0.1.0"

#: OpenBLAS's thread count when the user sets none: one (see :func:`main`); Ray tasks get it too
#: (:func:`convert.batch.ray_executor.task_options`), as their workers start with NumPy loaded.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "1")

def main() -> int:
    """The ``convert-bnb`` console script (and ``python -m convert``).

    OpenBLAS gets one thread unless ``OPENBLAS_NUM_THREADS`` is set (see below). SIGINT, SIGTERM and
    SIGHUP are handled (:mod:`convert.signals`) before anything heavy is imported, and held while the
    command line (with NumPy) is imported: a signal then ends the process with exit 130 and one line, as
    it does later in :func:`convert.cli.main`, instead of a traceback (SIGINT), an ``ImportError`` from
    inside NumPy's import, or exit 143 (SIGTERM).
    """
    import os
    import sys

    from convert import signals

    # One BLAS thread (unless the user chose): the workers of --threads are the parallelism, and
    # OpenBLAS's own pool on top of them oversubscribes the cores (its threads spin while they wait:
    # a rank-16 merge of 7 layers took 1.45x as long) and makes a product's bits depend on how many
    # cores the machine has. Set before NumPy loads OpenBLAS.
    os.environ.setdefault(*BLAS_THREADS)
    signals.install()
    try:
        with signals.deferred():
            from convert.cli import main as cli_main
        return cli_main()
    except KeyboardInterrupt:  # while importing, or after the command line returned (its output is final)
        signals.settle()
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    finally:  # the run is over: a late signal no longer kills the process while it exits with its code
        signals.settle()
