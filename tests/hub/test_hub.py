"""Hub repo ids as SRC, resolved by the real huggingface_hub against a cache these tests fill (offline)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from convert.hub.download import (
    DownloadPlan,
    RepoFile,
    check_disk,
    choose_files,
    choose_weight_files,
    estimate_output_bytes,
    resolve_repo,
)
from convert.hub.repo import is_repo_id, parse_repo_spec
from convert.options import target_for
from convert.output_names import default_output
from convert.stream.plan import make_plan
from formats.checkpoint import open_checkpoint
from formats.errors import DiskSpaceError, HubError, NoAdapterWeightsError, NoWeightsError
from tests.helpers.fixtures import MODELS, REFERENCES, assert_same_tensors, load_all, read_safetensors
from tests.helpers.hubcache import add_model_dir, commit_sha, offline_env, run_cli

NF4 = commit_sha("nf4")
FP4 = commit_sha("fp4")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    c = tmp_path / "hub"
    add_model_dir(c, "org/llama-nf4", MODELS / "llama_nf4_dq", NF4, refs=("main",))
    add_model_dir(c, "org/llama-nf4", MODELS / "llama_fp4_nodq", FP4, refs=("v2",))
    add_model_dir(c, "org/llama-sharded", MODELS / "llama_nf4_dq_sharded", commit_sha("sharded"))
    add_model_dir(c, "org/llama-bin", MODELS / "llama_nf4_dq_bin", commit_sha("bin"))
    return c


def _bf16_reference(model: str) -> dict:
    return read_safetensors(REFERENCES[model])


def test_repo_id_end_to_end_offline_default_output(cache: Path, tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    r = run_cli(["org/llama-nf4", "--to", "bf16", "--json"], offline_env(tmp_path, cache), cwd=work)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    out = work / "llama-nf4-bf16"
    assert summary["output"] == str(out)
    assert (summary["source"], summary["commit"]) == (f"org/llama-nf4@{NF4}", NF4)  # --json: repo@commit
    assert f"source: Hub repo org/llama-nf4@{NF4}" in summary["notes"]
    assert_same_tensors(load_all(out), _bf16_reference("llama_nf4_dq"))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json",
    ]


@pytest.mark.parametrize(
    ("args", "model"),
    [
        (["org/llama-nf4", "--revision", "v2"], "llama_fp4_nodq"),  # a tag in refs/
        (["org/llama-nf4@v2"], "llama_fp4_nodq"),  # the same, spelled repo@revision
        (["org/llama-nf4", "--revision", NF4], "llama_nf4_dq"),  # a commit sha, no refs needed
        (["org/llama-nf4", "--revision", FP4], "llama_fp4_nodq"),
        (["org/llama-sharded"], "llama_nf4_dq_sharded"),  # index + shards
        (["org/llama-bin"], "llama_nf4_dq_bin"),  # a legacy pytorch_model.bin
    ],
)
def test_revisions_and_shards_resolve_to_the_right_snapshot(cache: Path, tmp_path: Path, args: list[str],
                                                            model: str) -> None:
    out = tmp_path / "out"
    r = run_cli([*args, "--to", "bf16", "-o", str(out)], offline_env(tmp_path, cache))
    assert r.returncode == 0, r.stderr
    assert_same_tensors(load_all(out), _bf16_reference(model))


def test_hf_home_alone_locates_the_cache(tmp_path: Path) -> None:
    home = tmp_path / "home"
    add_model_dir(home / "hub", "org/llama-nf4", MODELS / "llama_nf4_dq", NF4)
    out = tmp_path / "out"
    r = run_cli(["org/llama-nf4", "--to", "bf16", "-o", str(out)], offline_env(tmp_path, None, hf_home=home))
    assert r.returncode == 0, r.stderr
    assert_same_tensors(load_all(out), _bf16_reference("llama_nf4_dq"))


def test_offline_missing_repo_is_one_clear_line(cache: Path, tmp_path: Path) -> None:
    r = run_cli(["org/absent", "--to", "bf16", "-o", str(tmp_path / "o")], offline_env(tmp_path, cache))
    assert r.returncode == 2
    line = r.stderr.strip()
    assert line.count("\n") == 0
    assert ("cannot fetch Hub repo 'org/absent' at revision 'main' (LocalEntryNotFoundError: Cannot find an "
            "appropriate cached snapshot folder for the specified revision on the local disk and outgoing traffic "
            "has been disabled.) (expected") in line
    assert "local_files_only" not in line  # (huggingface_hub's advice to a library caller is left out)
    assert "Hint: HF_HUB_OFFLINE is set" in line
    assert not (tmp_path / "o").exists()


def test_offline_unknown_revision(cache: Path, tmp_path: Path) -> None:
    r = run_cli(["org/llama-nf4", "--revision", "nope", "--to", "bf16", "-o", str(tmp_path / "o")],
                offline_env(tmp_path, cache))
    assert r.returncode == 2
    assert "cannot fetch Hub repo 'org/llama-nf4' at revision 'nope'" in r.stderr


def test_revision_with_local_path_is_refused(tmp_path: Path) -> None:
    r = run_cli([str(MODELS / "llama_nf4_dq"), "--revision", "main", "--dry-run"], offline_env(tmp_path))
    assert r.returncode == 2
    assert "--revision applies to a Hub repo id, but SRC is a local path" in r.stderr


def test_dry_run_names_the_repo_and_commit(cache: Path, tmp_path: Path) -> None:
    r = run_cli(["org/llama-nf4", "--to", "fp16", "--dry-run", "--json"], offline_env(tmp_path, cache))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["notes"] == [f"source: Hub repo org/llama-nf4@{NF4}"]
    assert plan["source"].endswith(f"models--org--llama-nf4/snapshots/{NF4}")
    assert plan["out_bytes"] == 3975680


def test_resolve_repo_in_process(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    src = resolve_repo("org/llama-nf4", "v2", cache_dir=cache)
    assert (src.repo_id, src.revision, src.commit, src.downloaded_bytes) == ("org/llama-nf4", "v2", FP4, 0)
    assert src.path == cache / "models--org--llama-nf4" / "snapshots" / FP4
    assert (src.path / "model.safetensors").is_symlink()
    with pytest.raises(HubError) as ei:
        resolve_repo("org/none", cache_dir=cache)
    assert ei.value.found == "LocalEntryNotFoundError"


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unsloth/llama-3-8b-bnb-4bit", True),
        ("org/name.v2_x", True),
        ("name-only", False),
        ("a/b/c", False),
        ("../x", False),
        ("org/model.safetensors", False),
        ("/abs/path", False),
        (str(MODELS / "llama_nf4_dq"), False),  # exists locally: a path, not a repo
    ],
)
def test_is_repo_id(text: str, expected: bool) -> None:
    assert is_repo_id(text) is expected


def test_parse_repo_spec_and_default_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_repo_spec("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_repo_spec("org/name") == ("org/name", None)
    monkeypatch.chdir(tmp_path)
    assert default_output(None, target_for("bf16"), "org/m-bnb-4bit") == tmp_path / "m-bnb-4bit-bf16"
    assert default_output(None, target_for("auto"), "org/m") == tmp_path / "m-dequantized"
    assert default_output(None, target_for("gguf:q8_0"), "org/m-bnb-4bit") == tmp_path / "m-Q8_0.gguf"
    # with a revision, the name says which: two revisions of one repo never share a default output
    assert default_output(None, target_for("bf16"), "org/m", "v2") == tmp_path / "m-v2-bf16"
    assert default_output(None, target_for("bf16"), "org/m", "refs/pr/1") == tmp_path / "m-refs-pr-1-bf16"
    assert default_output(None, target_for("gguf:q8_0"), "org/m", NF4) == tmp_path / f"m-{NF4[:12]}-Q8_0.gguf"


def test_default_output_of_a_revision_is_its_own(cache: Path, tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    env = offline_env(tmp_path, cache)
    for args in (["org/llama-nf4"], ["org/llama-nf4", "--revision", "v2"], ["org/llama-nf4@v2", "--to", "fp16"]):
        r = run_cli([*args, "--to", "bf16", "-q"] if "--to" not in args else [*args, "-q"], env, cwd=work)
        assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["llama-nf4-bf16", "llama-nf4-v2-bf16", "llama-nf4-v2-fp16"]
    assert_same_tensors(load_all(work / "llama-nf4-bf16"), _bf16_reference("llama_nf4_dq"))
    assert_same_tensors(load_all(work / "llama-nf4-v2-bf16"), _bf16_reference("llama_fp4_nodq"))


def test_choose_weight_files_reads_the_index() -> None:
    d = MODELS / "llama_nf4_dq_sharded"
    names = sorted(p.name for p in d.iterdir()) + ["pytorch_model.bin", "onnx_model.onnx"]
    got = choose_weight_files(names, lambda n: json.loads((d / n).read_text()))
    assert got[0] == "model.safetensors.index.json"
    assert sorted(got[1:]) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert choose_weight_files(["model.safetensors", "config.json"], lambda n: {}) == ["model.safetensors"]
    assert choose_weight_files(["pytorch_model.bin", "config.json"], lambda n: {}) == ["pytorch_model.bin"]
    both = ["pytorch_model.bin", "model.safetensors", "config.json"]
    assert choose_weight_files(both, lambda n: {}) == ["model.safetensors"]  # never both
    # the order a local directory is read in: model.safetensors before a pickle index
    mixed = ["pytorch_model.bin.index.json", "model.safetensors", "config.json"]
    assert choose_weight_files(mixed, lambda n: {"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}) == [
        "model.safetensors"]
    with pytest.raises(NoWeightsError) as ei:
        choose_weight_files(["config.json", "model.gguf"], lambda n: {})
    assert type(ei.value) is NoWeightsError and ei.value.rule == "CKPT-005"


def test_choose_files_tells_an_adapter_from_a_model() -> None:
    """adapter_config.json with adapter weights (or with no weights of either kind: LORA-005) is an adapter: its
    config, weights (safetensors first) and the card, config and generation config, never the tokenizer; beside a
    model's weights and no adapter weights, a model; with neither, CKPT-005 naming the repo and both layouts."""
    never = lambda n: pytest.fail(f"no index to read: {n}")  # noqa: E731
    extras = ["README.md", "tokenizer.json", "config.json", "training_args.bin", "generation_config.json"]
    adapter = ["adapter_config.json", "adapter_model.bin", "adapter_model.safetensors", *extras]
    assert choose_files(adapter, never, "org/a") == (["adapter_config.json", "adapter_model.safetensors"],
                                                     ["README.md", "config.json", "generation_config.json"], True)
    assert choose_files(["adapter_model.bin", "adapter_config.json"], never, "org/a") == (
        ["adapter_config.json", "adapter_model.bin"], [], True)
    merged = ["adapter_config.json", "model.safetensors", "README.md", "tokenizer.json"]
    assert choose_files(merged, never, "org/m") == (["model.safetensors"],
                                                    ["README.md", "adapter_config.json", "tokenizer.json"], False)
    with pytest.raises(NoAdapterWeightsError) as ei:
        choose_files(["adapter_config.json", "README.md"], never, "org/a")
    assert ei.value.rule == "LORA-005" and ei.value.path == "org/a"
    assert ei.value.expected == "adapter_model.safetensors or adapter_model.bin"
    with pytest.raises(NoWeightsError) as ei:
        choose_files(["README.md", "tokenizer.json"], never, "org/x")
    assert ei.value.rule == "CKPT-005" and ei.value.path == "org/x" and "(a PEFT LoRA adapter)" in ei.value.expected


