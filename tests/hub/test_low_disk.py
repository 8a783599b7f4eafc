"""Hub repos read in place: ``--low-disk`` (one shard at a time beside the output) and header-only
``inspect`` / ``--dry-run``, against the local fake Hub server (the real huggingface_hub client)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from formats.dtypes import BY_CODE
from formats.safetensors import SafetensorsReader, SafetensorsWriter
from tests.helpers.fixtures import MODELS
from tests.helpers.hubcache import commit_sha, offline_env, run_cli

REPO = "org/split"
COMMIT = commit_sha("lowdisk")
SHARDS = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
SMALL = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]


def _layer_of(name: str) -> str:
    return name[: name.index(".weight") + len(".weight")] if ".weight." in name else name


def _shard_bytes(tmp: Path, name: str, tensors: list[tuple[str, object, tuple[int, ...], bytes]]) -> bytes:
    path = tmp / name
    w = SafetensorsWriter(path, [(n, dt, shape) for n, dt, shape, _ in tensors], {"format": "pt"})
    for *_, data in tensors:
        w.write(data)
    w.close()
    return path.read_bytes()


def build_repo(tmp: Path) -> dict[str, bytes]:
    """llama_nf4_dq in four shards (each with a 2 MiB bf16 tensor, so headers are a small part of a
    shard), one layer split across shards 2 and 3, with its index and small files."""
    src = MODELS / "llama_nf4_dq"
    tmp.mkdir(parents=True, exist_ok=True)
    with SafetensorsReader(src / "model.safetensors") as r:
        order = sorted(r.tensors)  # a layer's weight, then its parts
        data = {n: (r.tensors[n].dtype, r.tensors[n].shape, r.raw(n).tobytes()) for n in order}
    quarter = len(order) // 4
    cuts = []
    for k in (1, 2, 3):
        i = quarter * k
        if k == 2:  # right after a 4-bit layer's packed weight: its QuantState parts open shard 3
            while not order[i].endswith(".weight.absmax"):
                i += 1
        else:  # at a layer boundary
            while _layer_of(order[i]) == _layer_of(order[i - 1]):
                i += 1
        cuts.append(i)
    assert cuts == sorted(cuts) and _layer_of(order[cuts[1]]) == order[cuts[1] - 1]  # split across 2 and 3
    rng = np.random.default_rng(0)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(order)], strict=True)):
        pad = rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16
        tensors = [(n, *data[n]) for n in order[a:b]]
        tensors.append((f"pad.{k}.weight", BY_CODE["BF16"], (1 << 20,), pad.astype(np.uint16).tobytes()))
        files[SHARDS[k]] = _shard_bytes(tmp, SHARDS[k], tensors)
        weight_map.update({t[0]: SHARDS[k] for t in tensors})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    for name in SMALL:
        files[name] = (src / name).read_bytes()
    return files


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return build_repo(tmp_path_factory.mktemp("split"))


@pytest.fixture
def hub(repo_files: dict[str, bytes], tmp_path: Path):
    from tests.helpers.fakehub import FakeHub

    h = FakeHub()
    h.add(REPO, COMMIT, dict(repo_files))
    url = h.start()
    env = offline_env(tmp_path, tmp_path / "hub")
    del env["HF_HUB_OFFLINE"]
    env.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
    yield h, env
    h.stop()


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _staging_dirs(parent: Path) -> list[Path]:
    return list(parent.glob(".*.convert-bnb-shards-*"))


class _Watch:
    """Polls the bytes of every file under the low-disk staging folders of ``parent`` every 2 ms."""

    def __init__(self, parent: Path) -> None:
        self.parent, self.peak, self.seen, self._stop = parent, 0, False, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for d in _staging_dirs(self.parent):
                self.seen = True
                for root, _dirs, names in os.walk(d):  # os.walk steps over folders removed meanwhile
                    for name in names:
                        try:
                            total += os.stat(os.path.join(root, name)).st_size
                        except FileNotFoundError:
                            pass
            self.peak = max(self.peak, total)
            time.sleep(0.002)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_low_disk_is_byte_identical_holds_two_shards_at_most_and_leaves_the_cache(hub, repo_files, tmp_path: Path):
    h, env = hub
    h.delays[".safetensors"] = 0.3  # each shard download takes a while: the watcher sees the folder fill
    with _Watch(tmp_path) as watch:
        r = run_cli([REPO, "--to", "bf16", "-o", str(tmp_path / "low"), "--low-disk", "--json"], env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert watch.seen and not _staging_dirs(tmp_path)  # the staging folder existed, and is gone
    assert not (tmp_path / "hub").exists() or not list((tmp_path / "hub").glob("models--*"))  # cache untouched
    shard_sizes = sorted((len(repo_files[s]) for s in SHARDS), reverse=True)
    small = sum(len(repo_files[n]) for n in repo_files if not n.endswith(".safetensors"))
    meta = 16 * 1024  # huggingface_hub's notes (.cache/huggingface/download/*.metadata, locks)
    assert watch.peak <= shard_sizes[0] + shard_sizes[1] + small + meta, watch.peak
    assert watch.peak < sum(shard_sizes)  # four shards: never all on disk at once
    low = summary["low_disk"]
    assert low["peak_input_bytes"] <= shard_sizes[0] + shard_sizes[1] < sum(shard_sizes)
    assert any(n.startswith("low-disk: 4 input shards fetched one at a time") for n in summary["notes"])
    # each shard downloaded once, in order; deleted once its last tensor is written: the shard holding
    # the split layer's packed weight (2) stays until its parts' shard (3) is there and the layer written
    assert [e for e in h.full_downloads if e.endswith(".safetensors")] == [f"{REPO}/{s}" for s in SHARDS]
    events = [tuple(e) for e in low["shards"]]
    assert events == [("fetch", SHARDS[0]), ("delete", SHARDS[0]), ("fetch", SHARDS[1]), ("fetch", SHARDS[2]),
                      ("delete", SHARDS[1]), ("delete", SHARDS[2]), ("fetch", SHARDS[3]), ("delete", SHARDS[3])]
    # the same conversion downloading into the cache first writes the same bytes
    r = run_cli([REPO, "--to", "bf16", "-o", str(tmp_path / "full"), "-q"], env)
    assert r.returncode == 0, r.stderr
    assert _tree_bytes(tmp_path / "low") == _tree_bytes(tmp_path / "full")


def test_split_layer_keeps_both_shards(hub, tmp_path: Path):
    """The split layer alone decides that shards 2 and 3 overlap: its bytes need both."""
    h, env = hub
    r = run_cli([REPO, "--to", "fp32", "-o", str(tmp_path / "o"), "--low-disk", "--json", "--threads", "1"], env)
    assert r.returncode == 0, r.stderr
    events = [tuple(e) for e in json.loads(r.stdout)["low_disk"]["shards"]]
    assert events.index(("fetch", SHARDS[2])) < events.index(("delete", SHARDS[1]))
    on_disk, most = set(), 0
    for kind, name in events:
        (on_disk.add if kind == "fetch" else on_disk.discard)(name)
        most = max(most, len(on_disk))
    assert most == 2


def _dry_run_and_inspect(args_src: list[str], env: dict[str, str]) -> tuple[dict, dict, str]:
    dry = run_cli([*args_src, "--to", "bf16", "--dry-run", "--json"], env)
    assert dry.returncode == 0, dry.stderr
    ins = run_cli(["inspect", *args_src, "--json"], env)
    assert ins.returncode == 0, ins.stderr
    txt = run_cli(["inspect", *args_src], env)
    assert txt.returncode == 0, txt.stderr
    return json.loads(dry.stdout), json.loads(ins.stdout), txt.stdout


def test_inspect_and_dry_run_read_headers_only(hub, repo_files, tmp_path: Path):
    h, env = hub
    dry, ins, text = _dry_run_and_inspect([REPO], env)
    weights = sum(len(repo_files[s]) for s in SHARDS)
    served = sum(n for k, n in h.served.items() if k.endswith(".safetensors"))
    assert not [k for k in h.full_downloads if k.endswith(".safetensors")]
    # three runs, each reading the first 100 KB of every shard (its header) and a few QuantState bytes
    per_run = len(SHARDS) * 100_000 + 64 * 1024
    assert served <= 3 * per_run and per_run < weights / 10, (served, weights)
    # the same report as for the downloaded files: the snapshot holds the small files; add the shards
    snap = tmp_path / "hub" / "models--org--split" / "snapshots" / COMMIT
    assert sorted(p.name for p in snap.iterdir()) == sorted(["model.safetensors.index.json", *SMALL])
    local = tmp_path / "local"
    local.mkdir()
    for name, data in repo_files.items():
        (local / name).write_bytes(data)
    off = dict(env, HF_HUB_OFFLINE="1")
    ldry, lins, ltext = _dry_run_and_inspect([str(local)], off)
    assert dry["notes"][0].startswith(f"source: Hub repo {REPO}@{COMMIT} (")
    dry["notes"] = dry["notes"][1:]
    hub_report = ins.pop("hub")
    assert hub_report == {"repo": REPO, "revision": None, "commit": COMMIT}
    for d in (dry, ins):
        assert d.pop("source") == str(snap)
    for d in (ldry, lins):
        assert d.pop("source") == str(local)
    assert dry.pop("output").endswith("split-bf16") and ldry.pop("output").endswith("local-bf16")  # default names
    assert dry == ldry
    assert ins == lins
    assert text.splitlines()[1:] == [line.replace(str(local), str(snap)) for line in ltext.splitlines()]


def test_auto_low_disk_when_only_that_fits(hub, repo_files, tmp_path: Path):
    from convert.hub.download import estimate_output_bytes

    h, env = hub
    headers = {}
    for s in SHARDS:
        path = tmp_path / s
        path.write_bytes(repo_files[s])
        with SafetensorsReader(path) as r:
            headers.update({n: (t.dtype.code, t.shape, t.nbytes) for n, t in r.tensors.items()})
    out_bytes = estimate_output_bytes(headers, "bf16")
    assert out_bytes is not None
    download = sum(len(b) for b in repo_files.values())
    sizes = sorted((len(repo_files[s]) for s in SHARDS), reverse=True)
    low = sizes[0] + sizes[1] + sum(len(b) for n, b in repo_files.items() if not n.endswith(".safetensors"))
    free = out_bytes + low + 4096
    assert free < out_bytes + download
    code = (
        "import shutil, sys, collections\n"
        "U = collections.namedtuple('U', 'total used free')\n"
        f"shutil.disk_usage = lambda p: U(10**9, 10**9 - {free}, {free})\n"
        "import convert.output\n"
        "convert.output.DISK_HEADROOM = 0\n"
        "from convert.cli import main\n"
        f"sys.exit(main(['{REPO}', '--to', 'bf16', '-o', {str(tmp_path / 'out')!r}, '--json']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    note = next(n for n in summary["notes"] if n.startswith("low-disk: the download and the output do not fit"))
    assert f"found '{free} bytes free'" in note or f"{free} bytes free" in note
    assert summary["low_disk"]["peak_input_bytes"] <= sizes[0] + sizes[1]
    assert not list((tmp_path / "hub").glob("models--*/blobs/*")) or all(
        p.stat().st_size < 100_000 for p in (tmp_path / "hub").glob("models--*/blobs/*"))  # the index only
    # with less free space than that, the full-download error stands
    r = subprocess.run([sys.executable, "-c", code.replace(f"{free}", f"{free - 8192}")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "not enough free disk space for the download and the output" in r.stderr


def test_a_shard_missing_mid_run_is_one_named_line(hub, tmp_path: Path):
    h, env = hub
    h.withheld.add(f"{REPO}/{SHARDS[2]}")  # its header reads, its download fails
    r = run_cli([REPO, "--to", "bf16", "-o", str(tmp_path / "out"), "--low-disk"], env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "HUB-002 cannot download a shard of the low-disk run" in r.stderr
    assert SHARDS[2] in r.stderr and "EntryNotFoundError" in r.stderr
    assert not (tmp_path / "out").exists()
    assert not _staging_dirs(tmp_path)
    assert not list(tmp_path.glob(".out.convert-bnb-tmp-*"))


def test_a_shard_the_repo_lacks_is_the_missing_shard_rule(hub, repo_files: dict[str, bytes], tmp_path: Path):
    """The index names a shard the repo does not have: CKPT-002 naming it, as without --low-disk."""
    h, env = hub
    h.add("org/missing", "c" * 40, {k: v for k, v in repo_files.items() if k != SHARDS[2]})
    for extra in ([], ["--low-disk"]):
        r = run_cli(["org/missing", "--to", "bf16", "-o", str(tmp_path / "out"), *extra], env)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert "CKPT-002 index names a shard that does not exist" in r.stderr and SHARDS[2] in r.stderr, r.stderr
        assert not (tmp_path / "out").exists() and not _staging_dirs(tmp_path)


def test_low_disk_usage_errors(hub, tmp_path: Path):
    _h, env = hub
    r = run_cli([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(tmp_path / "o"), "--low-disk"], env)
    assert r.returncode == 2 and "--low-disk applies to a Hub repo id" in r.stderr
    r = run_cli([REPO, "--to", "gguf:q8_0", "-o", str(tmp_path / "o.gguf"), "--low-disk"], env)
    assert r.returncode == 2 and "--low-disk works with --to auto, bf16, fp16 or fp32" in r.stderr


def test_interrupt_removes_the_staging_folder_and_a_dead_runs_folder_is_removed(hub, tmp_path: Path):
    h, env = hub
    proc = subprocess.Popen(["true"])  # a pid that has exited
    proc.wait()
    stale = tmp_path / f".out.convert-bnb-shards-{proc.pid}-abc"
    stale.mkdir()
    (stale / "model-00001-of-00004.safetensors").write_bytes(b"\0" * 1000)
    h.delays[".safetensors"] = 5.0
    run = subprocess.Popen([sys.executable, "-m", "convert", REPO, "--to", "bf16", "-o", str(tmp_path / "out"),
                            "--low-disk"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 120
    while not any((d / "config.json").exists() for d in _staging_dirs(tmp_path)):  # small files fetched
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.05)
    assert not stale.exists()  # removed when this run made its own folder
    time.sleep(0.5)  # now fetching the first shard
    run.send_signal(signal.SIGINT)
    _out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "interrupted; no output was left behind" in err
    assert not _staging_dirs(tmp_path) and not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if "convert-bnb" in p and not p.endswith("-lock")]
