"""A run of several targets (``--to bf16,gguf:q8_0,nf4``): each target as the options of its single run
(:func:`member_options`), the source resolved once (:func:`convert_set`), every target planned and its options and
output checked before any is written (:class:`_OutputGate`), then each written by its single run
(:func:`convert.run.single.convert_source`) in a thread of its own, reading each dequantized weight from the
blocks the first target to need them made (:class:`convert.stream.shared.SharedProducts`); the run's result
(:func:`_set_result`) and its errors. :func:`plan_set` is its dry run from a source resolved already (a batch
job's)."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from convert.hub.download import WeightMode
from convert.hub.repo import is_repo_id
from convert.options import DEFAULT_MIX, FLOAT_TARGETS, MIN_MEMORY, ConvertOptions, QuantOptions, Target
from convert.output import OUTPUT_REFUSALS, write_json
from convert.output_names import default_output, default_set_output, set_output_path
from convert.run.result import ConvertResult
from convert.run.single import base_without_adapter, check_base_repo, check_options, convert_source
from convert.run.source import ResolvedSource, resolve_source, src_repo_spec
from convert.stream.pipeline import SET_TARGET_MEMORY, min_memory, peak_rss_bytes, share_memory
from convert.stream.plan import Plan, make_plan
from convert.stream.shared import Consumer, SharedProducts
from convert.units import format_bytes, format_short_of
from formats.checkpoint import Checkpoint
from formats.errors import ConvertBnbError, ImatrixRequiredError, TargetsFailedError, UsageError
from formats.peft import is_adapter_dir

__all__ = ["auto_twin", "convert_set", "member_options", "plan_set", "set_plan_text"]


def member_options(options: ConvertOptions) -> tuple[list[ConvertOptions], int]:
    """Each target of a run of several (``options.to.members``) as the options of its single run: the options
    that apply to it, its share of ``max_memory`` (:func:`convert.stream.pipeline.share_memory`), no progress
    bar; each checked as :func:`~convert.run.single.check_options` checks a single run. ``--report`` and
    ``--original`` go to the first target, ``--quant-report`` to the first nf4/fp4 one (each target's figures are
    in its ``--json``).

    Returns:
        the options per target, in ``--to`` order, and the bytes of the shared blocks.

    Raises:
        UsageError: USE-001: an option that no target takes (4-bit settings without nf4/fp4, llama-quantize's
            options without one of its types, ``--metadata`` or a split without a GGUF target), ``--mmproj`` or
            ``--low-disk`` (one target only), ``max_memory`` below 64 MiB, and what
            :func:`~convert.run.single.check_options` refuses for a target.
    """
    members = options.to.targets
    families = {t.family for t in members}
    ggufs = [t for t in members if t.family == "gguf"]
    if is_adapter_dir(options.src):
        raise _adapter_one_target(options)
    for flag, given, one_gguf in (("--mmproj", options.mmproj is not None, True),
                                  ("--modelfile", options.modelfile is not None, True),
                                  ("--low-disk", options.low_disk, False)):
        if given and not (one_gguf and len(ggufs) == 1):
            one = " (or one GGUF target among several)" if one_gguf else ""
            raise UsageError(f"{flag} works with one --to target{one}", found=f"--to {options.to.name}",
                             hint=f"run the target that needs {flag} on its own")
    least = min_memory(len(members))
    if options.max_memory < least:
        raise UsageError(f"--max-memory is too small for {len(members)} targets",
                         expected=f">= {format_bytes(least)} ({format_bytes(MIN_MEMORY)}, and "
                                  f"{format_bytes(SET_TARGET_MEMORY)} for each target after the first: its output "
                                  "stream and chunks)",
                         found=format_short_of(options.max_memory, least),
                         hint="raise --max-memory or convert fewer targets")
    needs = [(options.mix.flags()[0].split()[0] if options.mix.flags() else None,
              any(t.llama_quantize for t in members), "a gguf:TYPE of llama-quantize's types (gguf:q4_0 ... q6_k)"),
             (options.quant.given()[0] if options.quant.given() else None, "bnb4" in families, "nf4 or fp4"),
             ("--metadata" if options.metadata is not None else None, "gguf" in families, "a gguf[:TYPE] target"),
             ("--split-max-size" if options.split_max_size is not None else
              "--split-max-tensors" if options.split_max_tensors is not None else None, "gguf" in families,
              "a gguf[:TYPE] target")]
    for flag, taken, what in needs:
        if flag is not None and not taken:
            raise UsageError(f"{flag} needs {what} among the --to targets", found=f"--to {options.to.name}")
    each, shared = share_memory(options.max_memory, len(members))
    first_bnb4 = next((t for t in members if t.family == "bnb4"), None)
    subs = []
    for i, t in enumerate(members):
        gguf = t.family == "gguf"
        quant = options.quant if t is first_bnb4 else replace(options.quant, quant_report=None)
        sub = replace(options, to=t, output=None, max_memory=each, manifest=None, progress=False,
                      list_files=options.list_files or options.manifest is not None,
                      mmproj=options.mmproj if gguf else None, modelfile=options.modelfile if gguf else None,
                      mmproj_manifest=options.mmproj_manifest if gguf else None,
                      modelfile_manifest=options.modelfile_manifest if gguf else None,
                      mix=options.mix if t.llama_quantize else DEFAULT_MIX,
                      quant=quant if t.family == "bnb4" else QuantOptions(),
                      metadata=options.metadata if gguf else None,
                      split_max_size=options.split_max_size if gguf else None,
                      split_max_tensors=options.split_max_tensors if gguf else None,
                      report=options.report if i == 0 else None, original=options.original if i == 0 else None)
        check_options(sub)
        subs.append(sub)
    return subs, shared


def set_plan_text(result: ConvertResult, overwrite: bool) -> str:
    """A dry run of several targets as text: each planned target's plan and output line
    (:meth:`~convert.run.result.ConvertResult.output_line`), in ``--to`` order."""
    return "\n".join(f"{o.plan_text}\n{o.output_line(overwrite)}" for o in result.outputs if o.error is None)


def _adapter_one_target(options: ConvertOptions) -> UsageError:
    """USE-001: several ``--to`` targets with a PEFT LoRA adapter as SRC (a local one, or a Hub repo once resolved):
    a usage error's plain line (no path: nothing failed to be read)."""
    return UsageError("SRC is a PEFT LoRA adapter: it becomes one GGUF LoRA adapter, one --to target",
                      expected="--to gguf[:TYPE]", found=f"--to {options.to.name}")


