"""Tokenizer -> GGUF metadata: ``tokenizer.ggml.*`` keys from the files next to the weights.

Follows llama.cpp's ``convert_hf_to_gguf.py`` (``TextModel._create_vocab_sentencepiece``,
``TextModel.get_vocab_base``, ``TextModel.does_token_look_special``) without sentencepiece,
transformers or torch:

- ``tokenizer.model`` (SentencePiece, read by :mod:`formats.sentencepiece`) ->
  ``tokenizer.ggml.model = "llama"`` with tokens, scores and token types; ``added_tokens.json`` and
  ``tokenizer_config.json`` ``added_tokens_decoder`` entries override their ids;
- Phi-3 (``Phi3MiniModel.set_vocab``): the same SentencePiece vocabulary with its own added-token
  rules (tokenizer_config.json then tokenizer.json, typed by ``special`` alone), or byte-level BPE when
  tokenizer_config.json names ``GPT2Tokenizer``;
- ``tokenizer.json`` (byte-level BPE) -> ``"gpt2"`` with tokens, types and merges, and
  ``tokenizer.ggml.pre`` from the hash of a check text's token ids, as llama.cpp chooses it
  (:mod:`convert.gguf.bpe_pre`; needs the optional ``tokenizers`` package);
- special token ids, ``add_bos``/``add_eos`` and the chat template through gguf-py's
  ``SpecialVocab``; the architecture's extra special ids (CodeGemma, CodeLlama's infill tokens).

Which tokenizer kinds an architecture takes and its ``add_space_prefix`` are columns of
:data:`convert.gguf.families.ARCHITECTURES`.

Where the output knowingly differs from ``convert_hf_to_gguf.py``:

- Added tokens with ``normalized: false`` are written as stored (llama.cpp passes them through
  ``decode(encode(token))``, which leaves special tokens unchanged).
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
          and readable; every tokenizer file read here or by ``SpecialVocab`` has the structure and
          types read from it (:func:`check_tokenizer_json`, :func:`check_tokenizer_config`,
          :func:`check_special_files`), is at most :data:`FILE_BYTES_BASE` +
          :data:`FILE_BYTES_PER_TOKEN` x embedding rows bytes (checked before it is parsed), and
          holds no more tokens than the embedding has rows, no more added tokens than rows and
          no more than :data:`MERGES_PER_TOKEN` merges per row (checked before any per-token list
          is built) (:class:`TokenizerError`)
========  ======================================================================================

Ids at or past the vocabulary (``added_tokens.json``, ``added_tokens_decoder``, special token ids)
are skipped as llama.cpp skips them; negative or non-integer ids are refused.

A malformed ``tokenizer.model`` raises :mod:`formats.sentencepiece`'s SPM-xxx errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from convert.gguf.bpe_pre import bpe_pre
from convert.gguf.config import SPECIAL_TOKEN_TYPES
from convert.gguf.families import Architecture
from formats import jsonfile, sentencepiece
from formats.errors import TokenizerError

__all__ = ["add_tokenizer"]


def _looks_special(text: str) -> bool:
    """TextModel.does_token_look_special: added tokens some models forget to mark special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


#: Bytes a tokenizer file may hold: a fixed allowance plus this much per row of the token embedding
#: (real tokenizer.json files hold 40-130 bytes per token, tokenizer.model 15-20).
FILE_BYTES_BASE = 16 << 20
FILE_BYTES_PER_TOKEN = 1024
#: Merges a byte-level BPE tokenizer.json may hold per embedding row. Each merge makes a token of the
#: vocabulary; real files hold up to about 2.2 per token (Llama 3: 280,147 merges for 128,256 tokens,
#: converted from tiktoken ranks), GPT-2 and Qwen2 about 1. Every merge costs Python objects when
#: it is written and re-read, so their number is bounded by the model, not by the file.
MERGES_PER_TOKEN = 4


def _check_size(path: Path, n_vocab: int | None) -> None:
    """Refuse a tokenizer file far larger than the model's vocabulary needs, before reading it.

    Parsing JSON costs about 12 bytes of memory per byte of file, so the bound keeps memory
    proportional to the model, whatever the file holds.
    """
    if n_vocab is None:
        return
    limit = FILE_BYTES_BASE + FILE_BYTES_PER_TOKEN * n_vocab
    try:
        size = path.stat().st_size
    except OSError as e:
        raise TokenizerError(f"cannot read the tokenizer file: {e.strerror}", path=path) from None
    if size > limit:
        raise TokenizerError(
            "tokenizer file is larger than a vocabulary of the model's size can need",
            path=path,
            expected=f"<= {limit} bytes (16 MiB + 1 KiB x {n_vocab} embedding rows)",
            found=f"{size} bytes",
            hint="the tokenizer files belong to another (larger) model, or are damaged",
            action="convert",
        )


