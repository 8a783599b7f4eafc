"""``--imatrix FILE``: the importance matrix files llama-imatrix writes, read and validated
(formats/imatrix.py, IMX-001..004), and quantization with them equal to llama-quantize's.

The end-to-end comparisons run llama.cpp's own tools (built by scripts/build_llama_tools.sh; CI builds
them): ``llama-imatrix`` computes an importance matrix for a model from our ``gguf:f32`` file on a few
lines of text, in both of its formats, and ``llama-quantize --imatrix`` of that same f32 file is the
reference, tensor by tensor (type and bytes) and key by key (names, types and values; the order of keys
is ours, llama.cpp's converter's, where llama-quantize moves ``general.file_type`` to the end).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from convert.cli import main
from convert.gguf.imatrix import imatrix_keys, load_importance
from formats.errors import (
    ImatrixFormatError,
    ImatrixValuesError,
    UsageError,
)
from formats.imatrix import read_imatrix
from tests.helpers.fixtures import MODELS
from tests.helpers.imatrix import write_dat_imatrix, write_gguf_imatrix
from tests.helpers.llama_tools import find_tool, run_tool

FIXTURE = MODELS / "llama_nf4_dq"
MOE = MODELS / "qwen3_moe_nf4_dq"
#: Every file type whose encoders use the importance matrix (and Q2_K_S, which needs one).
MIXES = ["q2_k", "q2_k_s", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q4_0",
         "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"]
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "\n"
        "A bitsandbytes checkpoint stores each weight as packed four-bit codes and a scale per block.\n"
        "Importance matrices weigh each column by the squares of the activations that enter it.\n") * 40

needs_tools = pytest.mark.skipif(
    find_tool("llama-quantize") is None or find_tool("llama-imatrix") is None,
    reason="llama-quantize / llama-imatrix not built (scripts/build_llama_tools.sh)")


# -------------------------------------------------------------------------------- the reader


def test_gguf_and_dat_files_read_and_normalize_as_llama_quantize(tmp_path):
    rng = np.random.default_rng(0)
    sums = rng.random((3, 8), dtype=np.float32) * 100
    g = write_gguf_imatrix(tmp_path / "m.gguf", {"blk.0.ffn_up_exps.weight": (sums, np.array([4, 0, 7])),
                                                 "blk.0.attn_q.weight": (sums[:1], np.array([2.4]))})
    f = read_imatrix(g)
    assert not f.legacy and f.datasets == ("text.txt",) and f.chunk_count == 3 and f.chunk_size == 64
    assert f.entries["blk.0.attn_q.weight"].counts.tolist() == [2]  # lround
    imp = load_importance(g)
    assert imp is not None
    rows = imp.rows["blk.0.ffn_up_exps.weight"]
    np.testing.assert_array_equal(rows[0], sums[0] / np.float32(4))
    np.testing.assert_array_equal(rows[1], np.ones(8, np.float32))  # a count of 0: all 1
    np.testing.assert_array_equal(rows[2], sums[2] / np.float32(7))
    d = write_dat_imatrix(tmp_path / "m.dat", {"blk.0.attn_q.weight": (sums[0], 5), "output.weight": (sums[1], 0)})
    f = read_imatrix(d)
    assert f.legacy and f.chunk_count == 3 and f.datasets == ("text.txt",)
    imp = load_importance(d)
    assert imp is not None
    np.testing.assert_array_equal(imp.rows["blk.0.attn_q.weight"][0], sums[0] / np.float32(5))
    np.testing.assert_array_equal(imp.rows["output.weight"][0], sums[1])  # ncall 0: as stored
    assert imatrix_keys(imp) == [
        ("quantize.imatrix.file", str(d), gguf.GGUFValueType.STRING),
        ("quantize.imatrix.dataset", "text.txt", gguf.GGUFValueType.STRING),
        ("quantize.imatrix.entries_count", 2, gguf.GGUFValueType.UINT32),
        ("quantize.imatrix.chunks_count", 3, gguf.GGUFValueType.UINT32)]
    # the optional trailer may be absent: no dataset, no chunk count
    bare = load_importance(write_dat_imatrix(tmp_path / "bare.dat", {"a.weight": (sums[0], 1)}, chunks=None))
    assert bare is not None and [k for k, _, _ in imatrix_keys(bare)] == [
        "quantize.imatrix.file", "quantize.imatrix.entries_count"]


def test_include_and_exclude_weights_select_entries_by_substring(tmp_path):
    v = np.ones(4, np.float32)
    d = write_dat_imatrix(tmp_path / "m.dat", {"blk.0.attn_q.weight": (v, 1), "blk.0.attn_v.weight": (v, 1),
                                                "blk.1.ffn_down.weight": (v, 1)})
    assert sorted(load_importance(d, include=["attn"]).rows) == ["blk.0.attn_q.weight", "blk.0.attn_v.weight"]
    assert sorted(load_importance(d, exclude=["attn_q", "ffn"]).rows) == ["blk.0.attn_v.weight"]
    assert load_importance(d, exclude=["blk"]) is None  # nothing left: as without --imatrix


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _dat_cut(tmp: Path) -> Path:
    full = write_dat_imatrix(tmp / "full.dat", {"blk.0.attn_q.weight": (np.ones(8, np.float32), 1)})
    (tmp / "cut.dat").write_bytes(full.read_bytes()[:40])
    return tmp / "cut.dat"


BAD: list[tuple[str, Callable[[Path], Path], type[Exception], list[str]]] = [
    ("missing", lambda t: t / "nope.gguf", ImatrixFormatError, ["IMX-001", "does not exist", "nope.gguf"]),
    ("empty", lambda t: _write(t / "e.dat", b""), ImatrixFormatError,
     ["IMX-001", "neither GGUF nor"]),
    ("text", lambda t: _write(t / "x.dat", b"hello world, not a matrix"), ImatrixFormatError,
     ["IMX-001", "entry count"]),
    ("cut-dat", _dat_cut, ImatrixFormatError, ["IMX-001", "ends inside entry 1's values"]),
    ("no-keys", lambda t: write_gguf_imatrix(t / "k.gguf", {"a.weight": (np.ones((1, 4)), np.ones(1))}, keys=False),
     ImatrixFormatError, ["IMX-001", "imatrix.datasets", "general.type 'imatrix'"]),
    ("model-gguf", lambda t: write_gguf_imatrix(t / "g.gguf", {}, keys=False), ImatrixFormatError,
     ["IMX-001", "no imatrix.datasets"]),
    ("no-entries", lambda t: write_gguf_imatrix(t / "n.gguf", {}), ImatrixFormatError,
     ["IMX-001", "no importance matrix entries"]),
    ("nan", lambda t: write_gguf_imatrix(t / "nan.gguf", {"a.weight": (np.array([[1, np.nan, 2, 3]]), np.ones(1))}),
     ImatrixValuesError, ["IMX-002", "tensor 'a.weight'", "nan at index 1"]),
    ("negative", lambda t: write_dat_imatrix(t / "neg.dat", {"a.weight": (np.array([1, 2, -3.0, 4]), 1)}),
     ImatrixValuesError, ["IMX-002", "-3.0 at index 2"]),
    ("negative-count", lambda t: write_dat_imatrix(t / "nc.dat", {"a.weight": (np.ones(4), -2)}),
     ImatrixValuesError, ["IMX-002", "count is negative"]),
]


@pytest.mark.parametrize(("build", "error", "parts"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_files_are_refused_with_named_errors(tmp_path, build, error, parts):
    path = build(tmp_path)
    with pytest.raises(error) as ei:
        read_imatrix(path)
    assert type(ei.value) is error
    for p in parts:
        assert p in str(ei.value), (p, str(ei.value))


def test_unpaired_and_non_f32_entries_are_refused(tmp_path):
    p = tmp_path / "u.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama")
    w.add_array("imatrix.datasets", ["t"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    w.add_tensor("a.weight.in_sum2", np.ones((1, 4), np.float32))
    w.add_tensor("b.weight.in_sum2", np.ones((1, 4), np.float16))
    w.add_tensor("b.weight.counts", np.ones((1, 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ImatrixFormatError, match=r"IMX-001 sums and counts come in pairs .*only a\.weight\.in_sum2"):
        read_imatrix(p)
    q = write_gguf_imatrix(tmp_path / "odd.gguf", {"a.weight": (np.ones((1, 5)), np.ones(2))})
    with pytest.raises(ImatrixFormatError, match=r"IMX-001 the sums are not a whole number of rows.*found 5"):
        read_imatrix(q)


# -------------------------------------------------------------------------------- options and refusals


def test_option_combinations_are_refused(tmp_path, capsys):
    from convert.gguf.types import parse_mix_options

    with pytest.raises(UsageError, match="cannot be used together"):
        parse_mix_options(imatrix="m.gguf", include_weights=["a"], exclude_weights=["b"])
    with pytest.raises(UsageError, match="--include-weights selects entries .* needs --imatrix FILE"):
        parse_mix_options(include_weights=["attn"])
    out = tmp_path / "o.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q8_0", "--imatrix", "m.gguf", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "USE-001 --imatrix needs --to gguf:TYPE of a llama-quantize type" in err[0]
    assert not out.exists()


def test_q2_k_s_without_an_importance_matrix_is_refused_before_reading(tmp_path, capsys):
    out = tmp_path / "o.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q2_k_s", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "IMX-004 gguf:q2_k_s needs an importance matrix (llama-quantize refuses it without one)" in err[0]
    assert "expected '--imatrix FILE', found 'no --imatrix'" in err[0]
    assert not out.exists()


def test_a_type_needing_an_importance_matrix_by_tensor_type_is_refused(tmp_path, capsys):
    out = tmp_path / "o.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "--tensor-type", "attn_q=iq2_xxs", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "IMX-004 gguf:q4_k_m IQ2_XXS needs an importance matrix" in err and "blk.0.attn_q.weight" in err
    assert not out.exists()


# -------------------------------------------------------------------------------- against llama.cpp's tools


def _keys(path: Path) -> dict[str, tuple[str, object]]:
    r = gguf.GGUFReader(path)
    return {f.name: (f.types[0].name if f.types else "", f.contents()) for f in r.fields.values()
            if not f.name.startswith("GGUF.")}


def assert_same_as_llama_quantize(ours: Path, ref: Path) -> int:
    """Every tensor's type and bytes and every key equal; returns how many tensors were compared."""
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(ref)
    ref_t = {t.name: t for t in b.tensors}
    assert sorted(t.name for t in a.tensors) == sorted(ref_t)
    for t in a.tensors:
        r = ref_t[t.name]
        assert t.tensor_type == r.tensor_type, (t.name, t.tensor_type.name, r.tensor_type.name)
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                              np.asarray(r.data).view(np.uint8).reshape(-1)), t.name
    assert _keys(ours) == _keys(ref)
    return len(a.tensors)


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory) -> dict[str, Path]:
    """Our f32 GGUF of the Llama fixture and llama-imatrix's matrices for it, in both formats."""
    if find_tool("llama-imatrix") is None:
        pytest.skip("llama-imatrix not built (scripts/build_llama_tools.sh)")
    root = tmp_path_factory.mktemp("imatrix")
    f32 = root / "f32.gguf"
    assert main([str(FIXTURE), "--to", "gguf:f32", "-o", str(f32), "-q"]) == 0
    text = root / "text.txt"
    text.write_text(TEXT)
    common = ["-m", f32, "-f", text, "-c", "64", "--chunks", "4", "-t", "1", "--no-ppl"]
    run_tool("llama-imatrix", *common, "-o", root / "imatrix.gguf")
    run_tool("llama-imatrix", *common, "--output-format", "dat", "-o", root / "imatrix.dat")
    return {"f32": f32, "gguf": root / "imatrix.gguf", "dat": root / "imatrix.dat"}


