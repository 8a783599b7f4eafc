"""``convert-bnb batch``: three Hub repos (one broken) from an offline cache; kill, resume, push plan."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert.batch.card import model_card
from convert.batch.cli import summary_table
from convert.batch.jobs import Job, parse_jobs
from convert.cli import main
from convert.output import sha256_file
from formats.errors import UsageError
from tests.helpers.batch import broken_model, kill_batch_at_pause, paused_env
from tests.helpers.fakehub import FakeHub, push_env
from tests.helpers.fixtures import MODELS, REFERENCES, ROOT, assert_same_tensors, load_all, read_safetensors
from tests.helpers.hubcache import add_model_dir, commit_sha, offline_env, run_cli
from tests.helpers.imatrix import write_dat_imatrix

JOBS = """\
# three repos; the middle one is broken
org/a --max-shard-size 1MB          # 4-bit nf4 + double quant, 5 shards
org/broken
org/c@main --to fp16 --max-shard-size 1MB   # the sharded input, fp16
"""
A, C = commit_sha("a"), commit_sha("c")


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    cache = tmp_path / "hub"
    add_model_dir(cache, "org/a", MODELS / "llama_nf4_dq", A)
    add_model_dir(cache, "org/c", MODELS / "llama_nf4_dq_sharded", C)
    broken = broken_model(tmp_path / "broken_src")
    add_model_dir(cache, "org/broken", broken, commit_sha("broken"))
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(JOBS)
    return jobs, cache, offline_env(tmp_path, cache)


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _stat(d: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(d.iterdir())}


def _straight(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """The same conversions with the main job, from the fixture directories."""
    ref = tmp_path / "straight"
    assert main([str(MODELS / "llama_nf4_dq"), "--to", "bf16", "--max-shard-size", "1MB", "-o",
                 str(ref / "a-bf16"), "--quiet"]) == 0
    assert main([str(MODELS / "llama_nf4_dq_sharded"), "--to", "fp16", "--max-shard-size", "1MB", "-o",
                 str(ref / "c-main-fp16"), "--quiet"]) == 0
    return {"a-bf16": _files(ref / "a-bf16"), "c-main-fp16": _files(ref / "c-main-fp16")}


def _ledger(out: Path, name: str) -> dict:
    return json.loads((out / f".{name}.convert-bnb-partial" / ".convert-bnb-shards.json").read_text())


def _batch(jobs: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli(["batch", str(jobs), "--out-dir", str(out), "--to", "bf16", "--max-memory", "256MiB", *extra],
                   env)


def test_straight_parallel_run(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    out = tmp_path / "out"
    r = _batch(jobs, out, env, "--jobs", "2", "--json")
    assert r.returncode == 3, r.stderr
    res = {x["name"]: x for x in json.loads(r.stdout)}
    assert [res[n]["status"] for n in ("a-bf16", "broken-bf16", "c-main-fp16")] == ["converted", "failed", "converted"]
    assert "BNB-009 quant_state is not valid JSON" in res["broken-bf16"]["error"]
    assert "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4" in res["broken-bf16"]["error"]
    assert (res["a-bf16"]["commit"], res["c-main-fp16"]["commit"]) == (A, C)
    assert (res["a-bf16"]["shards_written"], res["a-bf16"]["shards_reused"]) == (5, 0)
    assert res["a-bf16"]["bytes_out"] == sum(p.stat().st_size for p in (out / "a-bf16").iterdir())
    straight = _straight(tmp_path)
    assert _files(out / "a-bf16") == straight["a-bf16"]
    assert _files(out / "c-main-fp16") == straight["c-main-fp16"]
    assert_same_tensors(load_all(out / "a-bf16"), read_safetensors(REFERENCES["llama_nf4_dq"]))
    assert sorted(p.name for p in out.iterdir()) == [".convert-bnb", "a-bf16", "c-main-fp16"]
    state = json.loads((out / ".convert-bnb" / "a-bf16.json").read_text())
    assert state["status"] == "done" and state["key"]["commit"] == A and state["key"]["to"] == "bf16"
    assert state["source"] == {"repo": "org/a", "revision": None, "commit": A}
    for rel, rec in state["files"].items():
        assert rec == {"bytes": (out / "a-bf16" / rel).stat().st_size, "sha256": sha256_file(out / "a-bf16" / rel)}
    bad = json.loads((out / ".convert-bnb" / "broken-bf16.json").read_text())
    assert bad["status"] == "failed" and "BNB-009" in bad["error"]


def test_killed_halfway_then_resumed(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    """kill -9 of the batch process alone: its worker dies with it, nothing is marked done that is not
    complete, and an immediate re-run finishes byte-identical to an uninterrupted run."""
    jobs, _cache, env = setup
    out = tmp_path / "out"
    work = out / ".convert-bnb"
    kill_batch_at_pause(jobs, out, env, "c-main-fp16", 2, tmp_path / "c-main-fp16.paused")
    # what the kill left: a done, broken failed, c stopped by its batch's death (PR_SET_PDEATHSIG -> SIGTERM)
    # with 2 recorded shards in its resumable staging
    assert json.loads((work / "a-bf16.json").read_text())["status"] == "done"
    assert json.loads((work / "broken-bf16.json").read_text())["status"] == "failed"
    c_state = json.loads((work / "c-main-fp16.json").read_text())
    assert c_state["status"] == "interrupted"
    partial = out / ".c-main-fp16.convert-bnb-partial"
    assert c_state["error"] == (f"interrupted; its finished shards are kept in {partial} and reused when the batch "
                                "is run again")
    ledger = _ledger(out, "c-main-fp16")
    assert len(ledger["shards"]) == 2
    assert not (out / "c-main-fp16").exists()
    partial = out / ".c-main-fp16.convert-bnb-partial"
    first, second = sorted(ledger["shards"])
    # damage the second finished shard without changing its size: the sha256 check must catch it
    raw = bytearray((partial / second).read_bytes())
    raw[-1] ^= 0xFF
    (partial / second).write_bytes(bytes(raw))
    a_before = _stat(out / "a-bf16")
    first_before = (partial / first).stat()

    r = _batch(jobs, out, env, "--json")  # at once: the dead worker's claim on c-main-fp16 is free
    assert r.returncode == 3, r.stderr
    res = {x["name"]: x for x in json.loads(r.stdout)}
    assert res["a-bf16"]["status"] == "skipped"
    assert (res["a-bf16"]["shards_written"], res["a-bf16"]["shards_reused"]) == (0, 0)
    assert res["broken-bf16"]["status"] == "failed"
    assert res["c-main-fp16"]["status"] == "converted", res["c-main-fp16"]["error"]
    assert res["c-main-fp16"]["shards_reused"] == 1  # the intact one; the damaged one is rewritten
    index = json.loads((out / "c-main-fp16" / "model.safetensors.index.json").read_text())
    n_shards = len(set(index["weight_map"].values()))
    assert res["c-main-fp16"]["shards_written"] == n_shards - 1
    # finished work was not redone: same inodes and mtimes
    assert _stat(out / "a-bf16") == a_before
    after = (out / "c-main-fp16" / first).stat()
    assert (after.st_ino, after.st_mtime_ns) == (first_before.st_ino, first_before.st_mtime_ns)
    # and the outputs equal a straight run's, byte for byte
    straight = _straight(tmp_path)
    assert _files(out / "a-bf16") == straight["a-bf16"]
    assert _files(out / "c-main-fp16") == straight["c-main-fp16"]
    assert not partial.exists()
    c_state = json.loads((work / "c-main-fp16.json").read_text())
    assert c_state["status"] == "done" and set(c_state["files"]) == set(straight["c-main-fp16"])
    # a third run redoes nothing
    c_before = _stat(out / "c-main-fp16")
    r = _batch(jobs, out, env, "--json")
    res = {x["name"]: x for x in json.loads(r.stdout)}
    assert [res[n]["status"] for n in ("a-bf16", "broken-bf16", "c-main-fp16")] == ["skipped", "failed", "skipped"]
    assert _stat(out / "c-main-fp16") == c_before and _stat(out / "a-bf16") == a_before


def test_killed_between_commit_and_record(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    """kill -9 of the batch after a worker committed its output but before the state said done: the
    next run recognises the complete output by the manifest written before the commit and records it
    as done (not BATCH-006 'foreign files', not converted again)."""
    jobs, _cache, env = setup
    jobs.write_text("org/a --max-shard-size 1MB\n")
    out = tmp_path / "out"
    work = out / ".convert-bnb"
    kill_batch_at_pause(jobs, out, env, "a-bf16", "commit", tmp_path / "a-bf16.paused")
    state = json.loads((work / "a-bf16.json").read_text())
    assert state["status"] in ("running", "interrupted") and "files" not in state  # not recorded as done
    if state["status"] == "interrupted":
        assert state["error"].startswith("interrupted with an output in place; the next run checks it")
    straight = _straight(tmp_path)
    assert _files(out / "a-bf16") == straight["a-bf16"]  # committed complete, but not recorded
    before = _stat(out / "a-bf16")

    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    (res,) = json.loads(r.stdout)
    assert res["status"] == "skipped" and res["shards_written"] == 0
    assert res["notes"] == ["the output was committed by an earlier run that stopped before recording it"]
    assert _stat(out / "a-bf16") == before and _files(out / "a-bf16") == straight["a-bf16"]
    state = json.loads((work / "a-bf16.json").read_text())
    assert state["status"] == "done" and set(state["files"]) == set(straight["a-bf16"])
    # a file the user adds afterwards is still theirs: a changed setting is refused, nothing removed
    (out / "a-bf16" / "mine.txt").write_text("keep")
    jobs.write_text("org/a --max-shard-size 2MB\n")
    r = _batch(jobs, out, env, "--json", "--overwrite")
    (res,) = json.loads(r.stdout)
    assert (res["status"], res["rule"]) == ("failed", "BATCH-006")
    assert (out / "a-bf16" / "mine.txt").read_text() == "keep"


def test_a_live_worker_of_a_dead_batch_keeps_its_claim(setup: tuple[Path, Path, dict[str, str]],
                                                       tmp_path: Path) -> None:
    """Were a worker to outlive its batch, a re-run's job fails on the output claim (OUT-004) instead of
    writing beside it, and is never marked done; once the worker is gone the job completes."""
    jobs, _cache, env = setup
    jobs.write_text("org/c@main --to fp16 --max-shard-size 1MB\n")
    out = tmp_path / "out"
    from convert.output import OutputClaim

    claim = OutputClaim(out / "c-main-fp16", is_dir=True, nbytes=0, inputs=[], resume_key={"other": "run"})
    with claim:  # held by this process, as a live worker of another batch would hold it
        r = _batch(jobs, out, env, "--json")
        (res,) = json.loads(r.stdout)
        assert (r.returncode, res["status"], res["rule"], res["error_class"]) == (3, "failed", "OUT-004",
                                                                                  "OutputBusyError")
        assert json.loads((out / ".convert-bnb" / "c-main-fp16.json").read_text())["status"] == "failed"
        assert not (out / "c-main-fp16").exists()
    r = _batch(jobs, out, env, "--json")
    assert json.loads(r.stdout)[0]["status"] == "converted", r.stderr
    assert _files(out / "c-main-fp16") == _straight(tmp_path)["c-main-fp16"]


def test_changed_output_or_settings(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    jobs.write_text("org/a --max-shard-size 1MB\n")
    out = tmp_path / "out"
    assert _batch(jobs, out, env).returncode == 0
    victim = out / "a-bf16" / "model-00002-of-00005.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 1
    victim.write_bytes(bytes(raw))
    r = _batch(jobs, out, env, "--json")  # a damaged file of ours: redone
    assert json.loads(r.stdout)[0]["status"] == "converted"
    assert _files(out / "a-bf16") == _straight(tmp_path)["a-bf16"]
    before = _files(out / "a-bf16")
    jobs.write_text("org/a --max-shard-size 2MB --name a-bf16\n")  # other settings: refused without --overwrite
    r = _batch(jobs, out, env, "--json")
    (res,) = json.loads(r.stdout)
    assert (r.returncode, res["status"], res["rule"]) == (3, "failed", "BATCH-005")
    assert "max_shard_size=2000000" in res["error"] and "max_shard_size=1000000" in res["error"]
    assert _files(out / "a-bf16") == before
    (out / "a-bf16" / "notes.txt").write_text("mine")  # a file the batch did not write
    r = _batch(jobs, out, env, "--json", "--overwrite")
    (res,) = json.loads(r.stdout)
    assert (res["status"], res["rule"]) == ("failed", "BATCH-006") and "notes.txt" in res["error"]
    assert _files(out / "a-bf16") == {**before, "notes.txt": b"mine"}
    (out / "a-bf16" / "notes.txt").unlink()
    r = _batch(jobs, out, env, "--json", "--overwrite")
    (res,) = json.loads(r.stdout)
    assert (res["status"], res["shards_reused"], res["shards_written"]) == ("converted", 0, 3)
    assert len(list((out / "a-bf16").glob("model-*.safetensors"))) == 3


def test_user_files_beside_a_finished_output_and_an_empty_folder(setup: tuple[Path, Path, dict[str, str]],
                                                                  tmp_path: Path) -> None:
    jobs, _cache, env = setup
    jobs.write_text("org/a\n")
    out = tmp_path / "out"
    (out / "a-bf16").mkdir(parents=True)  # an empty folder where the output goes: nothing to lose
    r = _batch(jobs, out, env, "--json")
    assert (r.returncode, json.loads(r.stdout)[0]["status"]) == (0, "converted"), r.stderr
    (out / "a-bf16" / "mine.txt").write_text("mine")  # the user's file beside a finished output
    r = _batch(jobs, out, env, "--json")
    assert (r.returncode, json.loads(r.stdout)[0]["status"]) == (0, "skipped"), r.stdout
    assert (out / "a-bf16" / "mine.txt").read_text() == "mine"


def test_summary_table_text(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    r = _batch(jobs, tmp_path / "out", env)
    assert r.returncode == 3
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["job", "status", "shards", "new/kept", "output", "time", "detail"]
    assert lines[1].split()[:3] == ["a-bf16", "converted", "5/0"]
    assert lines[2].split()[:3] == ["broken-bf16", "failed", "0/0"]
    assert lines[3].split()[:3] == ["c-main-fp16", "converted", "5/0"]
    assert lines[-1] == "2 converted, 1 failed of 3 jobs"
    assert "[failed] broken-bf16: " in r.stderr


def test_memory_budget_is_split_between_jobs(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "o"), "--jobs", "3", "--max-memory", "150MiB"], env)
    assert r.returncode == 2
    assert "--max-memory split over --jobs leaves a worker less than 64.00 MiB" in r.stderr
    assert "found '50.00 MiB per job'" in r.stderr
    # --jobs above the number of jobs (3): the budget is split over the jobs there are (66.67 MiB each)
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "o"), "--jobs", "100", "--max-memory", "200MiB",
                 "--dry-run"], env)
    assert (r.returncode, r.stderr) == (3, "")  # planned, not refused (3: a job would fail)
    assert r.stdout.count(": convert\n") == 2 and r.stdout.count(" -> ") == 3


def test_out_dir_under_a_file_is_a_named_error(tmp_path: Path) -> None:
    """--out-dir FILE/x was 'Not a directory (errno 20)' with no rule: the file in the way is named."""
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'}\n")
    (tmp_path / "afile").write_text("mine")
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "afile" / "x" / "y")], offline_env(tmp_path))
    assert (r.returncode, r.stderr) == (2, f"convert-bnb: error: Failed to write '{tmp_path / 'afile'}': USE-003 "
                                           "--out-dir must be a directory (or go under one) (expected 'a directory', "
                                           "found 'a file')\n")
    assert (tmp_path / "afile").read_text() == "mine"


# ---------------------------------------------------------------- push (as far as it goes offline)


def test_push_dry_run_prints_card_and_upload_plan(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    out = tmp_path / "out"
    jobs.write_text("org/a --max-shard-size 1MB\n")
    assert _batch(jobs, out, env).returncode == 0  # a is converted, c is not
    jobs.write_text("org/a --max-shard-size 1MB\norg/c --to fp16 --max-shard-size 3MB\n")
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    a, c = json.loads(r.stdout)
    assert a["action"] == "skip (already converted)" and a["commit"] == A
    assert c["action"] == "convert" and c["commit"] == C
    state = json.loads((out / ".convert-bnb" / "a-bf16.json").read_text())
    card = a["card"]
    assert card.startswith("---\nbase_model: org/a\nlibrary_name: transformers\ntags:\n- convert-bnb\n"
                           "- bitsandbytes-dequantized\n---\n")
    # bf16 rounds the other tensors: only auto/fp32 cards say bit-exact
    assert "bit-exact" not in card and "rounded once to bfloat16" in card
    assert f"- commit: {A}" in card and "- revision: main (default branch)" in card
    assert "| --to | bf16 |" in card and "| --max-shard-size | 1000000 bytes |" in card
    assert "| converter | convert-bnb 0.1.0 |" in card
    assert "- quantization: nf4, blocksize 64, nested (blocksize 256, float32), dtype bfloat16, storage U8: 14 layers" \
        in card
    for rel, rec in state["files"].items():
        assert f"| {rel} | {rec['bytes']} | {rec['sha256']} |" in card
    assert f"convert-bnb org/a --revision {A} --to bf16 --max-shard-size 1000000" in card
    up = a["upload"]
    assert up["create_repo"] == {"repo_id": "me/a-bf16", "repo_type": "model", "private": False, "exist_ok": True}
    ops = {o["path_in_repo"]: o for o in up["commit"]["operations"]}
    assert set(ops) == set(state["files"]) | {"README.md"}
    assert ops["README.md"]["bytes"] == len(card.encode())
    assert ops["config.json"]["from"] == str(out / "a-bf16" / "config.json")
    # c is planned from the cached snapshot: 2 shards of fp16 tensors, hashes after conversion
    cops = {o["path_in_repo"]: o for o in c["upload"]["commit"]["operations"]}
    assert "model-00001-of-00002.safetensors" in cops and "model.safetensors.index.json" in cops
    assert "| model-00001-of-00002.safetensors |" in c["card"] and "(after conversion)" in c["card"]
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run")
    assert "upload: create me/a-bf16 (private=False, exist_ok), one commit 'convert-bnb 0.1.0: org/a --to bf16':" \
        in r.stdout
    assert "  model card:\n    ---\n    base_model: org/a" in r.stdout
    assert not (out / "c-main-fp16").exists()  # a dry run writes nothing


@pytest.mark.parametrize(("org", "jobs_text", "message"), [
    ("a--b", "org/a\n", "USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. in repo_id) (expected 'an "
                        "organisation or user name', found 'a--b')"),
    ("me/x", "org/a\n", "(expected 'an organisation or user name', found 'me/x')"),
    ("me", "org/a --name a--b\n", "USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. in repo_id) "
                                  "(expected \"ORG/<the job's name> (job jobs.txt:1)\", found 'me/a--b')"),
])
def test_push_repos_the_hub_refuses_are_refused_before_any_job(setup: tuple[Path, Path, dict[str, str]],
                                                              tmp_path: Path, org: str, jobs_text: str,
                                                              message: str) -> None:
    """huggingface_hub's repo id rules, checked before any job runs (the dry run too): not a job converted and then
    its upload refused."""
    jobs, _cache, env = setup
    jobs.write_text(jobs_text)
    out = tmp_path / "out"
    for extra in ([], ["--dry-run"]):
        r = _batch(jobs, out, env, "--push-to-hub", org, *extra)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not out.exists()


def test_a_set_jobs_output_repo_the_hub_refuses_fails_it_before_converting(tmp_path: Path) -> None:
    """A job of several targets pushes each output to ORG/<its name>: an output name the Hub refuses (a source
    named ``x--y``) fails the job's plan and the job itself before anything is converted."""
    import shutil

    src = tmp_path / "x--y"
    shutil.copytree(MODELS / "llama_nf4_dq", src, ignore=shutil.ignore_patterns("reference"))
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to bf16,nf4\n")
    out = tmp_path / "out"
    env = offline_env(tmp_path)
    message = ("USE-001 --push-to-hub needs a Hub repo id (Cannot have -- or .. in repo_id) (expected \"ORG/<the "
               "output's name> (job jobs.txt:1)\", found 'me/x--y-bf16')")
    r = run_cli(["batch", str(jobs), "--out-dir", str(out), "--push-to-hub", "me", "--dry-run", "--json"], env)
    (entry,) = json.loads(r.stdout)
    assert r.returncode == 3 and entry["action"] == "fail" and entry["error"] == message, r.stdout
    r = run_cli(["batch", str(jobs), "--out-dir", str(out), "--push-to-hub", "me", "--json"], env)
    (res,) = json.loads(r.stdout)
    assert r.returncode == 3 and (res["status"], res["rule"]) == ("failed", "USE-001") and message in res["error"]
    assert [p.name for p in out.iterdir()] == [".convert-bnb"]