def _read_json(path: Path, n_vocab: int | None = None) -> dict[str, Any]:
    """A tokenizer JSON file that must be an object: size checked first (:func:`_check_size`), then read
    within :data:`formats.jsonfile.TOKENIZER`'s limits (nesting, integer digits)."""
    _check_size(path, n_vocab)
    try:
        doc = jsonfile.load_json_file(path, jsonfile.TOKENIZER, TokenizerError, path.name)
    except OSError as e:
        raise TokenizerError(f"cannot read JSON: {e}", path=path) from None
    if not isinstance(doc, dict):
        raise TokenizerError(
            f"{path.name} is not a JSON object", path=path, expected="an object", found=_json_kind(doc),
            action="convert",
        )
    return doc


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, types in (("boolean", bool), ("number", (int, float)), ("string", str), ("array", list),
                        ("object", dict)):
        if isinstance(value, types):
            return kind
    return type(value).__name__


def _bad(path: Path, key: str, expected: str, value: Any) -> TokenizerError:
    """A structure error: ``key`` (a JSON path inside ``path``) is not what llama.cpp reads."""
    shown = repr(value)
    return TokenizerError(
        f"{path.name} {key!r} has the wrong type or value",
        path=path,
        expected=expected,
        found=f"{shown[:60]}{'...' if len(shown) > 60 else ''} ({_json_kind(value)})",
        action="convert",
    )


def _utf8(text: str, path: Path, key: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \\u escapes allow
        raise _bad(path, key, "text without lone UTF-16 surrogates", text[max(0, e.start - 8): e.end + 8]) from None


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _list_of_objects(value: Any, path: Path, key: str, *, optional: bool = True) -> list[dict[str, Any]]:
    if value is None and optional:
        return []
    if not isinstance(value, list):
        raise _bad(path, key, "an array of objects", value)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad(path, f"{key}[{i}]", "an object", item)
    return value


def _too_many(path: Path, what: str, limit: int, found: int) -> TokenizerError:
    return TokenizerError(
        f"tokenizer.json holds more {what} than a model with this many token embeddings can use",
        path=path,
        expected=f"<= {limit}",
        found=found,
        hint="the tokenizer files belong to another (larger) model, or are damaged",
        action="convert",
    )


def check_tokenizer_json(tok: Mapping[str, Any], path: Path, n_vocab: int | None = None) -> None:
    """The parts of tokenizer.json that this module and gguf-py's SpecialVocab read, structurally.

    ``model``: an object; its ``vocab`` an object of token -> id >= 0; its ``merges`` an array of
    strings or of [string, string] pairs; ``added_tokens``: objects with a string ``content``, an id
    >= 0 and a boolean ``special``; ``post_processor``: an object whose ``processors``,
    TemplateProcessing ``single``/``pair`` entries and ``SpecialToken``/``Sequence`` values are the
    objects and arrays SpecialVocab indexes. With ``n_vocab`` (the embedding rows), counted first:
    at most ``n_vocab`` added tokens and :data:`MERGES_PER_TOKEN` x ``n_vocab`` merges.

    Raises:
        TokenizerError: GGUF-004, naming the key.
    """
    model = tok.get("model", {})
    if not isinstance(model, dict):
        raise _bad(path, "model", "an object", model)
    vocab = model.get("vocab")
    if vocab is not None:
        if not isinstance(vocab, dict):
            raise _bad(path, "model.vocab", "an object of token -> id", vocab)
        for text, tid in vocab.items():
            if not _token_id(tid):
                raise _bad(path, f"model.vocab[{text!r}]", "a token id (an integer >= 0)", tid)
    merges = model.get("merges")
    if merges is not None:
        if not isinstance(merges, list):
            raise _bad(path, "model.merges", "an array", merges)
        if n_vocab is not None and len(merges) > MERGES_PER_TOKEN * n_vocab:
            raise _too_many(path, f"merges (model.merges; {MERGES_PER_TOKEN} per token)", MERGES_PER_TOKEN * n_vocab,
                            len(merges))
        pairs = bool(merges) and not isinstance(merges[0], str)
        for i, m in enumerate(merges):
            ok = (isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], str)
                  if pairs else isinstance(m, str))
            if not ok:
                raise _bad(path, f"model.merges[{i}]", "a [string, string] pair" if pairs else
                           "a string 'left right' (like model.merges[0])", m)
    added = tok.get("added_tokens", [])
    if n_vocab is not None and isinstance(added, list) and len(added) > n_vocab:
        raise _too_many(path, "added tokens (added_tokens)", n_vocab, len(added))
    for i, t in enumerate(_list_of_objects(added, path, "added_tokens", optional=False)):
        if not isinstance(t.get("content"), str):
            raise _bad(path, f"added_tokens[{i}].content", "a string", t.get("content"))
        if not _token_id(t.get("id")):
            raise _bad(path, f"added_tokens[{i}].id", "a token id (an integer >= 0)", t.get("id"))
        if not isinstance(t.get("special", False), bool):
            raise _bad(path, f"added_tokens[{i}].special", "a boolean", t.get("special"))
    post = tok.get("post_processor")
    if post is None:
        return
    if not isinstance(post, dict):
        raise _bad(path, "post_processor", "an object (or null)", post)
    listed = "processors" in post
    processors = _list_of_objects(post.get("processors", [post]), path, "post_processor.processors", optional=False)
    for i, proc in enumerate(processors):
        where = f"post_processor.processors[{i}]" if listed else "post_processor"
        for key in ("cls", "sep"):
            if key in proc and not (isinstance(proc[key], list) and proc[key]):
                raise _bad(path, f"{where}.{key}", "a non-empty array", proc[key])
        for key in ("single", "pair"):
            for j, item in enumerate(_list_of_objects(proc.get(key), path, f"{where}.{key}")):
                for part in ("SpecialToken", "Sequence"):
                    if part in item and not isinstance(item[part], dict):
                        raise _bad(path, f"{where}.{key}[{j}].{part}", "an object", item[part])