def convert_set(options: ConvertOptions, committed: list[Path], t0: float) -> ConvertResult:
    """A run of several targets (``--to bf16,gguf:q8_0,nf4``): each target's output exactly as its single run
    writes it, named as alone, in one folder (``-o``, or :func:`convert.output_names.default_set_output`); the
    source resolved once; every target planned first, then all written at once, each by its own writer in a
    thread of its own, reading each dequantized weight from the blocks the first target to need them made
    (:class:`convert.stream.shared.SharedProducts`), and committed on its own.

    Every target's output is claimed and checked before any target writes (:class:`_OutputGate`).

    Raises:
        OutputExistsError, OutputBusyError, OverwriteRefusedError, DiskSpaceError, OutputKindError,
            OutputInsideInputError: OUT-001, OUT-004, OUT-005, OUT-002, USE-003, USE-002: an output refused before
            anything was written (an existing one without ``overwrite``, another run's lock, ...: what a single
            run checks); nothing is converted or written (:func:`_refused_set`).
        TargetsFailedError: OUT-006, some targets failed (each with its own error in ``failures``); the
            others' outputs are committed and complete. When every target failed with one and the same
            error (a broken input), that error instead, as a single run raises it.
        UsageError: from :func:`member_options`, or ``-o`` naming a file (:func:`convert.output_names.set_output_path`).
    """
    subs, shared = member_options(options)
    folder = _set_folder(options)
    weights: WeightMode = ("headers" if options.dry_run
                           else "auto" if all(t.family == "float" for t in options.to.targets) else "download")
    check_base_repo(options, *src_repo_spec(options.src))
    if _auto_beside_float(options):  # from the headers alone (a Hub repo's read in place): before any download
        probe = resolve_source(options.src, options.revision, to=options.to.name, output=folder, weights="headers")
        try:
            if not probe.is_adapter:
                _check_auto_twin(options, probe)
        finally:
            probe.close()
    source = resolve_source(options.src, options.revision, to=options.to.name, output=folder,
                            progress=options.progress, weights=weights)
    try:
        if source.is_adapter:  # a Hub repo that holds an adapter
            raise _adapter_one_target(options)
        if options.base is not None:
            raise base_without_adapter(options)
        return _run_set(options, subs, shared, source, folder, committed, t0)
    finally:
        source.close()