def test_push_offline_fails_the_push_only(setup: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    jobs, _cache, env = setup
    jobs.write_text("org/a\n")
    out = tmp_path / "out"
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--json")
    assert r.returncode == 3
    (res,) = json.loads(r.stdout)
    assert (res["status"], res["rule"], res["error_class"]) == ("upload-failed", "HUB-003", "HubUploadError")
    assert res["error"].startswith("converted, upload failed: ")
    assert "cannot push to 'me/a-bf16' (OfflineModeIsEnabled" in res["error"] and res["bytes_out"] > 0
    r = _batch(jobs, out, env, "--push-to-hub", "me")  # the table and -q say so too; nothing converted again
    assert "a-bf16  upload-failed  0/0" in r.stdout and "run the batch again to retry the upload" in r.stdout
    r = _batch(jobs, out, env, "--push-to-hub", "me", "-q")
    assert r.stderr.startswith("convert-bnb batch: job a-bf16 upload-failed: converted, upload failed: ")
    state = json.loads((out / ".convert-bnb" / "a-bf16.json").read_text())
    assert state["status"] == "done" and "pushed" not in state  # the conversion stays done
    before = _stat(out / "a-bf16")
    r = _batch(jobs, out, env, "--json")  # without --push-to-hub: nothing left to do
    assert r.returncode == 0 and json.loads(r.stdout)[0]["status"] == "skipped"
    assert _stat(out / "a-bf16") == before


@pytest.mark.parametrize(("to", "library", "tags", "exact"), [
    ("auto", "transformers", ["convert-bnb", "bitsandbytes-dequantized"], True),
    ("fp32", "transformers", ["convert-bnb", "bitsandbytes-dequantized"], True),
    ("fp16", "transformers", ["convert-bnb", "bitsandbytes-dequantized"], False),
    ("nf4", "transformers", ["convert-bnb", "bitsandbytes", "4-bit", "nf4"], False),
    ("gguf:q4_0", "gguf", ["convert-bnb", "gguf"], False),
    ("gguf", "gguf", ["convert-bnb", "gguf"], False),
])
def test_model_card_metadata_and_claims_fit_the_target(to: str, library: str, tags: list[str], exact: bool) -> None:
    from huggingface_hub import ModelCard

    name = f"m-{to.replace(':', '-')}" + (".gguf" if to.startswith("gguf") else "")
    card = ModelCard(model_card(Job("org/m", "v2", to, 10**9, name), "f" * 40, {}))
    assert card.data.library_name == library and card.data.base_model == "org/m" and card.data.tags == tags
    assert ("bit-exact with bitsandbytes' own dequantization" in card.text) is exact
    assert card.text.lstrip().startswith(f"# m-{to.replace(':', '-')}\n")  # the repo's name: no file extension
    if to.startswith("gguf"):
        assert "not bit-exact" in card.text


def test_single_file_outputs_push_to_a_repo_named_without_the_extension() -> None:
    from convert.batch.card import build_upload_plan

    job = Job("org/m", None, "gguf:q8_0", 10**9, "m-gguf-q8_0.gguf")
    files = {"m-gguf-q8_0.gguf": {"bytes": 4, "sha256": "x"}}
    up = build_upload_plan("me", job, [(Path("/o/m-gguf-q8_0.gguf"), files)], "card", False)
    assert up["create_repo"]["repo_id"] == up["commit"]["repo_id"] == "me/m-gguf-q8_0"
    assert [o["path_in_repo"] for o in up["commit"]["operations"]] == ["m-gguf-q8_0.gguf", "README.md"]


def test_gguf_jobs_are_named_with_their_extension(tmp_path: Path) -> None:
    t = tmp_path / "j.txt"
    t.write_text(f"org/m --to gguf:q8_0\norg/m@v2 --to gguf\n{MODELS / 'llama_nf4_dq'} --to gguf:q8_0\n"
                 "org/a --to gguf:q4_k_m --name mine\norg/b --to gguf:q4_k_m --name theirs.gguf\n"
                 "org/c --to bf16 --name plain\n")
    # named before anything is read: llama.cpp's convention of the name alone (the revision as the version)
    assert [j.name for j in parse_jobs(t, _defaults())] == ["m-Q8_0.gguf", "m-v2-F16.gguf",
                                                           "llama_nf4_dq-Q8_0.gguf", "mine.gguf",
                                                           "theirs.gguf", "plain"]


def test_progress_per_job_and_overall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a job runs, the batch reports each running job's bytes written of its total and the jobs done."""
    import threading

    from convert.batch.run import BatchProgress, run_batch

    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_fp4_nodq'} --name a\n{MODELS / 'llama_nf4_dq'} --max-shard-size 1MB --name c\n")
    marker = tmp_path / "c.paused"
    for k, v in paused_env(offline_env(tmp_path), "c", 2, marker).items():
        monkeypatch.setenv(k, v)
    seen: list[BatchProgress] = []
    done: list[str] = []
    results: list = []
    t = threading.Thread(target=lambda: results.extend(run_batch(
        parse_jobs(jobs, _defaults()), tmp_path / "out", max_memory=256 << 20,
        on_done=lambda r: done.append(r.name), on_progress=seen.append, progress_interval=0.02)))
    t.start()
    deadline = time.monotonic() + 240
    while not (marker.exists() and marker.read_text() and any(p.running.get("c") for p in seen)):
        assert t.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # the paused worker: its job fails, the batch ends
    t.join(120)
    assert done == ["a", "c"] and [r.status for r in results] == ["converted", "failed"]
    assert results[1].error == "worker exited with code -9"  # nothing in its log: no "see <log>"
    c_seen = [p for p in seen if p.running.get("c")]
    assert all(p.jobs == 2 and p.finished == 1 and set(p.running) == {"c"} for p in c_seen)  # a finished first
    written, total = c_seen[-1].running["c"]
    assert total == 3975680 and 0 <= written <= total  # the bf16 bytes of the model
    assert c_seen[-1].line().startswith(f"[1/2 jobs done] c {100 * written // total}% (")


def test_model_card_for_a_local_source() -> None:
    job = Job("/data/m", None, "fp32", 5 * 10**9, "m-fp32")
    card = model_card(job, None, {"model.safetensors": {"bytes": 10, "sha256": "ab"}})
    assert "base_model" not in card and "- path: m" in card and "| model.safetensors | 10 | ab |" in card
    assert "/data" not in card  # a pushed card does not publish the local path


# ---------------------------------------------------------------- JOBS files


def _defaults() -> argparse.Namespace:
    return argparse.Namespace(to="bf16", max_shard_size=5 * 10**9)


def test_parse_text_json_yaml(tmp_path: Path) -> None:
    t = tmp_path / "j.txt"
    t.write_text(JOBS)
    text = parse_jobs(t, _defaults())
    assert [(j.src, j.revision, j.to.name, j.max_shard_size, j.name, j.where) for j in text] == [
        ("org/a", None, "bf16", 10**6, "a-bf16", "j.txt:2"),
        ("org/broken", None, "bf16", 5 * 10**9, "broken-bf16", "j.txt:3"),
        ("org/c", "main", "fp16", 10**6, "c-main-fp16", "j.txt:4"),
    ]
    j = tmp_path / "j.json"
    j.write_text(json.dumps(["org/a --max-shard-size 1MB", "org/broken",
                             {"repo": "org/c", "revision": "main", "to": "fp16", "max_shard_size": "1MB"}]))
    as_json = parse_jobs(j, _defaults())
    assert [(x.src, x.revision, x.to, x.max_shard_size, x.name) for x in as_json] == \
        [(x.src, x.revision, x.to, x.max_shard_size, x.name) for x in text]
    pytest.importorskip("yaml")
    y = tmp_path / "j.yaml"
    y.write_text("- org/a --max-shard-size 1MB\n- org/broken\n- {src: org/c@main, to: fp16, max_shard_size: 1MB}\n")
    as_yaml = parse_jobs(y, _defaults())
    assert [(x.src, x.revision, x.to, x.max_shard_size, x.name) for x in as_yaml] == \
        [(x.src, x.revision, x.to, x.max_shard_size, x.name) for x in text]


def test_local_file_job_writes_one_file(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_fp4_nodq' / 'model.safetensors'} --to fp32\n")
    out = tmp_path / "out"
    env = offline_env(tmp_path)
    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    (res,) = json.loads(r.stdout)
    assert (res["name"], res["status"], res["shards_written"]) == ("model-fp32.safetensors", "converted", 1)
    assert main([str(MODELS / "llama_fp4_nodq" / "model.safetensors"), "--to", "fp32", "-o",
                 str(tmp_path / "direct.safetensors"), "--quiet"]) == 0
    assert (out / "model-fp32.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    before = (out / "model-fp32.safetensors").stat()
    r = _batch(jobs, out, env, "--json")
    assert json.loads(r.stdout)[0]["status"] == "skipped"
    after = (out / "model-fp32.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_batch_jobs_behave_as_the_cli(tmp_path: Path) -> None:
    """Every target goes through convert() in the worker: --no-verify reaches nf4 and GGUF jobs, and an
    input error of any target is the CLI's error (class, rule, message), not a usage error."""
    broken = broken_model(tmp_path / "broken")
    good = MODELS / "llama_nf4_dq"
    targets = ("bf16", "nf4", "gguf:q8_0")
    lines = [f"{src} --to {t} --name {kind}-{t.replace(':', '-')}" for kind, src in (("good", good), ("bad", broken))
             for t in targets]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("\n".join(lines) + "\n")
    env = offline_env(tmp_path)
    results = {}
    for verify in (True, False):
        out = tmp_path / f"out-{verify}"
        r = run_cli(["batch", str(jobs), "--out-dir", str(out), "--json", *([] if verify else ["--no-verify"])], env)
        assert r.returncode == 3, r.stderr
        results[verify] = {x["name"]: x for x in json.loads(r.stdout)}
    for t in targets:
        name = t.replace(":", "-") + (".gguf" if t.startswith("gguf") else "")  # --name X of a GGUF job: X.gguf
        assert [results[v][f"good-{name}"]["verified"] for v in (True, False)] == [True, False]
        assert results[True][f"good-{name}"]["status"] == "converted"
        cli = run_cli([str(broken), "--to", t, "-o", str(tmp_path / f"cli-{name}")], env)
        assert cli.returncode == 2 and cli.stderr.count("\n") == 1
        bad = results[True][f"bad-{name}"]
        assert (bad["status"], bad["rule"], bad["error_class"]) == ("failed", "BNB-009", "QuantStateJsonError")
        assert bad["error"] in cli.stderr  # the same message, naming file, tensor and rule
    out = tmp_path / "out-True"
    assert sorted(p.name for p in out.iterdir()) == [".convert-bnb", "good-bf16", "good-gguf-q8_0.gguf", "good-nf4"]
    assert (out / "good-gguf-q8_0.gguf").read_bytes()[:4] == b"GGUF"


def test_local_paths_become_absolute(tmp_path: Path) -> None:
    t = tmp_path / "j.txt"
    t.write_text(f"{MODELS / 'llama_nf4_dq'} --name x\n{MODELS / 'llama_fp4_nodq' / 'model.safetensors'}\n")
    a, b = parse_jobs(t, _defaults())
    assert (a.src, a.name, a.is_repo) == (str(MODELS / "llama_nf4_dq"), "x", False)
    assert b.name == "model-bf16.safetensors"


@pytest.mark.parametrize(
    ("name", "content", "rule", "part"),
    [
        ("j.json", "[1, 2", "BATCH-001", "not valid JSON"),
        ("j.json", '{"a": 1}', "BATCH-001", "must hold a list"),
        ("j.json", "[3]", "BATCH-002", "j.json[0]: a job must be a string or an object"),
        ("j.json", '[{"to": "bf16"}]', "BATCH-002", "a job needs a source"),
        ("j.txt", "org/a --bogus 1\n", "BATCH-003", "j.txt:1: unknown job options"),
        ("j.txt", "\norg/a --to int4\n", "BATCH-003", "j.txt:2: unknown --to value 'int4'"),
        # a list's own words, as the command line gives them (not "unknown --to value")
        ("j.txt", "org/a --to bf16,bf16\n", "BATCH-003", "j.txt:1: --to names the target bf16 twice"),
        ("j.txt", "org/a --to bf16,,nf4\n", "BATCH-003", "j.txt:1: --to lists an empty target"),
        ("j.txt", "org/a --to bf16,gguf:q9_9\n", "BATCH-003", "j.txt:1: GGUF output type not supported (expected "),
        ("j.txt", "org/a --max-shard-size lots\n", "BATCH-003", "not a size: 'lots'"),
        ("j.json", '[{"src": "org/a", "colour": "red"}]', "BATCH-003", "unknown job fields"),
        ("j.txt", "org/a --name ../x\n", "BATCH-003", "name must be a plain directory name"),
        ("j.txt", "x/a\ny/a\n", "BATCH-004", "j.txt:2: output name 'a-bf16' is also written by j.txt:1"),
        ("j.txt", "'unclosed\n", "BATCH-001", "No closing quotation"),
    ],
)
def test_bad_jobs_files(tmp_path: Path, name: str, content: str, rule: str, part: str) -> None:
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(UsageError) as ei:
        parse_jobs(p, _defaults())
    assert ei.value.rule == rule
    assert part in str(ei.value)
    assert ei.value.path == str(p)


def test_summary_table_rows() -> None:
    from convert.batch.worker import JobResult

    t = summary_table([JobResult("a", "org/a", "converted", bytes_out=2048, shards_written=2, commit="f" * 40),
                       JobResult("b", "org/b", "failed", error="boom")])
    lines = t.splitlines()
    assert lines[1].split() == ["a", "converted", "2/0", "2.00", "KiB", "0.0s", "@ffffffffff"]
    assert lines[2].split() == ["b", "failed", "0/0", "-", "0.0s", "boom"]
    assert lines[3] == "1 converted, 1 failed of 2 jobs"


# ---------------------------------------------------------------- online: fetch and push through a local fake Hub


def _hub_with_a() -> FakeHub:
    """A started fake Hub holding ``org/a`` at commit ``A`` (the tiny Llama NF4 fixture)."""
    hub = FakeHub()
    hub.add("org/a", A, {p.name: p for p in (MODELS / "llama_nf4_dq").iterdir() if p.is_file()})
    hub.start()
    return hub


def test_online_batch_fetches_converts_and_pushes(tmp_path: Path) -> None:
    hub = _hub_with_a()
    try:
        env = push_env(offline_env(tmp_path, tmp_path / "hub"), hub.url)
        jobs = tmp_path / "jobs.txt"
        jobs.write_text("org/a --max-shard-size 1MB\n")
        out = tmp_path / "out"
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--private", "--json")
        assert r.returncode == 0, r.stderr + (out / ".convert-bnb" / "a-bf16.log").read_text()
        (res,) = json.loads(r.stdout)
        assert (res["status"], res["pushed"], res["commit"]) == ("converted", "me/a-bf16", A)
        assert hub.created == [{"repo_id": "me/a-bf16", "private": True, "type": "model"}]
        assert hub.auth == {"Bearer hf_fake_token_for_the_local_server"}  # HF_TOKEN on every request
        assert len(hub.commits) == 1
        assert hub.commits[0]["summary"] == "convert-bnb 0.1.0: org/a --to bf16"
        repo = hub.repos["me/a-bf16"]
        pushed = repo["commits"][repo["refs"]["main"]]
        assert {k: v for k, v in pushed.items() if k != "README.md"} == _files(out / "a-bf16")
        state = json.loads((out / ".convert-bnb" / "a-bf16.json").read_text())
        assert state["pushed"] == {"repo": "me/a-bf16", "key": state["key"], "commit": hub.commits[0]["commit"]}
        card = pushed["README.md"].decode()
        assert card == _dry_run_card(jobs, out, env)  # what --dry-run showed is what was pushed
        assert card.startswith("---\nbase_model: org/a\n") and f"- commit: {A}" in card
        # a re-run neither converts nor pushes again
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--private", "--json")
        (res,) = json.loads(r.stdout)
        assert (res["status"], res["pushed"]) == ("skipped", "me/a-bf16")
        assert len(hub.commits) == 1 and len(hub.created) == 1
    finally:
        hub.stop()


def _dry_run_card(jobs: Path, out: Path, env: dict[str, str]) -> str:
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]["card"]


def _head(hub: object, repo_id: str) -> dict[str, bytes]:
    """The files of a fake Hub repo's main branch."""
    repo = hub.repos[repo_id]  # type: ignore[attr-defined]
    return repo["commits"][repo["refs"]["main"]]


def test_online_batch_pushes_each_output_of_a_job_of_several_targets(tmp_path: Path) -> None:
    """A job of several targets with --push-to-hub ORG: each output of its folder to ORG/<its name> with the card
    the dry run shows for it; a refused upload keeps the job done and the next run uploads without converting;
    then a re-run pushes nothing. Before the download a dry run says the outputs are named later."""
    hub = _hub_with_a()
    try:
        env = push_env(offline_env(tmp_path, tmp_path / "hub"), hub.url)
        jobs = tmp_path / "jobs.txt"
        jobs.write_text("org/a --to bf16,gguf:q8_0 --max-shard-size 1MB\n")
        out = tmp_path / "out"
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
        (plan,) = json.loads(r.stdout)
        assert plan["action"] == "convert (not checked: not downloaded)" and "outputs" not in plan, r.stderr
        assert plan["push"] == ("each output to me/<its name>, named once the source is downloaded (a GGUF file's "
                                "name comes from the model's config)")
        # (a Hub source's outputs carry its commit: the job converts it at its resolved commit)
        bf16, gguf = f"a-{A[:12]}-bf16", f"org-a-2.0M-{A[:12]}-Q8_0.gguf"
        bf16_repo, gguf_repo = f"me/{bf16}", f"me/{gguf.removesuffix('.gguf')}"
        hub.refuse_commits = 403
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--json")
        assert r.returncode == 3, r.stderr
        (res,) = json.loads(r.stdout)
        assert (res["status"], res["rule"], res["pushed"]) == ("upload-failed", "HUB-003", None)
        # every output is tried: the line names each repo not pushed (one cause, said once)
        assert res["error"].startswith(f"converted, upload failed: HUB-003 cannot push to '{bf16_repo}', "
                                       f"'{gguf_repo}' (")
        folder = out / "a"
        assert sorted(p.name for p in folder.iterdir()) == [bf16, gguf]
        state = json.loads((out / ".convert-bnb" / "a.json").read_text())
        assert state["status"] == "done" and "pushed_outputs" not in state and hub.commits == []
        before = (_stat(folder), _stat(folder / bf16))

        hub.refuse_commits = None
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--json")
        assert r.returncode == 0, r.stderr + (out / ".convert-bnb" / "a.log").read_text()
        (res,) = json.loads(r.stdout)
        assert (res["status"], res["pushed"]) == ("skipped", f"{bf16_repo}, {gguf_repo}")
        assert (_stat(folder), _stat(folder / bf16)) == before  # uploaded, not converted again
        assert [c["summary"] for c in hub.commits] == ["convert-bnb 0.1.0: org/a --to bf16",
                                                       "convert-bnb 0.1.0: org/a --to gguf:q8_0"]
        pushed_bf16, pushed_gguf = _head(hub, bf16_repo), _head(hub, gguf_repo)
        assert {k: v for k, v in pushed_bf16.items() if k != "README.md"} == _files(folder / bf16)
        assert set(pushed_gguf) == {gguf, "README.md"} and pushed_gguf[gguf] == (folder / gguf).read_bytes()
        state = json.loads((out / ".convert-bnb" / "a.json").read_text())
        assert state["pushed_outputs"] == {
            bf16: {"repo": bf16_repo, "key": state["key"], "commit": hub.commits[0]["commit"]},
            gguf: {"repo": gguf_repo, "key": state["key"], "commit": hub.commits[1]["commit"]}}
        # each card is the one the dry run shows for its output: its own target and files, the job's command
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
        (plan,) = json.loads(r.stdout)
        assert plan["action"] == "skip (already converted)"
        assert [(o["name"], o["to"], o["output"]) for o in plan["outputs"]] == [
            (bf16, "bf16", str(folder / bf16)), (gguf, "gguf:q8_0", str(folder / gguf))]
        assert [o["card"] for o in plan["outputs"]] == [pushed_bf16["README.md"].decode(),
                                                        pushed_gguf["README.md"].decode()]
        card = pushed_gguf["README.md"].decode()
        assert card.startswith("---\nbase_model: org/a\nlibrary_name: gguf\ntags:\n- convert-bnb\n- gguf\n"
                               "base_model_relation: quantized\n---\n")
        assert f"\n# {gguf.removesuffix('.gguf')}\n" in card and "| --to | gguf:q8_0 |" in card
        assert f"convert-bnb org/a --revision {A} --to bf16,gguf:q8_0 --max-shard-size 1000000\n" in card
        rec = state["files"][gguf]
        assert f"| {gguf} | {rec['bytes']} | {rec['sha256']} |" in card and "| --to | bf16 |" not in card
        card = pushed_bf16["README.md"].decode()
        assert f"\n# {bf16}\n" in card and "| --to | bf16 |" in card and "library_name: transformers" in card
        inside = {rel.removeprefix(f"{bf16}/"): rec for rel, rec in state["files"].items() if rel != gguf}
        assert len(inside) == len(state["files"]) - 1 == len(_files(folder / bf16))
        for rel, rec in inside.items():  # the bf16 output's part of the job's manifest, as in its folder
            assert f"| {rel} | {rec['bytes']} | {rec['sha256']} |" in card
        assert {o["path_in_repo"]: o["from"] for o in plan["outputs"][1]["upload"]["commit"]["operations"]} == {
            gguf: str(folder / gguf), "README.md": "model card"}
        # a re-run neither converts nor pushes
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--json")
        (res,) = json.loads(r.stdout)
        assert (res["status"], res["pushed"]) == ("skipped", f"{bf16_repo}, {gguf_repo}") and len(hub.commits) == 2
    finally:
        hub.stop()


def test_push_dry_run_plans_each_output_of_a_job_of_several_targets(tmp_path: Path) -> None:
    """--dry-run --push-to-hub before a job of several targets is converted: each output's repo, planned files
    and card, named as the run names them; nothing written."""
    env = offline_env(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --to bf16,gguf:q8_0 --name set\n")
    out = tmp_path / "out"
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    (plan,) = json.loads(r.stdout)
    bf16, gguf = "llama_nf4_dq-bf16", "Llama_Nf4_Dq-2.0M-Q8_0.gguf"
    assert plan["action"] == "convert" and "card" not in plan and "upload" not in plan
    assert [(o["name"], o["to"], o["output"]) for o in plan["outputs"]] == [
        (bf16, "bf16", str(out / "set" / bf16)), (gguf, "gguf:q8_0", str(out / "set" / gguf))]
    ups = [o["upload"] for o in plan["outputs"]]
    assert [u["create_repo"]["repo_id"] for u in ups] == ["me/llama_nf4_dq-bf16", "me/Llama_Nf4_Dq-2.0M-Q8_0"]
    # a local source is named by its own name in the commit, as in the card: no path of this machine is pushed
    assert [u["commit"]["commit_message"] for u in ups] == [
        "convert-bnb 0.1.0: llama_nf4_dq --to bf16", "convert-bnb 0.1.0: llama_nf4_dq --to gguf:q8_0"]
    ops = [{o["path_in_repo"]: (o["bytes"], o["from"]) for o in u["commit"]["operations"]} for u in ups]
    assert ops[0]["model.safetensors"] == (3975680, str(out / "set" / bf16 / "model.safetensors"))
    assert ops[0]["config.json"][1] == str(out / "set" / bf16 / "config.json")
    assert set(ops[1]) == {gguf, "README.md"} and ops[1][gguf][1] == str(out / "set" / gguf)
    assert "| model.safetensors | 3975680 | (after conversion) |" in plan["outputs"][0]["card"]
    assert f"| {gguf} | {ops[1][gguf][0]} | (after conversion) |" in plan["outputs"][1]["card"]
    text = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run").stdout
    assert (f"  output {gguf} (--to gguf:q8_0):\n    upload: create me/Llama_Nf4_Dq-2.0M-Q8_0 (private=False, "
            "exist_ok), one commit 'convert-bnb 0.1.0: ") in text
    assert "\n    model card:\n      ---\n      library_name: gguf\n" in text
    assert not out.exists()  # a dry run writes nothing
    # the run names its outputs as planned
    assert _batch(jobs, out, env).returncode == 0
    assert sorted(p.name for p in (out / "set").iterdir()) == [gguf, bf16]


def test_sigterm_stops_the_workers_and_keeps_finished_shards(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --max-shard-size 1MB --name a\n"
                    f"{MODELS / 'llama_fp4_nodq'} --max-shard-size 1MB --name c\n")
    out = tmp_path / "out"
    env = offline_env(tmp_path)
    marker = tmp_path / "c.paused"
    cmd = [sys.executable, "-m", "convert", "batch", str(jobs), "--out-dir", str(out), "--max-memory", "256MiB",
           "--to", "bf16", "--jobs", "2"]
    proc = subprocess.Popen(cmd, env=paused_env(env, "c", 2, marker), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the batch only: it must stop its workers itself
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    partial = out / ".c.convert-bnb-partial"
    kept = f"interrupted; its finished shards are kept in {partial} and reused when the batch is run again"
    # the truth, where the user looks: the job's line, the batch's last line, the job's state and its log
    assert f"[interrupted] c: {kept}" in err
    assert err.rstrip().endswith("convert-bnb: interrupted; finished jobs are kept, and so are the finished shards "
                                 "of unfinished directory outputs (OUT/.NAME.convert-bnb-partial); run the same "
                                 "command again to resume")
    assert "no output was left behind" not in err and "see " not in err
    state = json.loads((out / ".convert-bnb" / "c.json").read_text())
    assert (state["status"], state["error"]) == ("interrupted", kept)
    assert f"convert-bnb batch: job c: {kept}" in (out / ".convert-bnb" / "c.log").read_text()
    assert len(_ledger(out, "c")["shards"]) == 2
    assert sorted(p.name for p in partial.iterdir() if p.name.startswith(".")) == [".convert-bnb-shards.json"]
    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    res = {x["name"]: x for x in json.loads(r.stdout)}
    assert (res["c"]["status"], res["c"]["shards_reused"], res["c"]["shards_written"]) == ("converted", 2, 3)
    straight = tmp_path / "straight"
    assert main([str(MODELS / "llama_fp4_nodq"), "--to", "bf16", "--max-shard-size", "1MB", "-o", str(straight),
                 "--quiet"]) == 0
    assert _files(out / "c") == _files(straight)


def test_one_batch_per_out_dir(tmp_path: Path) -> None:
    import fcntl

    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'}\n")
    out = tmp_path / "out"
    (out / ".convert-bnb").mkdir(parents=True)
    with open(out / ".convert-bnb" / "lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        r = _batch(jobs, out, offline_env(tmp_path))
    assert r.returncode == 2
    assert "another convert-bnb batch is running with this --out-dir" in r.stderr
    r = _batch(jobs, out, offline_env(tmp_path))
    assert r.returncode == 0, r.stderr


def test_out_dir_inside_a_job_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    import shutil

    from convert.cli import main as cli_main

    model = tmp_path / "model"
    shutil.copytree(MODELS / "llama_nf4_dq", model,
                    ignore=shutil.ignore_patterns("reference"))
    before = sorted(p.relative_to(model) for p in model.rglob("*"))
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{model} --to bf16\n")
    assert cli_main(["batch", str(jobs), "--out-dir", str(model / "out"), "-q"]) == 2
    assert sorted(p.relative_to(model) for p in model.rglob("*")) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main(["batch", str(jobs), "--out-dir", str(afile), "-q"]) == 2


def test_job_notes_are_printed_and_recorded(tmp_path: Path) -> None:
    """A batch prints each job's notes under its status line, its float16 line first, as a single conversion
    prints them under its summary (they were in --json only, without the float16 counts: nowhere)."""
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --to fp16\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    single = run_cli([str(MODELS / "llama_nf4_dq"), "--to", "fp16", "-o", str(tmp_path / "one")], env)
    line = "float16: 0 values overflowed to inf, 1 non-zero values flushed to zero"
    assert single.returncode == 0 and line in single.stderr.splitlines()
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "out")], env)
    assert r.returncode == 0 and f"  note: {line}" in r.stderr.splitlines()
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "out2"), "--json"], env)
    assert json.loads(r.stdout)[0]["notes"][0] == line