@needs_tools
@pytest.mark.parametrize("fmt", ["gguf", "dat"])
@pytest.mark.parametrize("mix", MIXES)
def test_quantization_with_an_importance_matrix_equals_llama_quantize(tool_files, tmp_path, monkeypatch, mix, fmt):
    monkeypatch.chdir(tool_files["f32"].parent)  # the same file name string for both (quantize.imatrix.file)
    imatrix = tool_files[fmt].name
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    assert main([str(FIXTURE), "--to", f"gguf:{mix}", "--imatrix", imatrix, "-o", str(ours), "-q"]) == 0
    run_tool("llama-quantize", "--imatrix", imatrix, tool_files["f32"], ref, mix.upper(), "1")
    assert assert_same_as_llama_quantize(ours, ref) > 0
    assert gguf.GGUFReader(ours).get_field("quantize.imatrix.entries_count").contents() == len(
        read_imatrix(tool_files[fmt]).entries)


@needs_tools
@pytest.mark.parametrize("option", [["--include-weights", "attn"], ["--exclude-weights", "ffn_down"],
                                    ["--include-weights", "blk.1.", "--include-weights", "output"]])
def test_include_and_exclude_weights_equal_llama_quantize(tool_files, tmp_path, monkeypatch, option):
    monkeypatch.chdir(tool_files["f32"].parent)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "--imatrix", "imatrix.gguf", *option, "-o", str(ours),
                 "-q"]) == 0
    run_tool("llama-quantize", "--imatrix", "imatrix.gguf", *option, tool_files["f32"], ref, "Q4_K_M", "1")
    assert_same_as_llama_quantize(ours, ref)


