"""Tokenizer -> GGUF metadata: ``tokenizer.ggml.*`` keys from the files next to the weights.

Follows llama.cpp's ``convert_hf_to_gguf.py`` (``TextModel._create_vocab_sentencepiece``,
``TextModel.get_vocab_base``, ``TextModel.does_token_look_special``) without sentencepiece,
transformers or torch:

- ``tokenizer.model`` (SentencePiece, read by :mod:`formats.sentencepiece`) ->
  ``tokenizer.ggml.model = "llama"`` with tokens, scores and token types; ``added_tokens.json`` and
  ``tokenizer_config.json`` ``added_tokens_decoder`` entries override their ids;
- ``tokenizer.json`` (byte-level BPE) -> ``"gpt2"`` with tokens, types and merges;
- special token ids, ``add_bos``/``add_eos`` and the chat template through gguf-py's
  ``SpecialVocab``; the architecture's extra special ids (CodeGemma, CodeLlama's infill tokens).

Which tokenizer kinds an architecture takes, its ``tokenizer.ggml.pre`` and ``add_space_prefix`` are
columns of :data:`convert.gguf_arch.ARCHITECTURES`.

Where the output knowingly differs from ``convert_hf_to_gguf.py``:

- ``tokenizer.ggml.pre`` of a byte-level BPE vocabulary is the architecture's (``qwen2``,
  ``llama-bpe``); llama.cpp derives it from a hash of transformers' tokenization of a test text and
  refuses unknown hashes. Added tokens with ``normalized: false`` are written as stored (llama.cpp
  passes them through ``decode(encode(token))``, which leaves special tokens unchanged).
- A Llama whose only tokenizer is a SentencePiece-style ``tokenizer.json`` (``byte_fallback``) is
  refused (llama.cpp reads it through transformers' ``LlamaHfVocab``); add ``tokenizer.model``.
- CodeGemma's prefix/suffix/middle/fsep ids are set as GemmaModel sets them, but this gguf package
  has no writer for those keys, so (as with llama.cpp's converter on the same package) only
  ``eot`` is written.

``SpecialVocab`` logs its notes through the ``gguf`` logger, which :mod:`formats.gguf` silences
(the library never prints).

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-004  a tokenizer (``tokenizer.model`` or ``tokenizer.json``) of a supported kind is present
          and readable (:class:`TokenizerError`); its JSON files are objects within
          :mod:`formats.jsonfile`'s limits (64 MiB, nesting, integer digits), checked before gguf-py's
          ``SpecialVocab`` reads them
========  ======================================================================================

A malformed ``tokenizer.model`` raises :mod:`formats.sentencepiece`'s SPM-xxx errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from formats import jsonfile, sentencepiece
from formats.errors import TokenizerError

from .gguf_arch import Architecture

__all__ = ["add_tokenizer"]


def _looks_special(text: str) -> bool:
    """TextModel.does_token_look_special: added tokens some models forget to mark special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


#: The JSON files gguf-py's ``SpecialVocab`` opens with plain ``json.load`` (``config.json`` is loaded
#: within limits when the checkpoint is opened); each is loaded here first, within limits.
SPECIAL_VOCAB_JSON = ("tokenizer.json", "tokenizer_config.json", "chat_template.json")


def _read_json(path: Path) -> dict[str, Any]:
    """A tokenizer JSON file, within :data:`formats.jsonfile.TOKENIZER`'s limits; it must be an object."""
    try:
        doc = jsonfile.load_json_file(path, jsonfile.TOKENIZER, TokenizerError, path.name)
    except OSError as e:
        raise TokenizerError(f"cannot read JSON: {e}", path=path) from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path.name} must be a JSON object", path=path, expected="object",
                             found=type(doc).__name__)
    return doc