def check_tokenizer_config(cfg: Mapping[str, Any], path: Path) -> None:
    """tokenizer_config.json keys read here and by SpecialVocab: types checked.

    ``add_prefix_space`` and ``add_{type}_token``: boolean or null; ``{type}_token``: a string, an
    object with a string ``content``, or null; ``added_tokens_decoder``: an object of decimal id ->
    object with a string ``content`` (and boolean ``special``); ``chat_template``: a string or an
    array of {``name``, ``template``} strings.

    Raises:
        TokenizerError: GGUF-004, naming the key.
    """
    if not isinstance(cfg.get("add_prefix_space", False), (bool, type(None))):
        raise _bad(path, "add_prefix_space", "a boolean", cfg["add_prefix_space"])
    for typ in SPECIAL_TOKEN_TYPES:
        flag, entry = cfg.get(f"add_{typ}_token"), cfg.get(f"{typ}_token")
        if flag is not None and not isinstance(flag, bool):
            raise _bad(path, f"add_{typ}_token", "a boolean", flag)
        if entry is not None and not isinstance(entry, str) and not (
            isinstance(entry, dict) and isinstance(entry.get("content"), str)
        ):
            raise _bad(path, f"{typ}_token", "a string or an object with a string 'content'", entry)
    decoder = cfg.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise _bad(path, "added_tokens_decoder", "an object of token id -> token", decoder)
        for key, data in decoder.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise _bad(path, f"added_tokens_decoder[{key!r}]", "a decimal token id as the key", key)
            if not isinstance(data, dict) or not isinstance(data.get("content"), str):
                raise _bad(path, f"added_tokens_decoder[{key!r}]", "an object with a string 'content'", data)
            if not isinstance(data.get("special", False), (bool, type(None))):
                raise _bad(path, f"added_tokens_decoder[{key!r}].special", "a boolean", data["special"])
    _check_chat_template(cfg.get("chat_template"), path, "chat_template")


def _check_chat_template(value: Any, path: Path, key: str) -> None:
    if value is None or isinstance(value, str):
        return
    if isinstance(value, list) and all(
        isinstance(c, dict) and isinstance(c.get("name", ""), str) and isinstance(c.get("template", ""), str)
        for c in value
    ):
        return
    raise _bad(path, key, "a string or an array of {name, template} strings", value)


def _check_text(path: Path, n_vocab: int | None) -> None:
    """A text file SpecialVocab reads (chat_template.jinja, merges.txt): bounded and UTF-8."""
    _check_size(path, n_vocab)
    try:
        path.read_bytes().decode("utf-8")
    except OSError as e:
        raise TokenizerError(f"cannot read the tokenizer file: {e.strerror}", path=path) from None
    except UnicodeDecodeError as e:
        raise TokenizerError(
            f"{path.name} is not UTF-8 text", path=path, expected="UTF-8", found=f"byte {e.start}", action="convert"
        ) from None


