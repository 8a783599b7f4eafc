"""What ``convert-bnb batch --push-to-hub ORG`` publishes, and what ``--dry-run`` shows.

Pushing
    After a job is done (its output verified complete), :func:`push_output` creates ``ORG/NAME``
    (``exist_ok``; ``--private`` makes it private) and uploads every file of the output (and its
    ``--mmproj`` file) and a model card (``README.md``, :func:`model_card`) with the code a single run's
    ``--push-to-hub`` uses (:mod:`convert.hub.upload`: one commit, or the resumable folder upload for an
    output over 5 GB; :mod:`convert.hub.card`). The card records the source repo (or a local source's
    folder name only: no paths of this machine are published), revision and commit, the source's
    quantization and license, the settings, the converter version, the command that reproduces the
    output and every file with its size and sha256. The push is
    recorded in the job's state file (``pushed``: repo, job key, Hub commit); a re-run does not push a
    job again that was pushed to the same repo with the same key. A push the Hub refuses raises
    :class:`~formats.errors.HubError`; the conversion stays done.

    A job of several targets (``--to bf16,gguf:q8_0``) pushes each output of its folder to a repo of its own,
    ``ORG/<its name>`` (:func:`convert.hub.repo.output_repo_name`), as a single run of several targets does: the
    outputs and their targets are those a dry run of the job's conversion plans (:func:`set_outputs`), each
    output's files are its part of the job's manifest (:func:`member_files`), its card is the job's card with
    its own target and name, and its push is recorded under ``pushed_outputs[NAME]``. Outputs are pushed in
    ``--to`` order; a refused upload stops there, and a re-run uploads the outputs not recorded as pushed.

Dry run
    :func:`plan_batch` converts, downloads and writes nothing: for each job it resolves the source
    (a Hub repo to its commit only, from the cache when offline), says whether a run would skip it
    (done with the same key, output in place), convert it or resume it (with the number of finished shards kept), or
    fail it: a job it would convert is checked as the run checks it (BATCH-005 and BATCH-006 by the worker's
    own :func:`convert.batch.state.check_replaceable`), and its input as ``convert-bnb check SRC --to TARGET``
    checks it, when its files are here (a Hub repo not in the cache is planned ``convert (not checked: not
    downloaded)``). With ``--push-to-hub`` it gives the card and the upload plan (:func:`build_upload_plan`);
    for a job of several targets each output's (its files planned as a single run plans them,
    :func:`convert.hub.publish.planned_outputs`), when the source's files are here to name them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convert.batch.jobs import Job, job_options
from convert.batch.state import STATE_DIR, check_replaceable, load_state, save_state, state_path
from convert.check import check_source
from convert.hub import card as hub_card
from convert.hub.card import CardSource, source_license
from convert.hub.download import resolve_repo
from convert.hub.publish import commit_message, planned_outputs, quant_summary
from convert.hub.repo import check_repo_id, output_repo_id, output_repo_name
from convert.hub.upload import PushOptions, push_refused, repo_files, upload, upload_folder_path
from convert.hub.upload import build_upload_plan as plan_upload
from convert.options import ConvertOptions, Target
from convert.output import recorded_shards
from convert.run.result import ConvertResult
from convert.run.several import plan_set
from convert.run.single import job_key
from convert.run.source import ResolvedSource, resolve_source
from convert.stream.plan import make_plan
from formats.checkpoint import open_checkpoint
from formats.errors import BatchNameClashError, ConvertBnbError, HubUploadError

__all__ = ["JobRepo", "build_upload_plan", "job_repos", "member_files", "model_card", "plan_batch", "push_output",
           "repo_name", "set_outputs"]


def repo_name(job: Job) -> str:
    """The name of the repo a job is pushed to (:func:`convert.hub.repo.output_repo_name` of its output)."""
    return output_repo_name(job.name)


def model_card(job: Job, commit: str | None, files: dict[str, dict[str, Any]],
               quantization: Iterable[str] = (), license: dict[str, str] | None = None,
               output: tuple[str, Target] | None = None) -> str:
    """The model card (``README.md``) pushed with a job's output: :func:`convert.hub.card.model_card` with the
    job's source, settings (``--max-shard-size``, ``--mmproj``) and the command that reproduces it.

    Args:
        job: the job (source, revision, target, shard size).
        commit: the source commit the output was made from (None for a local source).
        files: the manifest of the output (and its ``--mmproj`` file) as the repo holds them,
            ``{path: {"bytes", "sha256"}}``.
        quantization: lines describing the source's quantized layers.
        license: the source card's license keys (:func:`convert.hub.card.source_license`), or None.
        output: one output of a job of several targets: its name in the job's folder and its target (the
            card's title and target; the command stays the job's, which makes the whole folder).

    Returns:
        the card text. A local source is named by its folder only: a pushed card must not publish this
        machine's paths.
    """
    shown = _shown(job)
    source = CardSource(job.src if job.is_repo else None, shown, job.revision, commit, tuple(quantization),
                        license or {})
    settings = [("--max-shard-size", f"{job.max_shard_size} bytes")] + [("--mmproj", job.mmproj)] * bool(job.mmproj)
    settings += [("--modelfile", job.modelfile)] * bool(job.modelfile)
    cmd = f"convert-bnb {shown}" + (f" --revision {commit}" if commit else "")
    cmd += f" --to {job.to} --max-shard-size {job.max_shard_size}" + (f" --mmproj {job.mmproj}" if job.mmproj else "")
    cmd += " --modelfile" if job.modelfile else ""
    name, to = output or (job.name, job.to)
    return hub_card.model_card(output_repo_name(name), to, source, files, settings=settings, command=cmd)


def build_upload_plan(org: str, job: Job, outputs: list[tuple[Path, dict[str, dict[str, Any]] | None]],
                      card: str, private: bool, output: tuple[str, Target] | None = None) -> dict[str, Any]:
    """What ``--push-to-hub ORG`` does for one job (:func:`convert.hub.upload.build_upload_plan`): create
    ``ORG/NAME`` and upload every file of its outputs and the card (one commit, or the resumable folder upload
    for an output over :data:`convert.hub.upload.LARGE_UPLOAD` bytes).

    Args:
        outputs: each output of the job (the text model, then its ``--mmproj`` file) with its manifest
            ``{path relative to the output: {"bytes", "sha256"}}`` (a file output: its own name), or None
            when not known yet.
        output: one output of a job of several targets (its name and target): to ``ORG/<its name>``.
    """
    name, to = output or (job.name, job.to)
    return plan_upload(PushOptions(output_repo_id(org, name), private), outputs, card,
                       commit_message(_shown(job), to))


def _shown(job: Job) -> str:
    """How a job's source is named on the Hub (card, commit): a repo by its id, a local source by its own name
    only (a pushed card or commit must not publish this machine's paths)."""
    return job.src if job.is_repo else Path(job.src).name


@dataclass(frozen=True)
class JobRepo:
    """One repo a job pushes to: the job's output (with its ``--mmproj`` and ``--modelfile`` files) to
    ``ORG/NAME``, or one output of a job of several targets to ``ORG/<its name>``.

    Attributes:
        name: the output's name (the job's NAME, or the output's in the job's folder); the repo's is
            :func:`convert.hub.repo.output_repo_name` of it.
        to: the output's target.
        outputs: what goes up: each output path with its manifest ``{path relative to the output: {"bytes",
            "sha256"}}``, or None when not known yet.
        member: one output of a job of several targets (its push is recorded in the state's
            ``pushed_outputs[name]``, a job's own in ``pushed``).
    """

    name: str
    to: Target
    outputs: list[tuple[Path, dict[str, dict[str, Any]] | None]]
    member: bool = False

    def card_and_plan(self, org: str, job: Job, private: bool, commit: str | None, quantization: Iterable[str],
                      license: dict[str, str] | None) -> tuple[str, dict[str, Any]]:
        """Its model card (:func:`model_card`) and upload plan (:func:`build_upload_plan`)."""
        output = (self.name, self.to) if self.member else None
        card = model_card(job, commit, _card_files(self.outputs), quantization, license, output=output)
        return card, build_upload_plan(org, job, self.outputs, card, private, output=output)


def set_outputs(job: Job, options: ConvertOptions, source: ResolvedSource, org: str | None = None
                ) -> list[tuple[Target, ConvertResult]]:
    """Each output of a job of several targets with its target, in ``--to`` order, named as the job's conversion
    names them: the outputs a dry run of it plans (:func:`convert.run.several.plan_set`; headers only).

    Args:
        job: the job (``to`` of several targets).
        options: its options (:func:`convert.batch.jobs.job_options`, at the resolved commit).
        source: its source, resolved (its files here: a local path, or the Hub snapshot in the cache).
        org: ``--push-to-hub`` ORG: each output's repo, ``ORG/<its name>``, is checked as the Hub checks it.

    Raises:
        ConvertBnbError: a target cannot be planned (the run would fail on it too); UsageError (USE-001): an
            output's repo is not a Hub repo id (:func:`convert.hub.repo.check_repo_id`).
    """
    members = list(zip(job.to.targets, plan_set(options, source).outputs, strict=True))
    if org is not None:
        for _, o in members:
            repo = output_repo_id(org, Path(o.output).name)
            check_repo_id(repo, repo, f"ORG/<the output's name> (job {job.where})")
    return members


def member_files(files: dict[str, dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    """One output's part of the manifest of a job of several targets, relative to the output as its own
    manifest is: the job's manifest holds a directory output's files under ``NAME/`` and a file output by its
    name (:func:`convert.job.convert`'s result of a set; a batch job writes no split GGUF)."""
    prefix = f"{name}/"
    inside = {rel[len(prefix):]: rec for rel, rec in files.items() if rel.startswith(prefix)}
    return inside or {rel: rec for rel, rec in files.items() if rel == name}


def job_repos(job: Job, out_dir: Path, state: dict[str, Any],
              members: list[tuple[Target, ConvertResult]] | None = None) -> list[JobRepo]:
    """The repos a done job pushes to, each with the manifests its state records.

    Args:
        job: the job.
        out_dir: the batch's out dir.
        state: the job's state (``files``, ``mmproj_files``, ``modelfile_files``).
        members: a job of several targets: its outputs (:func:`set_outputs`); None for a job of one target.
    """
    if members is None:
        return [JobRepo(job.name, job.to, [(out_dir / name, state.get(f, {})) for name, f in job.outputs()])]
    repos = []
    for to, planned in members:
        name = Path(planned.output).name
        repos.append(JobRepo(name, to, [(out_dir / job.name / name, member_files(state.get("files") or {}, name))],
                             member=True))
    return repos


def push_output(job: Job, out_dir: Path, state: dict[str, Any], state_path: Path, spec: dict[str, Any],
                commit: str | None, quantization: list[str], license: dict[str, str] | None = None,
                members: list[tuple[Target, ConvertResult]] | None = None) -> str:
    """Push a done job's output to ``ORG/NAME`` with its model card (:func:`convert.hub.upload.upload`), or each
    output of a job of several targets to ``ORG/<its name>`` (:func:`job_repos`), unless the state records a push
    to that repo with the same key; record each push in the state file as it is done.

    Args:
        job: the job.
        out_dir: the batch's out dir.
        state: its state (``key``, ``files``, ``pushed``, ``pushed_outputs``); updated with each push.
        state_path: the state file.
        spec: the batch settings (``push_to_hub``: ORG, ``private``).
        commit: the source commit (None for a local source).
        quantization: lines describing the source's quantized layers, for the card.
        license: the source card's license keys, for the card, or None.
        members: a job of several targets: its outputs (:func:`set_outputs`).

    Returns:
        the repo id pushed to (now or before); a job of several targets: its repo ids, joined by ``, ``.

    Raises:
        HubUploadError: HUB-003, an upload failed (network, no write access, the Hub refused); the outputs
            pushed before it stay recorded.
        BatchNameClashError: BATCH-004, another job of the batch has pushed to one of its repos.
    """
    org = spec["push_to_hub"]
    targets: list[str] = []
    refused: list[tuple[str, str]] = []
    hint = ("the conversion is kept; check the network and HF_TOKEN's write access, then run the batch again to "
            "retry the upload")
    for repo in job_repos(job, out_dir, state, members):
        target = output_repo_id(org, repo.name)
        targets.append(target)
        pushed = (state.get("pushed_outputs") or {}).get(repo.name) if repo.member else state.get("pushed")
        if isinstance(pushed, dict) and pushed.get("repo") == target and pushed.get("key") == state.get("key"):
            continue
        other = _claim_repo(out_dir, job.name, target)
        if other is not None:
            raise _shared_repo(job.name, target, other)
        card, plan = repo.card_and_plan(org, job, bool(spec.get("private")), commit, quantization, license)
        try:
            oid = upload(plan, card, upload_folder_path(repo.outputs[0][0]), hint=hint)
        except HubUploadError as exc:  # the job's other outputs are tried too: the error names every repo not pushed
            refused += exc.refused
            continue
        record = {"repo": target, "key": state.get("key"), "commit": oid}
        if repo.member:
            state.setdefault("pushed_outputs", {})[repo.name] = record
        else:
            state["pushed"] = record
        save_state(state_path, state)
    if refused:
        raise push_refused(refused, hint)
    return ", ".join(targets)


def _claim_repo(out_dir: Path, name: str, repo_id: str) -> str | None:
    """Claim ``repo_id`` for job ``name`` of the batch in ``out_dir`` before its first upload: a file per repo under
    the batch's state folder, ``REPO-ID.repo-owner`` (``/`` as ``--``), holding the job's name, made atomically (a
    hard link of a written file: two workers of ``--jobs 2`` cannot both claim it). None when the repo is this
    job's (claimed now or by an earlier run), else the job that holds it."""
    folder = out_dir / STATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{repo_id.replace('/', '--')}.repo-owner"
    temp = folder / f".{path.name}.{os.getpid()}"
    temp.write_text(name, encoding="utf-8")
    try:
        os.link(temp, path)
    except FileExistsError:
        owner = path.read_text(encoding="utf-8")
        return None if owner == name else owner
    finally:
        temp.unlink()
    return None


def _shared_repo(name: str, repo_id: str, other: str) -> BatchNameClashError:
    """BATCH-004: job ``name`` would push to ``repo_id``, which job ``other`` of the batch pushes to (two models,
    one repo: the later upload would replace the other's files)."""
    return BatchNameClashError(f"job {name} would push to '{repo_id}', which job {other} of this batch pushes to",
                               hint="a repo is named after its output: give one job its own --name (a job of "
                                    "several targets names its outputs after its source: give the sources distinct "
                                    "names, or push with another --push-to-hub ORG)")


def _flag_shared_repos(entries: list[dict[str, Any]]) -> None:
    """A planned push to a repo an earlier job of the plan pushes to: that job is planned ``fail`` (BATCH-004),
    without its card and upload plan, as the run fails it."""
    owner: dict[str, str] = {}
    for entry in entries:
        uploads = [o["upload"] for o in entry.get("outputs", [])] + ([entry["upload"]] if "upload" in entry else [])
        repos = [u["create_repo"]["repo_id"] for u in uploads]
        clash = next((r for r in repos if r in owner), None)
        if clash is not None:
            for key in ("card", "upload", "outputs"):
                entry.pop(key, None)
            _fail(entry, [_shared_repo(entry["name"], clash, owner[clash])])
            continue
        owner.update((r, entry["name"]) for r in repos)


def plan_batch(jobs: list[Job], out_dir: Path, push_to_hub: str | None, private: bool,
               overwrite: bool = False) -> list[dict[str, Any]]:
    """``--dry-run``: for each job, its source and commit, what a run would do, and the card and upload plan.

    Nothing is downloaded or written: a Hub repo is resolved to its commit (from the cache when
    offline), its files are listed from the snapshot when it is cached, else from a finished output.
    A job a run would convert is checked as the run checks it before converting, so a job certain to
    fail is planned ``fail`` with the rule: the output against its state
    (:func:`convert.batch.state.check_replaceable`: BATCH-005, BATCH-006), then the input as
    ``convert-bnb check SRC --to TARGET`` checks it (:func:`convert.check.check_source`) when its files
    are here (a local source, or a Hub snapshot in the cache; else the action says it was not checked).

    Args:
        jobs: from :func:`convert.batch.jobs.parse_jobs`.
        out_dir: the batch's ``--out-dir``.
        push_to_hub: ``--push-to-hub`` ORG, or None.
        private: ``--private``.
        overwrite: ``--overwrite`` (a job whose output was made with other settings is redone, not BATCH-005).

    Returns:
        one entry per job: ``name``, ``src``, ``revision``, ``to``, ``max_shard_size``, ``output``, ``commit``,
        ``action`` (``skip (already converted)``, ``convert`` with what it resumes or what was not checked,
        or ``fail``); a failing job's ``error`` (the message), ``rule`` and, from the input check, every
        ``problems`` line; with ``push_to_hub`` the ``card`` and the ``upload`` plan of a job that would not fail
        (a job of several targets: ``outputs``, each output's ``name``, ``to``, ``output``, ``card`` and
        ``upload``; or, its source not downloaded, ``push``: a line saying the outputs are named later).

    Raises:
        HubError: a repo cannot be resolved.
    """
    out: list[dict[str, Any]] = []
    for job in jobs:
        entry: dict[str, Any] = {"name": job.name, "src": job.src, "revision": job.revision, "to": job.to.name,
                                 "max_shard_size": job.max_shard_size, "output": str(out_dir / job.name)}
        if job.mix.flags():
            entry["options"] = job.mix.flags()
        out.append(entry)
        try:
            source = _resolve_without_download(job)
        except ConvertBnbError as exc:
            _fail(entry, [exc])
            continue
        commit = source.hub.commit if source.hub is not None else None
        entry["commit"] = commit
        state_file = state_path(out_dir, job.name)
        state = load_state(state_file)
        final = out_dir / job.name
        options = job_options(job, {"out_dir": str(out_dir), "max_memory": 1 << 30, "threads": 1}, revision=commit)
        key = job_key(options, source)
        if job.mmproj:
            entry["mmproj"] = str(out_dir / job.mmproj)
        if job.modelfile:
            entry["modelfile"] = str(out_dir / job.modelfile)
        done = (state.get("key") == key and state.get("status") == "done"
                and all((out_dir / name).exists() for name, _ in job.outputs()))
        if done:
            entry["action"] = "skip (already converted)"
        else:
            problems = _convert_problems(job, source, out_dir, state, state_file, key, overwrite)
            if problems:
                _fail(entry, problems)
                continue
            kept = len(recorded_shards(final, {**(options.resume_key or {}), "job": key}))
            entry["action"] = "convert" + (f" (resume: {kept} shard(s) done)" if kept else "")
            if source.hub is not None and source.hub.missing:
                entry["action"] += " (not checked: not downloaded)"
        if push_to_hub:
            _plan_push(entry, job, out_dir, state, source, options, done, push_to_hub, private)
    _flag_shared_repos(out)
    return out


def _plan_push(entry: dict[str, Any], job: Job, out_dir: Path, state: dict[str, Any], source: ResolvedSource,
               options: ConvertOptions, done: bool, org: str, private: bool) -> None:
    """``--push-to-hub`` in a job's plan: its ``card`` and ``upload`` plan; for a job of several targets, each
    output's (``outputs``: ``name``, ``to``, ``output``, ``card``, ``upload``), when the source's files are here
    to plan them (else ``push`` says when they are named). A done job's files are those its state records, a
    job to convert its planned ones. An output that cannot be planned fails the job's plan, as it fails the run.
    """
    src = source.path
    commit = source.hub.commit if source.hub is not None else None
    several = job.to.family == "multi"
    if several and not _files_here(source):
        entry["push"] = (f"each output to {org}/<its name>, named once the source is downloaded (a GGUF file's "
                         "name comes from the model's config)")
        return
    if several:
        try:
            members = set_outputs(job, options, source, org)
        except ConvertBnbError as exc:
            _fail(entry, [exc])
            return
        repos = job_repos(job, out_dir, state, members) if done else [
            JobRepo(Path(o.output).name, to, [(path, files) for path, files in planned_outputs(o)], member=True)
            for to, o in members]
    elif done:
        repos = job_repos(job, out_dir, state)
    else:
        repos = [JobRepo(job.name, job.to, [(out_dir / job.name, _planned_files(src, job))]
                         + [(out_dir / name, _not_written_yet(name)) for name, _ in job.outputs()[1:]])]
    quant = quant_summary(src) if src.exists() else []
    lic = source_license(src if src.is_dir() else None, job.src if job.is_repo else None, commit)
    plans = [(repo, *repo.card_and_plan(org, job, private, commit, quant, lic)) for repo in repos]
    if several:
        entry["outputs"] = [{"name": r.name, "to": r.to.name, "output": str(r.outputs[0][0]), "card": card,
                             "upload": upload_plan} for r, card, upload_plan in plans]
    else:
        _, entry["card"], entry["upload"] = plans[0]


def _files_here(source: ResolvedSource) -> bool:
    """Whether the source's files are here to read (a local path, or its Hub snapshot in the cache): a dry
    run downloads nothing."""
    return source.hub is None or (not source.hub.missing and source.path.is_dir())


def _convert_problems(job: Job, source: ResolvedSource, out_dir: Path, state: dict[str, Any], state_file: Path,
                      key: dict[str, Any], overwrite: bool) -> list[ConvertBnbError]:
    """Why a run would fail to convert the job, as far as known without converting: BATCH-006 or BATCH-005
    (the worker's own check), else every problem ``check SRC --to TARGET`` finds in the input (none when
    its files are not here: a Hub repo not in the cache)."""
    outputs = [(out_dir / name, f) for name, f in job.outputs()]
    try:
        check_replaceable(outputs, state, state_file, key, overwrite)
    except ConvertBnbError as exc:
        return [exc]
    if not _files_here(source):
        return []  # not downloaded: a dry run fetches nothing to check
    name = source.hub.repo_id if source.hub is not None else None  # as the conversion names the model
    return check_source(source.path, job.to, name, base=job.base, mix=job.mix).problems


def _fail(entry: dict[str, Any], problems: list[ConvertBnbError]) -> None:
    """Plan a job as failing: the first problem's message and rule (as the run would report it), and
    every problem's line when there are more."""
    entry.update(action="fail", error=str(problems[0]), rule=problems[0].rule)
    if len(problems) > 1:
        entry["problems"] = [str(p) for p in problems]


def _card_files(outputs: list[tuple[Path, dict[str, dict[str, Any]] | None]]) -> dict[str, dict[str, Any]]:
    """The files of a job's outputs as the pushed repo holds them (a file output by its name, a
    directory's files by their path in it: both at the repo's root; an output's README.md gives way to the
    card)."""
    return {rel: rec for _, files in outputs for rel, rec in repo_files(files).items()}


def _not_written_yet(name: str) -> dict[str, dict[str, Any]]:
    """The planned manifest of a one-file output whose size and sha256 are known only once it is written."""
    return {name: {"bytes": None, "sha256": "(after conversion)"}}


def _resolve_without_download(job: Job) -> Any:
    """The job's source as a :class:`~convert.run.source.ResolvedSource`; a Hub repo resolved to its commit only."""

    if not job.is_repo:
        return resolve_source(job.src, job.revision)
    hub = resolve_repo(job.src, job.revision, download=False, progress=False)
    return ResolvedSource(hub.path, hub)


def _planned_files(src: Path, job: Job) -> dict[str, dict[str, Any]] | None:
    """Output files a conversion would write, with tensor-data bytes (sha256 unknown yet), when SRC is local;
    a GGUF job's one file by name (its size is known after conversion)."""
    if job.to.family == "gguf":
        return _not_written_yet(job.name)
    if not src.exists():
        return None

    if job.to.family != "float":
        return None
    try:
        with open_checkpoint(src) as ckpt:
            plan = make_plan(ckpt, job.to.dequantize_to, max_shard_size=job.max_shard_size)
            names = plan.shard_names() if ckpt.is_dir else [job.name]
            files = {n: {"bytes": sum(plan.tensors[i].nbytes for i in s), "sha256": "(after conversion)"}
                     for n, s in zip(names, plan.shards, strict=True)}
            if ckpt.is_dir:
                for extra in ckpt.extra_files:
                    files[extra.name] = {"bytes": extra.stat().st_size, "sha256": "(after conversion)"}
                if len(names) > 1:
                    files["model.safetensors.index.json"] = {"bytes": 0, "sha256": "(after conversion)"}
            return files
    except ConvertBnbError:
        return None
