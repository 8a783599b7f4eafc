"""GGUF output: metadata, tensor names, values, refusals, and (where llama_cpp imports) real loading."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

from convert.gguf.codecs import CODECS
from convert.gguf.encode import write_gguf
from convert.gguf.families import ARCHITECTURES
from convert.gguf.plan import plan_gguf
from convert.gguf.types import OUTPUT_TYPES, parse_output_type
from convert.stream.plan import PlannedTensor
from convert.stream.sources import ArraySource
from formats import sentencepiece
from formats.dtypes import BY_NAME
from formats.errors import CheckpointError, UnsupportedError, VerificationError
from formats.gguf import verify_gguf
from formats.safetensors import SafetensorsReader
from tests.helpers.gguf import (
    FIXTURE,
    REF,
    has_llama_cpp,
    known_pre,
    llama_logits,
    make_gemma,
    make_qwen2,
)
from tests.helpers.sources import array_tensor, array_tensors

CONFIG = json.loads((FIXTURE / "config.json").read_text())


def load_reference(path: Path) -> dict[str, np.ndarray]:
    r = SafetensorsReader(path)
    return {name: np.array(r.array(name)) for name in r.tensors}


REF_W = load_reference(REF / "dequantized.safetensors")


#: llama-quantize's q4_0..q5_1 keep output.weight at Q6_K (convert.gguf.mix): writing them needs that codec
needs_q6_k = pytest.mark.skipif(gguf.GGMLQuantizationType.Q6_K not in CODECS,
                                reason="q4_0..q5_1 write output.weight as Q6_K, whose codec is not merged yet")


def _shapes(weights: dict[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, a.shape) for n, a in weights.items()]


def _write(tmp_path: Path, out_type: str, weights=REF_W, config=CONFIG, tok_dir=FIXTURE, **kw):
    plan = plan_gguf(config, _shapes(weights), tok_dir, out_type)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"model-{out_type}.gguf"
    reports = write_gguf(plan, path, array_tensors(weights), **kw)
    verify_gguf(path, plan)
    return plan, path, reports


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def _tensor(reader: gguf.GGUFReader, name: str):
    return next(t for t in reader.tensors if t.name == name)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp LlamaModel.permute, written independently of convert.gguf.arch
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_f32(name: str, a: np.ndarray) -> np.ndarray:
    x = a.astype(np.float32)
    if name.endswith("q_proj.weight"):
        x = _permute(x, 4)
    elif name.endswith("k_proj.weight"):
        x = _permute(x, 2)
    return x


# --------------------------------------------------------------------------------------------
# Metadata, names, types (no llama.cpp needed)
# --------------------------------------------------------------------------------------------


def test_llama_metadata_matches_llama_cpp_converter(tmp_path):
    _, path, _ = _write(tmp_path, "f16")
    r = gguf.GGUFReader(path)
    expected = {
        "general.architecture": "llama",
        "general.type": "model",
        "general.name": "Llama_Nf4_Dq",  # gguf-py's Metadata.load: the folder's name, title-cased
        "general.size_label": "2.0M",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "general.quantization_version": 2,
        "llama.block_count": 2,
        "llama.context_length": 128,
        "llama.embedding_length": 256,
        "llama.feed_forward_length": 704,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.key_length": 64,
        "llama.attention.value_length": 64,
        "llama.vocab_size": 1000,
        "llama.rope.dimension_count": 64,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    for key, value in expected.items():
        assert _field(r, key) == value, key
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6, rel=1e-6)
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    scores = _field(r, "tokenizer.ggml.scores")
    assert len(tokens) == len(types) == len(scores) == 1000
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert types[:4] == [2, 3, 3, 6]  # UNKNOWN, CONTROL, CONTROL, BYTE
    assert tokens[302] == "\u2581in" and scores[302] == -43.0 and types[302] == 1
    # no chat template in tokenizer_config.json, so none is written
    assert r.get_field("tokenizer.chat_template") is None


def test_llama_tensor_names_types_and_fallbacks():
    plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "q8_0")
    by_name = {t.name: t for t in plan.tensors}
    assert len(by_name) == len(REF_W) == 21
    assert by_name["token_embd.weight"].source == "model.embed_tokens.weight"
    assert by_name["output.weight"].source == "lm_head.weight"
    assert by_name["output_norm.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    assert by_name["blk.1.attn_norm.weight"].ggml_type == gguf.GGMLQuantizationType.F32
    assert by_name["blk.1.ffn_norm.weight"].source == "model.layers.1.post_attention_layernorm.weight"
    assert by_name["blk.0.ffn_down.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    assert by_name["blk.0.ffn_down.weight"].nbytes == 256 * 704 // 32 * 34
    assert by_name["blk.0.attn_q.weight"].permute_heads == 4
    assert by_name["blk.0.attn_k.weight"].permute_heads == 2
    assert by_name["blk.0.attn_v.weight"].permute_heads == 0
    assert plan.nbytes == sum(t.nbytes for t in plan.tensors)
    assert any("blk.0.attn_q.weight" in line and "Q8_0" in line for line in plan.describe())


def test_rows_not_a_multiple_of_the_block_fall_back_to_f16():
    w = dict(REF_W)  # an FFN of 700 (config.json and every layer: llama.cpp's loader shapes must hold)
    for i in range(CONFIG["num_hidden_layers"]):
        for proj in ("gate_proj", "up_proj"):
            w[f"model.layers.{i}.mlp.{proj}.weight"] = np.zeros((700, 256), dtype=np.float32)
        w[f"model.layers.{i}.mlp.down_proj.weight"] = np.zeros((256, 700), dtype=np.float32)
    plan = plan_gguf(dict(CONFIG, intermediate_size=700), _shapes(w), FIXTURE, "q4_0")
    t = next(t for t in plan.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.ggml_type == gguf.GGMLQuantizationType.F16
    assert "700" in t.fallback and "Q4_0" in t.fallback


@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16"])
def test_float_tensors_equal_the_dequantized_weight_rounded_once(tmp_path, out_type):
    _, path, reports = _write(tmp_path, out_type)
    r = gguf.GGUFReader(path)
    np_type = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[out_type]
    plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, out_type)
    for t in plan.tensors:
        x = _expected_f32(t.source, REF_W[t.source])
        data = np.asarray(_tensor(r, t.name).data)
        if t.ggml_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(data.reshape(x.shape), x), t.name
        elif t.ggml_type == gguf.GGMLQuantizationType.BF16:
            bits = np.ascontiguousarray(data).view(np.uint16).reshape(x.shape)
            assert np.array_equal(bits, x.astype(np_type).view(np.uint16)), t.name
        else:
            assert np.array_equal(data.view(np.uint16).reshape(x.shape), x.astype(np_type).view(np.uint16)), t.name
    rep = {p.name: p for p in reports}
    # bf16 weights are exact in f32 and bf16; f16 loses only values below its normal range
    assert rep["blk.0.ffn_down.weight"].max_abs_error == 0.0
    assert rep["blk.0.attn_norm.weight"].rms_error == 0.0
    if out_type == "f16":
        emb = rep["token_embd.weight"]
        assert 0 < emb.max_abs_error < 6e-8
        x = _expected_f32(emb.source, REF_W[emb.source]).astype(np.float64)
        assert emb.rel_rms_error == pytest.approx(emb.rms_error / math.sqrt(float(np.mean(x * x))), rel=1e-6)
        # the summary's sample (1 row in 8): the same error, the weight's RMS over rows 0, 8, 16, ...
        _, _, sampled = _write(tmp_path / "sampled", out_type, sample=8)
        emb8 = next(p for p in sampled if p.name == "token_embd.weight")
        assert (emb8.max_abs_error, emb8.rms_error) == (emb.max_abs_error, emb.rms_error)
        assert emb8.rel_rms_error == pytest.approx(emb.rms_error / math.sqrt(float(np.mean(x[::8] * x[::8]))), rel=1e-6)
        assert not emb8.sampled and emb8.ref_sampled and not emb.ref_sampled
        from convert.gguf.target import _error_notes

        assert "F16 tensors' relative error is over the weight's RMS on a fixed 1/8 sample" in _error_notes(
            "f16", sampled, 8, "the dequantized weights")[0]
        assert "relative error is over" not in _error_notes("f16", reports, 8, "the dequantized weights")[0]


@pytest.mark.parametrize(
    "out_type", ["q8_0", *(pytest.param(t, marks=needs_q6_k) for t in ("q4_0", "q4_1", "q5_0", "q5_1"))]
)
def test_quantized_tensors_are_gguf_quants_of_the_weight_and_report_their_error(tmp_path, out_type):
    _, path, reports = _write(tmp_path, out_type, chunk_elements=5000)
    r = gguf.GGUFReader(path)
    qtype = OUTPUT_TYPES[out_type][0]
    name, source = "blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"
    x = _expected_f32(source, REF_W[source])
    want = gguf.quants.quantize(x, qtype)
    got = np.asarray(_tensor(r, name).data)
    assert np.array_equal(got.reshape(want.shape), want)
    back = gguf.quants.dequantize(want, qtype).reshape(x.shape)
    err = back.astype(np.float64) - x
    rep = next(p for p in reports if p.name == name)
    assert rep.ggml_type == qtype
    assert rep.max_abs_error == pytest.approx(float(np.abs(err).max()), rel=1e-12)
    assert rep.rms_error == pytest.approx(math.sqrt(float(np.mean(err * err))), rel=1e-5)
    assert rep.rel_rms_error == pytest.approx(rep.rms_error / math.sqrt(float(np.mean(x.astype(np.float64) ** 2))))
    assert 0 < rep.rel_rms_error < {"q8_0": 0.01}.get(out_type, 0.2)
    assert _field(r, "general.file_type") == int(OUTPUT_TYPES[out_type][1])
    if out_type != "q8_0":  # llama-quantize's mix: output.weight Q6_K
        assert _tensor(r, "output.weight").tensor_type == gguf.GGMLQuantizationType.Q6_K


def test_llama_quantize_types_of_q4_0_to_q5_1_are_planned_without_a_codec():
    """q4_0 ... q5_1 follow llama-quantize (convert.gguf.mix): output.weight Q6_K, the rest of the
    matrices the type asked for (704 is a multiple of 32: no fallback)."""
    for out_type in ("q4_0", "q4_1", "q5_0", "q5_1"):
        plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, out_type)
        types = {t.name: t.ggml_type for t in plan.tensors}
        assert types.pop("output.weight") == gguf.GGMLQuantizationType.Q6_K
        assert {t for n, t in types.items() if "norm" not in n} == {OUTPUT_TYPES[out_type][0]}


def test_chunk_size_threads_and_row_sources_do_not_change_the_bytes(tmp_path):
    _, a, _ = _write(tmp_path / "a", "q8_0", chunk_elements=1 << 30)
    _, b, _ = _write(tmp_path / "b", "q8_0", chunk_elements=300)
    assert a.read_bytes() == b.read_bytes()
    plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "q8_0")
    done: list[str] = []
    asked: list[tuple[str, int, int]] = []

    class Recorded(ArraySource):
        def produce(self, start, stop, dtype):
            cols = self.numel // REF_W[self.name].shape[0]
            asked.append((self.name, start // cols, -(-stop // cols)))
            return super().produce(start, stop, dtype)

        def finish(self):
            done.append(self.name)

    records = {n: PlannedTensor(n, BY_NAME[a.dtype.name], a.shape, Recorded(n, a)) for n, a in REF_W.items()}
    c = tmp_path / "c.gguf"
    write_gguf(plan, c, records, chunk_elements=4096, threads=3)
    assert c.read_bytes() == a.read_bytes()
    assert done == [t.source for t in plan.tensors]
    # q has 4 heads of 64 rows: chunks hold whole heads even when 4096 elements is 16 rows
    assert [(r0, r1) for n, r0, r1 in asked if n.endswith("0.self_attn.q_proj.weight")] == [
        (0, 64),
        (64, 128),
        (128, 192),
        (192, 256),
    ]


def test_each_source_is_read_once_and_in_plan_order(tmp_path):
    calls: list[str] = []

    class Counted(ArraySource):
        def produce(self, start, stop, dtype):
            calls.append(self.name)
            return super().produce(start, stop, dtype)

    plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "f16")
    tensors = {n: PlannedTensor(n, BY_NAME[a.dtype.name], a.shape, Counted(n, a)) for n, a in REF_W.items()}
    write_gguf(plan, tmp_path / "m.gguf", tensors)
    assert calls == [t.source for t in plan.tensors]


def test_llama3_rope_scaling_writes_rope_freqs():
    cfg = dict(
        CONFIG,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    plan = plan_gguf(cfg, _shapes(REF_W), FIXTURE, "f16")
    assert plan.tensors[0].name == "rope_freqs.weight" and plan.tensors[0].shape == (32,)
    freqs = plan.generated["rope_freqs.weight"]
    assert freqs[0] == 1.0 and freqs[-1] == 8.0
    assert plan.metadata["llama.rope.freq_base"][0] == 500000.0


def test_linear_rope_scaling_keys():
    cfg = dict(CONFIG, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    md = plan_gguf(cfg, _shapes(REF_W), FIXTURE).metadata
    assert md["llama.rope.scaling.type"][0] == "linear"
    assert md["llama.rope.scaling.factor"][0] == 2.0


# --------------------------------------------------------------------------------------------
# Refusals, before any weight is read
# --------------------------------------------------------------------------------------------


def _untouchable(weights):
    def boom():
        raise AssertionError("a weight was read")

    return {n: boom for n in weights}


def test_unsupported_architecture_is_refused_with_the_supported_list():
    cfg = dict(CONFIG, architectures=["FalconForCausalLM"])
    with pytest.raises(UnsupportedError) as e:
        plan_gguf(cfg, _shapes(REF_W), FIXTURE, "f16")
    assert e.value.rule == "GGUF-001" and e.value.found == "FalconForCausalLM"
    for arch in ARCHITECTURES:
        for hf in arch.hf_architectures:
            assert hf in str(e.value)
    assert "Qwen2ForCausalLM, Qwen3ForCausalLM" in str(e.value) and "..." not in str(e.value)


def test_unknown_output_type_is_refused():
    assert parse_output_type(None) == "f16" and parse_output_type("Q8_0") == "q8_0"
    assert parse_output_type("Q4_K_M") == "q4_k_m"
    with pytest.raises(UnsupportedError) as e:
        parse_output_type("q9_k")
    assert e.value.rule == "GGUF-002" and "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k" in str(e.value)


def test_unmappable_tensor_is_refused():
    shapes = _shapes(REF_W) + [("model.extra_head.weight", (8, 8))]
    with pytest.raises(UnsupportedError) as e:
        plan_gguf(CONFIG, shapes, FIXTURE, "f16")
    assert e.value.rule == "GGUF-003" and e.value.tensor == "model.extra_head.weight"


def test_other_towers_are_left_out_and_language_model_prefixes_stripped():
    """llama.cpp's TextModel.filter_tensors: vision/audio/projector tensors are not the text model's; a
    multimodal checkpoint's ``language_model.`` (transformers 4.x) or ``model.language_model.`` (5.x)
    level is dropped before naming."""
    towers = [("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", (8, 8)),
              ("multi_modal_projector.linear_1.weight", (8, 8)), ("visual.blocks.0.attn.qkv.weight", (24, 8)),
              ("model.visual.patch_embed.proj.weight", (8, 8))]
    plain = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "f16")
    legacy = plan_gguf(CONFIG, [("language_model." + n, s) for n, s in _shapes(REF_W)] + towers, FIXTURE, "f16")
    v5 = plan_gguf(CONFIG, [(n.replace("model.", "model.language_model.", 1), s) for n, s in _shapes(REF_W)]
                   + towers, FIXTURE, "f16")
    assert plain.towers == [] and legacy.towers == v5.towers == [n for n, _ in towers]
    for p in (legacy, v5):
        assert [(t.name, t.shape, t.ggml_type) for t in p.tensors] == [(t.name, t.shape, t.ggml_type)
                                                                        for t in plain.tensors]
        assert p.metadata == plain.metadata
    assert legacy.tensors[1].source.startswith("language_model.model.")


def test_missing_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError) as e:
        plan_gguf(CONFIG, _shapes(REF_W), tmp_path, "f16")
    assert e.value.rule == "GGUF-004" and "tokenizer.model or tokenizer.json" in str(e.value)


def test_unsupported_rope_and_moe_are_refused():
    cfg = dict(CONFIG, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(UnsupportedError) as e:
        plan_gguf(cfg, _shapes(REF_W), FIXTURE)
    assert e.value.rule == "GGUF-005" and e.value.found == "longrope"
    cfg = dict(CONFIG, architectures=["MistralForCausalLM"], num_local_experts=8)
    with pytest.raises(UnsupportedError) as e:
        plan_gguf(cfg, _shapes(REF_W), FIXTURE)
    assert e.value.rule == "GGUF-006" and "num_local_experts = 8" in str(e.value)


def test_source_with_the_wrong_shape_is_refused(tmp_path):
    plan = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "f16")
    src = array_tensors(REF_W)
    src["model.norm.weight"] = array_tensor("model.norm.weight", np.zeros(255, dtype=np.float32))
    with pytest.raises(UnsupportedError) as e:
        write_gguf(plan, tmp_path / "m.gguf", src)
    assert e.value.rule == "GGUF-007" and e.value.tensor == "model.norm.weight"


def test_verify_catches_a_truncated_file_and_a_different_plan(tmp_path):
    plan, path, _ = _write(tmp_path, "q8_0")
    other = plan_gguf(CONFIG, _shapes(REF_W), FIXTURE, "f16")
    with pytest.raises(VerificationError) as e:
        verify_gguf(path, other)
    assert e.value.rule == "GGUF-008" and "GGML type differs" in str(e.value)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(VerificationError) as e:
        verify_gguf(path, plan)
    assert e.value.rule == "GGUF-008"


# --------------------------------------------------------------------------------------------
# SentencePiece reader
# --------------------------------------------------------------------------------------------


def test_sentencepiece_reader_matches_the_sentencepiece_package():
    spm = pytest.importorskip("sentencepiece")
    p = spm.SentencePieceProcessor()
    p.LoadFromFile(str(FIXTURE / "tokenizer.model"))
    pieces = sentencepiece.read_pieces(FIXTURE / "tokenizer.model")
    assert len(pieces) == p.vocab_size() == 1000
    for i, piece in enumerate(pieces):
        assert piece.text == p.IdToPiece(i) and piece.score == p.GetScore(i)
        assert (piece.type == sentencepiece.UNKNOWN) == p.IsUnknown(i)
        assert (piece.type == sentencepiece.CONTROL) == p.IsControl(i)
        assert (piece.type == sentencepiece.BYTE) == p.IsByte(i)
        assert (piece.type == sentencepiece.UNUSED) == p.IsUnused(i)


def test_sentencepiece_reader_values_and_malformed_input(tmp_path):
    pieces = sentencepiece.read_pieces(FIXTURE / "tokenizer.model")
    assert pieces[0] == sentencepiece.Piece("<unk>", 0.0, sentencepiece.UNKNOWN)
    assert pieces[3] == sentencepiece.Piece("<0x00>", 0.0, sentencepiece.BYTE)
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x0a\x80")  # field 1, length varint cut short
    with pytest.raises(CheckpointError) as e:
        sentencepiece.read_pieces(bad)
    assert e.value.rule == "SPM-001"
    bad.write_bytes(b"\x0b")  # wire type 3 (group)
    with pytest.raises(CheckpointError) as e:
        sentencepiece.read_pieces(bad)
    assert e.value.rule == "SPM-002"
    bad.write_bytes(b"\x12\x00")  # only field 2 (trainer_spec): no pieces
    with pytest.raises(CheckpointError) as e:
        sentencepiece.read_pieces(bad)
    assert e.value.rule == "SPM-003"
    piece = b"\x0a\x03abc" + b"\x15" + struct.pack("<f", -1.5) + b"\x18\x04"
    bad.write_bytes(b"\x0a" + bytes([len(piece)]) + piece)
    assert sentencepiece.read_pieces(bad) == [sentencepiece.Piece("abc", -1.5, sentencepiece.USER_DEFINED)]


# --------------------------------------------------------------------------------------------
# Qwen2 and Gemma
# --------------------------------------------------------------------------------------------
def test_qwen2_metadata_tokenizer_and_names(tmp_path, monkeypatch):
    w = make_qwen2(tmp_path / "qwen2")
    known_pre(monkeypatch, tmp_path / "qwen2", "qwen2")
    cfg = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    _, path, _ = _write(tmp_path, "f32", weights=w, config=cfg, tok_dir=tmp_path / "qwen2")
    r = gguf.GGUFReader(path)
    assert _field(r, "general.architecture") == "qwen2"
    assert _field(r, "qwen2.rope.freq_base") == 1000000.0
    assert _field(r, "qwen2.attention.head_count_kv") == 2
    assert r.get_field("qwen2.vocab_size") is None and r.get_field("qwen2.rope.dimension_count") is None
    assert _field(r, "tokenizer.ggml.model") == "gpt2" and _field(r, "tokenizer.ggml.pre") == "qwen2"
    tokens, types = _field(r, "tokenizer.ggml.tokens"), _field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == 264 and tokens[256:262] == [
        "Ġt",
        "he",
        "Ġthe",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert types[255:264] == [1, 1, 1, 1, 3, 3, 3, 5, 5] and tokens[263] == "[PAD263]"
    assert _field(r, "tokenizer.ggml.merges") == ["Ġ t", "h e", "Ġt he"]
    assert _field(r, "tokenizer.ggml.eos_token_id") == 261
    assert _field(r, "tokenizer.ggml.padding_token_id") == 259
    assert "<|im_start|>" in _field(r, "tokenizer.chat_template")
    # no permutation for Qwen2: q is stored as given, biases kept F32
    q = np.asarray(_tensor(r, "blk.0.attn_q.weight").data).reshape(64, 64)
    assert np.array_equal(q, w["model.layers.0.self_attn.q_proj.weight"])
    bias = _tensor(r, "blk.0.attn_k.bias")
    assert bias.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.asarray(bias.data), w["model.layers.0.self_attn.k_proj.bias"])


def test_gemma_norm_offset_tied_head_and_tokenizer(tmp_path):
    w = make_gemma(tmp_path / "gemma")
    cfg = json.loads((tmp_path / "gemma" / "config.json").read_text())
    w_with_head = dict(w, **{"lm_head.weight": w["model.embed_tokens.weight"]})
    plan, path, _ = _write(tmp_path, "f16", weights=w_with_head, config=cfg, tok_dir=tmp_path / "gemma")
    assert "output.weight" not in {t.name for t in plan.tensors}
    r = gguf.GGUFReader(path)
    assert _field(r, "general.architecture") == "gemma"
    assert _field(r, "gemma.attention.key_length") == 16 and _field(r, "gemma.attention.head_count_kv") == 1
    assert r.get_field("gemma.rope.freq_base") is None  # GemmaModel writes no rope keys
    assert _field(r, "tokenizer.ggml.add_space_prefix") is False
    # CodeGemma's ids: the gguf package has no writer for prefix/suffix/middle/fsep (llama.cpp's
    # converter skips them too); eot is written
    assert _field(r, "tokenizer.ggml.eot_token_id") == 107
    assert r.get_field("tokenizer.ggml.prefix_token_id") is None
    norm = np.asarray(_tensor(r, "blk.1.ffn_norm.weight").data)
    want = w["model.layers.1.post_attention_layernorm.weight"] + np.float32(1.0)
    assert norm.dtype == np.float32 and np.array_equal(norm, want)


# --------------------------------------------------------------------------------------------
# llama.cpp loads what we write
# --------------------------------------------------------------------------------------------


LOGIT_BOUND = {"f32": 0.03, "f16": 0.03, "bf16": 0.03, "q8_0": 0.08}


@pytest.mark.parametrize("out_type", list(LOGIT_BOUND))
def test_llama_cpp_logits_match_the_dequantized_model(tmp_path, out_type):
    pytest.importorskip("llama_cpp")
    _, path, _ = _write(tmp_path, out_type)
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    want = np.array(r.array("logits_dequantized"), dtype=np.float32).reshape(len(ids), -1)
    got = llama_logits(path, ids, want.shape[-1])
    diff = float(np.abs(got - want).max())
    assert diff <= LOGIT_BOUND[out_type], diff
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@needs_q6_k
@pytest.mark.parametrize("out_type", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_llama_cpp_runs_the_4_and_5_bit_types(tmp_path, out_type):
    """Re-quantizing NF4 weights to 4/5-bit GGML types adds real error (rel RMS 4-10 %, see the
    reports); llama.cpp loads them and the logits stay strongly correlated with the reference."""
    pytest.importorskip("llama_cpp")
    _, path, _ = _write(tmp_path, out_type)
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    want = np.array(r.array("logits_dequantized"), dtype=np.float32).reshape(len(ids), -1)
    got = llama_logits(path, ids, want.shape[-1])
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > (0.98 if out_type.startswith("q5") else 0.95)


def _transformers_logits(kind: str, root: Path, ids: list[int]) -> np.ndarray | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "gemma": transformers.GemmaForCausalLM}[kind]
    model = cls.from_pretrained(str(root), torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["qwen2", "gemma"])
def test_llama_cpp_loads_qwen2_and_gemma(tmp_path, kind, monkeypatch):
    pytest.importorskip("llama_cpp")
    root = tmp_path / kind
    w = (make_qwen2 if kind == "qwen2" else make_gemma)(root)
    if kind == "qwen2":
        known_pre(monkeypatch, root, "qwen2")
    cfg = json.loads((root / "config.json").read_text())
    ids = [5, 77, 120, 3, 250, 9, 31, 200]
    for out_type in ("f32", "f16"):
        _, path, _ = _write(tmp_path, out_type, weights=w, config=cfg, tok_dir=root)
        got = llama_logits(path, ids, cfg["vocab_size"])
        assert np.isfinite(got).all() and got.std() > 0.1
        want = _transformers_logits(kind, root, ids)
        if want is not None:
            assert float(np.abs(got - want).max()) <= (2e-3 if out_type == "f32" else 0.05) * max(
                1.0, float(np.abs(want).max())
            )
            assert np.array_equal(got.argmax(-1), want.argmax(-1))


# --------------------------------------------------------------------------------------------
# Through the CLI: convert-bnb SRC --to gguf[:TYPE] -o model.gguf
# --------------------------------------------------------------------------------------------

MODELS = FIXTURE.parent


def _tensors_by_name(path: Path) -> dict[str, tuple[int, np.ndarray]]:
    r = gguf.GGUFReader(path)
    return {t.name: (int(t.tensor_type), np.array(t.data)) for t in r.tensors}


@pytest.mark.parametrize("model", ["llama_nf4_dq", "llama_nf4_dq_sharded", "llama_nf4_dq_qsbf16", "llama_nf4_dq_bin"])
def test_cli_gguf_equals_gguf_of_the_dequantized_reference(tmp_path, model):
    from convert.cli import main

    out = tmp_path / "model.gguf"
    assert main([str(MODELS / model), "--to", "gguf:q8_0", "-o", str(out), "-q", "--threads", "2"]) == 0
    _, ref_path, _ = _write(tmp_path / "ref", "q8_0")
    got, want = _tensors_by_name(out), _tensors_by_name(ref_path)
    assert sorted(got) == sorted(want)
    for name, (qtype, data) in want.items():
        assert got[name][0] == qtype and np.array_equal(got[name][1], data), name
    assert not list(tmp_path.glob(".*convert-bnb-tmp*"))


@pytest.mark.parametrize("out_type", ["q8_0", pytest.param("q4_1", marks=needs_q6_k)])
def test_cli_gguf_small_memory_cap_and_threads_give_the_same_bytes(tmp_path, out_type):
    from convert.cli import main

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    src = str(MODELS / "llama_nf4_dq_sharded")
    assert main([src, "--to", f"gguf:{out_type}", "-o", str(a), "-q", "--threads", "1"]) == 0
    assert (
        main(
            [
                str(MODELS / "llama_nf4_dq_sharded"),
                "--to",
                f"gguf:{out_type}",
                "-o",
                str(b),
                "-q",
                "--threads",
                "3",
                "--max-memory",
                "64MiB",
            ]
        )
        == 0
    )
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("model", ["llama_fp4_nodq", "llama_int8"])
def test_cli_gguf_bf16_equals_each_models_dequantized_reference(tmp_path, model):
    from convert.cli import main

    out = tmp_path / "m.gguf"
    assert main([str(MODELS / model), "--to", "gguf:bf16", "-o", str(out), "-q"]) == 0
    want = load_reference(MODELS / model / "reference" / "dequantized.safetensors")
    plan = plan_gguf(CONFIG, _shapes(want), MODELS / model, "bf16")
    r = gguf.GGUFReader(out)
    for t in plan.tensors:
        x = _expected_f32(t.source, want[t.source])
        data = np.ascontiguousarray(np.asarray(_tensor(r, t.name).data))
        if t.ggml_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(data.reshape(x.shape), x), t.name
        else:
            assert np.array_equal(data.view(np.uint16).reshape(x.shape), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_cli_gguf_default_type_json_report_and_refusals(tmp_path, capsys):
    from convert.cli import main

    out = tmp_path / "m.gguf"
    assert main([str(MODELS / "llama_fp4_nodq"), "--to", "gguf", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["gguf"]["type"] == "f16" and summary["gguf"]["architecture"] == "llama"
    rows = {t["name"]: t for t in summary["gguf"]["tensors"]}
    assert rows["blk.0.ffn_up.weight"]["type"] == "F16" and rows["blk.0.ffn_up.weight"]["max_abs_error"] == 0.0
    assert rows["output_norm.weight"]["type"] == "F32"
    r = gguf.GGUFReader(out)
    assert _field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    want = load_reference(MODELS / "llama_fp4_nodq" / "reference" / "dequantized.safetensors")
    up = np.asarray(_tensor(r, "blk.1.ffn_up.weight").data)
    assert np.array_equal(up, want["model.layers.1.mlp.up_proj.weight"].astype(np.float32).astype(np.float16))
    # an existing output is refused, a lone weight file too, an unknown GGUF type is a usage error
    assert main([str(MODELS / "llama_fp4_nodq"), "--to", "gguf", "-o", str(out), "-q"]) == 2
    assert "output exists" in capsys.readouterr().err
    assert (
        main([str(MODELS / "llama_nf4_dq" / "model.safetensors"), "--to", "gguf", "-o", str(tmp_path / "x.gguf"), "-q"])
        == 2
    )
    assert "GGUF-004" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:iq2_xxs", "-o", str(tmp_path / "y.gguf")])


def test_cli_gguf_dry_run_writes_nothing(tmp_path, capsys):
    from convert.cli import main

    out = tmp_path / "m.gguf"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:q4_0", "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "blk.0.attn_q.weight" in text and "Q4_0" in text and "output_norm.weight" in text
    assert not out.exists()


def test_cli_gguf_unsupported_architecture_reads_no_weight(tmp_path, capsys, monkeypatch):
    import convert.stream.sources
    from convert.cli import main

    def no_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(convert.stream.sources.Dequant4Source, "produce", no_read)
    monkeypatch.setattr(convert.stream.sources.CastSource, "produce", no_read)
    src = tmp_path / "falcon"
    shutil.copytree(MODELS / "llama_nf4_dq", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert main([str(src), "--to", "gguf", "-o", str(tmp_path / "f.gguf"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "GGUF-001" in err and "FalconForCausalLM" in err and "GemmaForCausalLM" in err
    assert not (tmp_path / "f.gguf").exists()


def test_cli_gguf_loads_in_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp")
    from convert.cli import main

    out = tmp_path / "model.gguf"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:f16", "-o", str(out), "-q"]) == 0
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    want = np.array(r.array("logits_dequantized"), dtype=np.float32).reshape(len(ids), -1)
    got = llama_logits(out, ids, want.shape[-1])
    assert float(np.abs(got - want).max()) <= 0.03
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_cli_gguf_composes_with_plan_hooks(tmp_path, monkeypatch):
    """A plan hook (as --merge-lora installs) changes a source; the GGUF carries the changed values."""
    from convert.cli import main
    from convert.stream.plan import make_plan
    from convert.stream.sources import Source

    class Shifted(Source):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.unit, self.numel, self.kind, self.in_nbytes = base.unit, base.numel, "shifted", base.in_nbytes

        def produce(self, start, stop, dtype):
            x = self.base.produce(start, stop, dtype).astype(np.float32) + np.float32(0.5)
            return x.astype(dtype.numpy)

        def release(self, start, stop):
            self.base.release(start, stop)

        def finish(self):
            self.base.finish()

    import convert.run.single

    def shifted_plan(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        for t in plan.tensors:
            if t.name == "model.layers.1.self_attn.q_proj.weight":
                t.source = Shifted(t.source)
        return plan

    monkeypatch.setattr(convert.run.single, "make_plan", shifted_plan)
    out = tmp_path / "m.gguf"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:f16", "-o", str(out), "-q"]) == 0
    r = gguf.GGUFReader(out)
    q = np.asarray(_tensor(r, "blk.1.attn_q.weight").data).reshape(256, 256)
    shifted = (REF_W["model.layers.1.self_attn.q_proj.weight"].astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    assert np.array_equal(q, _permute(shifted.astype(np.float32), 4).astype(np.float16))
    k = np.asarray(_tensor(r, "blk.1.attn_k.weight").data).reshape(128, 256)
    want_k = _expected_f32("k_proj.weight", REF_W["model.layers.1.self_attn.k_proj.weight"]).astype(np.float16)
    assert np.array_equal(k, want_k)


def test_llama_with_a_byte_level_bpe_tokenizer_is_llama_bpe(tmp_path, monkeypatch):
    make_qwen2(tmp_path / "tok")  # a byte-level BPE tokenizer.json, no tokenizer.model
    known_pre(monkeypatch, tmp_path / "tok", "llama-bpe")
    cfg = dict(CONFIG, vocab_size=264)
    shapes = [(n, (264, 256) if "embed" in n or "lm_head" in n else s) for n, s in _shapes(REF_W)]
    md = plan_gguf(cfg, shapes, tmp_path / "tok", "f16").metadata
    assert md["tokenizer.ggml.model"][0] == "gpt2" and md["tokenizer.ggml.pre"][0] == "llama-bpe"
    assert "tokenizer.ggml.scores" not in md and len(md["tokenizer.ggml.merges"][0]) == 3
    # a Llama-style (SentencePiece-as-BPE, byte_fallback) tokenizer.json needs its tokenizer.model
    with pytest.raises(UnsupportedError) as e:
        plan_gguf(CONFIG, _shapes(REF_W), _only(tmp_path / "spm", FIXTURE / "tokenizer.json"), "f16")
    assert e.value.rule == "GGUF-004" and "tokenizer.model" in str(e.value)


def _only(root: Path, *files: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(f, root / f.name)
    return root


def test_cli_gguf_with_merge_lora_equals_the_peft_merged_model(tmp_path):
    from convert.cli import main

    lora = FIXTURE.parent.parent / "lora"
    out = tmp_path / "merged.gguf"
    args = [str(FIXTURE), "--merge-lora", str(lora / "adapter"), "--to", "gguf:f32", "-o", str(out), "-q"]
    assert main(args) == 0
    # gguf:f32 holds the exact float32 dequantized base with the delta added in float32 (no bf16
    # intermediate): exactly our own `--merge-lora --to fp32`, and within one bf16 rounding of PEFT's
    # bf16 merge (PEFT adds the delta to the bf16 base)
    fp32 = tmp_path / "merged-fp32"
    assert main([str(FIXTURE), "--merge-lora", str(lora / "adapter"), "--to", "fp32", "-o", str(fp32), "-q"]) == 0
    base32 = tmp_path / "base-fp32"
    assert main([str(FIXTURE), "--to", "fp32", "-o", str(base32), "-q"]) == 0
    exact = load_reference(fp32 / "model.safetensors")
    base = load_reference(base32 / "model.safetensors")
    want = load_reference(lora / "merged_reference" / "model.safetensors")
    plan = plan_gguf(CONFIG, _shapes(want), FIXTURE, "f32")
    r = gguf.GGUFReader(out)
    for t in plan.tensors:
        x = _expected_f32(t.source, exact[t.source])
        got = np.asarray(_tensor(r, t.name).data).reshape(x.shape)
        assert np.array_equal(got, x), t.name
        peft = _expected_f32(t.source, want[t.source])
        # PEFT rounds the base to bf16 and the sum to bf16: half a bf16 ulp (2^-8 relative) of each
        bound = 2.0**-8 * (np.abs(_expected_f32(t.source, base[t.source])) + np.abs(peft))
        assert (np.abs(got - peft) <= bound).all(), t.name
    if has_llama_cpp():
        lr = SafetensorsReader(lora / "merged_reference" / "logits.safetensors")
        ids = [int(i) for i in np.array(lr.array("input_ids")).reshape(-1)]
        logits = np.array(lr.array("logits"), dtype=np.float32).reshape(len(ids), -1)
        got = llama_logits(out, ids, logits.shape[-1])
        assert float(np.abs(got - logits).max()) <= 0.03
        assert np.array_equal(got.argmax(-1), logits.argmax(-1))


def test_hub_repo_id_to_gguf_default_name(tmp_path):
    """A Hub repo id (offline, from a filled cache) converts to ./<org>-<name>-<size>-Q8_0.gguf (llama.cpp's
    naming convention, the repo id as general.name as its converter's --remote sets it, ``-nf4`` dropped)."""
    from tests.helpers.hubcache import add_model_dir, commit_sha, offline_env, run_cli

    cache = tmp_path / "hub"
    add_model_dir(cache, "org/llama-nf4", FIXTURE, commit_sha("nf4"), refs=("main",))
    work = tmp_path / "cwd"
    work.mkdir()
    r = run_cli(["org/llama-nf4", "--to", "gguf:q8_0", "--json"], offline_env(tmp_path, cache), cwd=work)
    assert r.returncode == 0, r.stderr
    out = work / "org-llama-2.0M-Q8_0.gguf"
    assert json.loads(r.stdout)["output"] == str(out)
    _, ref_path, _ = _write(tmp_path / "ref", "q8_0")
    got, want = _tensors_by_name(out), _tensors_by_name(ref_path)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[n][1], want[n][1]) for n in want)
    assert _field(gguf.GGUFReader(out), "general.name") == "org/llama"


