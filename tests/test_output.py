"""The output protocol (convert/output.py): one claim per output path, staging, atomic commit, and the
recovery of what dead runs leave - through real processes where a kill or a second run is the point."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert.cli import main
from convert.options import target_for
from convert.output import InterruptedAfterCommit, OutputClaim, ShardLedger
from convert.output_names import default_output, output_name
from formats.errors import OutputBusyError, OutputExistsError
from tests.helpers.fixtures import MODELS, REFERENCES, ROOT, assert_same_tensors, load_all, read_safetensors

MODEL = MODELS / "llama_nf4_dq"
#: The CLI whose first dequantized chunk waits until the file argv[1] exists, so a second process meets it
#: mid-write whatever the machine's load.
HELD = """
import os, sys, time
import convert.stream.plan as plan
_produce = plan.Dequant4Source.produce_into
def held(self, *args, **kwargs):
    deadline = time.monotonic() + 120  # a guard against a broken test
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _produce(self, *args, **kwargs)
plan.Dequant4Source.produce_into = held
from convert.cli import main
sys.exit(main(sys.argv[2:]))
"""
#: The CLI with the process ending at once right after the N-th os.rename (kill -9 between the steps of a
#: commit): argv[1] is N.
CRASH_AT_RENAME = """
import os, sys
import convert.output as output
calls = [0]
_rename = os.rename
def rename(a, b):
    _rename(a, b)
    calls[0] += 1
    if calls[0] == int(sys.argv[1]):
        os._exit(9)