# ---------------------------------------------------------------- --mmproj in JOBS files

MM_SRC = MODELS / "gemma3cg_nf4_dq"


def test_mmproj_in_jobs_files(tmp_path: Path) -> None:
    t = tmp_path / "j.txt"
    t.write_text(f"{MM_SRC} --to gguf:q8_0 --mmproj\n{MM_SRC} --to gguf:f16 --name g --mmproj proj\n"
                 f"{MM_SRC} --to gguf:q4_k_m --name h\n")
    a, b, c = parse_jobs(t, _defaults())
    assert (a.name, a.mmproj) == ("gemma3cg_nf4_dq-Q8_0.gguf", "mmproj-gemma3cg_nf4_dq-Q8_0.gguf")
    assert (b.name, b.mmproj) == ("g.gguf", "proj.gguf")
    assert (c.name, c.mmproj) == ("h.gguf", None)
    assert a.outputs() == [(a.name, "files"), (a.mmproj, "mmproj_files")] and c.outputs() == [("h.gguf", "files")]
    j = tmp_path / "j.json"
    j.write_text(json.dumps([{"src": str(MM_SRC), "to": "gguf:f16", "name": "g", "mmproj": True},
                             {"src": str(MM_SRC), "to": "gguf", "name": "k", "mmproj": "p2"},
                             {"src": str(MM_SRC), "to": "gguf", "name": "l", "mmproj": False}]))
    assert [x.mmproj for x in parse_jobs(j, _defaults())] == ["mmproj-g.gguf", "p2.gguf", None]
    assert Job(**a.to_dict()) == a  # a worker's spec file reads it back


