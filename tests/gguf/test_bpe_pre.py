"""``tokenizer.ggml.pre`` from the check-text hash, as llama.cpp's ``get_vocab_base_pre`` chooses it.

The real tokenizers come from llama.cpp's vocab-only GGUF files (``models/ggml-vocab-llama-bpe.gguf``: Meta
Llama 3; ``ggml-vocab-qwen2.gguf``: Qwen1.5), too large to keep here (6-8 MB): set ``LLAMA_CPP_MODELS``
to a llama.cpp ``models/`` directory (e.g. from the llama-cpp-python source distribution's
``vendor/llama.cpp/models``). From each, a ``tokenizer.json`` is rebuilt (tokens, merges, the
pre-tokenizer's regular expression, BOS handling), checked against llama.cpp's own expected token ids
for its test texts (``.inp``/``.out``), and its hash must give the name llama.cpp's table gives.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

import formats.errors as E
from convert.gguf import bpe_pre as gguf_bpe_pre
from convert.gguf.bpe_table import PRE_BY_HASH

#: Pre-tokenizer regular expressions of the two tokenizers (their tokenizer.json ``Split`` patterns).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

#: vocab file -> (regex, BOS added by the post-processor, ignore_merges, NFC normalizer, expected pre)
REAL = {
    "llama-bpe": (LLAMA3_REGEX, True, True, False, "llama-bpe"),
    "qwen2": (QWEN2_REGEX, False, False, True, "qwen2"),
}


def _models_dir() -> Path:
    d = os.environ.get("LLAMA_CPP_MODELS")
    if not d or not (Path(d) / "ggml-vocab-llama-bpe.gguf").is_file():
        pytest.skip("set LLAMA_CPP_MODELS to llama.cpp's models/ directory (vocab-only GGUF files of real "
                    "tokenizers, 6-8 MB each, not kept in this repository)")
    return Path(d)


def rebuild_tokenizer_json(
    vocab_gguf: Path, regex: str, *, bos: bool, ignore_merges: bool, nfc: bool
) -> dict[str, Any]:
    """A tokenizer.json equivalent to the tokenizer a llama.cpp vocab-only GGUF was converted from."""
    r = gguf.GGUFReader(vocab_gguf)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    vocab: dict[str, int] = {}
    added = []
    for i, (text, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ == gguf.TokenType.UNUSED and text.startswith("[PAD"):
            continue
        if typ in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": typ == gguf.TokenType.USER_DEFINED,
                          "special": typ == gguf.TokenType.CONTROL})
        else:
            vocab[text] = i
    post: dict[str, Any] | None = None
    if bos:
        bos_id = int(r.fields["tokenizer.ggml.bos_token_id"].contents())
        bos_text = tokens[bos_id]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos_text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos_text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos_text: {"id": bos_text, "ids": [bos_id], "tokens": [bos_text]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_tokenizers_hash_to_llama_cpps_name(tmp_path, name):
    tokenizers = pytest.importorskip("tokenizers")
    models = _models_dir()
    regex, bos, ignore_merges, nfc, want = REAL[name]
    path = tmp_path / "tokenizer.json"
    doc = rebuild_tokenizer_json(models / f"ggml-vocab-{name}.gguf", regex, bos=bos, ignore_merges=ignore_merges,
                                 nfc=nfc)
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    # the rebuilt tokenizer is the real one: llama.cpp's expected ids for its test texts
    tok = tokenizers.Tokenizer.from_file(str(path))
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # each text is followed by the separator
        texts.pop()
    outs = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(outs) and len(texts) > 10
    for text, out in zip(texts, outs, strict=True):
        assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in out.split()], text
    digest = gguf_bpe_pre.check_hash(path)
    assert PRE_BY_HASH[digest] == want
    assert gguf_bpe_pre.bpe_pre(path) == want


def _tiny_tokenizer(root: Path) -> Path:
    from tests.helpers.gguf import make_qwen2

    make_qwen2(root)
    return root / "tokenizer.json"


def test_check_text_is_llama_cpps():
    assert len(gguf_bpe_pre.CHECK_TEXT) == 350
    assert gguf_bpe_pre.CHECK_TEXT.startswith("\n \n\n \n\n\n \t \t\t \t\n")
    assert gguf_bpe_pre.CHECK_TEXT.endswith("We'Ve a'lL")


def test_unknown_hash_is_a_named_error_never_a_guess(tmp_path):
    pytest.importorskip("tokenizers")
    path = _tiny_tokenizer(tmp_path / "tok")
    with pytest.raises(E.UnknownBpePreTokenizerError) as e:
        gguf_bpe_pre.bpe_pre(path)
    assert e.value.rule == "GGUF-009"
    assert "chkhsh " + gguf_bpe_pre.check_hash(path) in str(e.value)
    assert "llama-bpe" in str(e.value) and "qwen2" in str(e.value)


def test_without_the_tokenizers_package_a_bpe_vocab_is_a_named_error(tmp_path, monkeypatch):
    path = _tiny_tokenizer(tmp_path / "tok")
    monkeypatch.setattr(gguf_bpe_pre, "_tokenizers", lambda: None)
    with pytest.raises(E.MissingTokenizersError) as e:
        gguf_bpe_pre.bpe_pre(path)
    assert e.value.rule == "GGUF-010" and "pip install" in str(e.value) and "tokenizers" in str(e.value)


def test_a_tokenizer_json_tokenizers_cannot_load_is_gguf_004(tmp_path):
    pytest.importorskip("tokenizers")
    path = _tiny_tokenizer(tmp_path / "tok")
    doc = json.loads(path.read_text())
    doc["decoder"] = {"type": "NoSuchDecoder"}
    path.write_text(json.dumps(doc))
    with pytest.raises(E.TokenizerError) as e:
        gguf_bpe_pre.bpe_pre(path)
    assert e.value.rule == "GGUF-004"
