"""An input cut shorter while it is converted (another program truncating or rewriting it) ends with
CKPT-012 naming the file and exit 2, never a bare ``SIGBUS``; the next run removes what it left.

The run is a subprocess converting a synthetic 4-bit layer of 8M elements in ~24 chunks
(``--max-memory 64MiB``). The test harness (tests/harness/sitecustomize.py) truncates the input from
inside the run at the third chunk:
before a chunk's view is taken (the readers' size check raises the error on the normal path, which
removes the temporary), or after (the read touches a vanished page: ``SIGBUS``, reported by
:func:`convert.signals.on_bus_error`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convert.output import TMP_MARK
from formats.errors import InputChangedError
from formats.mapping import InputMap
from tests.helpers.fixtures import HARNESS, ROOT
from tests.helpers.malformed import layer, model_dir, st_bytes, write


@pytest.fixture(scope="module")
def big_layer() -> dict:
    return layer(shape=(2048, 4096), bs=64, dtype="bfloat16")


def run_cut(where: str, weights: Path, argv: list[str], env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``convert-bnb ARGV`` with the harness truncating ``weights`` at the third chunk (``where``: before
    or during its read; see tests/harness/sitecustomize.py)."""
    env = {**os.environ, "PYTHONPATH": f"{HARNESS}{os.pathsep}{ROOT}", "CONVERT_BNB_TEST_CUT": f"{where}:{weights}",
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "convert", *argv], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def args(src: Path, out: Path, *extra: str) -> list[str]:
    return [str(src), "-o", str(out), "--max-memory", "64MiB", "--threads", "1", *extra]


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_cut_between_chunks_is_ckpt012_and_leaves_nothing(kind: str, tmp_path: Path, big_layer: dict) -> None:
    if kind == "file":
        src = weights = write(tmp_path / "in" / "big.safetensors", st_bytes(big_layer, {"format": "pt"}))
    else:
        src = model_dir(tmp_path / "in" / "model", {"model.safetensors": big_layer})
        weights = src / "model.safetensors"
    size = weights.stat().st_size
    out = tmp_path / "outdir" / "out"
    r = run_cut("before", weights, args(src, out))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line
    assert line.startswith("convert-bnb: error: ")
    for part in (str(weights), "CKPT-012", "the file changed while it was read",
                 f"its size in bytes (expected {size}, found 4096)"):
        assert part in line
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_sigbus_during_a_read_is_reported_and_the_next_run_cleans_up(tmp_path: Path, big_layer: dict) -> None:
    weights = write(tmp_path / "in" / "big.safetensors", st_bytes(big_layer, {"format": "pt"}))
    size = weights.stat().st_size
    out = tmp_path / "outdir" / "out.safetensors"
    r = run_cut("during", weights, args(weights, out, "--json"))
    assert r.returncode == 2, r.stderr  # not -SIGBUS
    line = r.stderr.strip()
    assert "\n" not in line
    for part in (f"'{weights}'", "CKPT-012", "cut shorter while it was read (SIGBUS",
                 f"its size in bytes (expected {size}, found 4096)"):
        assert part in line
    import json

    failure = json.loads(r.stdout)
    assert failure["ok"] is False and failure["rule"] == "CKPT-012" and failure["error"] == "InputChangedError"
    assert not out.exists()
    assert any(TMP_MARK in p.name for p in out.parent.iterdir())  # left as after a kill: the next run removes it
    write(weights, st_bytes(big_layer, {"format": "pt"}))
    again = subprocess.run([sys.executable, "-m", "convert", str(weights), "-o", str(out), "-q"], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_input_map_checks_the_size_on_every_view(tmp_path: Path) -> None:
    f = write(tmp_path / "x.bin", bytes(range(256)) * 64)
    m = InputMap(f, 16384)
    assert m.view(256, 4).tolist() == [0, 1, 2, 3]
    assert m.view(0, 2, np.uint16).tolist() == [256, 770]
    os.truncate(f, 100)
    with pytest.raises(InputChangedError) as e:
        m.view(0, 4)
    assert e.value.rule == "CKPT-012" and e.value.expected == 16384 and e.value.found == 100
    m.close()
    with pytest.raises(InputChangedError, match=r"its size in bytes \(expected 16384, found 100\)"):
        InputMap(f, 16384)  # the header was read with the old size


def test_sigbus_in_a_batch_worker_fails_that_job_with_ckpt012(tmp_path: Path, big_layer: dict) -> None:
    weights = write(tmp_path / "in" / "big.safetensors", st_bytes(big_layer, {"format": "pt"}))
    size = weights.stat().st_size
    jobs = write(tmp_path / "jobs.txt", f"{weights} --name big\n".encode())
    argv = ["batch", str(jobs), "--out-dir", str(tmp_path / "out"), "--max-memory", "64MiB", "--threads", "1", "-q"]
    r = run_cut("during", weights, argv, {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("convert-bnb batch: job big failed: ")
    for part in (f"'{weights}'", "CKPT-012", "(SIGBUS on a vanished page)",
                 f"its size in bytes (expected {size}, found 4096)"):
        assert part in line
    assert not (tmp_path / "out" / "big").exists()


def test_rewrite_in_place_of_the_same_size_is_ckpt012(tmp_path: Path, big_layer: dict) -> None:
    """Another program writing into the input (same size) while it is converted: the modification time
    changed, so the run ends with CKPT-012 and commits nothing (it used to exit 0 with a mixed output)."""
    weights = write(tmp_path / "in" / "big.safetensors", st_bytes(big_layer, {"format": "pt"}))
    out = tmp_path / "outdir" / "out.safetensors"
    r = run_cut("rewrite", weights, args(weights, out))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line
    for part in (str(weights), "CKPT-012", "another program wrote to it or replaced it"):
        assert part in line
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_check_inputs_before_commit_sees_a_rewrite_after_the_last_read(tmp_path: Path) -> None:
    from formats.mapping import check_inputs

    f = write(tmp_path / "x.bin", bytes(8192))
    m = InputMap(f, 8192)
    m.view(0, 16)
    check_inputs()
    import time

    time.sleep(0.02)
    with open(f, "r+b") as fh:
        fh.write(b"\x01")
    with pytest.raises(InputChangedError, match="CKPT-012 the file changed while it was read .another program wrote"):
        check_inputs()
    m.close()
    check_inputs()  # a closed map is no longer an input of the run


def test_check_inputs_while_another_thread_closes_its_maps(tmp_path: Path) -> None:
    """A run of several targets: one target's commit checks every open input (check_inputs) while another
    target, done, closes its maps. The check used to fstat a descriptor the close had just closed (EBADF, the
    bf16 target of ``--to bf16,nf4`` failing now and then with "Bad file descriptor"), or a file opened meanwhile
    under the same number; now a map closed meanwhile is skipped and nothing fails."""
    import threading
    import time

    from formats.mapping import InputMap, check_inputs

    paths = []
    for i in range(4):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * 8192)
        paths.append(p)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(p: Path) -> None:
        while not stop.is_set():
            InputMap(p, 8192).close()
            os.close(os.open(paths[0], os.O_RDONLY))  # (a new file under the number just freed)

    def check() -> None:
        end = time.monotonic() + 3  # (before the fix: about 7 failures a second here; it stops at the first)
        while time.monotonic() < end and not errors:
            try:
                check_inputs()
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(exc)
        stop.set()

    threads = [threading.Thread(target=churn, args=(p,)) for p in paths[1:]] + [
        threading.Thread(target=check) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