@pytest.mark.parametrize(("content", "rule", "part"), [
    (f"{MM_SRC} --to bf16 --mmproj\n", "BATCH-003", "j.txt:1: --mmproj needs a GGUF target"),
    (f"{MM_SRC} --to gguf --mmproj ../p\n", "BATCH-003", "mmproj must be true or a plain file name"),
    (f"{MM_SRC} --to gguf --name a --mmproj b\n{MM_SRC} --to gguf --name b\n", "BATCH-004",
     "j.txt:2: output name 'b.gguf' is also written by j.txt:1"),
    (f"{MM_SRC} --to gguf --name a --mmproj a\n", "BATCH-004", "j.txt:1: output name 'a.gguf' is also written by "
     "j.txt:1"),
    (f"{MM_SRC} --to gguf --mmproj {'m' * 201}\n", "BATCH-003", "mmproj must be true or a plain file name "
     "(expected \"a name without '/' or NUL, not starting with '.', of at most 200 UTF-8 bytes\""),
    (f"{MM_SRC} --to gguf --name {'n' * 201}\n", "BATCH-003", "name must be a plain directory name"),
    (json.dumps([{"src": str(MM_SRC), "to": "gguf", "mmproj": "x\u0000y"}]), "BATCH-003", "j.txt[0]: mmproj must "),
    (json.dumps([{"src": str(MM_SRC), "to": "gguf", "name": "x\u0000y"}]), "BATCH-003", "j.txt[0]: name must "),
    (json.dumps([{"src": str(MM_SRC), "to": "gguf", "mmproj": "\ud800"}]), "BATCH-001", "lone UTF-16 surrogate"),
])
def test_bad_mmproj_jobs(tmp_path: Path, content: str, rule: str, part: str) -> None:
    p = tmp_path / "j.txt"
    p.write_text(content)
    with pytest.raises(UsageError) as ei:
        parse_jobs(p, _defaults())
    assert (ei.value.rule, ei.value.path) == (rule, str(p))
    assert part in str(ei.value)