@pytest.mark.parametrize("model", ["llama_nf4_dq", "llama_fp4_nodq", "llama_nf4_dq_qsbf16", "llama_nf4_dq_sharded"])
@pytest.mark.parametrize("to", ["bf16", "fp16", "fp32", "auto"])
def test_estimate_output_bytes_from_headers_equals_the_plan(model: str, to: str) -> None:
    with open_checkpoint(MODELS / model) as ckpt:
        headers = {n: (t.dtype.code, t.shape, t.nbytes) for n, t in ckpt.tensors.items()}
        assert estimate_output_bytes(headers, to) == make_plan(ckpt, to).out_nbytes
    assert estimate_output_bytes(headers, "gguf") is None


def test_check_disk_counts_the_download_and_the_output(tmp_path: Path) -> None:
    class Usage:
        free = 1000

    check_disk(900, tmp_path / "cache", tmp_path / "out", None, disk_usage=lambda p: Usage)
    with pytest.raises(DiskSpaceError) as ei:
        check_disk(900, tmp_path / "cache", tmp_path / "out", 200, disk_usage=lambda p: Usage)
    msg = str(ei.value)
    assert "not enough free disk space for the download and the output" in msg
    assert "expected '>= 1100 bytes free (900 to download + 200 of output)', found '1000 bytes free'" in msg
    with pytest.raises(DiskSpaceError, match="for the download"):
        check_disk(1001, tmp_path / "cache", disk_usage=lambda p: Usage)
    check_disk(0, tmp_path / "cache", disk_usage=lambda p: Usage)


