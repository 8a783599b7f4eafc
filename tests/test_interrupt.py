"""Killing a conversion mid-write never leaves a complete-looking output; a later run removes the
stale temporary and says so; the input is never modified.

The conversion runs in a subprocess on a synthetic 4-bit layer of 8M elements (16 MiB of bf16
output) with ``--max-memory 64MiB --threads 1``, so it is written in about 24 chunks; each chunk
also sleeps 50 ms (a wrapper around ``Dequant4Source.produce_into``, which ``produce`` calls too) so
that the signal lands mid-write on any machine. The test waits until the temporary holds data, then signals.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert.output import TMP_MARK
from formats.errors import TruncatedFileError
from formats.safetensors import SafetensorsReader
from tests.helpers.fixtures import HARNESS, MODELS, ROOT
from tests.helpers.fuzzing import check_output
from tests.helpers.malformed import layer, model_dir, st_bytes, write

SHAPE = (2048, 4096)
SLOW = """
import sys, time
import convert.stream.plan as plan
_produce = plan.Dequant4Source.produce_into
def slow(self, *args, **kwargs):
    time.sleep(0.05)
    return _produce(self, *args, **kwargs)
plan.Dequant4Source.produce_into = slow
from convert.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def big_layer() -> dict:
    return layer(shape=SHAPE, bs=64, dtype="bfloat16")


def make_input(kind: str, root: Path, tensors: dict) -> Path:
    if kind == "file":
        return write(root / "in" / "big.safetensors", st_bytes(tensors, {"format": "pt"}))
    return model_dir(root / "in" / "model", {"model.safetensors": tensors})


