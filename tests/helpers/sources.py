"""In-memory arrays as the stream plan's tensors, for tests that drive a writer without a checkpoint."""

from __future__ import annotations

import numpy as np

from convert.stream.plan import PlannedTensor
from convert.stream.sources import ArraySource
from formats.dtypes import BY_NAME


def array_tensor(name: str, array: np.ndarray) -> PlannedTensor:
    """``array`` as a planned tensor of its own dtype and shape, read through an
    :class:`~convert.stream.sources.ArraySource`."""
    return PlannedTensor(name, BY_NAME[array.dtype.name], tuple(array.shape), ArraySource(name, array))


def array_tensors(weights: dict[str, np.ndarray]) -> dict[str, PlannedTensor]:
    """Every array of ``weights`` as :func:`array_tensor` (the ``tensors`` argument of
    :func:`convert.gguf.encode.write_gguf`)."""
    return {n: array_tensor(n, a) for n, a in weights.items()}