def test_download_plan_counts_only_uncached_files() -> None:
    files = [RepoFile("model.safetensors", 100, False), RepoFile("config.json", 7, True),
             RepoFile("model[1].json", None, False)]
    plan = DownloadPlan("org/m", None, NF4, files)
    assert plan.download_bytes == 100
    assert plan.allow_patterns == ["model.safetensors", "config.json", "model[[]1].json"]


# ---------------------------------------------------------------- online, against a local fake Hub server


NEEDED = ["LICENSE", "README.md", "config.json", "configuration_custom.py", "generation_config.json",
          "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
          "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors", "model.safetensors.index.json",
          "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
#: What a directory output holds besides its weights: the same online and offline (and from a local copy).
KEPT = sorted(n for n in NEEDED if not n.startswith("model"))
#: Files of the fake repo beyond the fixture's: the card, the licence, remote code (kept, like a local directory's).
EXTRA = {"README.md": b"# card", "LICENSE": b"Apache-2.0", "configuration_custom.py": b"X = 1\n"}


def _size(name: str) -> int:
    return len(EXTRA[name]) if name in EXTRA else (MODELS / "llama_nf4_dq_sharded" / name).stat().st_size


@pytest.fixture
def fakehub(tmp_path: Path):
    from tests.helpers.fakehub import FakeHub

    hub = FakeHub()
    files: dict[str, Path | bytes] = {p.name: p for p in (MODELS / "llama_nf4_dq_sharded").iterdir() if p.is_file()}
    files.update({"pytorch_model.bin": b"\0" * 5000, "onnx/model.onnx": b"\1" * 300,
                  "onnx/config.json": b"{}", ".gitattributes": b"*.bin lfs"})  # none of these is needed
    # kept by the output as a local directory's are: the card, the licence, remote code
    files.update(EXTRA)
    hub.add("org/sharded", commit_sha("online-1"), files)
    hub.add("org/sharded", commit_sha("online-2"),
            {p.name: p for p in (MODELS / "llama_fp4_nodq").iterdir() if p.is_file()}, refs=("v2",))
    url = hub.start()
    env = offline_env(tmp_path, tmp_path / "hub")
    del env["HF_HUB_OFFLINE"]
    env.update(HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="30", HF_HUB_DOWNLOAD_TIMEOUT="30")
    yield hub, env
    hub.stop()


def test_online_fetches_exactly_what_the_conversion_needs(fakehub, tmp_path: Path) -> None:
    hub, env = fakehub
    r = run_cli(["org/sharded", "--to", "bf16", "-o", str(tmp_path / "out"), "--json"], env)
    assert r.returncode == 0, r.stderr
    assert sorted(set(hub.full_downloads)) == sorted(f"org/sharded/{n}" for n in NEEDED)
    assert len(hub.full_downloads) == len(NEEDED)  # each file once
    sizes = sum(_size(n) for n in NEEDED)
    notes = json.loads(r.stdout)["notes"]
    assert notes == [f"source: Hub repo org/sharded@{commit_sha('online-1')} ({sizes} bytes downloaded)"]
    assert r.stderr == ""  # --json: no progress bars
    assert hub.auth == {None}  # no HF_TOKEN, no stored login: anonymous
    assert_same_tensors(load_all(tmp_path / "out"), _bf16_reference("llama_nf4_dq_sharded"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("model")) == KEPT
    assert (tmp_path / "out" / "configuration_custom.py").read_bytes() == b"X = 1\n"
    snap = tmp_path / "hub" / "models--org--sharded" / "snapshots" / commit_sha("online-1")
    assert sorted(p.name for p in snap.iterdir()) == sorted(NEEDED)
    # again: everything is cached, nothing is downloaded
    before = list(hub.full_downloads)
    r = run_cli(["org/sharded", "--to", "fp32", "-o", str(tmp_path / "out2"), "--json"], env)
    assert r.returncode == 0, r.stderr
    assert hub.full_downloads == before
    assert json.loads(r.stdout)["notes"] == [f"source: Hub repo org/sharded@{commit_sha('online-1')}"]
    # and offline from the same cache (huggingface_hub checks the snapshot against the cached tree listing)
    off = dict(env, HF_HUB_OFFLINE="1")
    r = run_cli(["org/sharded", "--to", "bf16", "-o", str(tmp_path / "out3")], off)
    assert r.returncode == 0, r.stderr
    assert_same_tensors(load_all(tmp_path / "out3"), _bf16_reference("llama_nf4_dq_sharded"))
    assert sorted(p.name for p in (tmp_path / "out3").iterdir() if not p.name.startswith("model")) == KEPT


def test_network_failure_uses_the_cached_snapshot_with_a_note(fakehub, tmp_path: Path) -> None:
    hub, env = fakehub
    r = run_cli(["org/sharded", "--to", "bf16", "-o", str(tmp_path / "out"), "-q"], env)  # fills the cache
    assert r.returncode == 0, r.stderr
    # HF_HUB_OFFLINE unset, but nothing listens at the endpoint: as huggingface_hub and transformers, use the cache
    down = dict(env, HF_ENDPOINT="http://127.0.0.1:1")
    r = run_cli(["org/sharded", "--to", "bf16", "-o", str(tmp_path / "out2"), "--json"], down)
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert notes[0] == f"source: Hub repo org/sharded@{commit_sha('online-1')}"
    # (the HTTP client's class: httpx's ConnectError from huggingface_hub 1.0, requests' ConnectionError before)
    assert re.match(r"the Hub could not be reached \((ConnectError|ConnectionError): ", notes[1]), notes[1]
    assert notes[1].endswith(f"used the cached snapshot org/sharded@{commit_sha('online-1')}, as huggingface_hub does")
    assert_same_tensors(load_all(tmp_path / "out2"), _bf16_reference("llama_nf4_dq_sharded"))
    assert sorted(p.name for p in (tmp_path / "out2").iterdir() if not p.name.startswith("model")) == KEPT
    # a revision that was never fetched (and a repo never fetched) is the network error, one line
    for args in (["org/sharded", "--revision", "v2"], ["org/other"]):
        r = run_cli([*args, "--to", "bf16", "-o", str(tmp_path / "o3")], down)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "HUB-001" in r.stderr and re.search(r"\((ConnectError|ConnectionError)\b", r.stderr), r.stderr
    assert not (tmp_path / "o3").exists()


def test_online_revision_and_errors(fakehub, tmp_path: Path) -> None:
    hub, env = fakehub
    r = run_cli(["org/sharded", "--revision", "v2", "--to", "bf16", "-o", str(tmp_path / "o")], env)
    assert r.returncode == 0, r.stderr
    assert_same_tensors(load_all(tmp_path / "o"), _bf16_reference("llama_fp4_nodq"))
    r = run_cli(["org/nothing", "--to", "bf16", "-o", str(tmp_path / "o2")], env)
    assert r.returncode == 2
    assert "cannot fetch Hub repo 'org/nothing' at revision 'main' (RepositoryNotFoundError" in r.stderr
    assert "Hint: check the repo id; for a private or gated repo set HF_TOKEN" in r.stderr
    r = run_cli(["org/sharded", "--revision", "v9", "--to", "bf16", "-o", str(tmp_path / "o3")], env)
    assert r.returncode == 2
    assert "(RevisionNotFoundError" in r.stderr


def test_online_disk_preflight_counts_download_and_output(fakehub, tmp_path: Path) -> None:
    hub, env = fakehub
    code = (
        "import shutil, sys, collections\n"
        "U = collections.namedtuple('U', 'total used free')\n"
        "shutil.disk_usage = lambda p: U(10**9, 10**9 - 3_000_000, 3_000_000)\n"
        "from convert.cli import main\n"
        f"sys.exit(main(['org/sharded', '--to', 'bf16', '-o', {str(tmp_path / 'out')!r}]))\n"
    )
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    download = sum(_size(n) for n in NEEDED)
    need = download + 3975680  # + the bf16 output, estimated from the safetensors headers the Hub serves
    assert (f"not enough free disk space for the download and the output (expected '>= {need} bytes free "
            f"({download} to download + 3975680 of output)', found '3000000 bytes free')") in r.stderr
    assert hub.full_downloads == ["org/sharded/model.safetensors.index.json"]  # only to learn the shards
    assert not (tmp_path / "out").exists()
