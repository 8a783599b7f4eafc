"""``convert-bnb SRC --to T -o OUT --push-to-hub ORG/NAME``: the upload, its card, and what a refused or offline
push leaves, against a local fake Hub (the real huggingface_hub client over HTTP; never the network)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from convert.hub.card import CardSource, base_model_relation, model_card, published_command, source_license
from convert.hub.publish import RECORD_MARK
from convert.hub.upload import UPLOAD_MARK
from convert.options import target_for
from convert.output import file_manifest
from tests.helpers.fakehub import FakeHub
from tests.helpers.fixtures import FIXTURES, MODELS
from tests.helpers.hubcache import commit_sha, copy_model, offline_env, run_cli

SRC = commit_sha("push-src")
CARD = b"---\nlicense: apache-2.0\nlanguage: en\n---\n# m\n\nThe source's own card.\n"
ADAPTER = FIXTURES / "lora" / "adapter"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    h = FakeHub()
    files: dict[str, bytes | Path] = {p.name: p for p in (MODELS / "llama_nf4_dq").iterdir() if p.is_file()}
    h.add("org/m", SRC, {**files, "README.md": CARD})
    h.start()
    yield h
    h.stop()


def _env(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    env = offline_env(tmp_path, tmp_path / "cache")
    del env["HF_HUB_OFFLINE"]
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_fake_token_for_the_local_server")
    return env


def _pushed(hub: FakeHub, repo: str, branch: str = "main") -> dict[str, bytes]:
    r = hub.repos[repo]
    return r["commits"][r["refs"][branch]]


def _card(text: str) -> tuple[dict, str]:
    from huggingface_hub import ModelCard

    card = ModelCard(text)
    return card.data.to_dict(), card.text


def _stat(path: Path) -> dict[str, tuple[int, int]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


def test_single_run_pushes_the_output_and_a_card(hub: FakeHub, tmp_path: Path) -> None:
    out = tmp_path / "out" / "m-bf16"
    args = ["org/m", "--to", "bf16", "-o", str(out), "--push-to-hub", "me/m-bf16", "--json"]
    r = run_cli(args, _env(tmp_path, hub))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    (commit,) = hub.commits
    assert res["push"] == {"repo": "me/m-bf16", "revision": None, "private": False, "converted": True,
                           "files": 7, "method": "commit", "commit": commit["commit"], "uploaded": True,
                           "bytes": sum(len(b) for b in _pushed(hub, "me/m-bf16").values())}
    assert hub.created == [{"repo_id": "me/m-bf16", "private": False, "type": "model"}] and hub.branches == []
    assert (commit["summary"], commit["revision"]) == ("convert-bnb 0.1.0: org/m --to bf16", "main")
    pushed = _pushed(hub, "me/m-bf16")
    # every file of the output but the source's own card, which the pushed card replaces
    assert (out / "README.md").read_bytes() == CARD
    assert {k: v for k, v in pushed.items() if k != "README.md"} == {
        p.name: p.read_bytes() for p in out.iterdir() if p.name != "README.md"}
    data, text = _card(pushed["README.md"].decode())
    assert data == {"base_model": "org/m", "library_name": "transformers", "license": "apache-2.0",
                    "tags": ["convert-bnb", "bitsandbytes-dequantized"]}  # a dequantized copy: no relation
    assert f"- repo: org/m\n- revision: main (default branch)\n- commit: {SRC}\n" in text
    assert "- quantization: nf4, blocksize 64, nested (blocksize 256, float32), dtype bfloat16, storage U8: 14 layers" \
        in text
    assert ("## Verification\n\n- re-read and checked (headers, sizes, tensors) before it was committed\n"
            f"- 21 tensors, 1987840 values, {res['bytes_out']} bytes written\n") in text
    assert "```\nconvert-bnb org/m --to bf16 -o m-bf16 --push-to-hub me/m-bf16 --json\n```" in text
    assert str(tmp_path) not in text  # no path of this machine
    for rel, rec in file_manifest(out).items():
        assert (f"| {rel} | {rec['bytes']} | {rec['sha256']} |" in text) is (rel != "README.md")
    record = json.loads((out.parent / f".m-bf16{RECORD_MARK}").read_text())
    assert record["pushed"] == {"repo": "me/m-bf16", "revision": None, "key": record["key"],
                                "commit": commit["commit"], "method": "commit"}
    assert record["files"] == res["files"] == file_manifest(out)
    # the same command again: the Hub source resolved (its snapshot is cached), nothing converted or uploaded
    downloads, before = list(hub.full_downloads), _stat(out)
    r = run_cli(args, _env(tmp_path, hub))
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert (again["push"]["converted"], again["push"]["uploaded"], again["push"]["method"]) == (False, False, "none")
    assert hub.full_downloads == downloads and _stat(out) == before and len(hub.commits) == 1


def test_merged_gguf_to_a_private_branch(hub: FakeHub, tmp_path: Path) -> None:
    """--private creates the repo private; --push-revision pushes to a branch made from main, main untouched;
    a merge is base_model_relation merge; the GGUF's figures are on the card."""
    out = tmp_path / "out"
    args = ["org/m", "--to", "gguf:q8_0", "--merge-lora", str(ADAPTER), "-o", f"{out}/", "--push-to-hub", "me/m-gguf",
            "--private", "--push-revision", "dev", "--json"]
    r = run_cli(args, _env(tmp_path, hub))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    gguf = Path(res["output"])
    assert gguf.parent == out and gguf.suffix == ".gguf"
    assert hub.created == [{"repo_id": "me/m-gguf", "private": True, "type": "model"}]
    assert hub.branches == [{"repo_id": "me/m-gguf", "branch": "dev"}]
    assert [c["revision"] for c in hub.commits] == ["dev"]
    assert _pushed(hub, "me/m-gguf", "main") == {}  # the default branch keeps its first (empty) commit
    pushed = _pushed(hub, "me/m-gguf", "dev")
    assert pushed[gguf.name] == gguf.read_bytes() and set(pushed) == {gguf.name, "README.md"}
    data, text = _card(pushed["README.md"].decode())
    assert data == {"base_model": "org/m", "library_name": "gguf", "license": "apache-2.0",
                    "tags": ["convert-bnb", "gguf"], "base_model_relation": "merge"}
    assert "- merged LoRA adapter: adapter\n" in text
    types = ", ".join(f"{k} x{v}" for k, v in sorted(res["gguf"]["type_counts"].items()))
    assert f"- GGML types: {types}\n" in text
    errs = [t["rel_rms_error"] for t in res["gguf"]["tensors"]]
    assert f"relative RMS error against the dequantized weights: mean {sum(errs) / len(errs):.6f}, " \
           f"max {max(errs):.6f}" in text
    assert ("convert-bnb org/m --to gguf:q8_0 --merge-lora adapter -o out/ --push-to-hub me/m-gguf --private "
            "--push-revision dev --json") in text
    assert res["push"]["revision"] == "dev" and res["push"]["private"] is True