def _moe_imatrix(f32: Path, path: Path, seed: int = 1) -> Path:
    """A random importance matrix for every quantized weight of a MoE GGUF (one row per expert)."""
    rng = np.random.default_rng(seed)
    entries = {}
    for t in gguf.GGUFReader(f32).tensors:
        if t.name.endswith(".weight") and len(t.shape) >= 2 and "norm" not in t.name and "gate_inp" not in t.name:
            n_mat = int(t.shape[2]) if len(t.shape) == 3 else 1
            entries[t.name] = ((rng.random((n_mat, int(t.shape[0]))) * 10).astype(np.float32),
                               rng.integers(0, 5, n_mat))
    return write_gguf_imatrix(path, entries, datasets=("moe.txt",), chunks=2)


@pytest.mark.skipif(find_tool("llama-quantize") is None, reason="llama-quantize not built")
@pytest.mark.parametrize("mix", ["q4_k_m", "q4_0", "iq4_xs"])
def test_expert_tensors_take_their_experts_rows_as_llama_quantize(tmp_path, monkeypatch, mix):
    monkeypatch.chdir(tmp_path)
    f32 = tmp_path / "f32.gguf"
    assert main([str(MOE), "--to", "gguf:f32", "-o", str(f32), "-q"]) == 0
    _moe_imatrix(f32, tmp_path / "moe.gguf")
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    # (a chunk of the writer holds several experts' rows: it is cut at their boundaries)
    assert main([str(MOE), "--to", f"gguf:{mix}", "--imatrix", "moe.gguf", "-o", str(ours), "-q"]) == 0
    run_tool("llama-quantize", "--imatrix", "moe.gguf", f32, ref, mix.upper(), "1")
    assert_same_as_llama_quantize(ours, ref)