def test_batch_mmproj_job_writes_records_skips_and_redoes_both_files(tmp_path: Path) -> None:
    """A JOBS line with --mmproj writes the text GGUF and the projector, each byte-identical to the single
    run's; the state records both; a re-run skips; a missing or damaged projector is redone; a file of the
    user's where the projector goes is never replaced (BATCH-006)."""
    env = offline_env(tmp_path)
    direct = tmp_path / "direct"
    assert main([str(MM_SRC), "--to", "gguf:q4_k_m", "-o", str(direct / "g.gguf"), "--mmproj",
                 str(direct / "mmproj-g.gguf"), "--quiet"]) == 0
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MM_SRC} --to gguf:q4_k_m --name g --mmproj\n")
    out = tmp_path / "out"
    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    (res,) = json.loads(r.stdout)
    assert (res["status"], res["mmproj"]) == ("converted", str(out / "mmproj-g.gguf"))
    assert _files(direct) == {n: (out / n).read_bytes() for n in ("g.gguf", "mmproj-g.gguf")}
    assert res["bytes_out"] == sum(len(b) for b in _files(direct).values())
    state = json.loads((out / ".convert-bnb" / "g.gguf.json").read_text())
    assert state["status"] == "done" and state["key"]["mmproj"] == "mmproj-g.gguf"
    assert state["files"] == {"g.gguf": {"bytes": len(_files(direct)["g.gguf"]),
                                         "sha256": sha256_file(direct / "g.gguf")}}
    assert state["mmproj_files"] == {"mmproj-g.gguf": {"bytes": len(_files(direct)["mmproj-g.gguf"]),
                                                       "sha256": sha256_file(direct / "mmproj-g.gguf")}}
    before = _stat(out)
    r = _batch(jobs, out, env, "--json")
    assert json.loads(r.stdout)[0]["status"] == "skipped" and _stat(out) == before
    # the projector removed: the job is done again, both files as before
    (out / "mmproj-g.gguf").unlink()
    r = _batch(jobs, out, env, "--json")
    assert json.loads(r.stdout)[0]["status"] == "converted", r.stderr
    assert _files(direct) == {n: (out / n).read_bytes() for n in ("g.gguf", "mmproj-g.gguf")}
    # a projector of the user's under a new job's MMNAME: refused, kept
    jobs.write_text(f"{MM_SRC} --to gguf:q4_k_m --name g --mmproj\n{MM_SRC} --to gguf:q8_0 --name h --mmproj\n")
    (out / "mmproj-h.gguf").write_bytes(b"mine")
    r = _batch(jobs, out, env, "--json")
    g, h = json.loads(r.stdout)
    assert g["status"] == "skipped" and (h["status"], h["rule"]) == ("failed", "BATCH-006")
    assert "mmproj-h.gguf" in h["error"] and (out / "mmproj-h.gguf").read_bytes() == b"mine"
    assert "give the job another --mmproj MMNAME" in h["error"]
    assert not (out / "h.gguf").exists()
    # the projector dropped from a done job: other settings, named (BATCH-005), nothing replaced
    jobs.write_text(f"{MM_SRC} --to gguf:q4_k_m --name g\n")
    r = _batch(jobs, out, env, "--json")
    (g,) = json.loads(r.stdout)
    assert (g["status"], g["rule"]) == ("failed", "BATCH-005")
    assert "expected 'to=gguf:q4_k_m, max_shard_size=5000000000, converter=" in g["error"]
    assert "found 'to=gguf:q4_k_m, max_shard_size=5000000000, mmproj=mmproj-g.gguf, converter=" in g["error"]


