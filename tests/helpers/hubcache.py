"""Fill a Hugging Face cache in the standard layout from local model directories (no network).

    <cache>/models--<org>--<name>/
        blobs/<sha256 of the file>           the bytes (LFS files are named by their sha256)
        snapshots/<commit>/<file>            relative symlinks to ../../blobs/<sha256>
        refs/<branch or tag>                 the commit sha, no newline

This is the layout huggingface_hub writes and reads; the tests then let huggingface_hub itself
resolve repo ids, revisions and snapshots against it with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.fixtures import ROOT


def commit_sha(text: str) -> str:
    """A deterministic 40-hex-digit commit sha for a label."""
    return hashlib.sha1(text.encode()).hexdigest()


def add_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, Path | bytes],
    commit: str,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Put one commit of a repo into the cache; returns its snapshot directory.

    Args:
        cache: the hub cache directory (``HF_HUB_CACHE``).
        repo_id: ``org/name``.
        files: repo path -> a local file to copy, or the bytes.
        commit: the commit sha (40 hex digits).
        refs: branch / tag names pointing at this commit.
    """
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    blobs = storage / "blobs"
    snap = storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        data = content if isinstance(content, bytes) else Path(content).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        blob = blobs / digest
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snap


def add_model_dir(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",),
                  extra: dict[str, bytes] | None = None) -> Path:
    """Put every top-level file of a local model directory into the cache as one commit."""
    files: dict[str, Path | bytes] = {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}
    files.update(extra or {})
    return add_snapshot(cache, repo_id, files, commit, refs)


def offline_env(tmp: Path, cache: Path | None = None, hf_home: Path | None = None) -> dict[str, str]:
    """An environment for the CLI: offline, this cache, no token or config from the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(hf_home or (tmp / "hf_home"))
    if cache is not None:
        env["HF_HUB_CACHE"] = str(cache)
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m convert ARGS`` in a fresh interpreter (huggingface_hub reads its env at import)."""
    return subprocess.run([sys.executable, "-m", "convert", *args], env=env, cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)


def copy_model(src: Path, dst: Path) -> Path:
    """A writable copy of a fixture model directory (top-level files only)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file():
            shutil.copy2(p, dst / p.name)
    return dst