def _auto_beside_float(options: ConvertOptions) -> bool:
    """Whether a run of several targets asks for ``auto`` and another float target (bf16, fp16, fp32), which may
    write the same output (:func:`_check_auto_twin`)."""
    floats = [t.name for t in options.to.targets if t.family == "float"]
    return "auto" in floats and len(floats) > 1


def _check_auto_twin(options: ConvertOptions, source: ResolvedSource) -> None:
    """Refuse ``auto`` beside a float target that writes the same output for this input (:func:`auto_twin`), from
    the headers, before any weight is read or anything written. An input that cannot be planned is left to the
    run, whose targets report its error as a single run does.

    Raises:
        UsageError: USE-001, ``auto`` and a float target of the list write the same tensors and config.json.
    """
    try:
        with source.open() as ckpt:
            error = auto_twin(ckpt, options.to, options.max_shard_size)
    except (ConvertBnbError, OSError):
        return
    if error is not None:
        raise error


def auto_twin(ckpt: Checkpoint, to: Target, max_shard_size: int = 5 * 10**9) -> UsageError | None:
    """USE-001 when ``to`` (several targets) holds ``auto`` and a float target that write the same output for
    ``ckpt``, as a ``--to`` naming one target twice is refused (:func:`convert.options.target_for`): ``auto``
    resolved from the headers (every tensor's dtype in the plan of each, and the config.json each writes); else
    None. Also ``convert-bnb check``'s (and so a batch dry run's).

    Raises:
        ConvertBnbError: the input cannot be planned (:func:`convert.stream.plan.make_plan`).
    """
    floats = [t.name for t in to.targets if t.family == "float"]
    if "auto" not in floats or len(floats) < 2:
        return None
    auto = _plan_outline(make_plan(ckpt, "auto", max_shard_size=max_shard_size))
    twin = next((name for name in floats if name != "auto"
                 and _plan_outline(make_plan(ckpt, name, max_shard_size=max_shard_size)) == auto), None)
    if twin is None:
        return None
    return UsageError(f"--to names the target {twin} twice (auto and {twin} write the same output: every tensor of "
                      f"this input is {FLOAT_TARGETS[twin]} in auto)", expected="each target once", found=to.name,
                      hint=f"drop auto or {twin}")


def _plan_outline(plan: Plan) -> tuple[Any, ...]:
    """What a float output's bytes follow from: each tensor's name, dtype and shape, the shards, the config.json."""
    return ([(t.name, t.dtype.name, tuple(t.shape)) for t in plan.tensors], plan.shards,
            json.dumps(plan.config, sort_keys=True))


def _set_folder(options: ConvertOptions) -> Path:
    """The folder of a run of several targets: ``-o``, or :func:`convert.output_names.default_set_output` of SRC (a SRC
    that is neither a path nor a repo id: itself, for :func:`~convert.run.source.resolve_source` to name it)."""
    repo, rev = src_repo_spec(options.src)
    if repo is not None and not is_repo_id(repo):  # resolve_source names the missing SRC
        return Path(options.output or options.src)
    return set_output_path(options.output, default_set_output(None if repo else Path(options.src), repo,
                                                              options.revision or rev))


def plan_set(options: ConvertOptions, source: ResolvedSource) -> ConvertResult:
    """The dry run of a run of several targets from a source its caller resolved already (a batch job's
    Hub snapshot in the cache, or its local path): only headers are read, nothing is downloaded or written.

    Args:
        options: the run (``to`` of several targets); its ``revision`` is the one :func:`convert.job.convert` would
            resolve the source at, so the outputs are named as that run names them (a Hub repo's revision is part
            of the names: :func:`convert.output_names.default_output`).
        source: the source, resolved at any revision of the same commit.

    Returns:
        the dry run's result: each target's planned result in ``outputs`` (``output``: its path in the folder).

    Raises:
        UsageError: as :func:`member_options`.
        TargetsFailedError: OUT-006, some targets cannot be planned; the input's own error when none can.
    """
    options = replace(options, dry_run=True, progress=False)
    subs, shared = member_options(options)
    if _auto_beside_float(options) and not source.is_adapter:
        _check_auto_twin(options, source)
    if source.hub is not None and source.hub.revision != options.revision:  # (the names carry the revision)
        source = replace(source, hub=replace(source.hub, revision=options.revision))
    return _run_set(options, subs, shared, source, _set_folder(options), [], time.perf_counter())