def test_batch_mmproj_killed_between_the_two_commits(tmp_path: Path) -> None:
    """kill -9 after the text GGUF is committed, before the projector is: the next run does not take the
    text file alone for the job, converts again and records both; killed after the projector's commit,
    the next run records both as the earlier run committed them."""
    env = offline_env(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MM_SRC} --to gguf:q8_0 --name g --mmproj\n")
    for point, status in (("g.gguf", "converted"), ("mmproj-g.gguf", "skipped")):
        out = tmp_path / f"out-{point}"
        kill_batch_at_pause(jobs, out, env, point, "commit", tmp_path / f"{point}.paused")
        assert json.loads((out / ".convert-bnb" / "g.gguf.json").read_text())["status"] != "done"
        assert (out / "mmproj-g.gguf").exists() is (status == "skipped")
        r = _batch(jobs, out, env, "--json")
        (res,) = json.loads(r.stdout)
        assert (r.returncode, res["status"]) == (0, status), r.stderr
        state = json.loads((out / ".convert-bnb" / "g.gguf.json").read_text())
        assert state["status"] == "done" and set(state["files"]) == {"g.gguf"}
        assert set(state["mmproj_files"]) == {"mmproj-g.gguf"}
        assert state["mmproj_files"]["mmproj-g.gguf"]["sha256"] == sha256_file(out / "mmproj-g.gguf")


