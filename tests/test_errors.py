"""Every rule of docs/errors.md on a hand-made malformed input: the exact class, the key parts of the
message, exit code 2 with exactly one line on stderr, nothing left behind, the input untouched."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest

from convert.check import check_source
from convert.cli import main
from formats import errors as E
from tests.helpers.fixtures import MODELS, ROOT, SINGLE
from tests.helpers.malformed import (
    CASES,
    VN,
    Case,
    W,
    f32,
    layer,
    model_dir,
    one_file,
    out_for,
    st_bytes,
    with_state,
    write,
)


def tree_hash(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    if out.parent.exists():
        assert [p.name for p in out.parent.iterdir()] == []


def test_every_rule_has_a_case() -> None:
    assert sorted(E.all_rules()) == sorted({c.rule for c in CASES})


def test_one_class_per_rule_with_builtin_parents() -> None:
    rules = E.all_rules()
    assert len(set(rules.values())) == len(rules)
    families = {"ST": E.SafetensorsError, "CKPT": E.CheckpointError, "BNB": E.BnbLayerError}
    for rule, cls in rules.items():
        assert cls.advice, rule
        if rule.split("-")[0] in families:
            assert issubclass(cls, families[rule.split("-")[0]]) and issubclass(cls, ValueError), rule
    assert issubclass(E.SourceNotFoundError, FileNotFoundError)
    assert issubclass(E.DiskSpaceError, OSError) and issubclass(E.OutputExistsError, FileExistsError)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = case.build(tmp_path / "in")
    out = out_for(src, tmp_path)
    before = tree_hash(src)
    with pytest.raises(E.ConvertBnbError) as info:
        case.run(src, out)
    exc = info.value
    assert type(exc) is case.error
    assert exc.rule == case.rule
    message = str(exc)
    for part in case.parts:
        assert part in message, f"{part!r} not in {message!r}"
    assert "\n" not in message
    assert_nothing_left(out)
    assert tree_hash(src) == before
    if case.argv is None:
        return
    capsys.readouterr()
    argv = [a.replace("{src}", str(src)).replace("{out}", str(out)) for a in case.argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n")
    assert err.startswith("convert-bnb: error: ")
    if case.same_message:
        assert err == f"convert-bnb: error: {message}\n"
    else:
        assert f" {case.rule} " in err
    assert_nothing_left(out)
    assert tree_hash(src) == before


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    src = one_file(with_state(layer(), blocksize=48))(tmp_path)
    with pytest.raises(E.BlocksizeError):
        main([str(src), "-o", str(tmp_path / "o.safetensors"), "--debug"])


@pytest.mark.parametrize(("exc", "code", "line"), [
    (RuntimeError("boom"), 1, "convert-bnb: internal error: RuntimeError: boom. This is a bug; please report it with "
                              "the output of the same command plus --debug."),
    (MemoryError("cannot map 68157440 bytes for a chunk"), 2,
     "convert-bnb: error: out of memory (cannot map 68157440 bytes for a chunk): try a lower --max-memory or fewer "
     "--threads"),
], ids=["internal-error", "out-of-memory"])
def test_unexpected_exception_and_out_of_memory_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str], exc: Exception,
                                                             code: int, line: str) -> None:
    """An unexpected exception is a bug (exit 1, asking for a report); running out of memory is the
    environment's (exit 2, naming the caps to lower). One line each, no output left."""
    import convert.run.single

    def fail(*a: object, **k: object) -> None:
        raise exc

    monkeypatch.setattr(convert.run.single, "make_plan", fail)
    src = one_file(layer())(tmp_path)
    assert main([str(src), "-o", str(tmp_path / "o.safetensors")]) == code
    assert capsys.readouterr().err == line + "\n"
    assert not (tmp_path / "o.safetensors").exists()


