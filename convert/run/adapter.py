"""A PEFT LoRA adapter as SRC (a local directory, or a Hub repo holding ``adapter_config.json``): its options
checked (:func:`check_adapter_options`), its base model's config.json found (:func:`base_model`), and its GGUF
LoRA adapter planned and written as every output is (:func:`convert_adapter`, through
:func:`convert.run.single.write_output`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from convert.hub.download import resolve_config
from convert.hub.repo import is_repo_id, parse_repo_spec
from convert.options import ConvertOptions
from convert.output_names import output_path
from convert.run.result import ConvertResult
from convert.run.single import done, named_default, write_output
from convert.run.source import ResolvedSource, absolute
from convert.stream.pipeline import RunSettings
from convert.targets import ADAPTER_JOB, BaseModel
from formats.checkpoint import path_kind
from formats.errors import UsageError
from formats.peft import Adapter, open_adapter

__all__ = ["base_model", "check_adapter_options", "convert_adapter"]


#: Options of a model conversion that mean nothing for a LoRA adapter as SRC (its GGUF adapter is one file made
#: from the adapter alone). ``--revision`` is a Hub adapter's, never a local one's.
_MODEL_ONLY = (("--merge-lora", "merge_lora"), ("--mmproj", "mmproj"), ("--low-disk", "low_disk"),
               ("--split-max-size", "split_max_size"), ("--split-max-tensors", "split_max_tensors"),
               ("--modelfile", "modelfile"))


def check_adapter_options(options: ConvertOptions, *, hub: bool = False) -> None:
    """Refuse what a LoRA adapter as SRC cannot be converted with: a target other than GGUF, an option of a model
    conversion (:data:`_MODEL_ONLY`), ``--revision`` with a local adapter directory.

    Args:
        options: the run's options (``src`` the adapter).
        hub: the adapter is a Hub repo (``--revision`` is its revision).

    Raises:
        UsageError: USE-001.
    """
    src = Path(options.src)
    if options.revision and not hub:
        raise UsageError("--revision applies to a Hub repo id, but SRC is a local adapter directory", path=src,
                         found=f"--revision {options.revision}")
    if options.to.family != "gguf":
        raise UsageError("SRC is a PEFT LoRA adapter: it becomes a GGUF LoRA adapter (--to gguf[:f32|f16|bf16|q8_0])",
                         path=src, expected="--to gguf[:TYPE]", found=f"--to {options.to.name}",
                         hint="to merge it into a model instead, give the model as SRC with --merge-lora ADAPTER")
    for flag, attr in _MODEL_ONLY:
        if getattr(options, attr):
            raise UsageError(f"{flag} does not apply to a LoRA adapter as SRC", path=src, found=flag,
                             hint="a GGUF LoRA adapter is one file made from the adapter and its base's config.json")


def convert_adapter(options: ConvertOptions, source: ResolvedSource, committed: list[Path], t0: float
                    ) -> ConvertResult:
    """A PEFT LoRA adapter as SRC, a directory or a Hub repo's snapshot (``source``, resolved): its GGUF LoRA adapter
    (:mod:`convert.gguf.adapter`), planned from the adapter and its base model's config.json (:func:`base_model`),
    named by llama.cpp's convention (the ``general.*`` name: the folder's, or the repo id as for a Hub model) next to
    a local SRC or in the working directory for a Hub repo (:func:`convert.output_names.default_output`), written,
    verified and committed as every output. A Hub adapter's weights may be read in place (a dry run).

    Raises:
        UsageError: USE-001, a target other than GGUF, or an option of a model conversion (:data:`_MODEL_ONLY`).
        AdapterError, UnsupportedError, HubError: the adapter, its base, or what a GGUF adapter cannot hold.
    """
    hub = source.hub
    check_adapter_options(options, hub=hub is not None)
    shards = hub.shards if hub is not None else None
    with open_adapter(source.path, remote=shards.open if shards is not None else None) as adapter:
        base = base_model(options.base, adapter, progress=options.progress)
        job = ADAPTER_JOB(adapter, base, options, source.model_name(source.path))
        job.plan.notes += source.notes()
        out = output_path(options.output, named_default(options, source, job.naming), is_dir=False)
        result = ConvertResult(source=source.ref, to=options.to.name, output=str(out),
                               commit=hub.commit if hub is not None else None)
        if options.dry_run:
            result.dry_run, result.plan_text = job.plan_dict(), job.describe()
            result.output_exists = out.exists()
            return result
        threads = options.worker_threads
        run = RunSettings(threads=threads, max_memory=options.max_memory, progress=options.progress, label=out.name,
                          on_progress=options.on_progress, processes=options.processes)
        result.timings["plan"] = time.perf_counter() - t0
        write_output(job, options, source, source.path, out, run, result, committed)
        return done(result, job, [], t0)


def base_model(spec: str | None, adapter: Adapter, *, progress: bool = False) -> BaseModel:
    """The base model of a LoRA adapter, for its GGUF adapter: ``spec`` (``--base``), or the adapter config's
    ``base_model_name_or_path``; a local directory (as it is given, from the working directory), or else a Hub repo
    id ``org/name[@rev]`` whose config.json alone is fetched (:func:`convert.hub.download.resolve_config`).

    Raises:
        UsageError: USE-001, no base named, a directory without config.json, a name that is neither.
        ConfigJsonError: CKPT-007. HubError: HUB-001.
    """
    given = "--base" if spec is not None else "the adapter config's base_model_name_or_path"
    spec = spec if spec is not None else adapter.config.base_model
    hint = "give --base with the base model's directory or Hub repo id (only its config.json is read)"
    if spec is None:
        raise UsageError("the adapter config names no base model", path=adapter.config.path,
                         expected="base_model_name_or_path, or --base", found=None, hint=hint)
    if os.path.lexists(spec):
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise UsageError(f"the base model ({given}) has no config.json", path=path,
                             expected="a model directory with config.json", found=path_kind(path), hint=hint)
        return BaseModel.read(path, path.resolve().name, absolute(path))
    repo, rev = parse_repo_spec(spec)
    if not is_repo_id(repo):
        raise UsageError(f"the base model ({given}) is neither a local directory nor a Hub repo id", found=spec,
                         expected="a model directory or org/name", hint=hint)
    hub = resolve_config(repo, rev, progress=progress)
    if not (hub.path / "config.json").is_file():
        raise UsageError(f"the base model's Hub repo ({given}) has no config.json", path=f"{repo}@{hub.commit}",
                         expected="a model repo with config.json", found="none", hint=hint)
    return BaseModel.read(hub.path, repo, f"{repo}@{hub.commit}")
