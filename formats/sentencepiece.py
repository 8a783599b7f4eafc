"""The pieces of a SentencePiece ``tokenizer.model``, read without the sentencepiece package.

A ``tokenizer.model`` is one serialized protobuf ``ModelProto``
(https://github.com/google/sentencepiece, ``src/sentencepiece_model.proto``). Only its vocabulary
is needed to write a GGUF tokenizer::

    message ModelProto {
      repeated SentencePiece pieces = 1;      // id i is the i-th piece
      ...                                     // trainer_spec = 2, normalizer_spec = 3, ... (skipped)
    }
    message SentencePiece {
      optional string piece = 1;              // UTF-8 text, "▁" (U+2581) for a space
      optional float  score = 2;              // default 0.0
      optional Type   type  = 3;              // default NORMAL
    }
    enum Type { NORMAL = 1; UNKNOWN = 2; CONTROL = 3; USER_DEFINED = 4; BYTE = 6; UNUSED = 5; }

The type numbers are the ones GGUF stores in ``tokenizer.ggml.token_type`` (``gguf.TokenType``), and
they answer what ``SentencePieceProcessor.IsUnknown / IsControl / IsUnused / IsByte`` answer.

Protobuf wire format (https://protobuf.dev/programming-guides/encoding/): each field is a varint
key ``(field_number << 3) | wire_type``; wire type 0 = varint, 1 = 8 bytes, 2 = varint length +
bytes, 5 = 4 bytes (a little-endian float for ``score``). Unknown fields are skipped.

Rules, each raising :class:`~formats.errors.CheckpointError`:

=======  ==========================================================================
SPM-001  the file is a well-formed protobuf (no truncated varint or field)
SPM-002  wire types are 0, 1, 2 or 5 (groups 3/4 are not used by ModelProto)
SPM-003  the model has at least one piece, and every piece is valid UTF-8
=======  ==========================================================================
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import SentencePieceFormatError, SentencePiecePiecesError, SentencePieceWireTypeError

__all__ = ["NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "UNUSED", "BYTE", "Piece", "read_pieces"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Piece:
    """One vocabulary entry of a SentencePiece model.

    Attributes:
        text: the piece as stored (``"▁the"``, ``"<0x0A>"``, ``"<s>"``).
        score: its log-probability score (float32 in the file).
        type: NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6.
    """

    text: str
    score: float
    type: int


def _varint(buf: bytes, pos: int, path: str) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise SentencePieceFormatError(
                "truncated or overlong varint", path=path, found=f"byte {pos}"
            )
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _fields(buf: bytes, path: str) -> list[tuple[int, int, int | bytes]]:
    """Split one message into (field number, wire type, value) triples."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = _varint(buf, pos, path)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos, path)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos, path)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise SentencePieceWireTypeError(
                "unsupported protobuf wire type",
                path=path,
                expected="0, 1, 2 or 5",
                found=wire,
            )
        if pos > end:
            raise SentencePieceFormatError(
                "field runs past the end of the message",
                path=path,
                expected=f"<= {end} bytes",
                found=pos,
            )
        out.append((number, wire, value))
    return out


def read_pieces(path: str | os.PathLike[str]) -> list[Piece]:
    """Read the vocabulary of a SentencePiece ``tokenizer.model``.

    Matches what ``SentencePieceProcessor.IdToPiece / GetScore / IsUnknown / IsControl / IsUnused /
    IsByte`` report for every id (the inputs llama.cpp's ``_create_vocab_sentencepiece`` reads).

    Args:
        path: the ``tokenizer.model`` file.

    Returns:
        One :class:`Piece` per token id, in id order.

    Raises:
        SentencePieceFormatError, SentencePieceWireTypeError, SentencePiecePiecesError: SPM-001..003 (not a
            well-formed SentencePiece model).
        OSError: the file cannot be read.
    """
    spath = os.fspath(path)
    data = Path(path).read_bytes()
    pieces: list[Piece] = []
    for number, wire, value in _fields(data, spath):
        if number != 1 or wire != 2:
            continue
        assert isinstance(value, bytes)
        text, score, kind = "", 0.0, NORMAL
        for f_number, f_wire, f_value in _fields(value, spath):
            if f_number == 1 and f_wire == 2:
                assert isinstance(f_value, bytes)
                try:
                    text = f_value.decode("utf-8")
                except UnicodeDecodeError:
                    raise SentencePiecePiecesError(
                        "piece is not valid UTF-8", path=spath, found=f"piece {len(pieces)}"
                    ) from None
            elif f_number == 2 and f_wire == 5:
                assert isinstance(f_value, bytes)
                score = struct.unpack("<f", f_value)[0]
            elif f_number == 3 and f_wire == 0:
                assert isinstance(f_value, int)
                kind = f_value
        pieces.append(Piece(text, score, kind))
    if not pieces:
        raise SentencePiecePiecesError(
            "no vocabulary pieces (field 1) in the model",
            path=spath,
            hint="is this a SentencePiece tokenizer.model?",
        )
    return pieces
