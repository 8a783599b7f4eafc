"""formats/jsonfile.py, the one bounded JSON loader (issue 12, classes 1 and 5): its limits on their own,
that real files load exactly as ``json.loads`` loads them, and that ``check`` and ``inspect`` stop on
hostile JSON with the same named error as the conversion (tests/helpers/malformed.py has one case per reader
and limit, run through the library and the CLI)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from convert.check import check_source
from convert.cli import main
from formats import errors as E
from formats import jsonfile
from formats.jsonfile import CONFIG, HEADER, INDEX, JOBS, MAX_DEPTH, QUANT_STATE, TOKENIZER, load_json_bytes
from tests.helpers.fixtures import FIXTURES, MODELS
from tests.helpers.malformed import BIG_INT, CASES, DEEP, Case, _two_shards, out_for

ALL_KINDS = [HEADER, INDEX, CONFIG, TOKENIZER, QUANT_STATE, JOBS]


def load(text: str | bytes, kind: jsonfile.JsonKind = CONFIG) -> object:
    raw = text.encode() if isinstance(text, str) else text
    return load_json_bytes(raw, kind, E.ConfigJsonError, "config.json", path="m/config.json")


def refused(text: str | bytes, kind: jsonfile.JsonKind = CONFIG) -> str:
    with pytest.raises(E.ConfigJsonError) as info:
        load(text, kind)
    message = str(info.value)
    assert message.startswith("Failed to read 'm/config.json': CKPT-007 config.json ") and "\n" not in message
    return message


def test_real_files_load_as_json_loads_does() -> None:
    files = [p for p in sorted(FIXTURES.rglob("*.json")) if p.stat().st_size < 64 << 20]
    assert len(files) > 20
    for p in files:
        raw = p.read_bytes()
        assert load(raw, TOKENIZER) == json.loads(raw), p


def test_depth_limit_is_exact_and_ignores_brackets_in_strings() -> None:
    assert load("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert load('{"a": [' * (MAX_DEPTH // 2) + "]}" * (MAX_DEPTH // 2)) is not None
    message = refused("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert "is nested too deeply (expected 'at most 256 levels', found 'level 257 at byte 256')" in message
    # brackets inside strings, escaped quotes and escaped backslashes do not count
    text = '{"a": "' + "[" * 1000 + '\\"' + "{" * 1000 + '", "b": "\\\\", "c": [[1]]}'
    assert load(text) == json.loads(text)
    # ...but a backslash-backslash closes the string, so what follows counts
    assert "found 'level 257 at byte" in refused('{"a": "\\\\", "b": ' + "[" * 300 + "]" * 300 + "}")
    # the byte offset is exact past escapes and across the 4 MiB chunks
    pad = '"' + "\\\\" * (3 << 20) + '"'
    message = refused("[" + pad + "," + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "]")
    assert f"found 'level 257 at byte {1 + len(pad) + 1 + MAX_DEPTH - 1}'" in message


def test_deep_input_never_recurses_and_stays_linear() -> None:
    for text in [DEEP, "{" * 100_000, '{"a":' * 500_000, "[" * 50_000 + '"' + "[" * 50_000]:
        assert "nested too deeply" in refused(text) or "not valid JSON" in refused(text)
    # 10x the input takes about 10x the time (never quadratic): 64 MiB of brackets, the worst case
    t0 = time.perf_counter()
    refused("[]" * (1 << 20) + "[" * 300, TOKENIZER)
    small = time.perf_counter() - t0
    t0 = time.perf_counter()
    refused("[]" * (10 << 20) + "[" * 300, TOKENIZER)
    big = time.perf_counter() - t0
    assert big < 40 * small + 5.0, (small, big)
    # an unterminated string full of escaped quotes (quadratic for a naive string regex)
    t0 = time.perf_counter()
    assert "not valid JSON" in refused('["' + '\\"[' * (5 << 20), TOKENIZER)
    assert time.perf_counter() - t0 < 20


def test_integer_digits() -> None:
    assert load('{"model_max_length": 1000000000000000019884624838656}') == {
        "model_max_length": 1000000000000000019884624838656}  # transformers' int(1e30): 31 digits
    assert load("[" + "9" * 100 + ", -" + "9" * 100 + "]") == [int("9" * 100), -int("9" * 100)]
    assert "found '101 digits (-11111111111...)'" in refused("[-" + "1" * 101 + "]")
    assert "found '5000 digits (111111111111...)'" in refused("[" + BIG_INT + "]")
    # floats have no digit limit in Python; a long one parses, a huge exponent is inf (judged by the readers)
    assert load("[1." + "5" * 5000 + ", 1e99999]") == [1.5555555555555556, float("inf")]
    assert "5000 digits" in refused('{"a": {"b": [1, 2, ' + BIG_INT + "]}}")  # anywhere


@pytest.mark.parametrize("kind", ALL_KINDS, ids=[k.name for k in ALL_KINDS])
def test_nan_and_infinity_per_kind(kind: jsonfile.JsonKind) -> None:
    for token in ("NaN", "Infinity", "-Infinity"):
        if kind.allow_nan:
            value = load(f"[{token}]", kind)
            assert isinstance(value, list) and str(value[0]) == str(float(token))
        else:
            assert f"holds {token}, which is not JSON (expected 'finite numbers', found '{token}')" in refused(
                f"[{token}]", kind)


def test_duplicate_keys_in_any_object() -> None:
    assert "has the key 'a' twice in one object (expected 'each key once', found 'twice')" in refused(
        '{"a": 1, "b": {"c": 1}, "a": 2}')
    assert "has the key 'c' twice" in refused('{"b": [{"c": 1, "c": 1}]}')
    assert load('{"a": {"a": {"a": 1}}}') == {"a": {"a": {"a": 1}}}  # the same key at other levels is fine


@pytest.mark.parametrize("text, key", [
    (r'{"a" : 1, "a":2}', "a"),            # a space before one colon
    ('{"a":{"b":1,"b"\n:2}}', "b"),        # a newline before the second
    (r'{"a\\":1,"a\\":2}', "a\\"),        # keys ending in an escaped backslash
    (r'{"q\"":1,"q\"":2}', 'q"'),          # keys holding an escaped quote
])
def test_duplicate_keys_whatever_the_spacing_and_escapes(text: str, key: str) -> None:
    """The loader parses without a per-object hook and compares the keys parsed with the keys in the
    text; a duplicate is still found (and named) with spaces before colons and escapes in the keys."""
    assert f"has the key {key!r} twice in one object" in refused(text)


@pytest.mark.parametrize("text", [r'{"x": "\":", "y": 1}', r'{"x": "a\" :", "y": [{"z": "\\"}]}'])
def test_strings_that_look_like_keys_are_not_counted(text: str) -> None:
    assert load(text) == json.loads(text)


@pytest.mark.parametrize("text", ["null", "3", '"a string"', "[]", "{}", '[1, "x", null]'])
def test_scalar_and_empty_documents_parse(text: str) -> None:
    """The duplicate-key count walks containers only: a document that is a scalar has no keys."""
    assert load(text) == json.loads(text)


def test_size_and_utf8() -> None:
    assert "is larger than the limit for a JSON QuantState (expected 'at most 1048576 bytes', " \
           "found '1048577 bytes')" in refused("{}".ljust((1 << 20) + 1), QUANT_STATE)
    assert load("{}".ljust(1 << 20), QUANT_STATE) == {}
    assert "is not valid UTF-8 (byte 7)" in refused(b'{"a": "\xff"}')
    assert "is not valid JSON (Expecting value: line 1 column 7 (char 6))" in refused('{"a": }')


def test_limits_fit_the_files_they_are_for() -> None:
    assert (HEADER.max_bytes, INDEX.max_bytes, CONFIG.max_bytes, TOKENIZER.max_bytes, QUANT_STATE.max_bytes,
            JOBS.max_bytes) == (100 << 20, 64 << 20, 16 << 20, 64 << 20, 1 << 20, 16 << 20)
    from formats.safetensors import MAX_HEADER_BYTES

    assert MAX_HEADER_BYTES == HEADER.max_bytes


def test_file_is_never_read_past_the_limit(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_bytes(b"{}" + b" " * (CONFIG.max_bytes + 100))
    with pytest.raises(E.ConfigJsonError) as info:
        jsonfile.load_json_file(p, CONFIG, E.ConfigJsonError, "config.json")
    assert f"found '{CONFIG.max_bytes + 102} bytes'" in str(info.value)


# --------------------------------------------------------------- check and inspect agree with the conversion

#: the cases whose SRC holds the hostile JSON (header, index, config, QuantState): ``check`` and ``inspect``
#: read the same files as the conversion and must stop with the same error
SRC_CASES = [c for c in CASES if c.id.startswith(("header-", "index-", "config-", "quant-state-"))
             and c.error.default_rule in ("ST-003", "CKPT-001", "CKPT-007", "BNB-009")
             and any(w in c.id for w in ("5000", "100k", "too-large", "nan", "twice"))]


def test_src_cases_cover_every_src_reader() -> None:
    assert {c.error.default_rule for c in SRC_CASES} == {"ST-003", "CKPT-001", "CKPT-007", "BNB-009"}
    assert len(SRC_CASES) == 13


@pytest.mark.parametrize("case", SRC_CASES, ids=[c.id for c in SRC_CASES])
def test_check_and_inspect_name_the_conversions_error(case: Case, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = case.build(tmp_path / "in")
    with pytest.raises(E.ConvertBnbError) as info:
        case.run(src, out_for(src, tmp_path))
    message = str(info.value)
    rep = check_source(src)
    assert [str(p) for p in rep.problems if p.rule == case.rule] == [message]
    capsys.readouterr()
    assert main(["check", str(src)]) == 2
    out = capsys.readouterr().out
    assert message in out.splitlines()
    assert main(["inspect", str(src)]) == 2
    err = capsys.readouterr().err
    assert err == f"convert-bnb: error: {message}\n"


# --------------------------------------------------------------------------------------- the Hub index


def test_hub_index_and_headers_are_bounded(tmp_path: Path) -> None:
    """The shard index fetched from the Hub to choose the shards goes through the same loader (CKPT-001):
    refused before any shard is downloaded. A header that huggingface_hub's metadata call cannot parse
    (the output estimate) is refused by our reader once downloaded (ST-003), never an internal error."""
    from tests.helpers.fakehub import FakeHub
    from tests.helpers.hubcache import commit_sha, offline_env, run_cli

    model = _two_shards(tmp_path / "src")
    index = model / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"weight_map": {', '"x": ' + DEEP + ', "weight_map": {'))
    hub = FakeHub()
    hub.add("org/deep-index", commit_sha("deep"), {p.name: p for p in model.iterdir()})
    # a safetensors header huggingface_hub's own metadata call (the output estimate) cannot parse
    for name, value in (("deep-header", DEEP), ("big-header", BIG_INT)):
        header = ('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "x": ' + value + "}").encode()
        header += b" " * (-len(header) % 8)
        hub.add(f"org/{name}", commit_sha(name), {"config.json": b"{}", "model.safetensors":
                                                  len(header).to_bytes(8, "little") + header + b"\0"})
    url = hub.start()
    try:
        env = offline_env(tmp_path, tmp_path / "hub")
        del env["HF_HUB_OFFLINE"]
        env.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
        for args in (["org/deep-index", "--to", "bf16", "-o", str(tmp_path / "o")], ["check", "org/deep-index"]):
            r = run_cli(args, env)
            assert r.returncode == 2, r.stderr
            text = r.stderr if args[0] != "check" else r.stdout
            assert "model.safetensors.index.json': CKPT-001 the index is nested too deeply" in text, text
            assert "internal error" not in r.stderr and "Traceback" not in r.stderr
        assert r.stderr == ""
        assert set(hub.full_downloads) == {"org/deep-index/model.safetensors.index.json"}  # no shard
        assert not (tmp_path / "o").exists()
        for name, part in (("deep-header", "nested too deeply"), ("big-header", "5000 digits")):
            r = run_cli([f"org/{name}", "--to", "bf16", "-o", str(tmp_path / name)], env)
            assert r.returncode == 2, r.stderr
            assert r.stderr.count("\n") == 1 and "model.safetensors': ST-003 header" in r.stderr, r.stderr
            assert part in r.stderr and not (tmp_path / name).exists()
    finally:
        hub.stop()


def test_hub_choose_weight_files_reads_through_the_loader(tmp_path: Path) -> None:
    from convert.hub.download import _load_index, choose_weight_files

    p = tmp_path / "model.safetensors.index.json"
    p.write_text('{"metadata": {"total_size": ' + BIG_INT + '}, "weight_map": {}}')
    with pytest.raises(E.IndexJsonError, match="5000 digits"):
        choose_weight_files(["model.safetensors.index.json"], lambda name: _load_index(tmp_path / name))


# ------------------------------------------------------------------------------------- YAML JOBS files


@pytest.mark.parametrize(("text", "part"), [("[" * 100_000 + "]" * 100_000, "BATCH-001"),
                                            ("- src: org/a\n  max_shard_size: " + BIG_INT + "\n", "BATCH-001")])
def test_yaml_jobs_file_hostile(text: str, part: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("yaml")
    p = tmp_path / "jobs.yaml"
    p.write_text(text)
    assert main(["batch", str(p), "--out-dir", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and part in err and "internal error" not in err, err


def test_real_model_directory_still_converts_clean() -> None:
    rep = check_source(MODELS / "llama_nf4_dq_sharded")
    assert rep.ok, [str(p) for p in rep.problems]


def test_a_duplicate_inside_an_entry_names_the_entry_not_a_tensor(tmp_path) -> None:
    """Only a key twice in the header object itself is a tensor named twice (ST-013); a key twice
    inside a tensor's entry is a malformed header (ST-003) naming the entry that holds it."""
    import struct

    from formats import errors as E
    from formats.safetensors import SafetensorsReader

    def header_file(text: str) -> str:
        raw = text.encode()
        raw += b" " * (-len(raw) % 8)
        path = tmp_path / "h.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
        return str(path)

    inner = '{"a": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}'
    with pytest.raises(E.HeaderJsonError) as exc:
        SafetensorsReader(header_file(inner))
    assert "has the key 'dtype' twice in one object (in the value of 'a')" in str(exc.value)
    top = '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], ' \
          '"data_offsets": [0, 4]}}'
    with pytest.raises(E.DuplicateTensorError) as dup:
        SafetensorsReader(header_file(top))
    assert dup.value.tensor == "a"