def check_special_files(tok_dir: Path, n_vocab: int | None, *, merges_txt: bool, tokenizer_json: bool = True) -> None:
    """Every file gguf-py's SpecialVocab opens in ``tok_dir``, checked before it runs
    (``tokenizer_json=False``: the caller checks tokenizer.json itself).

    Raises:
        TokenizerError: GGUF-004.
    """
    tok_json, tok_cfg = tok_dir / "tokenizer.json", tok_dir / "tokenizer_config.json"
    if tokenizer_json and tok_json.is_file():
        check_tokenizer_json(_read_json(tok_json, n_vocab), tok_json, n_vocab)
    if tok_cfg.is_file():
        check_tokenizer_config(_read_json(tok_cfg, n_vocab), tok_cfg)
    jinja, ct_json = tok_dir / "chat_template.jinja", tok_dir / "chat_template.json"
    if jinja.is_file():
        _check_text(jinja, n_vocab)
        extra = tok_dir / "additional_chat_templates"
        for p in sorted(extra.glob("*.jinja"))[:1000] if extra.is_dir() else []:
            _check_text(p, n_vocab)
    elif ct_json.is_file():
        _check_chat_template(_read_json(ct_json, n_vocab).get("chat_template"), ct_json, "chat_template")
    if merges_txt and (tok_dir / "merges.txt").is_file():
        _check_text(tok_dir / "merges.txt", n_vocab)


