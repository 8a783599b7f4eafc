"""Batch runs shared by the batch tests (local processes and Ray): a broken model, a worker held by the
test harness (tests/harness/sitecustomize.py) and the batch process killed while it holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.fixtures import HARNESS, MODELS, ROOT, rewrite_data


def broken_model(root: Path) -> Path:
    """A copy of llama_nf4_dq whose layer-1 up_proj QuantState JSON is zeroed (BNB-009)."""
    root.mkdir()
    for p in (MODELS / "llama_nf4_dq").iterdir():
        if p.is_file():
            (root / p.name).write_bytes(p.read_bytes())
    rewrite_data(root / "model.safetensors", ["model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"],
                 0x00)
    return root


def paused_env(env: dict[str, str], name: str, point: int | str, marker: Path) -> dict[str, str]:
    """``env`` with the test harness (tests/harness/sitecustomize.py): job ``name``'s worker stops after
    ``point`` finished shards (an int) or right after its commit (``"commit"``) and writes its pid to
    ``marker``."""
    return {**env, "PYTHONPATH": f"{HARNESS}{os.pathsep}{env['PYTHONPATH']}",
            "CONVERT_BNB_TEST_PAUSE": f"{name}:{point}:{marker}"}


def kill_batch_at_pause(jobs: Path, out: Path, env: dict[str, str], name: str, point: int | str,
                        marker: Path) -> None:
    """Run ``batch JOBS --to bf16`` until job ``name``'s worker holds at ``point`` (see paused_env), then
    SIGKILL the batch process alone and wait until its worker is gone (it must not write on)."""
    cmd = [sys.executable, "-m", "convert", "batch", str(jobs), "--out-dir", str(out), "--to", "bf16",
           "--max-memory", "256MiB", "--quiet"]
    proc = subprocess.Popen(cmd, env=paused_env(env, name, point, marker), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240  # a guard against hanging, not a timing assertion
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None, "the batch ended before reaching the pause point"
            assert time.monotonic() < deadline, "the batch never reached the pause point"
            time.sleep(0.05)
        worker = int(marker.read_text())
        proc.kill()  # SIGKILL to the batch process only: no clean-up possible there
        proc.wait()
        _wait_gone(worker)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if _pid_alive(proc.pid) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 60  # a guard against hanging, not a timing assertion
    while _pid_alive(pid) and not _is_zombie(pid):
        assert time.monotonic() < deadline, f"worker {pid} outlived its batch"
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