def _run_set(options: ConvertOptions, subs: list[ConvertOptions], shared: int, source: ResolvedSource,
             folder: Path, committed: list[Path], t0: float) -> ConvertResult:
    """:func:`convert_set` once the source is resolved."""
    hub = source.hub
    defaults = [folder / default_output(None if hub else Path(options.src), sub.to, hub.repo_id if hub else None,
                                        hub.revision if hub else None).name for sub in subs]
    existed = os.path.lexists(folder)  # (each output's claim makes the folder, after its own checks)
    products = SharedProducts(shared, len(subs), threads=options.worker_threads)
    gate = _OutputGate(len(subs))
    try:
        if options.dry_run:
            outcomes = [_attempt(sub, source, d, committed, t0, folder, None)
                        for sub, d in zip(subs, defaults, strict=True)]
        else:
            outcomes = _write_set(subs, defaults, source, folder, products, gate, committed, t0,
                                  options.on_progress)
    finally:
        if not existed and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # (every target failed, or the run was stopped before a commit: nothing left behind)
    if gate.refused:  # an output refused before any was written: the run is refused, as a single run would be
        raise _refused_set(subs, gate.refused)
    result = _set_result(options, subs, defaults, outcomes, source, folder, products, shared, t0)
    complete = not any(isinstance(o, BaseException) for o in outcomes)
    if options.manifest is not None and not options.dry_run and complete:
        write_json(options.manifest, result.files)  # (the whole set committed: a batch's record of its own)
    internal = next((o for o in outcomes if isinstance(o, BaseException)
                     and not isinstance(o, (ConvertBnbError, OSError, MemoryError))), None)
    if internal is not None:
        raise internal
    failures = [(sub.to.name, o) for sub, o in zip(subs, outcomes, strict=True) if isinstance(o, BaseException)]
    if failures and len(failures) == len(subs) and len({(type(e), str(e)) for _, e in failures}) == 1:
        raise failures[0][1]  # one error for all: a broken input, as a single run reports it
    if failures:
        done = len(subs) - len(failures)
        raise TargetsFailedError(
            f"{len(failures)} of {len(subs)} targets failed: "
            + ", ".join(f"{t} ({getattr(e, 'rule', None) or type(e).__name__})" for t, e in failures)
            + (f"; the {done} other output{'s are' if done > 1 else ' is'} complete" if done else ""),
            path=folder, action="write", failures=failures, result=result)
    return result


def _attempt(sub: ConvertOptions, source: ResolvedSource, default: Path, committed: list[Path], t0: float,
             folder: Path, share: Consumer | None, gate: tuple[_OutputGate, int] | None = None
             ) -> ConvertResult | BaseException:
    """One target of a set (:func:`convert.run.single.convert_source`): its result, or the exception that ended
    it. With ``gate`` (the run's :class:`_OutputGate` and this target's index) its output is written only once every
    target's is checked."""
    try:
        on_checked = functools.partial(gate[0].checked, gate[1]) if gate is not None else None
        return convert_source(sub, source, default, default, committed, t0, folder, share, on_checked)
    except BaseException as exc:  # noqa: BLE001 - each target's own outcome; the run reports them all
        if gate is not None:
            gate[0].failed(gate[1], exc)
        return exc
    finally:
        if share is not None:
            share.withdraw()


class _RefusedWithOthers(Exception):
    """A target of a set whose output passed its checks, stopped before writing because another target was refused
    (:data:`_RUN_REFUSALS`, :class:`_OutputGate`); never raised out of :func:`convert.job.convert`."""


#: What refuses a whole run of several targets when a target meets it before any output is written: an output
#: refused (:data:`convert.output.OUTPUT_REFUSALS`), or an option the target cannot take (a usage error: a
#: ``--metadata`` file missing or broken; IMX-004, a ``--tensor-type`` needing an importance matrix). An input
#: rule a target fails at planning (GGUF-001, GGUF-004: this model cannot be that target) fails that target only.
_RUN_REFUSALS: tuple[type[BaseException], ...] = (*OUTPUT_REFUSALS, UsageError, ImatrixRequiredError)