def digest(src: Path) -> dict[str, str]:
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def start(src: Path, out: Path, slow: bool = True) -> subprocess.Popen[str]:
    argv = [str(src), "-o", str(out), "--max-memory", "64MiB", "--threads", "1"]
    cmd = [sys.executable, "-c", SLOW, *argv] if slow else [sys.executable, "-m", "convert", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def temporaries(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if TMP_MARK in p.name] if out.parent.exists() else []


def data_bytes(tmp: Path) -> int:
    files = [tmp] if tmp.is_file() else list(tmp.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def wait_mid_write(proc: subprocess.Popen[str], out: Path) -> Path:
    """Wait until the temporary holds the header and at least one chunk of data."""
    deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the conversion ended before it could be interrupted: {proc.communicate()}"
        tmps = temporaries(out)
        if tmps and data_bytes(tmps[0]) > 1 << 20:
            return tmps[0]
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("the conversion never started writing")


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_sigterm_sigint_remove_the_temporary(kind: str, sig: int, tmp_path: Path, big_layer: dict) -> None:
    src = make_input(kind, tmp_path, big_layer)
    before = digest(src)
    out = tmp_path / "outdir" / ("out.safetensors" if kind == "file" else "out")
    proc = start(src, out)
    wait_mid_write(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err == "convert-bnb: interrupted; no output was left behind\n"
    assert not out.exists()
    assert list(out.parent.iterdir()) == []
    assert digest(src) == before


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_sigkill_leaves_only_a_stale_temporary_that_the_next_run_removes(
    kind: str, tmp_path: Path, big_layer: dict
) -> None:
    src = make_input(kind, tmp_path, big_layer)
    before = digest(src)
    out = tmp_path / "outdir" / ("out.safetensors" if kind == "file" else "out")
    proc = start(src, out)
    tmp = wait_mid_write(proc, out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    # nothing under the output name; only the hidden temporary (which does not read as complete) and
    # the dead run's claim file (a lock no process holds)
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([tmp.name, f".{out.name}.convert-bnb-lock"])
    assert tmp.name.startswith(f".{out.name}{TMP_MARK}")
    shard = tmp if tmp.is_file() else tmp / "model.safetensors"
    if shard.exists():
        with pytest.raises(TruncatedFileError):
            SafetensorsReader(shard)
    if kind == "dir":
        assert not (tmp / "config.json").exists()  # written only after every shard
    assert digest(src) == before

    again = start(src, out, slow=False)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"removed a stale temporary left by an interrupted run: {tmp}\n" in err
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    check_output(src if kind == "file" else src, out)
    assert digest(src) == before


@pytest.mark.parametrize("point", ["convert.cli", "datetime"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_during_start_up_imports_is_one_line_and_exit_130(sig: int, point: str, tmp_path: Path) -> None:
    """The harness (tests/harness/sitecustomize.py) holds the process while ``convert.cli`` is being
    imported, or ``datetime`` (imported by NumPy's C extension, which turned a KeyboardInterrupt there
    into an ImportError: exit 1 and a traceback), then lets the import finish: the signal is raised
    once it has (convert.signals.deferred). It used to print a KeyboardInterrupt traceback (SIGINT) or
    end with 143 (SIGTERM)."""
    marker = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": f"{HARNESS}{os.pathsep}{ROOT}",
           "CONVERT_BNB_TEST_PAUSE": f"import:{point}:{marker}"}
    out = tmp_path / "out.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(tmp_path / "in.safetensors"), "-o", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # a guard against a broken test, not a speed check
    while not marker.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    assert marker.read_text() == str(proc.pid)
    proc.send_signal(sig)
    time.sleep(0.2)  # (the signal is delivered while the import is held)
    (tmp_path / "pid.go").touch()
    stdout, err = proc.communicate(timeout=60)
    assert (proc.returncode, stdout, err) == (130, "", "convert-bnb: interrupted\n")
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_after_the_commit_says_the_output_is_complete(sig: int, tmp_path: Path) -> None:
    """The harness holds the process right after the output is renamed into place; a signal there used to
    print "no output was left behind" while the (complete) output was there."""
    src = tmp_path / "in.safetensors"
    write(src, st_bytes(layer()))
    out = tmp_path / "out" / "o.safetensors"
    marker = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": f"{HARNESS}{os.pathsep}{ROOT}",
           "CONVERT_BNB_TEST_PAUSE": f"{out.name}:commit:{marker}"}
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(src), "-o", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # a guard against a broken test, not a speed check
    while not marker.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, f"convert-bnb: interrupted after the output was complete: {out}\n")
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.safetensors"]
    check_output(src, out)


ENCODER_WRAPPER = ("import sys\nfrom convert.gguf import encode as gguf_encode\ngguf_encode.PROCESS_MIN_ELEMENTS = 0\n"
                   "from convert.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def start_gguf_with_a_held_worker(tmp_path: Path) -> tuple[subprocess.Popen[str], int, Path]:
    """``--to gguf:q4_k_m --threads 2`` of the small fixture with encoder processes forced, in a process group
    of its own; returns once the harness holds the first spawned encoder in its NumPy import, with that
    worker's pid (the test touches ``pid.go`` to let it go on)."""
    marker = tmp_path / "pid"
    out = tmp_path / "out" / "m.gguf"
    env = {**os.environ, "PYTHONPATH": f"{HARNESS}{os.pathsep}{ROOT}",
           "CONVERT_BNB_TEST_PAUSE": f"worker-import:numpy:{marker}"}
    proc = subprocess.Popen([sys.executable, "-c", ENCODER_WRAPPER, str(MODELS / "llama_nf4_dq"), "--to", "gguf:q4_k_m",
                             "--threads", "2", "-o", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the conversion ended before its encoder started: {proc.communicate()}")
        time.sleep(0.01)
    worker = int(marker.read_text())
    assert worker != proc.pid
    return proc, worker, out


def spawned_workers(parent: int) -> list[int]:
    """The pids of ``parent``'s multiprocessing workers (command line ending in ``--multiprocessing-fork``)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(stat_fields(proc)[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and cmdline.endswith(b"--multiprocessing-fork\0"):
            found.append(int(proc.name))
    return found


def stat_fields(proc: Path) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state, ppid, ..."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def ended(pid: int) -> bool:
    """The process is gone, or a zombie (it has exited; whoever adopted it has not reaped it yet)."""
    try:
        return stat_fields(Path(f"/proc/{pid}"))[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_terminal_ctrl_c_while_gguf_encoder_processes_start_is_one_line_and_exit_130(
    sig: int, tmp_path: Path
) -> None:
    """A terminal's Ctrl-C goes to the whole process group: here while a spawned K-quant encoder process
    is still importing (the harness holds it in NumPy's import). The workers used to die there with a
    KeyboardInterrupt traceback each, and on Python 3.11.2 the pool could wait for the dead worker for
    ever (CPython gh-94777); now they are started with the stop signals blocked
    (convert.signals.blocked), and only the converting process stops. SIGHUP (the terminal closed) also
    used to kill CPython's resource tracker (it ignores only SIGINT and SIGTERM), whose relaunch printed a
    warning and KeyError tracebacks; it is started with the signals blocked too."""
    src = MODELS / "llama_nf4_dq"
    before = digest(src)
    proc, _, out = start_gguf_with_a_held_worker(tmp_path)
    try:
        os.killpg(proc.pid, sig)  # the whole group, as a terminal does
        time.sleep(0.2)  # (delivered while the worker's import is held)
        (tmp_path / "pid.go").touch()
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert (proc.returncode, stdout, err) == (130, "", "convert-bnb: interrupted; no output was left behind\n")
    assert list(out.parent.iterdir()) == []
    assert digest(src) == before


def test_gguf_encoder_processes_end_when_the_converting_process_is_killed(tmp_path: Path) -> None:
    """SIGKILL to the converting process alone (the OOM killer): its encoder processes used to wait for
    ever on their queues (they hold both ends), each holding its memory; now each exits when its parent
    is gone."""
    proc, worker, _ = start_gguf_with_a_held_worker(tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=60)  # (not communicate: the worker holds the same stdout and stderr)
        (tmp_path / "pid.go").touch()
        deadline = time.monotonic() + 60  # a guard against a broken test, not a speed check
        while not ended(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended(worker)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (what is left of the group, if the test failed)
        except ProcessLookupError:
            pass
        proc.communicate()


def test_a_killed_gguf_encoder_process_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """One encoder process SIGKILLed (the OOM killer) while the other runs: the pool, broken, terminates the
    other, which blocks SIGTERM, so the run used to wait for ever to join it; now the pool's terminate is a
    SIGKILL and the run ends with exit 2 and one line, its temporary removed."""
    proc, held, out = start_gguf_with_a_held_worker(tmp_path)
    try:
        deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
        while len(spawned_workers(proc.pid)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        assert held in spawned_workers(proc.pid) and len(spawned_workers(proc.pid)) == 2
        os.kill(held, signal.SIGKILL)
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 2, err
    assert err == ("convert-bnb: error: a GGUF encoder process ended abruptly (killed, or out of memory?). "
                   "Hint: run again, with a lower --max-memory or --threads 1\n"), err
    assert list(out.parent.iterdir()) == []


def test_a_chunk_submitted_as_the_encoder_pool_breaks_does_not_wait_for_ever() -> None:
    """CPython 3.11's pool can lose a future submitted while it breaks (its ``terminate_broken`` fails the
    pending work without the lock ``submit`` holds); the chunk's wait then ends in BrokenProcessPool once
    the pool says it is broken, instead of never (a hang seen once in ~120 runs with a worker SIGKILLed)."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from convert.gguf import encoder_pool
    from formats.errors import EncoderProcessError

    class Broken:
        _broken = "A child process terminated abruptly"

        def __init__(self, fut: Future[int]) -> None:
            self.fut = fut

        def submit(self, fn: object, *args: object) -> Future[int]:
            return self.fut

    start = time.monotonic()
    with pytest.raises(EncoderProcessError, match="a GGUF encoder process ended abruptly") as caught:
        encoder_pool.call(Broken(Future()), print)  # type: ignore[arg-type]
    assert isinstance(caught.value.__cause__, BrokenProcessPool)
    assert "broke while this chunk was being submitted" in str(caught.value.__cause__)
    assert time.monotonic() - start < 30  # a guard against a hang, not a speed check
    done: Future[int] = Future()
    done.set_result(7)
    assert encoder_pool.call(Broken(done), print) == 7  # type: ignore[arg-type]