def test_an_importance_matrix_of_another_model_is_refused(tmp_path, capsys):
    m = write_gguf_imatrix(tmp_path / "other.gguf", {"blk.0.attn_q.weight": (np.ones((1, 256)), np.ones(1)),
                                                     "blk.7.attn_q.weight": (np.ones((1, 256)), np.ones(1))})
    out = tmp_path / "o.gguf"
    assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "--imatrix", str(m), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'blk.7.attn_q.weight': IMX-003" in err[0] and "another model" in err[0]
    s = write_gguf_imatrix(tmp_path / "size.gguf", {"blk.0.attn_q.weight": (np.ones((1, 128)), np.ones(1))})
    assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "--imatrix", str(s), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "IMX-003" in err and "expected '256 x 1 = 256 values for shape [256, 256]', found '128'" in err
    assert not out.exists()


def test_dry_run_marks_the_tensors_with_rows_and_notes_the_matrix(tmp_path, capsys):
    m = write_gguf_imatrix(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (np.ones((1, 256)), np.ones(1))})
    assert main([str(FIXTURE), "--to", "gguf:q4_k_m", "--imatrix", str(m), "--dry-run"]) == 0
    text = capsys.readouterr().out
    marked = [line for line in text.splitlines() if "[imatrix]" in line]
    assert len(marked) == 1 and "blk.0.attn_q.weight" in marked[0]
    assert f"importance matrix {m}: 1 of 16 quantized tensors (without: " in text