output.os.rename = rename
from convert.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _digest(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)) if root.is_dir() else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def test_two_runs_to_one_output_exactly_one_wins(tmp_path: Path) -> None:
    out = tmp_path / "out"
    go = tmp_path.parent / f"{tmp_path.name}.go"
    first = subprocess.Popen([sys.executable, "-c", HELD, str(go), str(MODEL), "--to", "bf16", "-o", str(out),
                              "--threads", "1"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
        while not any(".convert-bnb-tmp-" in p.name for p in tmp_path.iterdir()):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        second = subprocess.run([sys.executable, "-m", "convert", str(MODEL), "--to", "fp16", "-o", str(out)],
                                cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        assert first.poll() is None  # the first run was still writing when the second one gave up
        go.touch()
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and "OUT-004 another convert-bnb run is writing this output" in second.stderr
    assert f"'{out}'" in second.stderr
    # the winner's output is complete and is the bf16 one; nothing else is left beside it
    assert_same_tensors(load_all(out), read_safetensors(REFERENCES["llama_nf4_dq"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_kill_inside_an_overwrite_commit_is_recovered(tmp_path: Path, crash_at: int) -> None:
    """--overwrite of a directory renames the old output aside (rename 1), the new one in (rename 2), then
    removes the old one. Killed after rename 1 the final path is empty and the next run puts the old
    output back; killed after rename 2 the new output is in place and the next run removes the old one."""
    out = tmp_path / "out"
    assert main([str(MODEL), "--to", "fp16", "-o", str(out), "-q"]) == 0
    old = _digest(out)
    r = subprocess.run([sys.executable, "-c", CRASH_AT_RENAME, str(crash_at), str(MODEL), "--to", "bf16", "-o",
                        str(out), "--overwrite", "-q"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 9, r.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".out.convert-bnb-old-")]
    assert len(aside) == 1 and _digest(aside[0]) == old
    if crash_at == 1:
        assert not out.exists()
    else:
        assert_same_tensors(load_all(out), read_safetensors(REFERENCES["llama_nf4_dq"]))
    new = tmp_path / "again"
    r = subprocess.run([sys.executable, "-m", "convert", str(MODEL), "--to", "bf16", "-o", str(out)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    # the next run first completes or undoes the dead commit, then applies its own rules (no --overwrite)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    if crash_at == 1:
        assert _digest(out) == old  # rolled back to the complete old output
    else:
        assert_same_tensors(load_all(out), read_safetensors(REFERENCES["llama_nf4_dq"]))  # the new one stays
    assert not new.exists()


def test_claim_recovers_stale_temporaries_and_restores_a_set_aside_output(tmp_path: Path) -> None:
    final = tmp_path / "model-bf16"
    (tmp_path / ".model-bf16.convert-bnb-tmp-999999").mkdir()
    aside = tmp_path / ".model-bf16.convert-bnb-old-999998"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"old")
    with OutputClaim(final, is_dir=True, nbytes=0, inputs=[], overwrite=True) as claim:
        assert (final / "model.safetensors").read_bytes() == b"old"
        assert claim.recovered == [
            f"restored the output that an interrupted --overwrite had set aside: {final}",
            f"removed a stale temporary left by an interrupted run: {tmp_path / '.model-bf16.convert-bnb-tmp-999999'}",
        ]
        (claim.staging / "model.safetensors").write_bytes(b"new")
        claim.commit()
    assert (final / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-bf16"]


def test_an_interrupt_while_the_old_output_is_removed_says_the_new_one_is_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--overwrite of a directory: once the new output is renamed in, an interrupt while the old one (set
    aside) is being removed is an interrupt after the commit (the CLI then says the output is complete,
    not "no output was left behind"); the next claim removes what is left of the old one."""
    from convert import output

    final = tmp_path / "out"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"old")
    real_remove = output.remove_path

    def interrupted(path: Path) -> None:
        if output.OLD_MARK in path.name:
            raise KeyboardInterrupt
        real_remove(path)

    monkeypatch.setattr(output, "remove_path", interrupted)
    with pytest.raises(output.InterruptedAfterCommit) as caught:
        with OutputClaim(final, is_dir=True, nbytes=0, inputs=[], overwrite=True) as claim:
            (claim.staging / "model.safetensors").write_bytes(b"new")
            claim.commit()
    assert caught.value.path == final
    assert (final / "model.safetensors").read_bytes() == b"new"
    aside = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    assert len(aside) == 1 and output.OLD_MARK in aside[0]
    monkeypatch.setattr(output, "remove_path", real_remove)
    with OutputClaim(final, is_dir=True, nbytes=0, inputs=[], overwrite=True) as claim:
        assert claim.recovered == [f"removed an old output set aside by an interrupted --overwrite: "
                                   f"{tmp_path / aside[0]}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (final / "model.safetensors").read_bytes() == b"new"


@pytest.mark.parametrize("at_rename", [1, 2])
def test_a_signal_during_the_commit_renames_waits_until_they_are_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], at_rename: int) -> None:
    """SIGINT right after the first rename of an --overwrite commit (the old output set aside) or the
    second (the new one in): held until both are done (convert.signals.deferred), then reported as an
    interrupt after the commit. It used to delete the complete new output after rename 1, or say
    "no output was left behind" with the new output in place after rename 2."""
    from convert import output

    out = tmp_path / "out"
    assert main([str(MODEL), "--to", "fp16", "-o", str(out), "-q"]) == 0
    calls = [0]
    real_rename = os.rename

    def rename(a: object, b: object) -> None:
        real_rename(a, b)
        calls[0] += 1
        if calls[0] == at_rename:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(output.os, "rename", rename)
    code = main([str(MODEL), "--to", "bf16", "-o", str(out), "--overwrite", "-q"])
    monkeypatch.setattr(output.os, "rename", real_rename)
    assert (code, capsys.readouterr().err) == (130, f"convert-bnb: interrupted after the output was complete: {out}\n")
    assert calls[0] == 2
    assert_same_tensors(load_all(out), read_safetensors(REFERENCES["llama_nf4_dq"]))
    # the old output is still set aside (its removal comes after the renames); the next claim removes it
    assert len([p for p in tmp_path.iterdir() if output.OLD_MARK in p.name]) == 1
    with OutputClaim(out, is_dir=True, nbytes=0, inputs=[], overwrite=True):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_second_signal_while_stopping_after_the_commit_keeps_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGINT while the old output is removed after an --overwrite commit, and a second one while the
    claim is released on the way out (a double Ctrl-C): the second is dropped, the claim released, and
    the one line says the new output is complete. It used to say "no output was left behind", or print
    two lines, and leave the lock file."""
    from convert import output

    out = tmp_path / "out"
    assert main([str(MODEL), "--to", "fp16", "-o", str(out), "-q"]) == 0
    real_remove, real_release = output.remove_path, OutputClaim._release

    def remove(path: Path) -> None:
        if output.OLD_MARK in path.name:
            os.kill(os.getpid(), signal.SIGINT)
        real_remove(path)

    def release(self: OutputClaim) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        real_release(self)

    monkeypatch.setattr(output, "remove_path", remove)
    monkeypatch.setattr(OutputClaim, "_release", release)
    code = main([str(MODEL), "--to", "bf16", "-o", str(out), "--overwrite", "-q"])
    assert (code, capsys.readouterr().err) == (130, f"convert-bnb: interrupted after the output was complete: {out}\n")
    assert_same_tensors(load_all(out), read_safetensors(REFERENCES["llama_nf4_dq"]))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith("-lock")]


def test_claim_is_exclusive_and_released(tmp_path: Path) -> None:
    final = tmp_path / "x.safetensors"
    with OutputClaim(final, is_dir=False, nbytes=0, inputs=[]) as claim:
        with pytest.raises(OutputBusyError, match="OUT-004"):
            OutputClaim(final, is_dir=False, nbytes=0, inputs=[]).__enter__()
        claim.staging.write_bytes(b"data")
        claim.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no lock file left
    with pytest.raises(OutputExistsError, match="OUT-001"):
        OutputClaim(final, is_dir=False, nbytes=0, inputs=[]).__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


@pytest.mark.parametrize("is_dir", [False, True], ids=["file", "directory"])
def test_on_checked_runs_after_the_checks_and_before_the_staging(tmp_path: Path, is_dir: bool) -> None:
    """``on_checked`` is called under the claim once every check passed, before the staging exists (not at all when
    a check refuses the output); what it raises undoes the claim: no staging, no lock file left."""
    final = tmp_path / ("m" if is_dir else "x.safetensors")
    seen: list[tuple[bool, bool]] = []

    def checked() -> None:
        lock = tmp_path / f".{final.name}.convert-bnb-lock"
        seen.append((lock.exists(), any(".convert-bnb-tmp-" in p.name for p in tmp_path.iterdir())))
        raise KeyError("another output was refused")

    with pytest.raises(KeyError):
        OutputClaim(final, is_dir=is_dir, nbytes=0, inputs=[], on_checked=checked).__enter__()
    assert seen == [(True, False)] and list(tmp_path.iterdir()) == []
    final.mkdir() if is_dir else final.write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="OUT-001"):
        OutputClaim(final, is_dir=is_dir, nbytes=0, inputs=[], on_checked=checked).__enter__()
    assert seen == [(True, False)] and [p.name for p in tmp_path.iterdir()] == [final.name]


def test_failed_run_keeps_the_old_output_and_a_resumable_staging(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"old")
    key = {"job": 1}
    with pytest.raises(RuntimeError):
        with OutputClaim(final, is_dir=True, nbytes=0, inputs=[], overwrite=True, resume_key=key) as claim:
            assert claim.ledger is not None
            (claim.staging / "model-00001-of-00002.safetensors").write_bytes(b"shard one")
            claim.ledger.record("model-00001-of-00002.safetensors")
            raise RuntimeError("killed")
    assert (final / "model.safetensors").read_bytes() == b"old"
    partial = tmp_path / ".out.convert-bnb-partial"
    ledger = ShardLedger.open(partial, key)
    assert ledger.reusable("model-00001-of-00002.safetensors")
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"shard 0ne")  # same size, other bytes
    assert not ledger.reusable("model-00001-of-00002.safetensors")
    assert not (partial / "model-00001-of-00002.safetensors").exists()
    assert ShardLedger.open(partial, {"job": 2}).shards == {}  # another key: nothing is reused


def test_default_output_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "model-bnb-4bit"
    d.mkdir()
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"")
    assert default_output(d, target_for("bf16")) == tmp_path / "model-bnb-4bit-bf16"
    assert default_output(d, target_for("auto")) == tmp_path / "model-bnb-4bit-dequantized"
    # GGUF before its input is read (a batch job's name): llama.cpp's convention of the name alone
    assert default_output(d, target_for("gguf:q8_0")) == tmp_path / "model-Q8_0.gguf"
    assert default_output(f, target_for("fp16")) == tmp_path / "weights-fp16.safetensors"
    assert default_output(f, target_for("nf4")) == tmp_path / "weights-nf4.safetensors"
    monkeypatch.chdir(tmp_path)
    assert default_output(None, target_for("bf16"), "org/m") == tmp_path / "m-bf16"
    assert output_name("m", target_for("gguf"), single_file=True) == "m-F16.gguf"


def test_sigterm_while_claimed_releases_everything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    go = tmp_path.parent / f"{tmp_path.name}.go"  # the run stays held until the signal
    proc = subprocess.Popen([sys.executable, "-c", HELD, str(go), str(MODEL), "--to", "bf16", "-o", str(out)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(".convert-bnb-tmp-" in p.name for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    go.touch()  # the chunks in flight finish, then the run stops
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given", [".", "..", "/", ""])
def test_o_must_name_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([str(MODEL), "--to", "bf16", "-o", given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "USE-001 -o must name the output itself" in err
    assert list(tmp_path.iterdir()) == []


def test_o_ending_in_a_separator_puts_a_file_output_into_the_directory(tmp_path: Path) -> None:
    src = MODEL / "model.safetensors"
    assert main([str(src), "--to", "bf16", "-o", f"{tmp_path / 'into'}/", "-q"]) == 0
    assert [p.name for p in (tmp_path / "into").iterdir()] == ["model-bf16.safetensors"]
    assert main([str(MODEL), "--to", "gguf:q8_0", "-o", f"{tmp_path / 'g'}/", "-q"]) == 0
    assert [p.name for p in (tmp_path / "g").iterdir()] == ["Llama_Nf4_Dq-2.0M-Q8_0.gguf"]
    assert main([str(MODEL), "--to", "bf16", "-o", f"{tmp_path / 'd'}/", "-q"]) == 0  # a directory output: DIR
    assert (tmp_path / "d" / "config.json").is_file()


def test_overwrite_replaces_only_a_model_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "things"
    (folder / "sub").mkdir(parents=True)
    (folder / "precious.txt").write_text("keep")
    assert main([str(MODEL), "--to", "bf16", "-o", str(folder), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "OUT-005 --overwrite replaces a model output, and this directory holds other things" in err
    assert "found \"subdirectories ['sub']\"" in err
    (folder / "sub").rmdir()
    assert main([str(MODEL), "--to", "bf16", "-o", str(folder), "--overwrite"]) == 2
    assert "found 'no model files (1 entries)'" in capsys.readouterr().err
    assert (folder / "precious.txt").read_text() == "keep"
    monkeypatch.chdir(folder)
    (folder / "config.json").write_text("{}")
    assert main([str(MODEL), "--to", "bf16", "-o", str(folder), "--overwrite"]) == 2
    assert "OUT-005 --overwrite would replace the working directory" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main([str(MODEL), "--to", "bf16", "-o", str(folder), "--overwrite", "-q"]) == 0  # a model output
    assert not (folder / "precious.txt").exists() and (folder / "model.safetensors").is_file()


def test_a_symlink_in_place_of_the_output_is_replaced_not_followed(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert main([str(MODEL), "--to", "fp16", "-o", str(tmp_path / "dangling"), "--overwrite", "-q"]) == 0
    assert not (tmp_path / "dangling").is_symlink() and (tmp_path / "dangling" / "config.json").is_file()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (tmp_path / "link").symlink_to(target)
    assert main([str(MODEL), "--to", "fp16", "-o", str(tmp_path / "link"), "--overwrite", "-q"]) == 0
    assert (tmp_path / "link" / "config.json").is_file() and not (tmp_path / "link").is_symlink()
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_a_symlink_loop_in_place_of_the_output_exists_and_is_replaced(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39: -o naming a symlink loop was 'internal error: RuntimeError: Symlink loop' (Path.resolve)."""
    (tmp_path / "loop").symlink_to("loop")
    assert main([str(MODEL), "--to", "fp16", "-o", str(tmp_path / "loop"), "-q"]) == 2
    assert "OUT-001 output exists" in capsys.readouterr().err
    assert main([str(MODEL), "--to", "fp16", "-o", str(tmp_path / "loop"), "--overwrite", "-q"]) == 0
    assert not (tmp_path / "loop").is_symlink() and (tmp_path / "loop" / "config.json").is_file()


# ------------------------------------------------------------------ environment errors name the output


def test_disk_full_mid_run_names_the_output_and_out_002(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import formats.safetensors as st

    calls = []

    def write(self, data, in_place=False):  # the third write() finds the disk full, as a real write() would
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, data, in_place)

    original = st.SafetensorsWriter.write
    monkeypatch.setattr(st.SafetensorsWriter, "write", write)
    out = tmp_path / "out"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"Failed to write '{out}'" in err and "OUT-002" in err and "No space left on device (errno 28)" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_other_write_errors_name_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import formats.safetensors as st

    def write(self, data, in_place=False):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(st.SafetensorsWriter, "write", write)
    out = tmp_path / "o.safetensors"
    src = REFERENCES["llama_nf4_dq"]
    assert main([str(src), "--to", "bf16", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"convert-bnb: error: Failed to use '{out}': Input/output error (errno 5)\n"
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--report", "--quant-report"])
def test_report_paths_are_checked_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], flag: str) -> None:
    import convert.run.source

    def no_work(*a, **k):
        raise AssertionError("the input was opened before the report path was checked")

    monkeypatch.setattr(convert.run.source, "open_checkpoint", no_work)
    extra = (["--merge-lora", str(MODELS.parent / "lora" / "adapter")] if flag == "--report" else ["--to", "nf4"])
    base = [str(MODELS / "llama_nf4_dq"), "-o", str(tmp_path / "out"), "-q"] + extra
    if flag == "--report":
        base += ["--to", "bf16"]
    for path, part in [(tmp_path, "names a directory"),
                       (tmp_path / "missing" / "r.json", "the report's directory does not exist")]:
        assert main(base + [flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "USE-001" in err and part in err and flag in err, err
    assert [p.name for p in tmp_path.iterdir()] == []


def test_threads_are_capped_so_the_memory_cap_holds(tmp_path: Path) -> None:
    from convert.job import convert
    from convert.options import ConvertOptions
    from convert.stream.pipeline import _BASELINE, _BYTES_PER_ELEMENT, MIN_CHUNK_ELEMENTS, chunk_elements, max_threads

    cap = max_threads(64 << 20)
    budget = max((64 << 20) - _BASELINE, 16 << 20)
    assert (2 * cap + 1) * MIN_CHUNK_ELEMENTS * _BYTES_PER_ELEMENT <= budget
    assert (2 * cap + 3) * MIN_CHUNK_ELEMENTS * _BYTES_PER_ELEMENT > budget
    assert (2 * cap + 1) * chunk_elements(64, 64 << 20, cap) * _BYTES_PER_ELEMENT <= budget
    assert max_threads(64 << 20, unit=1 << 30) == 1  # a row larger than the budget: one thread
    res = convert(ConvertOptions(str(MODELS / "llama_nf4_dq"), to="bf16", output=tmp_path / "o", threads=1000,
                                 max_memory=64 << 20))
    assert any(n.startswith(f"--threads 1000 lowered to {cap}:") and "--max-memory 64.00 MiB" in n
               for n in res.notes), res.notes
    want = load_all(REFERENCES["llama_nf4_dq"])
    assert_same_tensors({k: v for k, v in load_all(tmp_path / "o").items() if k in want}, want)


def test_copied_files_take_the_umask_not_the_source_mode(tmp_path):
    """tokenizer and generation files are copied byte for byte, but created like every other output file
    (a read-only source file used to give a read-only copy that ignored the umask)."""
    src = tmp_path / "model"
    src.mkdir()
    for p in (MODELS / "llama_nf4_dq").iterdir():
        if p.is_file():
            (src / p.name).write_bytes(p.read_bytes())
    os.chmod(src / "tokenizer_config.json", 0o444)
    os.chmod(src / "generation_config.json", 0o400)
    old = os.umask(0o027)
    try:
        assert main([str(src), "--to", "bf16", "-o", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    for name in ("tokenizer_config.json", "generation_config.json", "tokenizer.json"):
        out = tmp_path / "out" / name
        assert out.read_bytes() == (src / name).read_bytes()
        assert out.stat().st_mode & 0o777 == 0o640, name


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A disk too full for the lock's pid: the run ends with the disk error (exit 2) and no lock file, empty
    or not, is left beside the output."""
    import errno
    import os

    from convert.cli import main

    real = os.write

    def full(fd: int, data: bytes) -> int:
        if data == str(os.getpid()).encode():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("convert-bnb: error: No space left on device (errno 28). Hint: free some "
                                       "disk space or write elsewhere with -o\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("src", "to", "name", "extra"), [
    ("llama_nf4_dq", "bf16", "out", []),
    ("llama_nf4_dq_sharded", "nf4", "out", ["--max-shard-size", "1MB"]),
    ("llama_nf4_dq", "gguf:q4_k_m", "out.gguf", []),
    ("qwen3_moe_nf4_dq", "gguf:q8_0", "out.gguf", []),
])
def test_disk_preflight_asks_for_the_output_files_bytes_and_1mib(src: str, to: str, name: str, extra: list[str],
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The pre-flight needs the bytes of every file the output will hold (headers, index, config, copied
    files and, for a GGUF, its metadata: computed, not guessed) plus DISK_HEADROOM (1 MiB): it passes with
    exactly that much free and refuses one byte less (a 3.8 MiB output with 60 MB free used to be refused)."""
    from types import SimpleNamespace
    from unittest import mock

    from convert.output import DISK_HEADROOM

    first = tmp_path / "first" / name
    assert main([str(MODELS / src), "--to", to, "-o", str(first), "-q", *extra]) == 0
    size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file()) if first.is_dir() else first.stat().st_size
    assert DISK_HEADROOM == 1 << 20
    for free, code in ((size + DISK_HEADROOM, 0), (size + DISK_HEADROOM - 1, 2)):
        out = tmp_path / str(free) / name
        with mock.patch("convert.output.shutil.disk_usage", return_value=SimpleNamespace(free=free)):
            assert main([str(MODELS / src), "--to", to, "-o", str(out), "-q", *extra]) == code
        err = capsys.readouterr().err
        if code:
            assert f"OUT-002 not enough free disk space for the output (expected '>= {size + DISK_HEADROOM} bytes " \
                   f"free', found '{free} bytes free')" in err
            assert not out.exists()


def test_the_interrupt_message_counts_the_outputs_not_written() -> None:
    one, two = Path("a"), Path("b")
    assert InterruptedAfterCommit(one).message() == "interrupted after the output was complete: a"
    assert InterruptedAfterCommit(one, (one, two), 3).message() == (
        "interrupted after 2 of 3 outputs were complete: a, b; the other was not written (convert it alone, or "
        "all again with --overwrite)")
    assert InterruptedAfterCommit(one, (one,), 3).message() == (
        "interrupted after 1 of 3 outputs were complete: a; the other 2 were not written (convert them alone, or all "
        "again with --overwrite)")
    assert InterruptedAfterCommit(one, (one, two), 2).message() == (
        "interrupted after 2 of 2 outputs were complete: a, b")