def test_batch_mmproj_push_plan_holds_both_files(tmp_path: Path) -> None:
    env = offline_env(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MM_SRC} --to gguf:q8_0 --name g --mmproj\n")
    out = tmp_path / "out"
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    (plan,) = json.loads(r.stdout)
    assert (plan["action"], plan["mmproj"]) == ("convert", str(out / "mmproj-g.gguf"))
    assert "| --mmproj | mmproj-g.gguf |" in plan["card"] and "--mmproj mmproj-g.gguf" in plan["card"]
    ops = {o["path_in_repo"]: (o["bytes"], o["from"]) for o in plan["upload"]["commit"]["operations"]}
    assert ops == {"g.gguf": (None, str(out / "g.gguf")), "mmproj-g.gguf": (None, str(out / "mmproj-g.gguf")),
                   "README.md": (len(plan["card"].encode()), "model card")}
    assert "| mmproj-g.gguf | (after conversion) | (after conversion) |" in plan["card"]
    text = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run").stdout
    assert f"    mmproj-g.gguf{' ' * 28}(after conversion)  <- {out / 'mmproj-g.gguf'}" in text
    assert _batch(jobs, out, env).returncode == 0
    r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
    (plan,) = json.loads(r.stdout)
    state = json.loads((out / ".convert-bnb" / "g.gguf.json").read_text())
    assert plan["action"] == "skip (already converted)"
    ops = {o["path_in_repo"]: o["from"] for o in plan["upload"]["commit"]["operations"]}
    assert ops == {"g.gguf": str(out / "g.gguf"), "mmproj-g.gguf": str(out / "mmproj-g.gguf"),
                   "README.md": "model card"}
    for rel, rec in {**state["files"], **state["mmproj_files"]}.items():
        assert f"| {rel} | {rec['bytes']} | {rec['sha256']} |" in plan["card"]


def test_quiet_batch_still_names_each_failed_job(tmp_path: Path) -> None:
    """``batch -q``: no table and no progress, but one line per failed job with its rule (a CI log names it)."""
    broken = broken_model(tmp_path / "broken")
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --name good\n{broken} --name bad\n")
    r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "out"), "-q"], offline_env(tmp_path))
    assert (r.returncode, r.stdout) == (3, "")
    (line,) = r.stderr.splitlines()
    assert line.startswith("convert-bnb batch: job bad failed: ") and "BNB-009" in line
    assert (tmp_path / "out" / "good").is_dir()


# ---------------------------------------------------------------- --dry-run: the run's own checks, exit 3


def test_dry_run_fails_a_job_whose_settings_changed_as_the_run_does(setup: tuple[Path, Path, dict[str, str]],
                                                                     tmp_path: Path) -> None:
    """BATCH-005 planned from the same comparison the worker makes; --overwrite plans it 'convert' again;
    BATCH-006 (a file the batch did not write) is planned 'fail' even with --overwrite, as the run fails it."""
    jobs, _cache, env = setup
    jobs.write_text("org/a --max-shard-size 1MB\n")
    out = tmp_path / "out"
    assert _batch(jobs, out, env).returncode == 0
    jobs.write_text("org/a --max-shard-size 2MB --name a-bf16\n")
    r = _batch(jobs, out, env, "--dry-run", "--json")
    (plan,) = json.loads(r.stdout)
    assert (r.returncode, plan["action"], plan["rule"]) == (3, "fail", "BATCH-005"), r.stderr
    assert plan["error"].startswith(f"Failed to write '{out / 'a-bf16'}': BATCH-005 the job's output was made with "
                                    "other settings (expected 'commit=")
    assert "max_shard_size=2000000" in plan["error"] and "max_shard_size=1000000" in plan["error"]
    assert "Hint: pass --overwrite" in plan["error"] and "card" not in plan
    r = _batch(jobs, out, env, "--dry-run")
    assert r.returncode == 3
    assert r.stdout == f"a-bf16: org/a@{A} --to bf16 -> {out / 'a-bf16'}: fail ({plan['error']})\n"
    r = _batch(jobs, out, env, "--dry-run", "-q")
    assert (r.returncode, r.stdout, r.stderr) == (3, "", f"convert-bnb batch: job a-bf16 would fail: {plan['error']}\n")
    r = _batch(jobs, out, env, "--json")  # the run: the same rule and message
    (res,) = json.loads(r.stdout)
    assert (r.returncode, res["status"], res["rule"], res["error"]) == (3, "failed", "BATCH-005", plan["error"])
    r = _batch(jobs, out, env, "--dry-run", "--overwrite", "--json")
    assert (r.returncode, json.loads(r.stdout)[0]["action"]) == (0, "convert"), r.stdout
    (out / "a-bf16" / "notes.txt").write_text("mine")
    r = _batch(jobs, out, env, "--dry-run", "--overwrite", "--json")
    (plan,) = json.loads(r.stdout)
    assert (r.returncode, plan["action"], plan["rule"]) == (3, "fail", "BATCH-006")
    assert "did not write" in plan["error"] and "found ['notes.txt']" in plan["error"]
    r = _batch(jobs, out, env, "--overwrite", "--json")
    (res,) = json.loads(r.stdout)
    assert (r.returncode, res["rule"], res["error"]) == (3, "BATCH-006", plan["error"])


def test_dry_run_runs_check_on_each_job_input(tmp_path: Path) -> None:
    """An architecture `check --to gguf:q8_0` refuses (GGUF-001) and a broken layer (BNB-009) are planned
    'fail' with check's own message, which is the run's; a clean job is planned 'convert'."""
    falcon = tmp_path / "falcon"
    shutil.copytree(MODELS / "llama_nf4_dq", falcon)
    cfg = json.loads((falcon / "config.json").read_text())
    (falcon / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    broken = broken_model(tmp_path / "broken")
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{falcon} --to gguf:q8_0 --name falcon\n{MODELS / 'llama_nf4_dq'} --to gguf:q8_0 --name good\n"
                    f"{broken} --name bad\n")
    out = tmp_path / "out"
    env = offline_env(tmp_path)
    r = _batch(jobs, out, env, "--dry-run", "--json")
    assert r.returncode == 3, r.stderr
    plan = {e["name"]: e for e in json.loads(r.stdout)}
    assert [(e["action"], e.get("rule")) for e in plan.values()] == [("fail", "GGUF-001"), ("convert", None),
                                                                     ("fail", "BNB-009")]
    gguf = plan["falcon.gguf"]
    assert "GGUF-001" in gguf["error"] and "found 'FalconForCausalLM'" in gguf["error"]
    check = run_cli(["check", str(falcon), "--to", "gguf:q8_0", "-q"], env)
    assert (check.returncode, check.stderr) == (2, gguf["error"] + "\n")  # as check prints it
    assert "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4" in plan["bad"]["error"]
    text = _batch(jobs, out, env, "--dry-run").stdout.splitlines()
    assert text[0].startswith(f"falcon.gguf: {falcon} --to gguf:q8_0 -> {out / 'falcon.gguf'}: fail (")
    assert text[0].endswith(f"({gguf['error']})")
    assert text[1] == f"good.gguf: {MODELS / 'llama_nf4_dq'} --to gguf:q8_0 -> {out / 'good.gguf'}: convert"
    assert not out.exists()  # a dry run writes nothing
    jobs.write_text(f"{falcon} --to gguf:q8_0 --name falcon\n{broken} --name bad\n")
    r = _batch(jobs, out, env, "--json")  # the run fails both with the same rule and message
    res = {x["name"]: x for x in json.loads(r.stdout)}
    for name in ("falcon.gguf", "bad"):
        assert (res[name]["status"], res[name]["rule"], res[name]["error"]) == \
            ("failed", plan[name]["rule"], plan[name]["error"])
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --name good\n")
    r = _batch(jobs, tmp_path / "clean", env, "--dry-run")
    assert (r.returncode, r.stdout) == (0, f"good: {MODELS / 'llama_nf4_dq'} --to bf16 -> {tmp_path / 'clean' / 'good'}"
                                           ": convert\n")
    r = _batch(jobs, jobs / "x", env, "--dry-run")  # the run's checks before any job, too
    assert (r.returncode, r.stdout) == (2, "") and f"'{jobs}': USE-003 --out-dir must be a directory" in r.stderr