class _OutputGate:
    """Every output of a run of several targets checked before any is written.

    Each target plans, then claims and checks its output (:class:`convert.output.OutputClaim`, up to its staging:
    the kind, the input, another run's lock OUT-004, an existing output OUT-001, OUT-005, the disk OUT-002) and
    waits in :meth:`checked` until every other target has done so or has failed. When a target met one of
    :data:`_RUN_REFUSALS` (there or while it was planned), every target stops before writing and :attr:`refused`
    holds each refusal; a target that failed otherwise (an input rule) leaves the others to go on.
    """

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._n = n
        self._arrived: set[int] = set()
        self._cancelled = False
        #: target index -> the error that refused its output, before any output was written
        self.refused: dict[int, ConvertBnbError] = {}

    def checked(self, i: int) -> None:
        """Target ``i``'s output is claimed and checked: wait until every target's is, or has failed.

        Raises:
            _RefusedWithOthers: another target was refused (this one is not written).
            KeyboardInterrupt: the run was stopped (:meth:`cancel`).
        """
        with self._cond:
            self._arrived.add(i)
            self._cond.notify_all()
            while len(self._arrived) < self._n:
                if self._cancelled:
                    raise KeyboardInterrupt("stopped")
                self._cond.wait()
            if self.refused:
                raise _RefusedWithOthers(f"{len(self.refused)} other target(s) refused")

    def failed(self, i: int, exc: BaseException) -> None:
        """Target ``i`` ended by ``exc``; before its output was checked, it arrives here (refused, when ``exc``
        is one of :data:`_RUN_REFUSALS`); after, nothing changes (every output was checked by then)."""
        with self._cond:
            if i in self._arrived:
                return
            self._arrived.add(i)
            if isinstance(exc, _RUN_REFUSALS):
                self.refused[i] = exc
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop the run: a target waiting in :meth:`checked` raises ``KeyboardInterrupt``."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


def _refused_set(subs: list[ConvertOptions], refused: dict[int, ConvertBnbError]) -> ConvertBnbError:
    """The one error of a run of several targets whose outputs were refused before any was written: the first
    refused target's (its class and rule, path and hint), naming its target and the other outputs refused."""
    order = sorted(refused)
    first = refused[order[0]]
    also = ", ".join(f"{Path(refused[i].path).name if refused[i].path else subs[i].to.name} ({refused[i].rule})"
                     for i in order[1:])
    if len(order) == len(subs) and len({(type(e), str(e)) for e in refused.values()}) == 1:
        return first  # one refusal for all (an option none can take): as a single run gives it
    also = f"; also refused: {also}" if also else ""
    return first.with_reason(f"{first.reason} (--to {subs[order[0]].to.name}{also}); nothing converted: each of the "
                             f"{len(subs)} targets is checked before any converts")


def _write_set(subs: list[ConvertOptions], defaults: list[Path], source: ResolvedSource, folder: Path,
               products: SharedProducts, gate: _OutputGate, committed: list[Path], t0: float,
               on_progress: Callable[[int, int], None] | None) -> list[ConvertResult | BaseException]:
    """Every target of a set planned, written, verified and committed, each in a thread of its own, reading
    through ``products``, none written before every output is checked (``gate``); the outcome of each. An
    interrupt (in the calling thread, the main one) cancels them all: each stops at its next chunk, leaves no
    temporary behind, and the interrupt is raised here."""
    consumers = [products.consumer() for _ in subs]
    outcomes: list[ConvertResult | BaseException] = [KeyboardInterrupt()] * len(subs)
    progress = _SetProgress(len(subs), products, on_progress)

    ended = [threading.Event() for _ in subs]

    def run(i: int) -> None:
        try:
            sub = replace(subs[i], on_progress=progress.reporter(i))
            outcomes[i] = _attempt(sub, source, defaults[i], committed, t0, folder, consumers[i], (gate, i))
        finally:
            ended[i].set()

    for i, sub in enumerate(subs):
        threading.Thread(target=run, args=(i,), name=f"convert-bnb --to {sub.to.name}").start()
    # (each target's end is an Event, not Thread.join: on CPython 3.11 a join cut by KeyboardInterrupt can leave the
    # thread counted as ended, and the run would return while a target still removes its temporary)
    try:
        for done in ended:
            while not done.wait(0.25):
                pass
    except KeyboardInterrupt:
        products.cancel()
        gate.cancel()
        for done in ended:
            done.wait()
        raise
    return outcomes