@pytest.mark.parametrize(("name", "parts"), [
    ("IQ2_XXS", ["'gguf:iq2_xxs'", "IQ2_XXS encoders, which this build does not have and an importance matrix",
                 "llama-quantize refuses it without --imatrix"]),
    ("iq3_xxs", ["IQ3_XXS/IQ3_S encoders", "llama-quantize refuses it without --imatrix"]),
    ("iq3_m", ["IQ3_S encoders, which this build does not have:"]),
])
def test_iq1_iq2_iq3_types_are_refused_saying_why(tmp_path, capsys, name, parts):
    from convert.gguf.types import parse_output_type
    from formats.errors import GgufTypeError

    with pytest.raises(GgufTypeError, match="GGUF-002 GGUF output type not supported"):
        parse_output_type(name)
    with pytest.raises(SystemExit) as ei:
        main([str(FIXTURE), "--to", f"gguf:{name}", "-o", str(tmp_path / "o.gguf")])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    for p in parts:
        assert p in err, (p, err)
    if "iq3_m" in name:
        assert "importance matrix" not in err
    assert not (tmp_path / "o.gguf").exists()


def test_only_regular_files_of_a_bounded_size_are_read(tmp_path):
    import os

    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # (opening it would wait for a writer forever)
    for path, found in ((fifo, "a FIFO (named pipe)"), (tmp_path, "directory")):
        with pytest.raises(ImatrixFormatError, match="IMX-001 the importance matrix is not a regular file.*"
                                                     + re.escape(found)):
            read_imatrix(path)
    big = tmp_path / "big.dat"
    with open(big, "wb") as f:
        f.truncate((8 << 30) + 1)  # sparse
    with pytest.raises(ImatrixFormatError, match="larger than any llama-imatrix writes"):
        read_imatrix(big)
    # an entry claiming more values than the file holds: refused before anything is allocated
    lie = tmp_path / "lie.dat"
    lie.write_bytes(struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 2**31 - 1) + b"\0" * 64)
    with pytest.raises(ImatrixFormatError, match="ends inside entry 1's values"):
        read_imatrix(lie)


def test_values_too_large_for_the_searches_are_refused(tmp_path):
    huge = write_gguf_imatrix(tmp_path / "huge.gguf", {"blk.0.attn_q.weight": (np.full((1, 256), 3e38), np.ones(1))})
    with pytest.raises(ImatrixValuesError, match=r"IMX-002 an importance value .* larger than squared activations"):
        load_importance(huge)
    ok = write_gguf_imatrix(tmp_path / "ok.gguf", {"blk.0.attn_q.weight": (np.full((1, 256), 3e30), np.full(1, 1e18))})
    assert load_importance(ok) is not None  # (3e30 / 1e18: an ordinary value)
    many = write_gguf_imatrix(tmp_path / "many.gguf", {"blk.0.attn_q.weight": (np.ones((1, 256)), np.full(1, 3e38))})
    with pytest.raises(ImatrixValuesError, match="IMX-002 an importance matrix count is not finite or too large"):
        read_imatrix(many)


def test_datasets_that_are_not_strings_are_not_written(tmp_path):
    p = write_gguf_imatrix(tmp_path / "n.gguf", {"a.weight": (np.ones((1, 4)), np.ones(1))}, datasets=(1, 2))
    imp = load_importance(p)
    assert imp is not None and imp.datasets == ()
    assert "quantize.imatrix.dataset" not in [k for k, _, _ in imatrix_keys(imp)]
