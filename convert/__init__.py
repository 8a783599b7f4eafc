"""convert-bnb's conversion side: kernels, planning, the streaming pipeline, LoRA, Hub and the CLI.

Reads through :mod:`formats`; ``formats`` never imports ``convert``.
"""

#: The version: the one source (pyproject.toml reads it; ``--version``, model cards and job keys use it).
__version__ = "0.1.0"


def main() -> int:
    """The ``convert-bnb`` console script (and ``python -m convert``).

    SIGINT and SIGTERM are handled before anything heavy is imported (NumPy and the command line
    take a second or more to import on a loaded machine): a signal then ends the process with exit
    130 and one line, as it does later in :func:`convert.cli.main`, instead of a traceback (SIGINT)
    or exit 143 (SIGTERM).
    """
    import signal
    import sys
    import threading

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    return cli_main()