class _SetProgress:
    """The progress of a set's writers, summed for the caller's ``on_progress``; each writer's reporter raises
    ``KeyboardInterrupt`` once the run is cancelled (so every writer stops at its next chunk)."""

    def __init__(self, n: int, products: SharedProducts, forward: Callable[[int, int], None] | None) -> None:
        self.done, self.total = [0] * n, [0] * n
        self.products, self.forward = products, forward
        self._lock = threading.Lock()

    def reporter(self, i: int) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if self.products.cancelled:
                raise KeyboardInterrupt("stopped")
            if self.forward is not None:
                with self._lock:
                    self.done[i], self.total[i] = done, total
                    self.forward(sum(self.done), sum(self.total))
        return report


def _set_result(options: ConvertOptions, subs: list[ConvertOptions], defaults: list[Path],
                outcomes: list[ConvertResult | BaseException], source: ResolvedSource, folder: Path,
                products: SharedProducts, shared: int, t0: float) -> ConvertResult:
    """The result of a set: every target's (a failed one with its error), and the run's totals."""
    result = ConvertResult(source=source.ref, to=options.to.name, output=str(folder),
                           commit=source.hub.commit if source.hub else None)
    for sub, default, o in zip(subs, defaults, outcomes, strict=True):
        if isinstance(o, ConvertResult):
            result.outputs.append(o)
        else:
            result.outputs.append(ConvertResult(
                source=result.source, to=sub.to.name, output=str(default), commit=result.commit,
                error={"error": type(o).__name__, "rule": getattr(o, "rule", None),
                       "message": str(o).replace("\n", " ")}))
    done = [o for o in result.outputs if o.error is None]
    if options.dry_run:
        result.dry_run = {"source": result.source, "to": result.to, "ok": len(done) == len(result.outputs)}
        result.output_exists = any(o.output_exists for o in done)  # (the folder itself may exist: it holds them)
        result.plan_text = set_plan_text(result, options.overwrite)
        return result
    result.tensors = sum(o.tensors for o in done)
    result.elements = max((o.elements for o in done), default=0)
    result.bytes_in = max((o.bytes_in for o in done), default=0)
    result.bytes_out = sum(o.bytes_out for o in done)
    result.fp16_overflow = sum(o.fp16_overflow for o in done)
    result.fp16_underflow = sum(o.fp16_underflow for o in done)
    result.shards_written = sum(o.shards_written for o in done)
    result.shards_reused = sum(o.shards_reused for o in done)
    result.verified = bool(done) and all(o.verified for o in done)
    for o in done:  # every file in the folder, relative to it (an output's, its vision projector's and Modelfile's)
        extras = [o.details.get(k) for k in ("mmproj", "modelfile")]
        for path, files in [(Path(o.output), o.files)] + [(Path(d["output"]), d.get("files", {})) for d in extras if d]:
            if path.parent == folder:
                result.files.update({(f"{path.name}/{k}" if path.is_dir() else k): v for k, v in files.items()})
    threads = {sub.to.name: products.allotted[i] for i, sub in enumerate(subs) if i in products.allotted}
    result.details["shared"] = {"budget_bytes": shared, "peak_bytes": products.peak, "blocks_made": products.made,
                                "values_shared": products.hits, "blocks_dropped": products.dropped,
                                "threads": threads}
    result.notes = [f"{len(subs)} targets from one read: {products.made} blocks of dequantized weights made once "
                    f"and shared, at most {format_bytes(products.peak)} of them held (of "
                    f"{format_bytes(shared)})" + (f"; {products.dropped} dropped for room and made again"
                                                  if products.dropped else "")
                    + ("; threads " + ", ".join(f"{t} {n}" for t, n in threads.items())
                       + f" (each target's share of --threads {options.worker_threads} by the work it does per "
                         "weight, rounded up)" if any(n < options.worker_threads for n in threads.values()) else "")]
    result.seconds = result.timings["total"] = time.perf_counter() - t0
    result.gelem_per_s = result.elements / result.seconds / 1e9 if result.seconds > 0 else 0.0
    result.peak_rss_bytes = peak_rss_bytes()
    return result
