"""formats.gguf on its own: the container writer and verify_gguf, with a layout made by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from formats.errors import GgufVerificationError
from formats.gguf import GGUFFileWriter, tensor_nbytes, verify_gguf

GT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType


@dataclass(frozen=True)
class Info:
    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    nbytes: int


@dataclass
class Layout:
    arch_name: str = "llama"
    metadata: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = field(
        default_factory=lambda: {"llama.block_count": (1, VT.UINT32, None)}
    )
    tensors: list[Info] = field(default_factory=list)


def _layout() -> Layout:
    return Layout(tensors=[
        Info("a.weight", (3, 5), GT.F32, tensor_nbytes((3, 5), GT.F32)),
        Info("b.weight", (2, 32), GT.Q8_0, tensor_nbytes((2, 32), GT.Q8_0)),
    ])


def test_tensor_nbytes() -> None:
    assert tensor_nbytes((3, 5), GT.F32) == 60
    assert tensor_nbytes((2, 32), GT.Q8_0) == 2 * 34
    assert tensor_nbytes((4096, 11008), GT.Q4_0) == 4096 * 11008 // 32 * 18


def test_pieces_padding_and_verify(tmp_path: Path) -> None:
    layout = _layout()
    a = np.arange(15, dtype=np.float32).reshape(3, 5)
    b = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), GT.Q8_0)
    path = tmp_path / "m.gguf"
    with GGUFFileWriter(path, layout) as out:
        assert out.write(a[:1]) == 20 and out.write(a[1:]) == 40  # one tensor in two pieces
        out.end_tensor()
        out.write(b)
        out.end_tensor()
    verify_gguf(path, layout)
    r = gguf.GGUFReader(path)
    assert [t.name for t in r.tensors] == ["a.weight", "b.weight"]
    assert np.array_equal(np.asarray(r.tensors[0].data).reshape(3, 5), a)
    assert all(int(t.data_offset) % 32 == 0 for t in r.tensors)
    assert path.stat().st_size % 32 == 0


def test_short_tensor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GgufVerificationError) as e, GGUFFileWriter(tmp_path / "m.gguf", _layout()) as out:
        out.write(np.zeros(14, dtype=np.float32))
        out.end_tensor()
    assert e.value.rule == "GGUF-008" and e.value.tensor == "a.weight"
    assert "byte count differs" in str(e.value) and "expected 60, found 56" in str(e.value)


def test_verify_names_the_difference(tmp_path: Path) -> None:
    layout = _layout()
    path = tmp_path / "m.gguf"
    with GGUFFileWriter(path, layout) as out:
        out.write(np.zeros(15, dtype=np.float32))
        out.end_tensor()
        out.write(np.zeros(68, dtype=np.uint8))
        out.end_tensor()
    with pytest.raises(GgufVerificationError, match="general.architecture differs"):
        verify_gguf(path, Layout(arch_name="qwen2", tensors=layout.tensors))
    other = [layout.tensors[0], Info("b.weight", (2, 32), GT.F16, tensor_nbytes((2, 32), GT.F16))]
    with pytest.raises(GgufVerificationError, match="GGML type differs") as e:
        verify_gguf(path, Layout(tensors=other))
    assert e.value.tensor == "b.weight"
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GgufVerificationError, match="does not parse as GGUF"):
        verify_gguf(tmp_path / "bad.gguf", layout)


@pytest.mark.parametrize("data", [b"GGUF", b"GGUF\x03\x00\x00\x00", b""])
def test_verify_a_truncated_file(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "t.gguf").write_bytes(data)
    with pytest.raises(GgufVerificationError, match="does not parse as GGUF") as e:
        verify_gguf(tmp_path / "t.gguf", _layout())
    assert e.value.rule == "GGUF-008"
