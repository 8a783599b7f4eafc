"""``convert(ConvertOptions) -> ConvertResult``: one conversion, readable top to bottom.

The command line (:mod:`convert.cli`), batch workers (:mod:`convert.batch.worker`) and library users all
call :func:`convert`; there is no other path to an output. It hands each run to its part (:mod:`convert.run`): a
run of several targets to :func:`convert.run.several.convert_set` (each target's steps 3-7 as below, from one
read), a PEFT LoRA adapter as SRC to :func:`convert.run.adapter.convert_adapter`, one target to these steps:

1. check the options against each other (:func:`convert.run.single.check_options`; usage errors before any I/O);
2. resolve the source (:func:`convert.run.source.resolve_source`): a local path, or a Hub repo id fetched into the
   HF cache (:mod:`convert.hub.download`), or read in place: headers only for ``dry_run``, one shard at a time for
   ``low_disk`` (:mod:`convert.hub.shards`, whose :class:`~convert.hub.shards.ShardLifetime` the pipeline tells
   when each tensor is about to be made and when it is written); a PEFT LoRA adapter (a local directory, or a
   Hub repo holding ``adapter_config.json``) becomes its GGUF LoRA adapter instead
   (:func:`convert.run.adapter.convert_adapter`);
3. open the checkpoint (:func:`formats.checkpoint.open_checkpoint`) and plan the dequantization
   (:func:`convert.stream.plan.make_plan`): every output tensor with the source that produces it
   (steps 3-7: :func:`convert.run.single.convert_source`);
4. merge LoRA adapters into the plan (:func:`convert.lora.apply.apply_lora`), when asked;
5. prepare the target's writer from the static table :data:`convert.targets.TARGETS`
   (safetensors float, bnb 4-bit, GGUF); ``dry_run`` stops here with the plan;
6. claim the output, write into staging, verify, commit (:class:`convert.output.OutputClaim`);
7. return what was done (:class:`convert.run.result.ConvertResult`).

Errors are the :mod:`formats.errors` classes, raised where each rule is checked; nothing here
prints or exits.
"""

from __future__ import annotations

import time
from pathlib import Path

from convert.hub.download import WeightMode
from convert.hub.repo import is_repo_id
from convert.options import ConvertOptions
from convert.output import InterruptedAfterCommit
from convert.output_names import default_output, output_path
from convert.run.adapter import convert_adapter
from convert.run.result import ConvertResult
from convert.run.several import convert_set
from convert.run.single import base_without_adapter, check_base_repo, check_options, convert_source
from convert.run.source import ResolvedSource, resolve_source, src_repo_spec
from formats.peft import is_adapter_dir

__all__ = ["convert"]


def convert(options: ConvertOptions) -> ConvertResult:
    """Run one conversion (see the module docstring for the steps).

    Args:
        options: what to convert, to what, where, and how.

    Returns:
        the :class:`~convert.run.result.ConvertResult`.

    Raises:
        ConvertBnbError: a usage error, an input rule broken (file, tensor and rule named), an
            output rule (OUT-xxx, USE-002/003); OSError from the file system.
    """
    committed: list[Path] = []
    try:
        return _convert(options, committed)
    except KeyboardInterrupt as exc:
        if committed and not isinstance(exc, InterruptedAfterCommit):  # the output is in place and complete
            several = options.to.family == "multi"
            raise InterruptedAfterCommit(committed[0], tuple(committed) if several else (),
                                         len(options.to.targets) if several else 1) from exc
        raise


def _convert(options: ConvertOptions, committed: list[Path]) -> ConvertResult:
    """:func:`convert`; appends the output path to ``committed`` once it is renamed into place."""
    t0 = time.perf_counter()
    if options.to.family == "multi":  # several targets from one read: each as it would be alone, in one folder
        return convert_set(options, committed, t0)
    # 1. the options against each other, and the output path as far as it is known before reading
    check_options(options)
    if is_adapter_dir(options.src):
        return convert_adapter(options, ResolvedSource(Path(options.src)), committed, t0)
    repo, rev = src_repo_spec(options.src)
    if repo is not None and not is_repo_id(repo):  # resolve_source names the missing SRC
        default = out = Path(options.output or options.src)
    else:
        default = default_output(None if repo else Path(options.src), options.to, repo, options.revision or rev)
        out = output_path(options.output, default, is_dir=True)  # -o checked now; a file output's name below
    # 2. the source, local or fetched from the Hub (weights read as the target needs them)
    weights: WeightMode = ("headers" if options.dry_run else "low-disk" if options.low_disk
                           else "auto" if options.to.family == "float" else "download")
    check_base_repo(options, repo, rev)
    source = resolve_source(options.src, options.revision, to=options.to.name, output=out, progress=options.progress,
                            weights=weights)
    try:
        if source.is_adapter:  # a Hub repo that holds a PEFT LoRA adapter: its GGUF LoRA adapter
            return convert_adapter(options, source, committed, t0)
        if options.base is not None:
            raise base_without_adapter(options)
        return convert_source(options, source, default, out, committed, t0)
    finally:
        source.close()