def test_large_outputs_go_up_through_the_folder_upload(hub: FakeHub, tmp_path: Path) -> None:
    """Over --push-large-size the output goes up with upload_folder from a folder of links beside it and the card;
    the output is never written into. A refused upload keeps that folder (one line, no commit) and the same
    command uploads from it without converting; a done one removes it. What an earlier try or an older version
    left in the folder (a stale link, upload_large_folder's ``.cache/huggingface/``) is not uploaded.

    The same path under every huggingface_hub (0.23 on): the fake Hub speaks no Xet (HF_HUB_DISABLE_XET), so
    upload_folder is one create_commit with the run's message everywhere; the streamed several-commit upload
    it makes with hf_xet (huggingface_hub 1.20 on) is not exercised here."""
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m-nf4")
    out = tmp_path / "m-4bit"
    args = [str(src), "--to", "nf4", "--requantize", "-o", str(out), "--push-to-hub", "me/m-nf4", "--push-large-size",
            "1000", "--json"]
    env = _env(tmp_path, hub)
    hub.refuse_commits = 403
    r = run_cli(args, env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("convert-bnb: error: HUB-003 cannot push to 'me/m-nf4' (HfHubHTTPError: 403 "), r.stderr
    assert hub.commits == [] and json.loads(r.stdout)["rule"] == "HUB-003"
    folder = tmp_path / f".m-4bit{UPLOAD_MARK}"
    links = {p.name: os.readlink(p) for p in folder.iterdir() if p.is_symlink()}
    assert links == {p.name: str(p) for p in out.iterdir()}  # links to the output's files, and the card
    assert sorted(p.name for p in folder.iterdir()) == sorted([*links, "README.md"])
    assert (folder / "README.md").read_text().startswith("---\nlibrary_name: transformers\n")
    stale = folder / ".cache" / "huggingface" / "upload" / "config.json.metadata"
    stale.parent.mkdir(parents=True)
    stale.write_text("an older convert-bnb's upload_large_folder progress\n")
    (folder / "old.bin").symlink_to(src / "config.json")
    before = _stat(out)
    hub.refuse_commits = None
    r = run_cli(args, env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    push = json.loads(r.stdout)["push"]
    (commit,) = hub.commits
    assert (commit["summary"], commit["revision"]) == ("convert-bnb 0.1.0: m-nf4 --to nf4", "main")
    assert (push["method"], push["converted"], push["uploaded"], push["commit"]) == (
        "large-folder", False, True, commit["commit"])
    assert json.loads((tmp_path / f".m-4bit{RECORD_MARK}").read_text())["pushed"]["commit"] == commit["commit"]
    assert not folder.exists() and _stat(out) == before
    pushed = _pushed(hub, "me/m-nf4")
    assert {k: v for k, v in pushed.items() if k != "README.md"} == {p.name: p.read_bytes() for p in out.iterdir()}
    assert push["files"] == len(pushed) and push["bytes"] == sum(len(b) for b in pushed.values())
    data, text = _card(pushed["README.md"].decode())
    assert "base_model" not in data and "base_model_relation" not in data  # a local source: no Hub base model
    assert data["tags"] == ["convert-bnb", "bitsandbytes", "4-bit", "nf4"]
    assert "- path: m-nf4\n" in text
    assert "\n- relative error: mean 0.0017, max 0.0023; 14 of 14 layers have outlier blocks" in text  # (--json: exact)


def test_refused_push_keeps_the_output_and_the_same_command_only_uploads(hub: FakeHub, tmp_path: Path) -> None:
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "m-bf16"
    args = [str(src), "--to", "bf16", "-o", str(out), "--push-to-hub", "me/m"]
    env = _env(tmp_path, hub)
    hub.refuse = 401  # no token, or one that may not write
    r = run_cli(args, env)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    # huggingface_hub's words: "Client error '401 Unauthorized' for url" (1.x on), "401 Client Error: Unauthorized
    # for url" (0.x)
    assert re.search(r"\(HfHubHTTPError: [^)]*\b401\b[^)]*Unauthorized", r.stderr), r.stderr
    assert r.stderr.startswith("convert-bnb: error: HUB-003 cannot push to 'me/m' (HfHubHTTPError: ")
    record = tmp_path / f".m-bf16{RECORD_MARK}"
    assert r.stderr.endswith(f". Hint: the output is kept ({out}) and recorded in '{record}': run the same command "
                             "again, with the same --push-to-hub, to upload it only (no conversion)\n"), r.stderr
    reference = run_cli([str(src), "--to", "bf16", "-o", str(tmp_path / "plain")], env)
    assert reference.returncode == 0, reference.stderr
    assert file_manifest(out) == file_manifest(tmp_path / "plain")  # complete: a plain run's bytes
    record = json.loads((tmp_path / f".m-bf16{RECORD_MARK}").read_text())
    assert "pushed" not in record and record["files"] == file_manifest(out)
    assert (hub.created, hub.commits) == ([], [])
    before = _stat(out)
    hub.refuse = None
    # the dry run says what the run does: upload the recorded output as it is (no --overwrite needed)
    r = run_cli([*args, "--dry-run"], env)
    assert r.returncode == 0 and "--overwrite needed" not in r.stdout, r.stdout
    assert ("me/m (the default branch) without converting: the output in place is an earlier run's with these "
            f"settings (its record .m-bf16{RECORD_MARK} and files match)") in r.stdout
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith(f"kept {out}: 3.87 MiB, made by an earlier run\n")
    assert r.stderr.endswith(f"pushed to me/m: 7 files, {_size(hub, 'me/m')} in one commit "
                             f"(commit {hub.commits[0]['commit']})\n")
    assert _stat(out) == before and len(hub.commits) == 1  # not converted again; uploaded once
    r = run_cli([*args, "--json"], env)  # pushed already: nothing to do
    assert r.returncode == 0, r.stderr
    push = json.loads(r.stdout)["push"]
    assert (push["uploaded"], push["converted"], push["commit"]) == (False, False, hub.commits[0]["commit"])
    assert len(hub.commits) == 1 and len(hub.created) == 1 and _stat(out) == before
    r = run_cli([*args, "--push-revision", "v2"], env)  # another branch: uploaded there, not converted again
    assert r.returncode == 0, r.stderr
    assert [c["revision"] for c in hub.commits] == ["main", "v2"] and _stat(out) == before
    # an output the record does not describe is refused as any existing output
    r = run_cli([str(src), "--to", "fp16", "-o", str(out), "--push-to-hub", "me/m"], env)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr
    (tmp_path / f".m-bf16{RECORD_MARK}").unlink()
    r = run_cli(args, env)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr
    assert len(hub.commits) == 2 and _stat(out) == before


def _size(hub: FakeHub, repo: str) -> str:
    from convert.units import format_bytes

    return format_bytes(sum(len(b) for b in _pushed(hub, repo).values()))


def test_offline_push_is_one_line_exit_2_and_keeps_the_output(tmp_path: Path) -> None:
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "m-bf16"
    record = tmp_path / f".m-bf16{RECORD_MARK}"
    r = run_cli([str(src), "--to", "bf16", "-o", str(out), "--push-to-hub", "me/m", "--json"], offline_env(tmp_path))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "convert-bnb: error: HUB-003 cannot push to 'me/m' (OfflineModeIsEnabled: ")
    fail = json.loads(r.stdout)
    assert (fail["ok"], fail["rule"], fail["error"]) == (False, "HUB-003", "HubUploadError")
    assert fail["hint"] == (f"the output is kept ({out}) and recorded in '{record}': run the same command again, with "
                            "the same --push-to-hub, to upload it only (no conversion)")
    assert (out / "model.safetensors").is_file()
    assert json.loads(record.read_text())["files"] == file_manifest(out)


def test_an_output_replaced_without_push_loses_its_stale_record(tmp_path: Path) -> None:
    """The record of a refused push describes its output: a run without --push-to-hub refused (OUT-001) keeps it;
    one that replaces the output (--overwrite) removes it, so the push command no longer takes the new output for
    the recorded one (OUT-001, as any output without a record). Several targets: the records of the outputs
    replaced go, the others stay."""
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "m-bf16"
    record = tmp_path / f".m-bf16{RECORD_MARK}"
    push = [str(src), "--to", "bf16", "-o", str(out), "--push-to-hub", "me/m"]
    env = offline_env(tmp_path)
    assert run_cli(push, env).returncode == 2 and record.is_file()
    r = run_cli([str(src), "--to", "bf16", "-o", str(out)], env)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr and record.is_file()
    r = run_cli([str(src), "--to", "bf16", "-o", str(out), "--overwrite", "--max-shard-size", "1MB"], env)
    assert r.returncode == 0, r.stderr
    assert not record.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m", "m-bf16"]
    r = run_cli(push, env)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr and not record.exists()
    folder = tmp_path / "set"
    several = [str(src), "--to", "bf16,gguf:q8_0", "-o", str(folder)]
    r = run_cli([*several, "--push-to-hub", "me"], env)
    assert r.returncode == 2 and "HUB-003" in r.stderr
    records = sorted(p.name for p in folder.glob(f".*{RECORD_MARK}"))
    assert records == [f".M-2.0M-Q8_0.gguf{RECORD_MARK}", f".m-bf16{RECORD_MARK}"]
    r = run_cli([str(src), "--to", "gguf:q8_0", "-o", str(folder / "M-2.0M-Q8_0.gguf"), "--overwrite"], env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in folder.glob(f".*{RECORD_MARK}")) == [f".m-bf16{RECORD_MARK}"]
    assert run_cli([*several, "--overwrite"], env).returncode == 0
    assert list(folder.glob(f".*{RECORD_MARK}")) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--private"], "USE-001 --private needs --push-to-hub REPO"),
    (["--push-revision", "dev"], "USE-001 --push-revision needs --push-to-hub REPO"),
    (["--push-to-hub", "not-a-repo"], "USE-001 --push-to-hub needs a Hub repo id (not of the form org/name) "
                                      "(expected 'org/name', found 'not-a-repo')"),
    # (huggingface_hub's validate_repo_id: what the upload would refuse after the conversion)
    (["--push-to-hub", "a--b/x"], "USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. in repo_id) "
                                  "(expected 'org/name', found 'a--b/x')"),
    (["--push-to-hub", "me/bad name"], "USE-001 --push-to-hub needs a Hub repo id (Repo id must use alphanumeric"),
    (["--push-to-hub", "a" * 100 + "/x"], "the maximum length is 96"),
    (["--push-to-hub", "me/m", "--push-revision", "a b"], "USE-001 --push-revision needs a branch name"),
    (["--to", "bf16,nf4", "--push-to-hub", "a--b"], "USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. "
                                                    "in repo_id) (expected 'an organisation or user name', found "
                                                    "'a--b')"),
    (["--to", "bf16,nf4", "--push-to-hub", "me/x"], "USE-001 --push-to-hub with several --to targets takes an "
                                                    "organisation or user"),
])
def test_push_options_are_checked_before_anything_is_converted(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "o"
    r = run_cli([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "-o", str(out), *args], offline_env(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not out.exists()


def test_an_output_name_the_hub_refuses_is_refused_before_converting(tmp_path: Path) -> None:
    """Several targets pushed to ORG/<each output's name>: a name the Hub refuses (a source named ``my--model``)
    is refused before anything is converted."""
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "my--model")
    out = tmp_path / "o"
    r = run_cli([str(src), "--to", "bf16,nf4", "-o", str(out), "--push-to-hub", "me"], offline_env(tmp_path))
    assert r.returncode == 2 and r.stderr == (
        "convert-bnb: error: USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. in repo_id) (expected "
        "\"ORG/<the output's name>\", found 'me/my--model-bf16')\n"), r.stderr
    assert not out.exists()


def test_dry_run_shows_the_push_and_writes_nothing(tmp_path: Path) -> None:
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    (src / "README.md").write_bytes(CARD)
    out = tmp_path / "o"
    args = [str(src), "--to", "gguf:q4_k_m", "-o", str(out), "--push-to-hub", "me/m", "--private", "--dry-run"]
    r = run_cli(args, offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "  push: me/m (the default branch, private) after the conversion, in one commit (outputs over 5GB go up " \
           "resumably)\n" in r.stdout
    r = run_cli([*args, "--json"], offline_env(tmp_path))
    push = json.loads(r.stdout)["push"]
    assert (push["create_repo"], push["method"]) == (
        {"repo_id": "me/m", "repo_type": "model", "private": True, "exist_ok": True}, "commit")
    data, _ = _card(push["card"])
    assert data == {"library_name": "gguf", "license": "apache-2.0", "tags": ["convert-bnb", "gguf"]}
    assert not out.exists() and not list(tmp_path.glob(f".*{RECORD_MARK}"))


def test_single_run_pushes_the_modelfile_and_keeps_it_in_the_record(hub: FakeHub, tmp_path: Path) -> None:
    """--modelfile (and --mmproj) with --push-to-hub: the Modelfile and the projector go up with the GGUF (as a
    batch's), are in the record, and a re-run finds them in place (nothing converted or uploaded again)."""
    out = tmp_path / "out"
    args = [str(MODELS / "gemma3cg_nf4_dq"), "--to", "gguf:q8_0", "-o", str(out / "m.gguf"), "--modelfile",
            "--mmproj", str(out / "mmproj-m.gguf"), "--push-to-hub", "me/m-gguf", "--json"]
    env = _env(tmp_path, hub)
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    pushed = _pushed(hub, "me/m-gguf")
    assert sorted(pushed) == ["Modelfile", "README.md", "m.gguf", "mmproj-m.gguf"]
    assert {k: v for k, v in pushed.items() if k != "README.md"} == {p.name: p.read_bytes() for p in out.iterdir()
                                                                     if not p.name.startswith(".")}
    assert record_files(out, "mmproj_files") == file_manifest(out / "mmproj-m.gguf")
    assert res["push"]["files"] == 4 and res["push"]["bytes"] == sum(len(b) for b in pushed.values())
    record = json.loads((out / f".m.gguf{RECORD_MARK}").read_text())
    assert record["modelfile_files"] == file_manifest(out / "Modelfile") == {"Modelfile": {
        "bytes": len(pushed["Modelfile"]), "sha256": hashlib.sha256(pushed["Modelfile"]).hexdigest()}}
    _, text = _card(pushed["README.md"].decode())
    assert f"| Modelfile | {len(pushed['Modelfile'])} | {hashlib.sha256(pushed['Modelfile']).hexdigest()} |" in text
    before = _stat(out)
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    push = json.loads(r.stdout)["push"]
    assert (push["converted"], push["uploaded"], push["files"]) == (False, False, 4)
    assert _stat(out) == before and len(hub.commits) == 1


def record_files(out: Path, key: str) -> dict:
    return json.loads((out / f".m.gguf{RECORD_MARK}").read_text())[key]


def test_a_pushed_gguf_lora_adapter_has_an_adapters_card(hub: FakeHub, tmp_path: Path) -> None:
    """A GGUF LoRA adapter's card: base_model the base repo, base_model_relation adapter, what the file is, and
    how PEFT's scale was carried (rsLoRA: alpha rescaled); a local base is named by its folder only."""
    adapter = tmp_path / "ad"
    adapter.mkdir()
    for f in ADAPTER.iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((ADAPTER / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    env = _env(tmp_path, hub)
    r = run_cli([str(adapter), "--to", "gguf:q8_0", "--base", "org/m", "-o", str(tmp_path / "a.gguf"),
                 "--push-to-hub", "me/a", "--json"], env)
    assert r.returncode == 0, r.stderr
    pushed = _pushed(hub, "me/a")
    assert sorted(pushed) == ["README.md", "a.gguf"]
    data, text = _card(pushed["README.md"].decode())
    assert data == {"base_model": "org/m", "base_model_relation": "adapter", "library_name": "gguf",
                    "tags": ["convert-bnb", "gguf", "lora"]}
    assert "The PEFT LoRA adapter `ad` converted by convert-bnb" in text
    assert ("A GGUF LoRA adapter (`general.type` adapter) for llama.cpp, for the base model "
            "[org/m](https://huggingface.co/org/m)") in text
    assert "dequantiz" not in text.lower() and "relative RMS error against the adapter's lora_A/lora_B values: " in text
    alpha = 16 * 8 ** 0.5  # rsLoRA: lora_alpha * sqrt(r), as float32
    import numpy as np
    assert f"- base model: org/m\n- scale: adapter.lora.alpha = {float(np.float32(alpha))!r} (lora_alpha 16): " \
           "use_rslora" in text
    r = run_cli([str(ADAPTER), "--to", "gguf", "--base", str(MODELS / "llama_orig_bf16"), "-o",
                 str(tmp_path / "b.gguf"), "--push-to-hub", "me/b"], env)
    assert r.returncode == 0, r.stderr
    data, text = _card(_pushed(hub, "me/b")["README.md"].decode())
    assert "base_model" not in data and "base_model_relation" not in data  # a local base: no Hub repo to name
    assert "for the base model `llama_orig_bf16`" in text and "- base model: llama_orig_bf16\n" in text
    assert "- scale:" not in text and str(tmp_path) not in text and str(MODELS) not in text


def test_a_hub_adapter_s_card_names_its_repo_and_a_rerun_keeps_it(hub: FakeHub, tmp_path: Path) -> None:
    """A Hub adapter as SRC: the card names the adapter repo (revision, commit) as the source and carries its card's
    license, the base repo as base_model; the same command again finds the output recorded under the repo's key
    (job_key: the repo id and commit) and pushed, and does nothing; another --base is another key (OUT-001)."""
    card = (ADAPTER / "README.md").read_text().replace("---\n", "---\nlicense: mit\n", 1)
    commit = commit_sha("hub-adapter")
    hub.add("org/ad", commit, {"adapter_config.json": ADAPTER / "adapter_config.json",
                               "adapter_model.safetensors": ADAPTER / "adapter_model.safetensors",
                               "README.md": card.encode()}, refs=("main", "v1"))
    env = _env(tmp_path, hub)
    args = ["org/ad@v1", "--to", "gguf:q8_0", "--base", "org/m", "-o", str(tmp_path / "a.gguf"), "--push-to-hub",
            "me/a", "--json"]
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["push"]["converted"] is True
    pushed = _pushed(hub, "me/a")
    assert sorted(pushed) == ["README.md", "a.gguf"] and pushed["a.gguf"] == (tmp_path / "a.gguf").read_bytes()
    data, text = _card(pushed["README.md"].decode())
    assert data == {"base_model": "org/m", "base_model_relation": "adapter", "library_name": "gguf", "license": "mit",
                    "tags": ["convert-bnb", "gguf", "lora"]}
    assert "The PEFT LoRA adapter [org/ad](https://huggingface.co/org/ad) converted by convert-bnb" in text
    assert f"## Source\n\n- repo: org/ad\n- revision: v1\n- commit: {commit}\n- base model: org/m\n" in text
    assert hub.commits[-1]["summary"] == "convert-bnb 0.1.0: org/ad --to gguf:q8_0"
    record = json.loads((tmp_path / f".a.gguf{RECORD_MARK}").read_text())
    assert (record["key"]["source"], record["key"]["commit"], record["key"]["base"]) == ("org/ad", commit, "org/m")
    before = _stat(tmp_path / "a.gguf")
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    push = json.loads(r.stdout)["push"]
    assert (push["converted"], push["uploaded"]) == (False, False) and len(hub.commits) == 1
    assert _stat(tmp_path / "a.gguf") == before
    local_base = [a if a != "org/m" else str(MODELS / "llama_orig_bf16") for a in args]
    r = run_cli(local_base, env)
    assert r.returncode == 2 and "OUT-001 output exists" in r.stderr, r.stderr
    assert len(hub.commits) == 1


def test_dry_run_plans_the_outputs_files_with_their_planned_sizes(tmp_path: Path) -> None:
    """--dry-run --json with --push-to-hub: the operations are the output's files with their planned bytes (the
    Modelfile's exact bytes and sha256), and the method follows their total."""
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "o"
    r = run_cli([str(src), "--to", "gguf:q8_0", "-o", str(out / "m.gguf"), "--modelfile", "--push-to-hub", "me/m",
                 "--dry-run", "--json"], offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    push, text = res["push"], res["modelfile"]["text"].encode()
    ops = {o["path_in_repo"]: (o["bytes"], o["from"]) for o in push["commit"]["operations"]}
    assert ops == {"m.gguf": (res["out_bytes"], str(out / "m.gguf")), "Modelfile": (len(text), str(out / "Modelfile")),
                   "README.md": (len(push["card"].encode()), "model card")}
    assert push["bytes"] == sum(b for b, _ in ops.values()) and push["method"] == "commit"
    assert f"| Modelfile | {len(text)} | {hashlib.sha256(text).hexdigest()} |" in push["card"]
    assert f"| m.gguf | {res['out_bytes']} | (after conversion) |" in push["card"]
    r = run_cli([str(src), "--to", "bf16", "-o", str(out), "--push-to-hub", "me/m", "--push-large-size", "3MB",
                 "--dry-run", "--json"], offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    ops = {o["path_in_repo"]: o["bytes"] for o in res["push"]["commit"]["operations"]}
    extras = {p.name: p.stat().st_size for p in src.iterdir() if not p.name.endswith(".safetensors")}
    assert ops == {"model.safetensors": 3975680, **extras, "README.md": len(res["push"]["card"].encode())}
    assert res["push"]["method"] == "large-folder" and not out.exists()


# ---------------------------------------------------------------- the card's parts


@pytest.mark.parametrize(("to", "merged", "relation"), [
    ("auto", False, None), ("bf16", False, None), ("fp32", False, None), ("nf4", False, "quantized"),
    ("fp4", False, "quantized"), ("gguf", False, "quantized"), ("gguf:q4_k_m", False, "quantized"),
    ("bf16", True, "merge"), ("gguf:q8_0", True, "merge"),
])
def test_base_model_relation_takes_the_hubs_values(to: str, merged: bool, relation: str | None) -> None:
    target = target_for(to)
    assert base_model_relation(target, merged) == relation
    data, _ = _card(model_card("x", target, CardSource("org/m", "org/m"), {}, command="c",
                               merged=["a"] if merged else []))
    assert data.get("base_model_relation") == relation
    data, _ = _card(model_card("x", target, CardSource(None, "m"), {}, command="c"))
    assert "base_model_relation" not in data and "base_model" not in data  # a local source has no Hub base


def test_source_license_is_carried_and_a_relative_link_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("---\nlicense: other\nlicense_name: llama3\nlicense_link: LICENSE\n---\nx\n")
    assert source_license(tmp_path, "org/m", "c" * 40) == {
        "license": "other", "license_name": "llama3",
        "license_link": f"https://huggingface.co/org/m/blob/{'c' * 40}/LICENSE"}
    assert source_license(tmp_path)["license_link"] == "LICENSE"  # a local source's link stays as it is
    (tmp_path / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    assert source_license(tmp_path) == {}  # a card that does not parse carries nothing
    assert source_license(tmp_path / "none") == {}


def test_published_command_shows_local_paths_by_their_last_component(tmp_path: Path) -> None:
    (tmp_path / "model dir").mkdir()
    argv = [str(tmp_path / "model dir"), "--to", "bf16", "-o", "/home/someone/out/m-bf16/", "--merge-lora",
            str(tmp_path), f"--report={tmp_path}/r.json", "--push-to-hub", "me/m", "--revision", "v2"]
    assert published_command(argv) == (f"convert-bnb 'model dir' --to bf16 -o m-bf16/ --merge-lora {tmp_path.name} "
                                       "--report=r.json --push-to-hub me/m --revision v2")


def test_several_targets_push_each_output_to_a_repo_of_its_own(hub: FakeHub, tmp_path: Path) -> None:
    """--push-to-hub ORG with several targets: each output to ORG/<its name> with its own card and record; a
    refused upload keeps every output recorded; the same command then uploads without converting; a missing
    output is made again alone and only it is uploaded."""
    out = tmp_path / "set"
    args = ["org/m", "--to", "bf16,gguf:q8_0", "-o", str(out), "--push-to-hub", "me"]
    env = _env(tmp_path, hub)
    hub.refuse_commits = 403
    r = run_cli(args, env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    # every repo not pushed is named (one cause, given once); the hint names each record
    assert re.match(r"convert-bnb: error: HUB-003 cannot push to 'me/m-bf16', 'me/org-m-2.0M-Q8_0' \(HfHubHTTPError: "
                    r"[^;]*\b403\b[^;]*\)\. Hint: ", r.stderr), r.stderr
    assert r.stderr.endswith(f". Hint: the outputs are kept and recorded in '.m-bf16{RECORD_MARK}', "
                             f"'.org-m-2.0M-Q8_0.gguf{RECORD_MARK}' (in '{out}'): run the same command again, with the "
                             "same --push-to-hub, to upload them only (no conversion)\n"), r.stderr
    bf16, gguf = out / "m-bf16", out / "org-m-2.0M-Q8_0.gguf"
    for o in (bf16, gguf):  # both complete and recorded before the first upload
        assert json.loads((out / f".{o.name}{RECORD_MARK}").read_text())["files"] == file_manifest(o)
    plain = run_cli(["org/m", "--to", "gguf:q8_0", "-o", str(tmp_path / "one.gguf")], env)
    assert plain.returncode == 0, plain.stderr
    assert gguf.read_bytes() == (tmp_path / "one.gguf").read_bytes()  # a single run's bytes
    before = {**_stat(bf16), **_stat(gguf)}
    hub.refuse_commits = None
    r = run_cli([*args, "--json"], env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [o["to"] for o in res["outputs"]] == ["bf16", "gguf:q8_0"]
    assert [(o["push"]["repo"], o["push"]["converted"], o["push"]["uploaded"]) for o in res["outputs"]] == [
        ("me/m-bf16", False, True), ("me/org-m-2.0M-Q8_0", False, True)]
    assert {**_stat(bf16), **_stat(gguf)} == before  # not converted again
    assert {k: v for k, v in _pushed(hub, "me/m-bf16").items() if k != "README.md"} == {
        p.name: p.read_bytes() for p in bf16.iterdir() if p.name != "README.md"}
    assert set(_pushed(hub, "me/org-m-2.0M-Q8_0")) == {gguf.name, "README.md"}
    assert _pushed(hub, "me/org-m-2.0M-Q8_0")[gguf.name] == gguf.read_bytes()
    data, text = _card(_pushed(hub, "me/org-m-2.0M-Q8_0")["README.md"].decode())
    assert data == {"base_model": "org/m", "base_model_relation": "quantized", "library_name": "gguf",
                    "license": "apache-2.0", "tags": ["convert-bnb", "gguf"]}
    assert "```\nconvert-bnb org/m --to bf16,gguf:q8_0 -o set --push-to-hub me --json\n```" in text
    assert _card(_pushed(hub, "me/m-bf16")["README.md"].decode())[0]["library_name"] == "transformers"
    assert [c["summary"] for c in hub.commits] == ["convert-bnb 0.1.0: org/m --to bf16",
                                                   "convert-bnb 0.1.0: org/m --to gguf:q8_0"]
    # one output gone: only it is made (alone) and uploaded; the other is kept and already pushed
    gguf.unlink()
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    assert "already pushed to me/m-bf16" in r.stderr and f"kept {bf16}: " in r.stderr
    assert "note: 1 of 2 outputs made by an earlier run with the same settings" in r.stderr
    assert "wrote 1 output into" in r.stderr and _stat(bf16) == {k: before[k] for k in _stat(bf16)}
    assert gguf.read_bytes() == (tmp_path / "one.gguf").read_bytes()
    assert len(hub.commits) == 3 and hub.commits[-1]["summary"].endswith("--to gguf:q8_0")
    r = run_cli(args, env)  # everything pushed: nothing converted or uploaded
    assert r.returncode == 0 and r.stderr.endswith(f"kept 2 outputs in {out}, made by an earlier run\n"
                                                   f"note: 2 of 2 outputs made by an earlier run with the same "
                                                   "settings: kept, not converted again\n"), r.stderr
    assert len(hub.commits) == 3


def test_several_targets_a_refused_repo_does_not_stop_the_others(hub: FakeHub, tmp_path: Path) -> None:
    """One repo refusing its commit (the first): the other output is still pushed, and the error names only the repo
    not pushed, its record, and the repo that was; the same command then uploads that one alone."""
    out = tmp_path / "set"
    args = ["org/m", "--to", "bf16,gguf:q8_0", "-o", str(out), "--push-to-hub", "me"]
    env = _env(tmp_path, hub)
    hub.refuse_repos = {"me/m-bf16"}
    r = run_cli(args, env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("convert-bnb: error: HUB-003 cannot push to 'me/m-bf16' (HfHubHTTPError: "), r.stderr
    assert "me/org-m-2.0M-Q8_0' (" not in r.stderr
    assert r.stderr.endswith(f". Hint: the output is kept ({out / 'm-bf16'}) and recorded in "
                             f"'{out / ('.m-bf16' + RECORD_MARK)}': run the same command again, with the same "
                             "--push-to-hub, to upload it only (no conversion) (me/org-m-2.0M-Q8_0 pushed)\n"), r.stderr
    assert [c["repo_id"] for c in hub.commits] == ["me/org-m-2.0M-Q8_0"]
    hub.refuse_repos = set()
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    assert [c["repo_id"] for c in hub.commits] == ["me/org-m-2.0M-Q8_0", "me/m-bf16"]


def test_push_refused_names_every_repo_and_each_cause_once() -> None:
    from convert.hub.upload import push_refused
    from formats.errors import HubUploadError

    refused = [("'me/a'", "OfflineModeIsEnabled: offline"), ("'me/b' branch 'v2'", "OfflineModeIsEnabled: offline")]
    same = push_refused(refused, "run it again")
    assert (type(same), same.rule, same.refused) == (HubUploadError, "HUB-003", refused)
    assert str(same) == ("HUB-003 cannot push to 'me/a', 'me/b' branch 'v2' (OfflineModeIsEnabled: offline). Hint: "
                         "run it again")
    differ = push_refused([("'me/a'", "HfHubHTTPError: 401"), ("'me/b'", "HfHubHTTPError: 403")], "h")
    assert str(differ) == ("HUB-003 cannot push to 'me/a' (HfHubHTTPError: 401); cannot push to 'me/b' "
                           "(HfHubHTTPError: 403). Hint: h")


def test_several_targets_dry_run_over_recorded_outputs_only_uploads(tmp_path: Path) -> None:
    """A set whose push was refused (offline) left its outputs complete and recorded: the dry run of the same
    command says each is uploaded without converting, and no output line asks for --overwrite (without
    --push-to-hub, each does)."""
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "set"
    args = [str(src), "--to", "bf16,gguf:q8_0", "-o", str(out), "--push-to-hub", "me"]
    env = offline_env(tmp_path)
    r = run_cli(args, env)
    assert r.returncode == 2 and "HUB-003" in r.stderr, r.stderr
    r = run_cli([*args, "--dry-run"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("without converting: the output in place is an earlier run's") == 2, r.stdout
    assert f"  output: {out / 'm-bf16'}\n" in r.stdout and "--overwrite needed" not in r.stdout, r.stdout
    r = run_cli([*args[:-2], "--dry-run"], env)
    assert r.stdout.count("(exists: --overwrite needed)") == 2, r.stdout


def test_several_targets_dry_run_plans_each_push(tmp_path: Path) -> None:
    src = copy_model(MODELS / "llama_nf4_dq", tmp_path / "m")
    out = tmp_path / "set"
    r = run_cli([str(src), "--to", "bf16,gguf:q8_0", "-o", str(out), "--push-to-hub", "me", "--dry-run"],
                offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(
        "\n  push m-bf16: me/m-bf16 (the default branch) after the conversion, in one commit (outputs over 5GB go up "
        "resumably)\n  push M-2.0M-Q8_0.gguf: me/M-2.0M-Q8_0 (the default branch) after the conversion, in one "
        f"commit (outputs over 5GB go up resumably)\nfolder: {out}\n"), r.stdout
    assert not out.exists() and not list(tmp_path.glob(f"**/.*{RECORD_MARK}"))
