"""GGUF output refuses bad config.json / tokenizer values with a named error, before writing anything.

Each case damages one value the GGUF writer reads in a copy of the llama_nf4_dq fixture (the
examples a structure-aware fuzzer found, then one per type / range / presence rule), and asserts the
exact error class, rule and message parts through the library and through the CLI (exit 2, one
line, nothing at the output path). The resource cases (a vocab_size of 10**12, 10**7 layers, a
200 MB tokenizer.json) also run as ``python -m convert`` under a clock and an RSS measurement.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf.vocab import bytes_to_unicode

from convert.cli import main
from formats import errors as E
from tests.helpers.fixtures import MODELS, ROOT, plan_inputs
from tests.helpers.malformed import convert
from tests.helpers.rss import run_measured

FIXTURE = MODELS / "llama_nf4_dq"
DELETE = object()
Mutate = Callable[[Path], None]


def _edit(name: str, change: Callable[[Any], Any]) -> Mutate:
    def run(root: Path) -> None:
        path = root / name
        doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        path.write_text(json.dumps(change(doc)), encoding="utf-8")

    return run


def _update(doc: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    for k, v in values.items():
        if v is DELETE:
            doc.pop(k, None)
        else:
            doc[k] = v
    return doc


def cfg(**values: Any) -> Mutate:
    """config.json with these keys set (DELETE removes one)."""
    return _edit("config.json", lambda d: _update(d, values))


def rope(**values: Any) -> Mutate:
    """config.json ``rope_parameters`` replaced by these keys."""
    return cfg(rope_parameters=dict(values))


def tok_cfg(**values: Any) -> Mutate:
    return _edit("tokenizer_config.json", lambda d: _update(d, values))


def replace(name: str, doc: Any) -> Mutate:
    return _edit(name, lambda _d: doc)


def raw(name: str, data: bytes) -> Mutate:
    return lambda root: (root / name).write_bytes(data)


def bpe_tokenizer(n_tokens: int = 300, merges: Any = None, vocab_edit: dict[str, Any] | None = None,
                  **top: Any) -> Mutate:
    """tokenizer.model removed; a byte-level BPE tokenizer.json with ``n_tokens`` tokens instead."""

    def run(root: Path) -> None:
        (root / "tokenizer.model").unlink()
        vocab = {t: i for i, t in enumerate(bytes_to_unicode().values())}
        while len(vocab) < n_tokens:
            vocab[f"t{len(vocab)}"] = len(vocab)
        vocab.update(vocab_edit or {})
        doc = {"model": {"type": "BPE", "byte_fallback": False, "vocab": vocab,
                         "merges": merges if merges is not None else [["Ġ", "t"]]},
               "added_tokens": [], **top}
        (root / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")

    return run


def spm_extra_piece(root: Path) -> None:
    """tokenizer.model with a 1001st piece (protobuf repeated field 1 appended)."""
    piece = b"\x0a\x03xyz" + b"\x15" + struct.pack("<f", -1.0) + b"\x18\x01"
    with open(root / "tokenizer.model", "ab") as f:
        f.write(b"\x0a" + bytes([len(piece)]) + piece)


def big_tokenizer(megabytes: int) -> Mutate:
    """A byte-level BPE tokenizer.json of ``megabytes`` MB: unique short tokens and merges (written as
    1 MB blocks that differ in a block number, so building it takes well under a second)."""

    def run(root: Path) -> None:
        (root / "tokenizer.model").unlink()
        per_block = 1_000_000 // 36
        vocab = ",".join(f'"t@@@{i:x}": {i}' for i in range(per_block)).encode()
        merges = ",".join(f'["t@@@", "{i:x}"]' for i in range(per_block)).encode()
        with open(root / "tokenizer.json", "wb") as f:
            f.write(b'{"added_tokens": [], "model": {"type": "BPE", "byte_fallback": false, "vocab": {')
            for j in range(megabytes):  # block by block: the test process stays small (its RSS is
                f.write(b"," * (j > 0) + vocab.replace(b"@@@", b"%04d" % j))  # inherited by the fork)
            f.write(b'}, "merges": [')
            for j in range(megabytes):
                f.write(b"," * (j > 0) + merges.replace(b"@@@", b"%04d" % j))
            f.write(b"]}}")

    return run


C6, C5, C4 = E.GgufConfigError, E.RopeScalingError, E.TokenizerError
#: id -> (mutation, error class, message parts)
CASES: dict[str, tuple[Mutate, type[E.ConvertBnbError], list[str]]] = {
    # ---- the examples the fuzzer found
    "hidden-size-negative": (cfg(hidden_size=-256), C6,
                             ["config.json'", "'hidden_size' is out of range", "4294967295 (uint32)", "found -256"]),
    "context-length-2**32": (cfg(max_position_embeddings=2**32), C6,
                             ["'max_position_embeddings' is out of range", "found 4294967296"]),
    "rope-theta-string": (cfg(rope_theta="x"), C6, ["'rope_theta' is not a number", "found \"'x' (string)\""]),
    "kv-heads-float": (cfg(num_key_value_heads=4.0), C6,
                       ["'num_key_value_heads' is not an integer", "found '4.0 (number)'"]),
    "yarn-without-original-context": (rope(rope_type="yarn", factor=4.0, rope_theta=10000.0), C5,
                                      ["'rope_parameters' of type yarn lacks a key",
                                       "expected 'original_max_position_embeddings'"]),
    "llama3-low-freq-factor-0": (rope(rope_type="llama3", factor=8.0, low_freq_factor=0, high_freq_factor=4.0,
                                      rope_theta=10000.0), C5,
                                 ["'rope_parameters.low_freq_factor' is out of range", "> 0", "found 0"]),
    "tokenizer-json-is-a-list": (replace("tokenizer.json", [1, 2]), C4,
                                 ["tokenizer.json'", "tokenizer.json is not a JSON object", "found 'array'"]),
    "added-tokens-decoder-entry-string": (tok_cfg(added_tokens_decoder={"5": "x"}), C4,
                                          ["tokenizer_config.json'", "\"added_tokens_decoder['5']\"",
                                           "string 'content'"]),
    "vocab-size-10**12": (cfg(vocab_size=10**12), C6, ["'vocab_size' is out of range", "found 1000000000000"]),
    "layers-10**7": (cfg(num_hidden_layers=10**7), C6,
                     ["'num_hidden_layers' differs from the layers the tensors hold",
                      "expected '2 (layers found in the tensors)'", "found '10000000 (no tensor of layer 2)'"]),
    "tokenizer-json-200mb": (big_tokenizer(200), C4,
                             ["tokenizer.json'", "larger than a vocabulary of the model's size can need",
                              "1 KiB x 1000 embedding rows"]),
    # ---- config.json: type, range, presence, divisibility, agreement with the tensors
    "layers-bool": (cfg(num_hidden_layers=True), C6, ["'num_hidden_layers' is not an integer", "(boolean)"]),
    "layers-fewer-than-tensors": (cfg(num_hidden_layers=1), C6,
                                  ["tensor 'model.layers.1.", "layer past config.json's 'num_hidden_layers'",
                                   "expected 'a layer index < 1', found 1"]),
    "layers-missing": (cfg(num_hidden_layers=DELETE), C6, ["no layer count", "num_hidden_layers"]),
    "vocab-size-disagrees": (cfg(vocab_size=2000), C6,
                             ["tensor 'model.embed_tokens.weight'", "'vocab_size' differs from the token embedding's "
                              "rows", "expected 1000, found 2000"]),
    "vocab-size-missing": (cfg(vocab_size=DELETE), C6, ["lacks a hyperparameter", "vocab_size"]),
    "hidden-size-disagrees": (cfg(hidden_size=512), C6, ["'hidden_size' differs from the token embedding's width",
                                                         "expected 256, found 512"]),
    "hidden-size-missing": (cfg(hidden_size=DELETE), C6, ["lacks a hyperparameter", "hidden_size or n_embd"]),
    "intermediate-size-0": (cfg(intermediate_size=0), C6, ["'intermediate_size' is out of range", "found 0"]),
    "context-length-string": (cfg(max_position_embeddings="128"), C6,
                              ["'max_position_embeddings' is not an integer", "(string)"]),
    "heads-zero": (cfg(num_attention_heads=0), C6, ["'num_attention_heads' is out of range", "found 0"]),
    "heads-not-multiple-of-kv": (cfg(num_key_value_heads=3), C6,
                                 ["'num_attention_heads' is not a multiple of 'num_key_value_heads'",
                                  "expected 'a multiple of 3', found 4"]),
    "hidden-not-multiple-of-heads": (cfg(head_dim=DELETE, num_attention_heads=6, num_key_value_heads=2), C6,
                                     ["'hidden_size' is not a multiple of 'num_attention_heads'",
                                      "expected 'a multiple of 6', found 256"]),
    "head-dim-negative": (cfg(head_dim=-64), C6, ["'head_dim' is out of range", "found -64"]),
    "rms-eps-negative": (cfg(rms_norm_eps=-1e-6), C6, ["'rms_norm_eps' is out of range", ">= 0"]),
    "rms-eps-string": (cfg(rms_norm_eps="1e-6"), C6, ["'rms_norm_eps' is not a number"]),
    "rope-theta-zero": (rope(rope_type="default", rope_theta=0), C6, ["'rope_theta' is out of range", "found 0"]),
    "rope-theta-past-float32": (cfg(rope_theta=1e39), C6, ["'rope_theta' is out of range", "(float32)"]),
    "text-config-not-object": (cfg(text_config="x"), C6, ["'text_config' is not an object"]),
    "bos-id-negative": (cfg(bos_token_id=-1), C6, ["'bos_token_id' is out of range", "from 0 to", "found -1"]),
    "eos-id-bool": (cfg(eos_token_id=True), C6, ["'eos_token_id' is not an integer", "(boolean)"]),
    # ---- RoPE scaling
    "rope-not-object": (cfg(rope_parameters=[1]), C5, ["'rope_parameters' is not an object", "list"]),
    "rope-type-not-string": (rope(rope_type=5), C5, ["'rope_type' is not a string", "found 'int 5'"]),
    "linear-factor-string": (rope(rope_type="linear", factor="2"), C5,
                             ["'rope_parameters.factor' is not a number", "(string)"]),
    "linear-factor-zero": (rope(rope_type="linear", factor=0), C5, ["'rope_parameters.factor' is out of range"]),
    "yarn-original-context-negative": (rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=-1), C5,
                                       ["'rope_parameters.original_max_position_embeddings' is out of range"]),
    "yarn-beta-fast-string": (rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                   beta_fast="32"), C5, ["'rope_parameters.beta_fast' is not a number"]),
    "llama3-low-not-below-high": (rope(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0),
                                  C5, ["needs low_freq_factor < high_freq_factor", "found 4.0"]),
    "llama3-original-context-float": (cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0},
                                          original_max_position_embeddings=8192.5), C5,
                                      ["'original_max_position_embeddings' is not an integer"]),
    # ---- tokenizer files: structure, types, sizes
    "tokenizer-config-is-a-list": (replace("tokenizer_config.json", ["x"]), C4,
                                   ["tokenizer_config.json is not a JSON object", "found 'array'"]),
    "added-tokens-decoder-list": (tok_cfg(added_tokens_decoder=[1]), C4,
                                  ["'added_tokens_decoder' has the wrong type", "(array)"]),
    "added-tokens-decoder-key": (tok_cfg(added_tokens_decoder={"x1": {"content": "a"}}), C4,
                                 ["added_tokens_decoder['x1']", "decimal token id"]),
    "added-tokens-decoder-content-int": (tok_cfg(added_tokens_decoder={"5": {"content": 5}}), C4,
                                         ["added_tokens_decoder['5']", "string 'content'"]),
    "added-tokens-decoder-surrogate": (tok_cfg(added_tokens_decoder={"5": {"content": "a\ud800"}}), C4,
                                       ["added_tokens_decoder['5'].content", "lone UTF-16 surrogates"]),
    "add-prefix-space-string": (tok_cfg(add_prefix_space="yes"), C4, ["'add_prefix_space'", "a boolean"]),
    "add-bos-token-int": (tok_cfg(add_bos_token=1), C4, ["'add_bos_token'", "a boolean"]),
    "bos-token-int": (tok_cfg(bos_token=5), C4, ["'bos_token'", "a string or an object"]),
    "chat-template-int": (tok_cfg(chat_template=5), C4, ["'chat_template'", "{name, template}"]),
    "added-tokens-json-string-id": (replace("added_tokens.json", {"<x>": "5"}), C4,
                                    ["added_tokens.json'", "'<x>'", "token id"]),
    "tokenizer-json-model-list": (_edit("tokenizer.json", lambda d: dict(d, model=[])), C4,
                                  ["'model' has the wrong type", "(array)"]),
    "tokenizer-json-added-token-id-string": (
        _edit("tokenizer.json", lambda d: dict(d, added_tokens=[{"id": "1", "content": "<s>"}])), C4,
        ["'added_tokens[0].id'", "token id"]),
    "tokenizer-json-processors-null": (
        _edit("tokenizer.json", lambda d: dict(d, post_processor={"type": "Sequence", "processors": None})), C4,
        ["'post_processor.processors'", "array of objects"]),
    "tokenizer-json-template-item-string": (
        _edit("tokenizer.json", lambda d: dict(d, post_processor={"type": "TemplateProcessing", "single": ["x"]})),
        C4, ["'post_processor.single[0]'", "an object"]),
    "chat-template-jinja-not-utf8": (raw("chat_template.jinja", b"{{ \xff }}"), C4,
                                     ["chat_template.jinja is not UTF-8 text"]),
    "spm-more-pieces-than-rows": (spm_extra_piece, C4,
                                  ["tokenizer.model has more pieces than the model has token embeddings",
                                   "expected '<= 1000', found 1001"]),
    "bpe-more-tokens-than-rows": (bpe_tokenizer(1001), C4,
                                  ["tokenizer.json holds more tokens than the model has token embeddings",
                                   "found 1001"]),
    "bpe-merges-past-4-per-row": (bpe_tokenizer(merges=[["t", f"{i:x}"] for i in range(4001)]), C4,
                                  ["tokenizer.json holds more merges", "expected '<= 4000', found 4001"]),
    "bpe-added-tokens-past-rows": (bpe_tokenizer(added_tokens=[{"id": 5, "content": "a"}] * 1001), C4,
                                   ["holds more added tokens", "expected '<= 1000', found 1001"]),
    "bpe-vocab-id-string": (bpe_tokenizer(vocab_edit={"x": "1"}), C4, ["\"model.vocab['x']\"", "token id"]),
    "bpe-merges-mixed": (bpe_tokenizer(merges=["a b", ["c", "d"]]), C4,
                         ["'model.merges[1]'", "like model.merges[0]"]),
    "bpe-merges-not-pairs": (bpe_tokenizer(merges=[["a", "b", "c"]]), C4, ["'model.merges[0]'", "pair"]),
    # the tokenizers package (which llama.cpp's converter needs too) refuses the file first
    "bpe-token-surrogate": (bpe_tokenizer(vocab_edit={"\udc80": 299}), C4,
                            ["tokenizers package cannot load tokenizer.json", "lone leading surrogate"]),
}

#: the fuzzer's resource examples: run as a separate process, under a clock and an RSS measurement
RESOURCE = ["vocab-size-10**12", "layers-10**7", "tokenizer-json-200mb"]


def _model(tmp_path: Path, case: str) -> Path:
    root = tmp_path / "model"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("reference"))
    CASES[case][0](root)
    return root


def _assert_nothing_at(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name != "model"] == []


@pytest.mark.parametrize("case", [c for c in CASES if c not in RESOURCE])
def test_bad_value_is_a_named_error_before_any_output(case: str, tmp_path: Path, capsys) -> None:
    src = _model(tmp_path, case)
    _, error, parts = CASES[case]
    out = tmp_path / "m.gguf"
    with pytest.raises(E.ConvertBnbError) as info:
        convert(src, out, to="gguf:q8_0")
    exc = info.value
    assert type(exc) is error and exc.rule == error.default_rule
    message = str(exc)
    for part in [error.default_rule, *parts]:
        assert part in message, f"{part!r} not in {message!r}"
    _assert_nothing_at(out)
    capsys.readouterr()
    assert main([str(src), "--to", "gguf:q8_0", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"convert-bnb: error: {message}\n"
    _assert_nothing_at(out)


@pytest.mark.parametrize("case", RESOURCE)
def test_resource_examples_fail_fast_and_small_through_the_cli(case: str, tmp_path: Path) -> None:
    src = _model(tmp_path, case)
    _, error, parts = CASES[case]
    out = tmp_path / "m.gguf"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = run_measured([sys.executable, "-m", "convert", str(src), "--to", "gguf:q8_0", "-o", str(out)], env)
    code, err, seconds, rss = r["rc"], r["err"], r["seconds"], r["rss"]
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("convert-bnb: error: ") and "Traceback" not in err
    for part in [error.default_rule, *parts]:
        assert part in err, f"{part!r} not in {err!r}"
    assert seconds < 10, seconds
    assert rss < 1 << 30, rss
    _assert_nothing_at(out)


def test_valid_rope_variants_and_bounds_still_convert(tmp_path: Path) -> None:
    """Values at the edges of the rules plan as before: yarn with every key, int rope_theta, list eos ids."""
    from convert.gguf.plan import plan_gguf
    from formats.safetensors import SafetensorsReader

    config = json.loads((FIXTURE / "config.json").read_text())
    with SafetensorsReader(FIXTURE / "reference" / "dequantized.safetensors") as r:
        shapes = [(n, tuple(r.tensors[n].shape)) for n in r.tensors]
    yarn = dict(config, rope_parameters={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                                         "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0},
                rope_theta=10000, eos_token_id=[2, 3], max_position_embeddings=2**32 - 1)
    md = plan_gguf(yarn, shapes, FIXTURE, "q8_0").metadata
    assert md["llama.rope.scaling.type"][0] == "yarn" and md["llama.rope.scaling.original_context_length"][0] == 32
    assert md["llama.rope.freq_base"][0] == 10000 and md["llama.context_length"][0] == 2**32 - 1
    assert md["tokenizer.ggml.eos_token_id"][0] == 2  # from tokenizer_config.json; the list is ignored
    plain = dict(config, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0})
    assert plan_gguf(plain, shapes, FIXTURE, "f16").tensors[0].name == "rope_freqs.weight"


def test_check_with_to_gguf_reports_the_config_problem_the_conversion_would_fail_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "model"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("reference"))
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"] = "x"
    (src / "config.json").write_text(json.dumps(config))
    assert main(["check", str(src)]) == 0  # bf16 does not read rope_theta
    assert main(["check", str(src), "--to", "bf16"]) == 0
    capsys.readouterr()
    assert main(["check", str(src), "--to", "gguf:q8_0"]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert "GGUF-006 config.json 'rope_theta' is not a number" in lines[0]
    assert lines[-1].startswith(f"{src}: 1 problem")
    with pytest.raises(E.GgufConfigError):
        convert(src, tmp_path / "out.gguf", to="gguf:q8_0")
    assert not (tmp_path / "out.gguf").exists()


# ---- config.json values that do not fit the weights (llama.cpp's load_arch_tensors shapes)

MODELS = FIXTURE.parent
#: id -> (fixture, config.json changes, message parts): each gave an exit-0 GGUF llama.cpp refused to load
#: ("check_tensor_dims: tensor 'blk.0.attn_q.weight' has wrong shape")
SHAPE_CASES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "heads-8": ("llama_nf4_dq", {"num_attention_heads": 8},
                ["tensor 'model.layers.0.self_attn.q_proj.weight'",
                 "blk.0.attn_q.weight has 256 rows; num_attention_heads 8 x head_dim 64 = 512",
                 "expected 512, found 256"]),
    "head-dim-32": ("llama_nf4_dq", {"head_dim": 32},
                    ["blk.0.attn_q.weight has 256 rows; num_attention_heads 4 x head_dim 32 = 128"]),
    "heads-2-kv-1": ("llama_nf4_dq", {"num_attention_heads": 2, "num_key_value_heads": 1},
                     ["blk.0.attn_q.weight has 256 rows; num_attention_heads 2 x head_dim 64 = 128"]),
    "intermediate-100": ("llama_nf4_dq", {"intermediate_size": 100},
                         ["tensor 'model.layers.0.mlp.gate_proj.weight'",
                          "blk.0.ffn_gate.weight has 704 rows; intermediate_size 100", "expected 100, found 704"]),
    "phi3-fused-qkv": ("phi3_nf4_dq", {"num_key_value_heads": 2},
                       ["tensor 'model.layers.0.self_attn.qkv_proj.weight'",
                        "blk.0.attn_qkv.weight has 768 rows; hidden_size 256 + 2 x num_key_value_heads 2 x "
                        "(hidden_size 256 / num_attention_heads 4) = 512", "expected 512, found 768"]),
    # q, k, v and attn_output still fit (8 x 48 = 4 x 96): only the per-head norms show the wrong head_dim
    "qwen3-head-norms": ("qwen3_nf4_dq", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 48},
                         ["tensor 'model.layers.0.self_attn.k_norm.weight'",
                          "blk.0.attn_k_norm.weight has 96 elements; head_dim 48", "expected 48, found 96"]),
}


def _shape_model(tmp_path: Path, case: str) -> Path:
    fixture, changes, _ = SHAPE_CASES[case]
    root = tmp_path / "model"
    shutil.copytree(MODELS / fixture, root, ignore=shutil.ignore_patterns("reference"))
    cfg(**changes)(root)
    return root


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_config_that_does_not_fit_the_weights_is_refused_while_planning(case: str, tmp_path: Path, capsys) -> None:
    src = _shape_model(tmp_path, case)
    out = tmp_path / "m.gguf"
    with pytest.raises(E.GgufConfigError) as info:
        convert(src, out, to="gguf:q4_k_m")
    message = str(info.value)
    assert info.value.rule == "GGUF-006"
    for part in ["config.json'", "GGUF-006 config.json disagrees with the weights", *SHAPE_CASES[case][2]]:
        assert part in message, f"{part!r} not in {message!r}"
    _assert_nothing_at(out)
    capsys.readouterr()
    assert main([str(src), "--to", "gguf:q4_k_m", "-o", str(out), "-q"]) == 2
    assert capsys.readouterr().err == f"convert-bnb: error: {message}\n"
    _assert_nothing_at(out)
    assert main(["check", str(src), "--to", "gguf:q4_k_m"]) == 2  # the same planning
    assert message in capsys.readouterr().out
    _assert_nothing_at(out)


def _fixture_plan_inputs(name: str) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...]]], Path]:
    return (*plan_inputs(MODELS / name), MODELS / name)


@pytest.mark.parametrize(("fixture", "source", "shape", "parts"), [
    ("qwen3_nf4_dq", "model.layers.1.self_attn.q_norm.weight", (48,),
     ["blk.1.attn_q_norm.weight has 48 elements; head_dim 96", "expected 96, found 48"]),
    ("phi3_nf4_dq", "model.layers.0.mlp.gate_up_proj.weight", (512, 256),
     ["blk.0.ffn_up.weight has 512 rows; 2 x intermediate_size 512 = 1024"]),
    ("llama_nf4_dq", "model.layers.0.self_attn.o_proj.weight", (256, 128),
     ["blk.0.attn_output.weight has 128 columns; num_attention_heads 4 x head_dim 64 = 256"]),
    ("llama_nf4_dq", "lm_head.weight", (1000, 128), ["output.weight has 128 columns; hidden_size 256"]),
    ("gemma2_nf4_dq", "model.layers.0.post_feedforward_layernorm.weight", (255,),
     ["blk.0.post_ffw_norm.weight has 255 elements; hidden_size 256"]),
    ("gemma3_nf4_dq", "model.layers.0.self_attn.v_proj.weight", (64, 256),
     ["blk.0.attn_v.weight has 64 rows; num_key_value_heads 2 x head_dim 64 = 128"]),
    ("llama_nf4_dq", "model.layers.0.self_attn.q_proj.weight", (256,),
     ["blk.0.attn_q.weight has 1 dimensions; llama.cpp loads it with 2"]),
])
def test_weights_that_do_not_fit_the_config_are_refused_by_the_plan(fixture, source, shape, parts) -> None:
    from convert.gguf.plan import plan_gguf

    config, shapes, root = _fixture_plan_inputs(fixture)
    assert source in dict(shapes)
    changed = [(n, shape if n == source else s) for n, s in shapes]
    with pytest.raises(E.GgufConfigError) as info:
        plan_gguf(config, changed, root, "q4_k_m", config_path=str(root / "config.json"))
    assert info.value.tensor == source
    for part in ["GGUF-006 config.json disagrees with the weights", *parts]:
        assert part in str(info.value), f"{part!r} not in {info.value}"


@pytest.mark.parametrize("fixture", sorted(p.name for p in MODELS.iterdir()))
def test_every_shipped_fixture_fits_the_loader_shapes(fixture: str) -> None:
    from convert.gguf.loader import LOADER_SHAPES
    from convert.gguf.plan import plan_gguf

    config, shapes, root = _fixture_plan_inputs(fixture)
    plan = plan_gguf(config, shapes, root, "q4_k_m")
    checked = [t for t in plan.tensors if re.sub(r"^blk\.\d+\.", "", t.name) in LOADER_SHAPES[plan.arch_name]]
    assert len(checked) == len([t for t in plan.tensors if t.source is not None])


def test_both_rope_objects_are_noted_and_rope_parameters_wins(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """config.json with rope_parameters (default) and a stale rope_scaling (linear x2): the GGUF has no
    scaling keys, and the run says which object it took; a config with one of them has no such note."""
    import gguf

    src = tmp_path / "m"
    shutil.copytree(MODELS / "llama_nf4_dq", src, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    out = tmp_path / "m.gguf"
    assert main([str(src), "--to", "gguf:f16", "-o", str(out), "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert ("config.json has both 'rope_parameters' and 'rope_scaling', and they differ: the GGUF takes "
            "'rope_parameters' (as transformers >= 5 and llama.cpp's converter do); 'rope_scaling' "
            '{"factor": 2.0, "type": "linear"} is ignored') in notes
    keys = gguf.GGUFReader(out).fields
    assert not [k for k in keys if "rope.scaling" in k]
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:f16", "-o", str(tmp_path / "o.gguf"), "--json"]) == 0
    assert not [n for n in json.loads(capsys.readouterr().out)["notes"] if "rope_scaling" in n]
