"""The one chunk loop (:func:`convert.stream.pipeline.ordered_chunks`): order, the bound on chunks in flight,
fences, chunks made in order, and no reference kept to a chunk once it is handed back."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from convert.stream.pipeline import FENCE, Chunk, ordered_chunks


def _slow(i: int) -> int:
    time.sleep(0.002 * ((7 * i) % 5))  # later chunks often finish first
    return i


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_chunks_come_back_in_their_order_whatever_finishes_first(workers: int) -> None:
    chunks = [Chunk(("t", i), lambda i=i: _slow(i)) for i in range(40)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        got = list(ordered_chunks(chunks, pool, 2 * workers))
    assert got == [(("t", i), i) for i in range(40)]


@pytest.mark.parametrize("held", [1, 2, 5])
def test_at_most_held_chunks_are_in_flight(held: int) -> None:
    """The generator of chunks is asked for the next one only when there is room: it runs at most
    ``held`` chunks ahead of the writer (markers do not count)."""
    asked: list[int] = []
    written: list[int] = []
    ahead: list[int] = []

    def chunks():
        for i in range(30):
            asked.append(i)
            ahead.append(len(asked) - len(written))
            yield Chunk(i, lambda i=i: i)
            yield Chunk(("end", i))  # a marker: holds nothing, not counted

    with ThreadPoolExecutor(max_workers=2) as pool:
        for key, data in ordered_chunks(chunks(), pool, held):
            if data is not None:
                written.append(key)
    assert written == list(range(30))
    assert max(ahead) == held + 1  # the chunk just taken, before the oldest is handed back


def test_a_fence_waits_for_every_earlier_chunk() -> None:
    written: list[int] = []
    seen_at_fence: list[list[int]] = []

    def chunks():
        for i in range(5):
            yield Chunk(i, lambda i=i: _slow(i))
        yield FENCE
        seen_at_fence.append(list(written))  # runs only once all five are handed back
        yield Chunk(5, lambda: 5)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for key, _ in ordered_chunks(chunks(), pool, 8):
            written.append(key)
    assert seen_at_fence == [[0, 1, 2, 3, 4]] and written == [0, 1, 2, 3, 4, 5]


def test_in_order_chunks_are_made_by_the_writing_thread_when_their_turn_comes() -> None:
    made: list[tuple[int, str]] = []
    writing = threading.current_thread().name

    def make(i: int) -> int:
        made.append((i, threading.current_thread().name))
        return i

    chunks = [Chunk(0, lambda: make(0)), Chunk(1, lambda: make(1), in_order=True), Chunk(2, data=2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(ordered_chunks(chunks, pool, 4)) == [(0, 0), (1, 1), (2, 2)]
    assert (1, writing) in made and (0, writing) not in made


def test_without_a_pool_each_chunk_is_made_when_taken() -> None:
    order: list[str] = []
    chunks = (Chunk(i, lambda i=i: order.append(f"make {i}") or i) for i in range(3))
    for key, _ in ordered_chunks(chunks, None, 1):
        order.append(f"write {key}")
    assert order == ["make 0", "make 1", "write 0", "make 2", "write 1", "write 2"]


def test_a_workers_exception_is_raised_when_its_turn_comes() -> None:
    def boom() -> int:
        raise ValueError("chunk 1")

    written: list[int] = []
    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(ValueError, match="chunk 1"):
        for key, _ in ordered_chunks([Chunk(0, lambda: 0), Chunk(1, boom), Chunk(2, lambda: 2)], pool, 4):
            written.append(key)
    assert written == [0]


@pytest.mark.parametrize("made", ["by a worker", "already", "in order"])
def test_no_reference_to_a_chunk_is_kept_once_it_is_handed_back(made: str) -> None:
    """A zero-copy chunk is a view of an input file the writer may unmap right after writing it: neither
    the loop nor its queue may hold the data then (the last chunk of all included)."""
    refs: list[weakref.ref] = []

    def make(i: int) -> np.ndarray:
        a = np.full(8, i)
        refs.append(weakref.ref(a))
        return a

    def chunks():
        for i in range(6):
            if made == "already":
                yield Chunk(i, data=make(i))
            else:
                yield Chunk(i, lambda i=i: make(i), in_order=made == "in order")

    with ThreadPoolExecutor(max_workers=2) as pool:
        for key, data in ordered_chunks(chunks(), pool, 2):
            ref = next(r for r in refs if r() is data)
            del data
            gc.collect()
            assert ref() is None, f"chunk {key} is still referenced after it was handed back"