def test_gguf_f16_counts_fp16_overflow_and_underflow(tmp_path, capsys):
    """`--to gguf:f16` counts the values F16 cannot hold, as `--to fp16` does (a bf16 model with values
    past float16's range and below its subnormals in one weight; the F16 bits are NumPy's cast)."""
    import shutil

    import ml_dtypes

    from convert.cli import main
    from formats.safetensors import SafetensorsReader, SafetensorsWriter

    model = tmp_path / "m"
    shutil.copytree(MODELS / "llama_orig_bf16", model)
    name = "model.layers.0.mlp.down_proj.weight"
    with SafetensorsReader(model / "model.safetensors") as r:
        entries = [(k, info.dtype, info.shape) for k, info in r.tensors.items()]
        arrays = {k: np.array(r.array(k)) for k in r.tensors}
    w = arrays[name]
    w.reshape(-1)[:6] = np.array([1e5, -7e4, 1e-9, -2e-9, 3e-8, 0.0], np.float32).astype(ml_dtypes.bfloat16)
    (model / "model.safetensors").unlink()
    out = SafetensorsWriter(model / "model.safetensors", entries, {"format": "pt"})
    for k, _, _ in entries:
        out.write(arrays[k])
    out.close()
    assert main([str(model), "--to", "gguf:f16", "-o", str(tmp_path / "m.gguf"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    x32 = w.astype(np.float32)
    with np.errstate(over="ignore"):
        y = x32.astype(np.float16)
    over = int(np.count_nonzero(np.isinf(y) & np.isfinite(x32)))
    under = int(np.count_nonzero((y == 0) & (x32 != 0)))
    assert over == 2 and under >= 2  # (bf16(3e-8) rounds to 0 in float16 too)
    rows = {t["source"]: t for t in summary["gguf"]["tensors"]}
    total = 0  # the model's other F16 matrices hold a few values below float16's subnormals
    for k, a in arrays.items():
        if rows.get(k, {}).get("type") == "F16":
            with np.errstate(over="ignore"):
                total += int(np.count_nonzero((a.astype(np.float32).astype(np.float16) == 0) & (a != 0)))
    assert (summary["fp16_overflow"], summary["fp16_underflow"]) == (over, total) and total >= under
    row = rows[name]
    assert row["type"] == "F16" and row["max_abs_error"] == "inf"
    got = np.asarray(_tensor(gguf.GGUFReader(tmp_path / "m.gguf"), "blk.0.ffn_down.weight").data)
    assert np.array_equal(got.view(np.uint16), y.view(np.uint16))


def test_cli_gguf_summary_error_on_a_sample_and_exact_with_json(tmp_path, capsys):
    """Without --json the summary's error figures come from one piece in 8 of each tensor (and say so);
    --json measures every value: the same bytes either way, and the sampled figures are those of the
    exact report's tensors where a tensor is one piece (token_embd, 256,000 values, is two)."""
    from convert.cli import main

    model = str(MODELS / "llama_nf4_dq")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main([model, "--to", "gguf:q8_0", "-o", str(a)]) == 0
    text = capsys.readouterr()
    assert "figures are measured on a fixed 1/8 sample of each (every value with --json)" in text.out + text.err
    assert main([model, "--to", "gguf:q8_0", "-o", str(b), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "sample" not in " ".join(summary["notes"])
    assert a.read_bytes() == b.read_bytes()
    rows = {t["name"]: t for t in summary["gguf"]["tensors"]}
    x = np.asarray(_tensor(gguf.GGUFReader(b), "token_embd.weight").data)
    want = load_reference(MODELS / "llama_nf4_dq" / "reference" / "dequantized.safetensors")
    w = want["model.embed_tokens.weight"].astype(np.float32)
    err = gguf.quants.dequantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape) - w
    assert rows["token_embd.weight"]["max_abs_error"] == pytest.approx(float(np.abs(err).max()), rel=1e-6)


def test_gguf_error_sample_is_a_fixed_grid_and_float_types_are_exact(tmp_path):
    """The sampled figures are those of fixed pieces of each tensor: the same for every chunk size and
    thread count (the summary's figures do not move with --max-memory); F16 is measured on every value
    (its few rounded values are cheap to measure, and a sample would hide an overflow)."""
    rng = np.random.default_rng(17)
    w = {n: (rng.standard_normal(a.shape) * 0.02).astype(np.float32) for n, a in REF_W.items()}
    runs = [_write(tmp_path / f"{i}", "q8_0", weights=w, chunk_elements=c, threads=th, sample=8)[2]
            for i, (c, th) in enumerate([(1 << 30, 1), (5000, 3), (70000, 2)])]
    exact = _write(tmp_path / "x", "q8_0", weights=w, sample=1)[2]
    assert [r.measured for r in runs[0]] == [r.measured for r in runs[1]] == [r.measured for r in runs[2]]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a.max_abs_error == b.max_abs_error and a.rms_error == pytest.approx(b.rms_error, rel=1e-6)
    assert any(r.measured < math.prod(r.shape) for r in runs[0])
    for r, e in zip(runs[0], exact, strict=True):
        assert e.measured == math.prod(e.shape) and r.max_abs_error <= e.max_abs_error
    f16 = _write(tmp_path / "f", "f16", weights=w, chunk_elements=5000, sample=8)[2]
    assert all(r.measured == math.prod(r.shape) for r in f16)


def test_gguf_f16_of_bf16_layers_from_the_tables_equals_rounding_their_bf16(tmp_path, monkeypatch):
    """gguf:f16 of a bnb model with bf16 layers takes each 4-bit layer's float16 straight from the kernel's
    tables where every value is exact (kernels_f16.dequantize_4bit_f16_of_bf16 of Dequant4Source.codes_4bit):
    the same file, byte for byte, as producing bf16 and rounding it to F16 (the route taken where a source
    cannot)."""
    from convert.cli import main
    from convert.dequant import kernels_f16
    from convert.stream.sources import Dequant4Source

    calls = []
    real = kernels_f16.dequantize_4bit_f16_of_bf16

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(kernels_f16, "dequantize_4bit_f16_of_bf16", spy)
    fast = tmp_path / "fast.gguf"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:f16", "-o", str(fast), "-q"]) == 0
    assert sum(calls) >= 14, calls  # every 4-bit layer of the two blocks (7 each) took the tables
    monkeypatch.setattr(Dequant4Source, "codes_4bit", lambda self, start, stop: None)
    slow = tmp_path / "slow.gguf"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "gguf:f16", "-o", str(slow), "-q"]) == 0
    assert fast.read_bytes() == slow.read_bytes()