def _sentencepiece_vocab(
    tok_dir: Path, vocab_size: int | None, n_vocab: int | None = None, *, phi3: bool = False
) -> tuple[list[bytes], list[float], list[int]]:
    """TextModel._create_vocab_sentencepiece, from tokenizer.model + added tokens.

    With ``phi3``, Phi3MiniModel.set_vocab's variant: the added tokens of tokenizer_config.json and then
    of tokenizer.json replace their ids as stored, CONTROL when ``special`` and USER_DEFINED otherwise
    (no look-alike special tokens, no ``\u2581`` replaced).
    """
    spm = tok_dir / "tokenizer.model"
    _check_size(spm, n_vocab)
    pieces = sentencepiece.read_pieces(spm)
    n = vocab_size or len(pieces)
    bound = min(n, n_vocab) if n_vocab is not None else n
    if len(pieces) > bound:
        raise TokenizerError(
            "tokenizer.model has more pieces than the model has token embeddings",
            path=spm,
            expected=f"<= {bound}",
            found=len(pieces),
            action="convert",
        )
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
        for text, tid in _read_json(added_file, n_vocab).items():
            if not _token_id(tid):
                raise _bad(added_file, text, "a token id (an integer >= 0)", tid)
            if tid < n:
                tokens[tid], scores[tid], types[tid] = (
                    _utf8(text, added_file, text),
                    -1000.0,
                    int(gguf.TokenType.USER_DEFINED),
                )
    config_file = tok_dir / "tokenizer_config.json"
    if config_file.is_file():
        decoder = _read_json(config_file, n_vocab).get("added_tokens_decoder", {}) or {}
        for key, data in decoder.items():
            tid = int(key)
            if not 0 <= tid < n:
                continue
            text = data["content"]
            if phi3:
                _phi3_added(tokens, scores, types, tid, data, config_file, f"added_tokens_decoder[{key!r}].content")
                continue
            if data.get("special") or _looks_special(text):
                types[tid] = int(gguf.TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[tid] = int(gguf.TokenType.USER_DEFINED)
            scores[tid] = -1000.0
            tokens[tid] = _utf8(text, config_file, f"added_tokens_decoder[{key!r}].content")
    tok_json = tok_dir / "tokenizer.json"
    if phi3 and tok_json.is_file():  # structure checked by check_special_files
        for i, data in enumerate(_read_json(tok_json, n_vocab).get("added_tokens") or []):
            if data["id"] < n:
                _phi3_added(tokens, scores, types, data["id"], data, tok_json, f"added_tokens[{i}].content")
    return tokens, scores, types


def _phi3_added(tokens: list[bytes], scores: list[float], types: list[int], tid: int, data: Mapping[str, Any],
                path: Path, key: str) -> None:
    """One added token as Phi3MiniModel.set_vocab stores it."""
    tokens[tid] = _utf8(data["content"], path, key)
    scores[tid] = -1000.0
    types[tid] = int(gguf.TokenType.CONTROL if data.get("special") else gguf.TokenType.USER_DEFINED)


def _bpe_vocab(
    tok_json: Mapping[str, Any], vocab_size: int | None, path: Path, n_vocab: int | None = None
) -> tuple[list[str], list[int]]:
    """TextModel.get_vocab_base, from tokenizer.json alone (no transformers).

    The caller has checked the structure (:func:`check_tokenizer_json`); the vocabulary is counted
    against the embedding rows before any per-token list is built.
    """
    model = tok_json.get("model") or {}
    base = model.get("vocab") or {}
    entries = len(base) + sum(1 for t in tok_json.get("added_tokens") or [] if t["content"] not in base)
    bound = min(vocab_size or n_vocab or entries, n_vocab or entries)
    if entries > bound:
        raise TokenizerError(
            "tokenizer.json holds more tokens than the model has token embeddings",
            path=path,
            expected=f"<= {bound} (vocab + added_tokens)",
            found=entries,
            action="convert",
        )
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


def add_tokenizer(
    w: gguf.GGUFWriter, tok_dir: Path, arch: Architecture, hp: Mapping[str, Any], *, n_vocab: int | None = None
) -> None:
    """Add the ``tokenizer.ggml.*`` keys (and special ids, chat template) to a writer's key/value table.

    The first of the architecture's tokenizer kinds present wins: ``tokenizer.model``
    (SentencePiece) or ``tokenizer.json`` (byte-level BPE).

    Args:
        w: the writer collecting the metadata (nothing is written to a file).
        tok_dir: the directory with the tokenizer files (and config.json for special token ids).
        arch: the architecture row.
        hp: the hyperparameters (:func:`convert.gguf.arch.hparams`; ``vocab_size`` pads the vocabulary).
        n_vocab: rows of the token embedding: no tokenizer may hold more tokens, and no tokenizer
            file more than :data:`FILE_BYTES_BASE` + :data:`FILE_BYTES_PER_TOKEN` x ``n_vocab`` bytes.

    Raises:
        TokenizerError: GGUF-004 (no tokenizer of a supported kind, unreadable JSON, a file that is
            not an object or has keys of the wrong structure or type, a file too large for the
            model, an empty vocabulary, more tokens than embedding rows, ids beyond ``vocab_size``).
        CheckpointError: SPM-xxx (a malformed ``tokenizer.model``).
    """
    vocab_size = hp.get("vocab_size")
    vocab_size = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    config_file = tok_dir / "tokenizer_config.json"
    spm, tjson = tok_dir / "tokenizer.model", tok_dir / "tokenizer.json"
    use_spm = "sentencepiece" in arch.tokenizers and spm.is_file()
    use_bpe = not use_spm and "bpe" in arch.tokenizers and tjson.is_file()
    if arch.phi3_vocab:  # Phi3MiniModel.set_vocab: GPT2Tokenizer -> byte-level BPE, else tokenizer.model
        gpt2 = config_file.is_file() and _read_json(config_file, n_vocab).get("tokenizer_class") == "GPT2Tokenizer"
        use_spm, use_bpe = not gpt2 and spm.is_file(), gpt2 and tjson.is_file()
    check_special_files(tok_dir, n_vocab, merges_txt=not use_spm, tokenizer_json=not use_bpe)
    if arch.add_space_prefix is None and not arch.phi3_vocab and config_file.is_file():
        add_prefix = _read_json(config_file, n_vocab).get("add_prefix_space")
        if add_prefix is not None:
            w.add_add_space_prefix(bool(add_prefix))
    if use_spm:
        tokens, scores, types = _sentencepiece_vocab(tok_dir, vocab_size, n_vocab, phi3=arch.phi3_vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    elif use_bpe:
        tok = _read_json(tjson, n_vocab)
        check_tokenizer_json(tok, tjson, n_vocab)
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
        tokens_s, types = _bpe_vocab(tok, vocab_size, tjson, n_vocab)
        del tok, model  # SpecialVocab parses tokenizer.json again: not both at once
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(bpe_pre(tjson))
        w.add_token_list(tokens_s)
        w.add_token_types(types)
        gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=len(tokens_s)).add_to_gguf(w, quiet=True)
    else:
        wanted = " or ".join({"sentencepiece": "tokenizer.model", "bpe": "tokenizer.json"}[t] for t in arch.tokenizers)
        raise TokenizerError(
            "no tokenizer in the model directory",
            path=tok_dir,
            expected=wanted,
            found=None,
            hint="llama.cpp needs the vocabulary inside the GGUF: copy the base model's tokenizer files "
            f"({wanted}, tokenizer_config.json) into the directory",
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
