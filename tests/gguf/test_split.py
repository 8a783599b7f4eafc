"""``--split-max-size`` / ``--split-max-tensors``: a GGUF written as the parts ``llama-gguf-split --split``
makes of our own single file (each part byte for byte), loaded by llama.cpp from the first part, refused
with USE-001 where the options do not fit, and committed all together or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from convert.cli import main
from convert.gguf.split import plan_split
from convert.gguf.types import parse_split_size
from convert.options import ConvertOptions
from convert.output import DISK_HEADROOM, TMP_MARK
from formats.errors import GgufVerificationError, UsageError
from formats.safetensors import SafetensorsReader
from tests.helpers.fixtures import MODELS, ROOT
from tests.helpers.gguf import REF, decoder_layers, llama_logits, make_gemma
from tests.helpers.llama_tools import llama_tool, run_tool

LLAMA = MODELS / "llama_nf4_dq"


def _convert(src: Path, to: str, out: Path, *extra: str) -> None:
    assert main([str(src), "--to", to, "-o", str(out), "-q", "--threads", "1", *extra]) == 0


def _files(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def wide_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 Gemma (tied embeddings: token_embd, 1000 x 64, is the first tensor) whose FFN matrices
    (4096 x 64: 1,048,576 bytes in F32) are larger than ``--split-max-size 1M`` while the first tensor is
    not."""
    root = tmp_path_factory.mktemp("wide") / "gemma-wide"
    make_gemma(root)
    cfg = json.loads((root / "config.json").read_text())
    cfg["intermediate_size"] = 4096
    (root / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(3)
    w = {"model.embed_tokens.weight": (rng.standard_normal((1000, 64)) * 0.1).astype(np.float32)}
    w.update(decoder_layers(rng, cfg, bias=False, norm_center=0.0, std=0.15))
    save_file(w, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def singles(tmp_path_factory: pytest.TempPathFactory, wide_gemma: Path):
    """(model, type) -> our single-file GGUF of it, made once."""
    made: dict[tuple[str, str], Path] = {}
    base = tmp_path_factory.mktemp("single")

    def single(model: str, to: str) -> Path:
        if (model, to) not in made:
            src = wide_gemma if model == "gemma_wide" else MODELS / model
            made[model, to] = base / f"{model}-{to}.gguf"
            _convert(src, f"gguf:{to}", made[model, to])
        return made[model, to]

    return single


CASES = [
    ("llama_nf4_dq", "f16", "--split-max-tensors", "1", 21),
    ("llama_nf4_dq", "f16", "--split-max-tensors", "4", 6),
    ("llama_nf4_dq", "f16", "--split-max-tensors", "21", 1),  # as many as the file has: one part
    ("llama_nf4_dq", "f16", "--split-max-tensors", "1000", 1),
    ("llama_nf4_dq", "f16", "--split-max-size", "1M", 5),
    ("llama_nf4_dq", "f16", "--split-max-size", "2M", 3),
    ("llama_nf4_dq", "f16", "--split-max-size", "1G", 1),
    ("llama_nf4_dq", "q4_k_m", "--split-max-tensors", "7", 3),
    ("llama_nf4_dq", "q4_k_m", "--split-max-size", "1M", 2),
    ("qwen3_moe_nf4_dq", "q4_k_m", "--split-max-tensors", "5", 6),
    ("qwen3_moe_nf4_dq", "f16", "--split-max-size", "1M", 5),
    ("mixtral_nf4_dq", "f16", "--split-max-tensors", "3", 8),
    ("gemma_wide", "f32", "--split-max-size", "1M", 9),  # each 1 MiB FFN matrix alone in a part, over the limit
    ("gemma_wide", "f16", "--split-max-size", "1M", 6),
]


@pytest.mark.parametrize(("model", "to", "flag", "value", "count"), CASES)
def test_parts_are_byte_identical_with_llama_gguf_split(tmp_path: Path, singles, wide_gemma: Path, model: str,
                                                        to: str, flag: str, value: str, count: int) -> None:
    llama_tool("llama-gguf-split")
    single = singles(model, to)
    (tmp_path / "tool").mkdir()
    run_tool("llama-gguf-split", "--split", flag, value, single, tmp_path / "tool" / "m")
    want = _files(tmp_path / "tool")
    src = wide_gemma if model == "gemma_wide" else MODELS / model
    _convert(src, f"gguf:{to}", tmp_path / "ours" / "m.gguf", flag, value)
    got = _files(tmp_path / "ours")
    assert list(got) == [f"m-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    assert got == want
    # every part says where it belongs; only the first carries the model's metadata
    for i, name in enumerate(got):
        r = gguf.GGUFReader(tmp_path / "ours" / name)
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == count
        assert r.fields["split.tensors.count"].contents() == len(gguf.GGUFReader(single).tensors)
        assert (r.get_field("general.architecture") is not None) == (i == 0)
    if model == "gemma_wide" and to == "f32":  # tensors larger than the limit get a part of their own
        big = [n for n in got if any(t.n_bytes > 10**6 for t in gguf.GGUFReader(tmp_path / "ours" / n).tensors)]
        assert big and all(len(gguf.GGUFReader(tmp_path / "ours" / n).tensors) == 1 for n in big)


@pytest.mark.parametrize("to", ["f16", "q4_k_m"])
def test_llama_cpp_loads_the_first_part(tmp_path: Path, singles, to: str) -> None:
    """llama.cpp, given the first part, finds the others and computes the single file's logits bit for bit
    (and transformers' for the dequantized model, to F16's rounding)."""
    pytest.importorskip("llama_cpp")
    _convert(LLAMA, f"gguf:{to}", tmp_path / "m.gguf", "--split-max-tensors", "4")
    first = tmp_path / "m-00001-of-00006.gguf"
    assert len(list(tmp_path.iterdir())) == 6
    r = SafetensorsReader(REF / "logits.safetensors")
    ids = [int(i) for i in np.array(r.array("input_ids")).reshape(-1)]
    ref = np.array(r.array("logits_dequantized"), dtype=np.float32).reshape(len(ids), -1)
    got = llama_logits(first, ids, ref.shape[-1])
    assert np.array_equal(got, llama_logits(singles("llama_nf4_dq", to), ids, ref.shape[-1]))
    if to == "f16":
        assert float(np.abs(got - ref).max()) <= 0.03 and np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_a_first_tensor_over_the_size_limit_is_refused_as_llama_gguf_split_fails(
        tmp_path: Path, singles, capsys: pytest.CaptureFixture[str]) -> None:
    single = singles("llama_nf4_dq", "f32")  # output.weight, the first tensor: 1,024,000 bytes
    tool = subprocess.run([str(llama_tool("llama-gguf-split")), "--split", "--split-max-size", "1M", str(single),
                           str(tmp_path / "tool")], capture_output=True, text=True, timeout=300)
    assert tool.returncode != 0 and "0 tensors" in tool.stderr
    assert main([str(LLAMA), "--to", "gguf:f32", "-o", str(tmp_path / "m.gguf"), "--split-max-size", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for part in ("tensor 'output.weight'", "USE-001 --split-max-size is smaller than the file's first tensor",
                 "a limit of at least 1024000 bytes (2M)", "found '1000000 bytes'"):
        assert part in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (the tool wrote nothing either)
    from convert.job import convert

    with pytest.raises(UsageError) as exc:
        convert(ConvertOptions(str(LLAMA), to="gguf:f32", output=tmp_path / "m.gguf", split_max_size="1M"))
    assert exc.value.rule == "USE-001" and exc.value.tensor == "output.weight"


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("text", ["0M", "2", "2GB", "2.5G", "1K", "g", "G", "-5G", "2g", "", "99999999999G"])
def test_split_size_takes_llama_gguf_split_syntax_only(text: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_split_size(text)
    assert exc.value.rule == "USE-001"
    assert "--split-max-size takes a positive whole number of megabytes or gigabytes" in str(exc.value)


def test_split_size_units_are_decimal() -> None:
    assert parse_split_size("2G") == 2 * 10**9 and parse_split_size("500M") == 500 * 10**6
    assert parse_split_size("2147483647M") == (2**31 - 1) * 10**6


@pytest.mark.parametrize(("argv", "parts"), [
    (["--to", "bf16", "--split-max-size", "1G"], ["USE-001 --split-max-size splits a GGUF output and needs --to gguf",
                                                  "found '--to bf16'"]),
    (["--to", "nf4", "--split-max-tensors", "3"], ["USE-001 --split-max-tensors splits a GGUF output"]),
    (["--to", "gguf", "--split-max-size", "1G", "--split-max-tensors", "3"],
     ["USE-001 give either --split-max-size or --split-max-tensors, not both"]),
    (["--to", "gguf", "--split-max-tensors", "0"], ["USE-001 --split-max-tensors must be a positive whole number",
                                                    "found '0'"]),
    (["--to", "gguf", "--split-max-tensors", "-2"], ["USE-001 --split-max-tensors must be a positive whole number"]),
    (["--to", "gguf", "--split-max-size", "0G"], ["USE-001 --split-max-size takes a positive whole number",
                                                  "found '0G'"]),
    (["--to", "gguf", "--split-max-size", "-5G"], ["USE-001 --split-max-size takes a positive whole number"]),
    (["--to", "gguf", "--split-max-size", "5GiB"], ["USE-001", "expected 'N(M|G), N from 1 to 2147483647"]),
    (["--to", "gguf", "--split-max-size", "９M"], ["USE-001 --split-max-size takes a positive whole number"]),
    (["--to", "gguf", "--split-max-tensors", "many"], ["argument --split-max-tensors: invalid whole number: 'many'"]),
    (["--to", "gguf", "--split-max-tensors", "３"], ["argument --split-max-tensors: invalid whole number: '３'"]),
    (["--to", "gguf", "--split-max-tensors", "99999999999"], ["USE-001 --split-max-tensors must be a positive whole",
                                                             "from 1 to 2147483647 (a 32-bit integer"]),
])
def test_bad_split_options_are_usage_errors_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                            parts: list[str]) -> None:
    import convert.job

    monkeypatch.setattr(convert.job, "resolve_source", mock.Mock(side_effect=AssertionError("read the input")))
    try:
        code = main([str(LLAMA), "-o", str(tmp_path / "m.gguf"), *argv])
    except SystemExit as exc:  # (argparse's own refusal)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert-bnb: error: ")
    for part in parts:
        assert part in err
    assert list(tmp_path.iterdir()) == []


def test_library_options_are_checked_too(tmp_path: Path) -> None:
    from convert.run.single import check_options

    for kwargs, words in (({"to": "bf16", "split_max_tensors": 2}, "needs --to gguf"),
                          ({"to": "gguf", "split_max_tensors": 2, "split_max_size": 10**9}, "not both"),
                          ({"to": "gguf", "split_max_size": 0}, "must be a positive whole number"),
                          ({"to": "gguf", "split_max_tensors": True}, "must be a positive whole number")):
        with pytest.raises(UsageError, match=words):
            check_options(ConvertOptions(str(LLAMA), output=tmp_path / "m.gguf", **kwargs))
    check_options(ConvertOptions(str(LLAMA), to="gguf", split_max_size=1))  # one byte: every tensor its own part


def test_plan_split_follows_the_tools_rule_on_padded_sizes() -> None:
    """By size the parts hold tensor data padded to 32 bytes, the header not counted; a part is closed when
    the next tensor would pass the limit."""
    t = [SimpleNamespace(name=f"t{i}", shape=(n,), ggml_type=gguf.GGMLQuantizationType.I8, nbytes=n)
         for i, n in enumerate([40, 20, 30, 100, 1])]  # padded: 64, 32, 32, 128, 32
    layout = SimpleNamespace(arch_name="llama", metadata={}, tensors=t)
    counts = [len(p.tensors) for p in plan_split(layout, max_size=96)]
    assert counts == [2, 1, 1, 1]
    assert [len(p.tensors) for p in plan_split(layout, max_size=128)] == [3, 1, 1]
    assert [len(p.tensors) for p in plan_split(layout, max_tensors=2)] == [2, 2, 1]
    assert plan_split(layout) is None
    with pytest.raises(UsageError, match="smaller than the file's first tensor"):
        plan_split(layout, max_size=63)


# ----------------------------------------------------------------------------------------- the output


def test_default_name_gets_the_part_suffix(tmp_path: Path) -> None:
    """Without -o the parts are the default GGUF name with the part suffix (``NAME.gguf`` ->
    ``NAME-00001-of-00002.gguf``), next to SRC."""
    import shutil

    src = tmp_path / "llama-bnb-4bit"
    shutil.copytree(LLAMA, src, ignore=shutil.ignore_patterns("reference"))
    assert main([str(src), "--to", "gguf:f16", "-q", "--split-max-tensors", "11"]) == 0
    # the single file's default name (llama.cpp's naming convention, the bnb words dropped)
    stem = "Llama-2.0M-F16"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        "llama-bnb-4bit", f"{stem}-00001-of-00002.gguf", f"{stem}-00002-of-00002.gguf"])


def test_dry_run_shows_the_parts_with_their_exact_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    argv = [str(LLAMA), "--to", "gguf:f16", "-o", str(out), "--split-max-size", "2M"]
    assert main([*argv, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert list(tmp_path.iterdir()) == []
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sizes = {p.name: p.stat().st_size for p in sorted(tmp_path.iterdir())}
    assert list(sizes) == [p["file"] for p in plan["parts"]] and len(sizes) == 3
    assert [p["bytes"] for p in plan["parts"]] == list(sizes.values())
    assert sum(p["tensors"] for p in plan["parts"]) == len(plan["tensors"]) == 21
    assert plan["output"] == str(tmp_path / "m-00001-of-00003.gguf") and plan["output_exists"] is False
    for i, p in enumerate(plan["parts"]):
        assert (f"  part {i + 1} of 3: {p['file']}: {p['tensors']} tensors ({p['first']} ... {p['last']}), "  # (> 1)
                f"{p['bytes']} bytes") in text
    assert f"  output: {tmp_path / 'm-00001-of-00003.gguf'}\n" in text
    # --json lists every part with its size and sha256
    assert result["output"] == plan["output"] and result["gguf"]["parts"] == plan["parts"]
    assert result["files"] == {n: {"bytes": b, "sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}
                               for n, b in sizes.items()}
    assert result["bytes_out"] == sum(sizes.values()) and result["shards_written"] == 3
    assert main([*argv, "--dry-run"]) == 0
    assert "(exists: --overwrite needed)" in capsys.readouterr().out


def test_disk_preflight_counts_every_parts_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--to", "gguf:f16", "-q", "--split-max-tensors", "4"]
    first = tmp_path / "first"
    assert main([str(LLAMA), "-o", str(first / "m.gguf"), *argv]) == 0
    size = sum(p.stat().st_size for p in first.iterdir())
    assert len(list(first.iterdir())) == 6
    for free, code in ((size + DISK_HEADROOM, 0), (size + DISK_HEADROOM - 1, 2)):
        out = tmp_path / str(free) / "m.gguf"
        with mock.patch("convert.output.shutil.disk_usage", return_value=SimpleNamespace(free=free)):
            assert main([str(LLAMA), "-o", str(out), *argv]) == code
        err = capsys.readouterr().err
        assert ("OUT-002 not enough free disk space" in err) == bool(code)
        assert (f"expected '>= {size + DISK_HEADROOM} bytes free'" in err) == bool(code)
        assert len(list(out.parent.iterdir())) == (0 if code else 6)


def test_an_existing_part_is_refused_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(LLAMA), "--to", "gguf:f16", "-o", str(tmp_path / "m.gguf"), "-q", "--split-max-size", "2M"]
    other = tmp_path / "m-00002-of-00003.gguf"
    other.write_bytes(b"not mine")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"Failed to write '{other}': OUT-001 output exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name] and other.read_bytes() == b"not mine"
    assert main([*argv, "--overwrite"]) == 0
    assert len(list(tmp_path.iterdir())) == 3 and gguf.GGUFReader(other).fields["split.no"].contents() == 1


def test_the_output_in_another_layout_is_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A split of ``m.gguf`` into 3 parts, then into 2, then not split, then into 2 again: each earlier layout is
    the output existing (OUT-001, naming its first file, nothing written) and an --overwrite removes its files once
    the new ones are in place (no part of another count is left beside them)."""
    out = tmp_path / "m.gguf"
    base = [str(LLAMA), "--to", "gguf:q8_0", "-o", str(out), "-q"]
    three = ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    steps = [(["--split-max-tensors", "8"], three),
             (["--split-max-tensors", "12"], ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]),
             ([], ["m.gguf"]),
             (["--split-max-tensors", "12"], ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"])]
    assert main([*base, *steps[0][0]]) == 0
    for (argv, names), (_, before) in zip(steps[1:], steps[:-1], strict=True):
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err == (f"convert-bnb: error: Failed to write '{tmp_path / before[0]}': OUT-001 output exists. Hint: "
                       "pass --overwrite to replace it, or choose -o\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        assert main([*base, *argv, "--overwrite"]) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert main([*base, *steps[1][0], "--dry-run"]) == 0  # (its own layout: exists as it is)
    first = tmp_path / "m-00001-of-00002.gguf"
    assert capsys.readouterr().out.endswith(f"output: {first} (exists: --overwrite needed)\n")
    assert main([*base, *steps[0][0], "--dry-run"]) == 0  # (another layout: the output exists all the same)
    assert capsys.readouterr().out.endswith("(exists: --overwrite needed)\n")
    assert main([*base, *steps[0][0], "--dry-run", "--overwrite"]) == 0
    assert capsys.readouterr().out.endswith("(exists: --overwrite replaces it)\n")


# ----------------------------------------------------------------------------------------- all or nothing


def test_a_failure_on_a_later_part_leaves_no_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Part 3 of 5 cannot be written (a full disk): the run ends with OUT-002 naming the output, and neither
    the two parts already written nor any temporary is left."""
    import errno

    import formats.gguf as fg

    opened: list[str] = []
    real_init = fg.GGUFFileWriter.__init__

    def init(self, path, layout):
        opened.append(os.path.basename(path))
        if "-00003-of-" in os.fspath(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_init(self, path, layout)

    monkeypatch.setattr(fg.GGUFFileWriter, "__init__", init)
    out = tmp_path / "m.gguf"
    assert main([str(LLAMA), "--to", "gguf:f16", "-o", str(out), "-q", "--split-max-size", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OUT-002 the disk filled up while the output was written" in err
    assert f"'{tmp_path / 'm-00001-of-00005.gguf'}'" in err
    assert opened == [f"m-0000{i}-of-00005.gguf" for i in (1, 2, 3)]
    assert list(tmp_path.iterdir()) == []


def test_a_later_part_failing_verification_leaves_no_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import convert.gguf.target as target

    real = target._verify_gguf
    checked: list[str] = []

    def verify(path, layout):
        checked.append(Path(path).name)
        if "-00002-of-" in Path(path).name:
            raise GgufVerificationError("tensor count differs", path=path, expected=4, found=3, action="verify")
        real(path, layout)

    monkeypatch.setattr(target, "_verify_gguf", verify)
    assert main([str(LLAMA), "--to", "gguf:f16", "-o", str(tmp_path / "m.gguf"), "-q", "--split-max-size", "2M"]) == 2
    assert "GGUF-008 tensor count differs" in capsys.readouterr().err
    assert checked == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf"]
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_while_writing_a_later_part_leaves_no_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import formats.gguf as fg

    real_end = fg.GGUFFileWriter.end_tensor
    ended = [0]

    def end_tensor(self):
        ended[0] += 1
        if ended[0] == 9:  # in the second part
            raise KeyboardInterrupt
        real_end(self)

    monkeypatch.setattr(fg.GGUFFileWriter, "end_tensor", end_tensor)
    assert main([str(LLAMA), "--to", "gguf:f16", "-o", str(tmp_path / "m.gguf"), "-q", "--split-max-tensors", "5"]) \
        == 130
    assert "interrupted; no output was left behind" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_one_part_is_open_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts are streamed one after the other (each through the single-file writer, closed and fsynced
    before the next is created): no more files open, nor buffers held, than for one file."""
    import formats.gguf as fg

    events: list[str] = []
    real_init, real_close = fg.GGUFFileWriter.__init__, fg.GGUFFileWriter.close

    def init(self, path, layout):
        events.append(f"open {Path(path).name}")
        real_init(self, path, layout)

    def close(self):
        events.append(f"close {Path(self.path).name}")
        real_close(self)

    monkeypatch.setattr(fg.GGUFFileWriter, "__init__", init)
    monkeypatch.setattr(fg.GGUFFileWriter, "close", close)
    _convert(LLAMA, "gguf:f16", tmp_path / "m.gguf", "--split-max-size", "2M", "--threads", "2")
    assert events == [f"{e} m-0000{i}-of-00003.gguf" for i in (1, 2, 3) for e in ("open", "close")]


#: The CLI ending at once (kill -9) right after the N-th part is renamed into place: argv[1] is N.
CRASH_AT_PART = """
import os, sys
calls = [0]
_replace = os.replace
def replace(a, b, **k):
    _replace(a, b, **k)
    if '.convert-bnb-tmp-' in os.fspath(a) and os.fspath(b).endswith('.gguf'):
        calls[0] += 1
        if calls[0] == int(sys.argv[1]):
            os._exit(9)
os.replace = replace
from convert.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_kill_between_the_part_renames_is_completed_by_the_next_run(tmp_path: Path) -> None:
    """The parts are renamed into place one by one after their list is written into the staging directory;
    killed after the first rename, the next run to the same output renames the others (and then applies its
    own rules: OUT-001, the output exists)."""
    want_dir = tmp_path / "want"
    _convert(LLAMA, "gguf:f16", want_dir / "m.gguf", "--split-max-size", "2M")
    want = _files(want_dir)
    out = tmp_path / "out" / "m.gguf"
    argv = [str(LLAMA), "--to", "gguf:f16", "-o", str(out), "-q", "--split-max-size", "2M", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CRASH_AT_PART, "1", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 9, r.stderr
    names = sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".convert-bnb-lock"))
    assert len(names) == 2 and names[1] == "m-00001-of-00003.gguf"
    assert names[0].startswith(f".m-00001-of-00003.gguf{TMP_MARK}")
    assert sorted(p.name for p in (out.parent / names[0]).iterdir()) == [
        ".convert-bnb-commit", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    r = subprocess.run([sys.executable, "-m", "convert", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr
    assert _files(out.parent) == want