def test_dry_run_checks_a_cached_hub_snapshot_and_not_an_uncached_repo(setup: tuple[Path, Path, dict[str, str]],
                                                                       tmp_path: Path) -> None:
    """A Hub repo in the cache is checked (offline: org/broken is BNB-009); online, a repo whose files are not
    in the cache is planned 'convert (not checked: not downloaded)' without downloading its weights."""
    jobs, _cache, env = setup
    r = _batch(jobs, tmp_path / "out", env, "--dry-run", "--json")
    assert r.returncode == 3, r.stderr
    assert [(e["action"], e.get("rule")) for e in json.loads(r.stdout)] == [
        ("convert", None), ("fail", "BNB-009"), ("convert", None)]
    from tests.helpers.fakehub import FakeHub, push_env

    hub = FakeHub()
    hub.add("org/new", commit_sha("new"), {p.name: p for p in (MODELS / "llama_nf4_dq").iterdir() if p.is_file()})
    url = hub.start()
    try:
        online = push_env(offline_env(tmp_path, tmp_path / "empty-hub"), url)
        jobs.write_text("org/new\n")
        r = _batch(jobs, tmp_path / "out", online, "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        (plan,) = json.loads(r.stdout)
        assert (plan["action"], plan["commit"]) == ("convert (not checked: not downloaded)", commit_sha("new"))
        assert "org/new/model.safetensors" not in hub.downloads
    finally:
        hub.stop()


# ---------------------------------------------------------------- llama-quantize's options per job


def test_jobs_carry_llama_quantize_options_in_every_format(tmp_path: Path) -> None:
    t = tmp_path / "j.txt"
    t.write_text("org/a --to gguf:q4_k_m --tensor-type attn_v=q8_0 --tensor-type 'ffn_.*=q5_k' --pure "
                 "--output-tensor-type q6_k --imatrix m.dat --include-weights attn\n")
    (job,) = parse_jobs(t, _defaults())
    assert job.mix.argv() == [["--tensor-type", "attn_v=q8_0"], ["--tensor-type", "ffn_.*=q5_k"],
                              ["--output-tensor-type", "q6_k"], ["--pure"], ["--imatrix", os.path.abspath("m.dat")],
                              ["--include-weights", "attn"]]
    j = tmp_path / "j.json"
    j.write_text(json.dumps([{"src": "org/a", "to": "gguf:q4_k_m", "tensor_type": ["attn_v=q8_0", "ffn_.*=q5_k"],
                              "output_tensor_type": "q6_k", "pure": True, "imatrix": "m.dat",
                              "include_weights": "attn"}]))
    (from_json,) = parse_jobs(j, _defaults())
    assert from_json.mix == job.mix
    # through a worker's spec file and the state file: the same options back
    assert Job(**json.loads(json.dumps(job.to_dict()))).mix == job.mix


@pytest.mark.parametrize(("line", "parts"), [
    ("org/a --to bf16 --pure", ["BATCH-003", "--pure needs a gguf:TYPE of llama-quantize's types", "--to bf16"]),
    ("org/a --to gguf:q8_0 --tensor-type attn_v=q8_0", ["BATCH-003", "--tensor-type needs a gguf:TYPE"]),
    ("org/a --to gguf:q4_k_m --tensor-type attn_v", ["BATCH-003", "USE-001 --tensor-type must be PATTERN=TYPE"]),
    ("org/a --to gguf:q4_k_m --output-tensor-type q9_k", ["BATCH-003", "GGUF-002", "not a GGML type"]),
    ("org/a --to gguf:q4_k_m --include-weights attn", ["BATCH-003", "needs --imatrix FILE"]),
])
def test_bad_llama_quantize_options_of_a_job_are_refused(tmp_path: Path, line: str, parts: list[str]) -> None:
    t = tmp_path / "j.txt"
    t.write_text(line + "\n")
    with pytest.raises(UsageError) as ei:
        parse_jobs(t, _defaults())
    assert ei.value.rule == "BATCH-003" and "j.txt:1" in str(ei.value)
    for p in parts:
        assert p in str(ei.value), (p, str(ei.value))
    j = tmp_path / "j.json"
    j.write_text(json.dumps([{"src": "org/a", "to": "gguf:q4_k_m", "pure": "yes"}]))
    with pytest.raises(UsageError, match="BATCH-003 j.json.* pure must be true or false"):
        parse_jobs(j, _defaults())


def test_a_job_with_llama_quantize_options_writes_what_the_cli_writes(tmp_path: Path) -> None:
    src = MODELS / "llama_nf4_dq"
    opts = ["--tensor-type", "attn_v=q8_0", "--token-embedding-type", "q4_0", "--leave-output-tensor"]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to gguf:q4_k_m --name m " + " ".join(opts) + "\n")
    out = tmp_path / "out"
    r = run_cli(["batch", str(jobs), "--out-dir", str(out), "--json"], offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert main([str(src), "--to", "gguf:q4_k_m", *opts, "-o", str(tmp_path / "direct.gguf"), "-q"]) == 0
    assert (out / "m.gguf").read_bytes() == (tmp_path / "direct.gguf").read_bytes()


def test_dry_run_plans_a_jobs_importance_matrix_and_options_as_the_run(tmp_path: Path) -> None:
    """A job's llama-quantize options reach the dry run's check: a missing or foreign importance matrix and a
    type without an encoder are planned 'fail' with the run's rule; the plan line shows the options."""
    src = MODELS / "llama_nf4_dq"
    foreign = write_dat_imatrix(tmp_path / "other.dat", {"blk.40.attn_q.weight": ([0.0] * 4, 1)}, chunks=None)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to gguf:q4_k_m --name a --imatrix {tmp_path / 'none.gguf'}\n"
                    f"{src} --to gguf:q4_k_m --name b --imatrix {foreign}\n"
                    f"{src} --to gguf:q4_k_m --name c --token-embedding-type iq3_s\n"
                    f"{src} --to gguf:q4_k_m --name d --pure\n")
    env = offline_env(tmp_path)
    r = _batch(jobs, tmp_path / "out", env, "--dry-run", "--json")
    assert r.returncode == 3, r.stderr
    plan = {e["name"]: e for e in json.loads(r.stdout)}
    assert [(e["action"], e.get("rule")) for e in plan.values()] == [
        ("fail", "IMX-001"), ("fail", "IMX-003"), ("fail", "GGUF-002"), ("convert", None)]
    assert plan["d.gguf"]["options"] == ["--pure"]
    text = _batch(jobs, tmp_path / "out", env, "--dry-run").stdout.splitlines()
    assert text[3] == f"d.gguf: {src} --to gguf:q4_k_m --pure -> {tmp_path / 'out' / 'd.gguf'}: convert"
    (tmp_path / "j.json").write_text(json.dumps([{"src": str(src), "to": "gguf:q4_k_m", "imatrix": ""}]))
    with pytest.raises(UsageError, match="BATCH-003 .*--imatrix needs a file name"):
        parse_jobs(tmp_path / "j.json", _defaults())


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_two_jobs_pushing_to_one_repo_are_refused(tmp_path: Path, parallel: str) -> None:
    """Two jobs of several targets whose sources have one name push their outputs to the same repos: the dry run
    plans the second ``fail`` (BATCH-004, no upload plan); the run pushes one, converts the other but does not push
    it over the first's files (BATCH-004, its conversion kept), also with both jobs running at once."""
    srcs = []
    for d in ("x1", "x2"):
        shutil.copytree(MODELS / "llama_nf4_dq", tmp_path / d / "llama", ignore=shutil.ignore_patterns("reference"))
        srcs.append(tmp_path / d / "llama")
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{srcs[0]} --to bf16,gguf:q8_0 --name s1\n{srcs[1]} --to bf16,gguf:q8_0 --name s2\n")
    out = tmp_path / "out"
    hub = FakeHub()
    hub.start()
    try:
        env = push_env(offline_env(tmp_path), hub.url)
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--dry-run", "--json")
        first, second = json.loads(r.stdout)
        assert first["action"] == "convert" and len(first["outputs"]) == 2, r.stderr
        assert (second["action"], second["rule"]) == ("fail", "BATCH-004") and "outputs" not in second
        assert second["error"].startswith("BATCH-004 job s2 would push to 'me/llama-bf16', which job s1 of this "
                                          "batch pushes to")
        r = _batch(jobs, out, env, "--push-to-hub", "me", "--json", "--jobs", parallel)
        assert r.returncode == 3, r.stderr
        res = {x["name"]: x for x in json.loads(r.stdout)}
        pushed, refused = sorted(res, key=lambda n: res[n]["status"] != "converted")
        assert res[pushed]["status"] == "converted" and res[pushed]["pushed"] == "me/llama-bf16, me/Llama-2.0M-Q8_0"
        assert (res[refused]["status"], res[refused]["rule"]) == ("failed", "BATCH-004")
        assert f"which job {pushed} of this batch pushes to" in res[refused]["error"]
        assert [c["summary"] for c in hub.commits] == ["convert-bnb 0.1.0: llama --to bf16",
                                                       "convert-bnb 0.1.0: llama --to gguf:q8_0"]
        assert sorted(p.name for p in (out / refused).iterdir()) == ["Llama-2.0M-Q8_0.gguf", "llama-bf16"]
    finally:
        hub.stop()


def test_dry_run_plans_auto_beside_its_float_target_as_a_failure(tmp_path: Path) -> None:
    """A job ``--to auto,bf16`` of a model auto keeps in bf16: the dry run plans it ``fail`` with the USE-001 the run
    gives (``check``'s), exit 3, nothing written."""
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{MODELS / 'llama_nf4_dq'} --to auto,bf16 --name s\n")
    out = tmp_path / "out"
    r = _batch(jobs, out, offline_env(tmp_path), "--dry-run", "--json")
    (plan,) = json.loads(r.stdout)
    assert r.returncode == 3 and (plan["action"], plan["rule"]) == ("fail", "USE-001"), r.stderr
    assert plan["error"].startswith("USE-001 --to names the target bf16 twice (auto and bf16 write the same output")
    assert not out.exists()


def test_an_adapter_job_takes_its_base(tmp_path: Path) -> None:
    """A PEFT adapter job with ``--base`` (its config's base is a relative path no worker can resolve): planned and
    converted as ``convert-bnb ADAPTER --to gguf --base MODEL`` (the same bytes); without it the dry run plans the
    USE-001 the run gives; ``--base`` that is not text in a JSON job is BATCH-003."""
    adapter, base = ROOT / "tests" / "fixtures" / "lora" / "adapter", MODELS / "llama_orig_bf16"
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{adapter} --to gguf --base {base} --name ad.gguf\n{adapter} --to gguf --name bare.gguf\n")
    out = tmp_path / "out"
    env = offline_env(tmp_path)
    with_base, bare = json.loads(_batch(jobs, out, env, "--dry-run", "--json").stdout)
    assert with_base["action"] == "convert"
    assert (bare["action"], bare["rule"]) == ("fail", "USE-001") and "give --base" in bare["error"]
    jobs.write_text(f"{adapter} --to gguf --base {base} --name ad.gguf\n")
    r = _batch(jobs, out, env, "--json")
    assert r.returncode == 0, r.stderr
    assert main([str(adapter), "--to", "gguf", "--base", str(base), "-o", str(tmp_path / "one.gguf"), "-q"]) == 0
    assert (out / "ad.gguf").read_bytes() == (tmp_path / "one.gguf").read_bytes()
    bad = tmp_path / "jobs.json"
    bad.write_text(json.dumps([{"src": str(adapter), "to": "gguf", "base": 3}]))
    r = _batch(bad, tmp_path / "o2", env)
    assert r.returncode == 2 and "BATCH-003" in r.stderr and "base must be a Hub repo id or a path" in r.stderr