def test_hostile_tensor_name_stays_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "evil\nname\r"
    src = write(tmp_path / "m.safetensors",
                st_bytes({name + ".absmax": ("F32", [1], f32([1]))}))
    assert main([str(src), "-o", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BNB-010" in err and "'evil\\nname\\r.absmax'" in err


# ------------------------------------------------------------------------------------------ check


def test_check_clean_fixtures(capsys: pytest.CaptureFixture[str]) -> None:
    for src in [MODELS / "llama_nf4_dq", MODELS / "llama_nf4_dq_sharded", MODELS / "llama_fp4_nodq",
                MODELS / "llama_nf4_dq_bin",
                MODELS / "llama_int8", SINGLE / "nf4_bs32_dq_bfloat16_37x51_normal.q.safetensors"]:
        assert main(["check", str(src)]) == 0
        out = capsys.readouterr().out
        assert out.strip().endswith(")") and ": OK (" in out
    rep = check_source(MODELS / "llama_nf4_dq_sharded")
    assert (rep.files, rep.tensors, rep.layers_4bit, rep.plain) == (4, 91, 14, 7)


def _many_problems(root: Path) -> Path:
    """A directory with eight problems of different kinds, in different files."""
    a = {**with_state(layer(prefix="a.weight"), blocksize=48, prefix="a.weight"),  # BNB-002
         **layer(prefix="b.weight", seed=2)}
    b_abs = "b.weight.absmax"
    a[b_abs] = ("F32", [2], f32([1.0, float("inf")]))  # BNB-012
    c = {**layer(prefix="c.weight", nested=True), "c.weight.nested_quant_map": ("F32", [1], f32([0]))}  # BNB-007
    c["d.weight.absmax"] = ("F32", [1], f32([1]))  # BNB-010
    index = {"weight_map": {**{k: "model-00001-of-00003.safetensors" for k in a},
                            **{k: "model-00002-of-00003.safetensors" for k in c},
                            "e.weight": "model-00003-of-00003.safetensors",  # CKPT-002: shard missing
                            "f.weight": "model-00002-of-00003.safetensors"}}  # CKPT-003
    root = model_dir(root, {"model-00001-of-00003.safetensors": a, "model-00002-of-00003.safetensors": c},
                     index=index, config="[]")  # CKPT-007
    # ST-005 and ST-006 in a fourth file that the index does not name: CKPT-004 (and it is not opened)
    write(root / "model-00004-of-00004.safetensors", b"junk")
    return root


def test_check_reports_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _many_problems(tmp_path / "m")
    before = tree_hash(root)
    rep = check_source(root)
    rules = sorted(p.rule or "" for p in rep.problems)
    assert rules == sorted(["CKPT-007", "CKPT-004", "CKPT-002", "CKPT-003", "BNB-002", "BNB-012", "BNB-007",
                            "BNB-010"])
    assert rep.layers_4bit == 0 and not rep.ok
    assert main(["check", str(root)]) == 2
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 9 and text[-1].startswith(f"{root}: 8 problems")
    assert main(["check", str(root), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False
    assert sorted(p["rule"] for p in data["problems"]) == rules
    bnb12 = next(p for p in data["problems"] if p["rule"] == "BNB-012")
    assert bnb12["error"] == "NonFiniteAbsmaxError" and bnb12["tensor"] == "b.weight.absmax"
    assert bnb12["found"].startswith("inf at block 1")
    assert tree_hash(root) == before
    assert sorted(p.name for p in root.iterdir()) == sorted(before and [Path(k).name for k in before])


def test_check_reports_every_bad_entry_of_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [-1], "data_offsets": [16, 20]},
              "c": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]},
              "d": {"dtype": "F32", "shape": [2], "data_offsets": [24, 28]}}
    from tests.helpers.malformed import header_bytes

    src = write(tmp_path / "x.safetensors", header_bytes(header) + b"\0" * 28)
    assert main(["check", str(src), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [(p["rule"], p["tensor"]) for p in data["problems"]] == [("ST-005", "a"), ("ST-006", "b"),
                                                                    ("ST-008", "d")]
    assert data["tensors"] == 1  # 'c' is valid


def test_check_overlapping_entry_is_one_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry whose span overlaps its neighbour and runs on is ST-009; the bytes it claims are no 'gap'
    before the next tensor (that was a second problem, ST-012, against an undamaged tensor). A real gap
    after it is still one."""
    from tests.helpers.malformed import header_bytes

    def check(header: dict) -> list[tuple[str, str]]:
        src = write(tmp_path / "x.safetensors", header_bytes(header) + b"\0" * 24)
        assert main(["check", str(src), "--json"]) == 2
        return [(p["rule"], p["tensor"]) for p in json.loads(capsys.readouterr().out)["problems"]]

    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    c = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
    assert check({"a": a, "b": {"dtype": "F32", "shape": [5], "data_offsets": [4, 24]}, "c": c}) == [("ST-009", "b")]
    c_later = {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}
    assert check({"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, "c": c_later}) == [
        ("ST-009", "b"), ("ST-012", "c")]


def test_check_of_a_truncated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated file is one problem (ST-010), not a valid file; its tensors whose bytes are present still
    count (the summary said "valid: 1 file"); a cut inside the last QuantState leaves its weight to a note
    (it was a second problem, BNB-011)."""
    src = (MODELS / "llama_nf4_dq" / "model.safetensors").read_bytes()
    path = write(tmp_path / "model.safetensors", src[:300_000])
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "ST-010" in out and out.splitlines()[-1].endswith("1 problem (valid: 0 files, 42 tensors, 0 4-bit layers, "
                                                             "0 int8 layers, 0 plain tensors)")
    write(path, src[:-1])  # the last byte of the last QuantState
    assert main(["check", str(path)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "BNB-" in line] == []
    assert "note: 1 4-bit weights in a damaged file whose QuantState is missing from it were not checked" in lines
    assert lines[-1].endswith("1 problem (valid: 0 files, 90 tensors, 13 4-bit layers, 0 int8 layers, 7 plain tensors)")
    assert main(["check", str(MODELS / "llama_nf4_dq")]) == 0
    assert "OK (1 file, 91 tensors, 14 4-bit layers" in capsys.readouterr().out


def test_check_of_a_damaged_shard_reports_the_damage_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated shard, or a bad entry in one, is its own problem; the index's names that its reader left out
    follow from it and are not reported again (they were: one CKPT-003 'absent' per tensor)."""
    import shutil

    root = tmp_path / "m"
    shutil.copytree(MODELS / "llama_nf4_dq_sharded", root)
    last = sorted(root.glob("*.safetensors"))[-1]
    good = last.read_bytes()
    last.write_bytes(good[:200_000])
    assert main(["check", str(root), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [p["rule"] for p in data["problems"]] == ["ST-010"] and data["files"] == 3
    header_len = int.from_bytes(good[:8], "little")
    i = good.index(b'"dtype"', good.index(b"model.norm.weight")) + 9
    assert good[i:i + 4] == b"BF16" and i < 8 + header_len
    last.write_bytes(good[:i] + b"Q999" + good[i + 4:])
    assert main(["check", str(root), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [(p["rule"], p["tensor"]) for p in data["problems"]] == [("ST-005", "model.norm.weight")]
    assert (data["files"], data["tensors"], data["plain"]) == (3, 90, 6)


def test_check_missing_source_and_not_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope")]) == 2
    assert "CKPT-010" in capsys.readouterr().out
    src = write(tmp_path / "model.safetensors", b"version https://git-lfs.github.com/spec/v1\noid x\n")
    assert main(["check", str(src)]) == 2
    assert "ST-004" in capsys.readouterr().out


def test_check_nested_layer_ok(tmp_path: Path) -> None:
    rep = check_source(one_file(VN)(tmp_path))
    assert rep.ok and rep.layers_4bit == 1, [str(p) for p in rep.problems]
    assert W in VN


def test_check_int8_scb_not_finite_and_layer_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = "model.layers.0.mlp.up_proj"
    bf16_absmax = layer(prefix="b.weight")
    bf16_absmax["b.weight.absmax"] = ("BF16", [2], b"\x80\x3f\x00\x40")  # 1.0, 2.0 as bfloat16
    src = one_file({f"{p}.weight": ("I8", [2, 2], bytes(4)), f"{p}.SCB": ("F32", [2], f32([1, float("nan")])),
                    **bf16_absmax})(tmp_path)
    assert main(["check", str(src), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert [(p_["rule"], p_["tensor"], p_["found"]) for p_ in data["problems"]] == [
        ("BNB-012", f"{p}.SCB", "nan at row 1")]
    assert data["layers_4bit"] == 1 and data["layers_int8"] == 0
    assert len(data["notes"]) == 1 and "absmax is stored as bfloat16" in data["notes"][0]


def test_check_on_a_truncated_file_names_the_cause_not_its_follow_ons(tmp_path: Path) -> None:
    whole = (MODELS / "llama_nf4_dq/model.safetensors").read_bytes()
    src = write(tmp_path / "model.safetensors", whole[:500_000])
    rep = check_source(src)
    assert [p.rule for p in rep.problems] == ["ST-010"]
    assert any("not checked" in n for n in rep.notes)


@pytest.mark.parametrize("case_id", ["nested-absmax-inf", "truncated", "quant-map-15-values", "config-nested-100k",
                                     "quant-state-shape-5000-digits"])
def test_cli_in_a_subprocess_prints_exactly_one_line(case_id: str, tmp_path: Path) -> None:
    """Through the real console entry point: no warning or traceback text around the one line."""
    import subprocess
    import sys

    case = {c.id: c for c in CASES}[case_id]
    src = case.build(tmp_path / "in")
    out = out_for(src, tmp_path)
    argv = [a.replace("{src}", str(src)).replace("{out}", str(out)) for a in (case.argv or ["{src}", "-o", "{out}"])]
    r = subprocess.run([sys.executable, "-m", "convert", *argv], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("convert-bnb: error: "), r.stderr
    assert_nothing_left(out)


def test_os_errors_are_one_line_naming_the_users_path() -> None:
    import errno

    from convert.cli import _os_message

    msg = _os_message(PermissionError(errno.EACCES, "Permission denied", "/x/ro/.out.convert-bnb-tmp-123"))
    assert msg == "Failed to use '/x/ro/out': Permission denied (errno 13). Hint: check the permissions"
    assert _os_message(OSError(errno.ENOSPC, "No space left on device")).startswith(
        "No space left on device (errno 28). Hint: free some disk space")


# --- every rule is raised by naming its class (issue 11, item 5) -------------------------------------

ERROR_CLASSES = {name for name, obj in vars(E).items() if isinstance(obj, type) and issubclass(obj, E.ConvertBnbError)}


def _library_trees() -> list[tuple[str, ast.Module]]:
    files = sorted([*ROOT.glob("convert/**/*.py"), *ROOT.glob("formats/**/*.py")])
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(encoding="utf-8"), str(p))) for p in files]


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def test_the_class_is_the_rule() -> None:
    # no class swapping in __new__ and no rule= argument: an instance's rule is its class's default_rule
    assert "__new__" not in vars(E.ConvertBnbError)
    for rule, cls in E.all_rules().items():
        exc = cls("message", path="f", tensor="t")
        assert type(exc) is cls and exc.rule == rule and str(exc) == f"Failed to read 'f': tensor 't': {rule} message"
    assert E.AdapterError("message").rule is None
    with pytest.raises(TypeError):
        E.AdapterError("message", rule="LORA-010")  # type: ignore[call-arg]


def test_no_error_class_is_given_a_rule_keyword() -> None:
    # the class is the rule: ``AdapterError(..., rule="LORA-010")`` is written ``LoraShapeError(...)``
    bad = [
        f"{path}:{node.lineno}: {_called_name(node)}(rule={ast.unparse(kw.value)})"
        for path, tree in _library_trees()
        for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno)
        if _called_name(node) in ERROR_CLASSES
        for kw in node.keywords
        if kw.arg == "rule"
    ]
    assert not bad, "error classes given rule=:\n" + "\n".join(bad)


def test_every_rule_class_is_raised_by_name() -> None:
    # ``grep ClassName`` finds where a rule is checked: the class is named in a ``raise`` (``raise
    # Cls(...)``, or a helper given the class: ``raise _err(Cls, ...)``), in check mode's
    # ``report(Cls(...))`` (which raises it when problems are not collected), or in the return of a
    # one-rule factory that call sites raise (``return Cls(...)``: peft_config's ``_bad``, bnb's ``bad``)
    named: set[str] = set()
    for _, tree in _library_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                named.update(n.id for n in ast.walk(node.exc) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                named.update(n.id for n in ast.walk(node.value) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Call) and _called_name(node) == "report":
                named.update(n.id for a in node.args for n in ast.walk(a) if isinstance(n, ast.Name))
    missing = [f"{rule} {cls.__name__}" for rule, cls in E.all_rules().items() if cls.__name__ not in named]
    assert not missing, "rule classes never raised by name in convert/ or formats/:\n" + "\n".join(missing)
