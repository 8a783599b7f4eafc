"""The command line's own surface: --version, check -q, --json on success and on failure."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import convert
from convert.cli import main
from tests.helpers.fixtures import MODELS, ROOT

MODEL = MODELS / "llama_nf4_dq"


def test_version_is_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"convert-bnb {convert.__version__}\n"
    # pyproject.toml takes its version from convert.__version__: no second copy to drift
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "convert.__version__"}


@pytest.mark.parametrize("preset", [None, "3"])
def test_console_script_gives_openblas_one_thread_unless_set(preset: str | None) -> None:
    """The console script sets OPENBLAS_NUM_THREADS=1 before NumPy loads (our workers are the
    parallelism; a BLAS pool on top oversubscribes the cores), and keeps a value the user set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    probe = ("import sys, convert.__main__, convert.cli, numpy; sys.argv = ['convert-bnb', '--version']\n"
             "convert.cli.main = lambda: print(__import__('os').environ['OPENBLAS_NUM_THREADS']) or 0\n"
             "sys.exit(convert.__main__.main())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (preset or "1")


def test_a_signal_after_the_command_returned_does_not_kill_the_exit() -> None:
    """SIGINT or SIGTERM landing after the command line has returned (its output final, the summary
    printed) used to kill the process by the signal, with no line; now it exits with the command's code."""
    import subprocess
    import sys

    probe = ("import os, signal, sys, convert.__main__, convert.cli\n"
             "convert.cli.main = lambda: print('wrote it') or 0\n"
             "code = convert.__main__.main()\n"
             "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM)\n"
             "sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (0, "wrote it\n", "")


def test_check_quiet_prints_nothing_when_clean_and_only_problems_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(MODEL), "-q"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["check", str(MODEL)]) == 0
    assert "OK (" in capsys.readouterr().out  # without -q: the summary
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["check", str(bad), "-q"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "ST-" in err
    assert main(["check", str(tmp_path / "missing"), "-q"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "CKPT-010" in err


def test_json_success_names_source_target_files_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main([str(MODEL), "--to", "bf16", "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert captured.err == ""
    assert d["ok"] is True and d["converter"] == f"convert-bnb {convert.__version__}"
    assert d["source"] == str(MODEL.resolve()) and d["commit"] is None
    assert d["to"] == "bf16" and d["output"] == str(out)
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(d["files"]) == on_disk and "model.safetensors" in on_disk
    for rel, rec in d["files"].items():
        data = (out / rel).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sum(r["bytes"] for r in d["files"].values()) == d["bytes_out"]
    t = d["timings"]
    assert set(t) == {"plan", "write", "verify", "commit", "total"}
    assert all(v >= 0 for v in t.values()) and t["total"] >= t["write"] + t["verify"]
    assert d["peak_rss_bytes"] > 10 * 2**20 and isinstance(d["notes"], list)


def test_json_failure_is_an_object_with_class_rule_message(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing"), "--to", "bf16", "--json"]) == 2
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert d["ok"] is False and d["error"] == "SourceNotFoundError" and d["rule"] == "CKPT-010"
    assert d["message"] in captured.err  # the human line on stderr is the same message
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main([str(MODEL), "--to", "bf16", "-o", str(out), "--json"]) == 2  # exists: OUT-001
    d = json.loads(capsys.readouterr().out)
    assert (d["ok"], d["error"], d["rule"]) == (False, "OutputExistsError", "OUT-001")
    with pytest.raises(SystemExit) as exc:  # an argparse usage error too
        main([str(MODEL), "--to", "nope", "--json"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert (d["ok"], d["error"], d["rule"]) == (False, "UsageError", "USE-001") and "'nope'" in d["message"]
    assert captured.err.count("\n") == 1
    assert main(["inspect", str(tmp_path / "missing"), "--json"]) == 2  # the subcommands too
    d = json.loads(capsys.readouterr().out)
    assert (d["ok"], d["rule"]) == (False, "CKPT-010")


def test_every_run_time_dependency_is_imported_by_the_run_time_code() -> None:
    """A declared dependency the code never imports is dead weight for every user (safetensors was one)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    code = "\n".join(p.read_text() for d in ("convert", "formats") for p in (ROOT / d).rglob("*.py"))
    imported = set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_][A-Za-z0-9_]*)", code, re.MULTILINE))
    names = [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].replace("-", "_") for d in deps]
    assert names == ["numpy", "huggingface_hub", "tqdm", "gguf", "ml_dtypes", "regex"]
    assert [n for n in names if n not in imported] == []


@pytest.mark.parametrize("spelled", ["BF16", "Bf16", " bf16 "])
def test_to_takes_any_letter_case_in_every_command(spelled: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main([str(MODEL), "--to", spelled, "-o", str(out), "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["to"] == "bf16"
    assert main(["check", str(MODEL), "--to", spelled.upper().replace("BF16", "GGUF:Q8_0"), "-q"]) == 0
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODEL} --to {spelled.strip()}\n")
    assert main(["batch", str(jobs), "--out-dir", str(tmp_path / "b"), "--to", spelled.strip(), "--dry-run"]) == 0


def test_peak_rss_is_the_processes_own() -> None:
    """The reported peak RSS is the conversion's own address space: not the peak of the process that
    started it (Linux carries that into a child's ru_maxrss across exec: a batch worker started by a big
    batch process reported at least its peak)."""
    import subprocess
    import sys

    import numpy as np

    big = np.ones(400 << 20, np.uint8)  # this process's peak: at least 400 MiB when the child starts
    code = "from convert.stream.pipeline import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               cwd=ROOT).stdout)
    assert 5 << 20 < child < 200 << 20 and big.sum() == 400 << 20


@pytest.mark.parametrize(("spelled", "suggestion"), [
    ("bf61", "; did you mean 'bf16'?"), ("gguf:q4km", "; did you mean 'gguf:q4_k_m'?"),
    ("nf5", "; did you mean 'nf4'?"), ("zzz", " (choose from"),
])
def test_a_to_typo_suggests_the_closest_target(spelled: str, suggestion: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([str(MODELS / "llama_nf4_dq"), "--to", spelled, "-o", str(tmp_path / "x")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --to: invalid choice: '{spelled}'{suggestion}" in err
    assert not (tmp_path / "x").exists()


def test_max_memory_floor_is_stated_in_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(MODELS / "llama_nf4_dq"), "--max-memory", "5MiB", "-o", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == ("convert-bnb: error: USE-001 --max-memory is too small "
                                       "(expected '>= 64.00 MiB', found '5.00 MiB')\n")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "at least 64MiB" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def test_nothing_quantized_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 16-bit model given by mistake converts (a copy), and the run says that nothing was dequantized."""
    from convert.stream.plan import NOTHING_QUANTIZED

    assert main([str(MODELS / "llama_orig_bf16"), "--to", "bf16", "-o", str(tmp_path / "o"), "--json"]) == 0
    assert NOTHING_QUANTIZED in json.loads(capsys.readouterr().out)["notes"]
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(tmp_path / "q"), "--json"]) == 0
    assert NOTHING_QUANTIZED not in json.loads(capsys.readouterr().out)["notes"]


def test_layers_bnb_cpu_gets_wrong_are_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every single-layer fixture: the note exactly when the weight has several rows whose length is not a
    multiple of the blocksize, for a dequantized and a re-quantized output; it covers every fixture where
    bnb's CPU dispatch was recorded disagreeing with its generic kernel."""
    from tests.helpers.fixtures import SINGLE, manifest

    noted = set()
    for e in manifest()["single"]:
        src = SINGLE / f"{e['name']}.q.safetensors"
        assert main([str(src), "--to", "bf16", "-o", str(tmp_path / f"{e['name']}.safetensors"), "--json"]) == 0
        notes = [n for n in json.loads(capsys.readouterr().out)["notes"] if "bitsandbytes' CPU kernel" in n]
        rows, length = (1, e["shape"][0]) if len(e["shape"]) == 1 else (e["shape"][0], e["shape"][-1])
        for d in e["shape"][1:-1]:
            rows *= d
        if rows > 1 and length % e["blocksize"]:
            noted.add(e["name"])
            assert notes == [f"1 4-bit layer with rows not a multiple of the blocksize (e.g. layer.weight: rows of "
                             f"{length}, blocksize {e['blocksize']}): bitsandbytes' CPU kernel on AVX512 machines "
                             "(and transformers' model.dequantize() there) computes them wrongly, so it will disagree "
                             "with this output, which equals bnb's generic and CUDA kernels"], e["name"]
        else:
            assert notes == [], e["name"]
    assert {e["name"] for e in manifest()["single"] if e["bnb_cpu_dispatch_value_mismatches_vs_generic"]} <= noted
    assert len(noted) == 20
    src = SINGLE / "fp4_bs64_dq_bfloat16_48x48_zeroblocks.q.safetensors"
    assert main([str(src), "--to", "nf4", "--include", "layer.weight", "-o", str(tmp_path / "n.safetensors")]) == 0
    assert "rows of 48, blocksize 64): bitsandbytes' CPU kernel" in capsys.readouterr().err
    # a 16-bit layer quantized to nf4: the note is about the file written; nothing was to be dequantized, and
    # that is not said (it was, for a quantizing target)
    from convert.stream.plan import NOTHING_QUANTIZED

    src = SINGLE / "fp4_bs128_dq_float16_37x51_mixed.orig.safetensors"
    assert main([str(src), "--to", "nf4", "--include", "layer.weight", "-o", str(tmp_path / "o.safetensors")]) == 0
    err = capsys.readouterr().err
    assert ("note: 1 4-bit layer with rows not a multiple of the blocksize (e.g. layer.weight: rows of 51, blocksize "
            "64): bitsandbytes' CPU kernel on AVX512 machines (and transformers' model.dequantize() there) computes "
            "them wrongly from this file (bnb's generic and CUDA kernels read it right)") in err
    assert NOTHING_QUANTIZED not in err


@pytest.mark.parametrize("argv", [["--max-memory", "-5GB"], ["--max-shard-size", "-1"], ["--max-memory=-5GB"]])
def test_a_negative_size_is_refused_as_a_size(argv: list[str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-memory -5GB`` was argparse's "expected one argument": the value reaches parse_size."""
    with pytest.raises(SystemExit) as info:
        main([str(MODELS / "llama_nf4_dq"), *argv, "-o", str(tmp_path / "x")])
    assert info.value.code == 2
    value = argv[-1].split("=")[-1]
    assert f"not a size: '{value}' (examples: 1GiB, 512MiB, 5GB)" in capsys.readouterr().err


def test_config_that_disagrees_with_the_weights_fails_check_and_every_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vocab_size past the embedding: transformers would refuse the bf16 folder; check, --dry-run and every
    target say so before writing (CKPT-013; a GGUF target by its own rule, GGUF-006)."""
    import shutil

    src = tmp_path / "m"
    shutil.copytree(MODELS / "llama_nf4_dq", src, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1024}))
    assert main(["check", str(src), "-q"]) == 2  # check's exit code for a problem found
    assert "CKPT-013 config.json 'vocab_size' differs from the token embedding's rows" in capsys.readouterr().err
    for to in ("bf16", "fp32", "nf4", "auto"):
        assert main([str(src), "--to", to, "-o", str(tmp_path / to), "--dry-run"]) == 2
        assert "CKPT-013" in capsys.readouterr().err
        assert not (tmp_path / to).exists()
    assert main([str(src), "--to", "gguf:q8_0", "-o", str(tmp_path / "g.gguf")]) == 2
    assert "GGUF-006 config.json 'vocab_size' differs from the token embedding's rows" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["--dry-run"], ["inspect"], ["check"]], ids=["convert", "dry-run", "inspect",
                                                                                 "check"])
def test_src_a_symlink_loop_is_ckpt_011_in_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         command: list[str]) -> None:
    """Issue 39 (struct-shard-paths fuzzer): convert and --dry-run made the result's source path with
    Path.resolve before opening SRC: 'internal error: RuntimeError: Symlink loop' (exit 1)."""
    (tmp_path / "loop").symlink_to("loop")
    sub, flags = (command, []) if command in (["inspect"], ["check"]) else ([], command)
    code = main([*sub, str(tmp_path / "loop"), *flags, *([] if sub else ["-o", str(tmp_path / "out")])])
    printed = capsys.readouterr()
    assert code == 2 and "internal error" not in printed.err
    assert "CKPT-011" in printed.out + printed.err and "a symlink loop" in printed.out + printed.err


@pytest.mark.parametrize(("edit", "part"), [
    ({"vocab_size": "1000"}, "CKPT-013 config.json 'vocab_size' is not an integer (expected 1000, found '1000 (str)')"),
    ({"hidden_size": True}, "CKPT-013 config.json 'hidden_size' is not an integer (expected 256, found 'True (bool)')"),
    ({"num_hidden_layers": 2.0}, "CKPT-013 config.json 'num_hidden_layers' is not an integer (expected 2, found "
                                 "'2.0 (float)')"),
    ({"num_hidden_layers": None}, "CKPT-013 config.json 'num_hidden_layers' is not an integer"),
    ({"vocab_size": "DELETE"}, "CKPT-013 config.json has no 'vocab_size' (expected 1000)"),
    ({"num_hidden_layers": "DELETE"}, "CKPT-013 config.json has no 'num_hidden_layers' (expected 2)"),
])
def test_config_values_transformers_cannot_use_are_refused(edit: dict, part: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A value of another type, or a missing one (transformers would take its class default: 32 layers of
    which 30 random), is refused before anything is written (it converted with exit 0)."""
    import shutil

    src = tmp_path / "m"
    shutil.copytree(MODELS / "llama_nf4_dq", src, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    for k, v in edit.items():
        if v == "DELETE":
            cfg.pop(k)
        else:
            cfg[k] = v
    (src / "config.json").write_text(json.dumps(cfg))
    assert main([str(src), "--to", "bf16", "-o", str(tmp_path / "o")]) == 2
    assert part in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["--to", "bf16"], ["--to", "bf16", "--dry-run"]])
def test_json_names_a_local_source_by_its_absolute_path(argv: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``source`` in --json is the absolute path, in a dry run as in a run (SRC given relative)."""
    monkeypatch.chdir(MODELS)
    assert main(["llama_nf4_dq", *argv, "-o", str(tmp_path / "o"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == str(MODELS / "llama_nf4_dq")
