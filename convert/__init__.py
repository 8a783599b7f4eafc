"""convert-bnb's conversion side: kernels, planning, the streaming pipeline, LoRA, Hub and the CLI.

Reads through :mod:`formats`; ``formats`` never imports ``convert``. The ``convert-bnb`` command is
:func:`convert.__main__.main`; a library user calls :func:`convert.job.convert` with a
:class:`convert.options.ConvertOptions`, which hands the run to its part in :mod:`convert.run` (the source
resolved, one target's run, a PEFT adapter as SRC, several targets from one read, the
:class:`~convert.run.result.ConvertResult`). This module holds data only (no imports): every module may
import it.
"""

#: The version: the one source (pyproject.toml reads it; ``--version``, model cards and job keys use it).
__version__ = "0.1.0"

#: OpenBLAS's thread count when the user sets none: one (see :func:`convert.__main__.main`); Ray tasks get it too
#: (:func:`convert.batch.ray_executor.task_options`), as their workers start with NumPy loaded.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "1")