def _sentencepiece_vocab(tok_dir: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """TextModel._create_vocab_sentencepiece, from tokenizer.model + added tokens."""
    pieces = sentencepiece.read_pieces(tok_dir / "tokenizer.model")
    n = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(gguf.TokenType.UNUSED)] * n
    spm_type = {
        sentencepiece.UNKNOWN: gguf.TokenType.UNKNOWN,
        sentencepiece.CONTROL: gguf.TokenType.CONTROL,
        sentencepiece.UNUSED: gguf.TokenType.UNUSED,
        sentencepiece.BYTE: gguf.TokenType.BYTE,
    }
    for i, piece in enumerate(pieces[:n]):
        tokens[i] = piece.text.encode("utf-8")
        scores[i] = piece.score
        types[i] = int(spm_type.get(piece.type, gguf.TokenType.NORMAL))
    added_file = tok_dir / "added_tokens.json"
    if added_file.is_file():
        for text, tid in _read_json(added_file).items():
            if isinstance(tid, int) and 0 <= tid < n:
                tokens[tid], scores[tid], types[tid] = (
                    text.encode("utf-8"),
                    -1000.0,
                    int(gguf.TokenType.USER_DEFINED),
                )
    config_file = tok_dir / "tokenizer_config.json"
    if config_file.is_file():
        decoder = _read_json(config_file).get("added_tokens_decoder", {}) or {}
        for key, data in decoder.items():
            tid = int(key)
            if not 0 <= tid < n:
                continue
            text = data["content"]
            if data.get("special") or _looks_special(text):
                types[tid] = int(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[tid] = int(gguf.TokenType.USER_DEFINED)
            scores[tid] = -1000.0
            tokens[tid] = text.encode("utf-8")
    return tokens, scores, types


def _bpe_vocab(tok_json: Mapping[str, Any], vocab_size: int | None, path: Path) -> tuple[list[str], list[int]]:
    """TextModel.get_vocab_base, from tokenizer.json alone (no transformers)."""
    model = tok_json.get("model") or {}
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in tok_json.get("added_tokens") or []}
    for text, t in added.items():
        vocab[text] = t["id"]
    if not vocab:
        raise TokenizerError("tokenizer.json has an empty vocabulary", path=path)
    n = vocab_size or len(vocab)
    if max(vocab.values()) >= n:
        raise TokenizerError(
            "tokenizer.json has token ids beyond the model's vocab_size",
            path=path,
            expected=f"< {n}",
            found=max(vocab.values()),
        )
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        text = reverse.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        if text in added:
            if added[text].get("special") or _looks_special(text):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                text = text.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(text)
    return tokens, types


def add_tokenizer(w: gguf.GGUFWriter, tok_dir: Path, arch: Architecture, hp: Mapping[str, Any]) -> None:
    """Add the ``tokenizer.ggml.*`` keys (and special ids, chat template) to a writer's key/value table.

    The first of the architecture's tokenizer kinds present wins: ``tokenizer.model``
    (SentencePiece) or ``tokenizer.json`` (byte-level BPE).

    Args:
        w: the writer collecting the metadata (nothing is written to a file).
        tok_dir: the directory with the tokenizer files (and config.json for special token ids).
        arch: the architecture row.
        hp: the hyperparameters (:func:`convert.gguf_arch.hparams`; ``vocab_size`` pads the vocabulary).

    Raises:
        TokenizerError: GGUF-004 (no tokenizer of a supported kind, unreadable JSON, an empty
            vocabulary or ids beyond ``vocab_size``).
        CheckpointError: SPM-xxx (a malformed ``tokenizer.model``).
    """
    vocab_size = hp.get("vocab_size")
    vocab_size = vocab_size if isinstance(vocab_size, int) else None
    for name in SPECIAL_VOCAB_JSON:  # before SpecialVocab reads them unbounded
        if (tok_dir / name).is_file():
            _read_json(tok_dir / name)
    config_file = tok_dir / "tokenizer_config.json"
    if arch.add_space_prefix is None and config_file.is_file():
        add_prefix = _read_json(config_file).get("add_prefix_space")
        if add_prefix is not None:
            w.add_add_space_prefix(bool(add_prefix))
    spm, tjson = tok_dir / "tokenizer.model", tok_dir / "tokenizer.json"
    if "sentencepiece" in arch.tokenizers and spm.is_file():
        tokens, scores, types = _sentencepiece_vocab(tok_dir, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    elif "bpe" in arch.tokenizers and tjson.is_file():
        tok = _read_json(tjson)
        model = tok.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback", False):
            raise TokenizerError(
                "tokenizer.json is not a byte-level BPE tokenizer",
                path=tjson,
                expected="model.type BPE without byte_fallback",
                found=f"{model.get('type')}, byte_fallback={model.get('byte_fallback', False)}",
                hint="add the model's tokenizer.model (SentencePiece)",
                action="convert",
            )
        tokens_s, types = _bpe_vocab(tok, vocab_size, tjson)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(arch.bpe_pre)
        w.add_token_list(tokens_s)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, load_merges=True).add_to_gguf(w, quiet=True)
    else:
        wanted = " or ".join({"sentencepiece": "tokenizer.model", "bpe": "tokenizer.json"}[t] for t in arch.tokenizers)
        raise TokenizerError(
            "no tokenizer next to the weights",
            path=tok_dir,
            expected=wanted,
            found=None,
            hint="llama.cpp needs the vocabulary inside the GGUF: convert a model directory (or repo id), "
            "not a lone weight file",
        )
    quirk = arch.vocab_quirks.get(vocab_size or -1)
    extra = arch.extra_special or ((tuple(quirk), quirk) if quirk else None)
    if extra is not None:
        types_, ids = extra
        special = gguf.SpecialVocab(tok_dir, load_merges=False, special_token_types=types_)
        for typ, tid in ids.items():
            special.special_token_ids.setdefault(typ, tid)
        special.chat_template = None
        special.add_to_gguf(w, quiet=True)
    if arch.add_space_prefix is not None:
        w.add_add_space_prefix(arch.add_space_prefix)
