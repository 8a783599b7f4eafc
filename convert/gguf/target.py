"""``--to gguf[:TYPE]``: the pipeline's dequantized tensors, written as GGUF (:class:`GgufJob`).

The dequantization plan (:func:`convert.stream.plan.make_plan` with ``to="auto"``: each tensor in the dtype
bitsandbytes dequantizes it to, LoRA merges applied) is planned by :func:`convert.gguf.plan.plan_gguf`
and feeds :func:`convert.gguf.encode.write_gguf` by row ranges, each rounded once to the GGUF type.
Output naming, pre-flight, claim and commit are :mod:`convert.output`'s, as for every target;
``verify`` re-reads the file with ``gguf.GGUFReader`` (:func:`formats.gguf.verify_gguf`). With
``--split-max-size`` / ``--split-max-tensors`` the file is written as the parts llama-gguf-split makes of it
(:mod:`convert.gguf.split`), each verified, and committed together.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import gguf

from convert.gguf.encode import SEARCH_TYPES, TensorReport, check_encoders, chunks_held, write_gguf
from convert.gguf.general import MetadataSource
from convert.gguf.mix import mix_summary
from convert.gguf.mmproj import mmproj_type, plan_mmproj
from convert.gguf.plan import GGUFTensor, plan_gguf
from convert.gguf.split import part_paths, plan_split
from convert.options import SUMMARY_SAMPLE, ConvertOptions
from convert.output import ShardLedger
from convert.output_names import GgufNaming
from convert.stream.pipeline import RunSettings, placed_memory
from convert.stream.plan import Plan, make_plan
from convert.stream.sources import Source
from formats.errors import TokenizerError
from formats.gguf import GGUFPart, file_nbytes, split_files
from formats.gguf import verify_gguf as _verify_gguf

GT = gguf.GGMLQuantizationType

__all__ = ["GgufJob"]

#: Bytes a GGUF chunk holds per element, at most: its rows as read (2-4), as float32 (4), permuted (4)
#: and encoded (at most 4); the encoders' scratch is per piece of 8192 blocks, not per chunk.
_GGUF_BYTES_PER_ELEMENT = 16


def _type_notes(out_type: str, tensors: list[GGUFTensor]) -> list[str]:
    """The type mix (``gguf q4_k_m: 14 Q4_K, 3 Q6_K, 2 Q5_0, 5 F32``) and why tensors differ from
    the default type, one line per reason (tensors named, the first three)."""
    notes = [f"gguf {out_type}: {mix_summary([t.ggml_type for t in tensors])}"]
    by_reason: dict[str, list[str]] = {}
    for t in tensors:
        if t.fallback and len(t.shape) > 1:
            by_reason.setdefault(t.fallback, []).append(t.name)
    for reason, names in by_reason.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        notes.append(f"  {reason} ({', '.join(names[:3])}{more})")
    return notes


def _tower_notes(towers: list[str], mmproj: Path | None = None) -> list[str]:
    """The note on a multimodal checkpoint's other towers, which the text model's GGUF does not hold."""
    if not towers:
        return []
    where = (f"the vision projector goes to --mmproj {mmproj}" if mmproj is not None
             else "as llama.cpp's converter writes it; --mmproj PATH writes the vision projector")
    return [f"{len(towers)} tensors of the vision/audio towers and projector not in the text model's GGUF ({where}; "
            f"first: {towers[0]})"]


def _error_notes(out_type: str, reports: list[TensorReport], sample: int, weights: str) -> list[str]:
    """The summary's error notes; ``weights``: what the tensors were made from (:attr:`GgufJob.weights`)."""
    # (a sampled tensor, of a block type, may differ outside its sample where it did not inside)
    changed = [r for r in reports if r.max_abs_error > 0 or r.sampled]
    if not changed:
        return [f"gguf {out_type}: every tensor equals {weights} exactly"]
    worst = sorted(changed, key=lambda r: r.rel_rms_error, reverse=True)
    notes = [
        f"gguf {out_type}: {len(changed)} of {len(reports)} tensors differ from {weights} "
        f"(rounding to each tensor's type); relative RMS error per tensor up to {worst[0].rel_rms_error:.3g}, "
        "worst tensors below (all in --json)"
        + (f"; the quantized tensors' figures are measured on a fixed 1/{sample} sample of each (every "
           "value with --json)" if any(r.sampled for r in reports) else "")
        + (f"; F16 tensors' relative error is over the weight's RMS on a fixed 1/{sample} sample of its rows "
           "(every row with --json)" if any(r.ref_sampled for r in changed) else "")
    ]
    for r in worst[:5]:
        notes.append(
            f"  {r.name:<28} {r.ggml_type.name:<5} rel RMS {r.rel_rms_error:.3g}, "
            f"RMS {r.rms_error:.3g}, max abs {r.max_abs_error:.3g}"
        )
    return notes


def _json_number(x: float) -> float | str:
    """A float for JSON: ``"inf"`` where a value overflowed F16 (JSON has no Infinity)."""
    return x if math.isfinite(x) else str(x)


def _model(plan: Plan, options: ConvertOptions, model_name: str) -> MetadataSource:
    """Where a job's ``general.*`` keys come from: the model directory, its id, config.json (as merged) and
    ``--metadata``."""
    ckpt = plan.checkpoint
    return MetadataSource(ckpt.source, model_name, plan.config or ckpt.config, options.metadata)


GT = gguf.GGMLQuantizationType
#: CPU per weight of each GGML type's writer, relative to a float output's (:attr:`GgufJob.work_per_weight`): single
#: runs on the bench model, one thread, CPU beyond the start (bf16 safetensors 1.15 s, gguf:f16 1.3, gguf:q8_0 2.9,
#: gguf:q4_0 6.8 s); the searching types from their encoders alone (25-107 ns a value against Q8_0's 3.3).
WORK_PER_WEIGHT: dict[gguf.GGMLQuantizationType, float] = {
    GT.F32: 1.0, GT.F16: 1.0, GT.BF16: 1.0, GT.Q8_0: 2.5, GT.Q4_0: 6.0, GT.Q4_1: 6.0, GT.Q5_0: 6.0, GT.Q5_1: 6.0,
    **dict.fromkeys(SEARCH_TYPES, 60.0),
}


class GgufJob:
    """The GGUF writer of one conversion (a :class:`convert.targets.TargetJob`).

    Args:
        plan: the dequantization plan (:attr:`convert.options.Target.dequantize_to`, merges applied).
        options: the conversion's options (``to`` of the gguf family; ``merge_report``: measure every
            tensor's error exactly, else on one piece in :data:`convert.options.SUMMARY_SAMPLE`; ``dry_run``).
        model_name: the model's id: the directory's name, or the repo id for a Hub SRC; with the directory,
            config.json and ``options.metadata``, what the ``general.*`` keys and the default file name are
            made of (:mod:`convert.gguf.general`).

    Attributes:
        split: the parts of a split output (``options.split_max_size`` / ``split_max_tensors``:
            :func:`convert.gguf.split.plan_split`), or None for one file.

    Raises:
        TokenizerError: the input is not a model directory with config.json (GGUF-004).
        UnsupportedError: GGUF-001..006 (from :func:`convert.gguf.plan.plan_gguf`).
        UsageError: USE-001, a split limit smaller than the first tensor (:func:`convert.gguf.split.plan_split`),
            or a bad ``--metadata`` file (:func:`convert.gguf.general.read_override`).
        GgufTypeError: GGUF-002, a planned type without an encoder in this build (not with ``dry_run``:
            raised before any output is claimed).
    """

    is_dir = False
    file_suffix = ".gguf"
    #: what its tensors are made from, as its error notes name it
    weights = "the dequantized weights"
    #: the default file name's parts (llama.cpp's naming convention: :func:`convert.output_names.gguf_file_name`)
    naming: GgufNaming | None

    def __init__(self, plan: Plan, options: ConvertOptions, model_name: str) -> None:
        ckpt = plan.checkpoint
        if not ckpt.is_dir or ckpt.config is None:
            raise TokenizerError(
                "GGUF output needs the model's config.json and tokenizer", path=ckpt.source,
                expected="a model directory", found="a lone weight file" if not ckpt.is_dir else "no config.json",
                hint="give the model directory (config.json, tokenizer files and weights)",
            )
        assert options.to.gguf_type is not None
        self.plan = plan
        # exact error figures for --json; the summary's alone from one piece in SUMMARY_SAMPLE
        self.sample = 1 if options.merge_report else SUMMARY_SAMPLE
        self.out_type = options.to.gguf_type
        self.to = options.to.name
        self.mmproj = options.mmproj
        self.gplan = plan_gguf(
            plan.config or ckpt.config,  # a merge may edit it (a LoRA-resized vocab_size)
            [(t.name, t.shape) for t in plan.tensors],
            ckpt.source,
            self.out_type,
            model=_model(plan, options, model_name),
            config_path=str(ckpt.source / "config.json"),
            mix=options.mix,
        )
        self.split = plan_split(self.gplan, max_tensors=options.split_max_tensors, max_size=options.split_max_size)
        self._sizes(options.dry_run)

    @property
    def work_per_weight(self) -> float:
        """:attr:`convert.targets.TargetJob.work_per_weight`: :data:`WORK_PER_WEIGHT` of each tensor's type, weighed
        by its elements (a llama-quantize mix holds several types)."""
        n = sum(math.prod(t.shape) for t in self.gplan.tensors)
        work = sum(math.prod(t.shape) * WORK_PER_WEIGHT.get(t.ggml_type, 60.0) for t in self.gplan.tensors)
        return work / n if n else 1.0

    def _sizes(self, dry_run: bool) -> None:
        """The planned figures of ``self.gplan`` (bytes out, tensors, values, input bytes read: each source
        once, a stack's every slice source); GGUF-002 (:func:`check_encoders`) unless ``dry_run``, before any
        output is claimed (a mix needs the K-quant codecs)."""
        self.naming = self.gplan.naming
        self.out_nbytes = self.gplan.nbytes
        self.disk_nbytes = sum(map(file_nbytes, self.split)) if self.split else file_nbytes(self.gplan)
        self.part_files: list[Path] = []
        self.tensors = len(self.gplan.tensors)
        self.elements = sum(t.numel for t in self.gplan.tensors)
        by_name = {t.name: t for t in self.plan.tensors}
        read = {name for t in self.gplan.tensors for name in ([p[0] for p in t.parts] or [t.source])}
        self.in_nbytes = sum(by_name[name].source.in_nbytes for name in read if name in by_name)
        self.reports: list[TensorReport] = []
        if not dry_run:
            check_encoders(self.gplan)

    def plan_dict(self) -> dict[str, Any]:
        return {
            "source": str(self.plan.checkpoint.source),
            "to": self.to,
            "out_bytes": self.gplan.nbytes,
            "metadata_keys": sorted(self.gplan.metadata),
            "tensors": [
                {"name": t.name, "source": t.source, "type": t.ggml_type.name, "shape": list(t.shape),
                 "bytes": t.nbytes, "note": t.fallback}
                for t in self.gplan.tensors
            ],
            **({"parts": self._parts_list()} if self.split else {}),
            "notes": self._plan_notes(),
        }

    def describe(self) -> str:
        g = self.gplan
        lines = [f"{self.plan.checkpoint.source} -> GGUF {g.arch.name}, {self.out_type}: {len(g.tensors)} tensors, "
                 f"{g.nbytes} bytes of tensor data, {len(g.metadata)} metadata keys; "
                 f"{mix_summary([t.ggml_type for t in g.tensors])}"]
        lines += ["  " + line for line in g.describe()]
        for i, p in enumerate(self._parts_list()):
            lines.append(f"  part {i + 1} of {len(self.split or [])}: {p['file']}: {p['tensors']} tensor"
                         f"{'s' if p['tensors'] > 1 else ''} ({p['first']} ... {p['last']}), {p['bytes']} bytes")
        lines += [f"  note: {n}" for n in self._plan_notes()]
        return "\n".join(lines)

    def output_parts(self, out: Path) -> list[Path] | None:
        """The files of a split output ``out`` (``OUT-00001-of-0000N.gguf`` ...: :func:`convert.gguf.split.part_paths`),
        remembered for :meth:`write`, :meth:`verify` and the plan; None for one file."""
        if not self.split:
            return None
        self.part_files = part_paths(out, self.split)
        return self.part_files

    def other_layouts(self, out: Path, parts: list[Path] | None) -> list[Path]:
        """The existing files of ``out`` in another layout (:meth:`convert.targets.TargetJob.other_layouts`): the
        parts of a split of it into another number of parts, and ``out`` itself when this output is split."""
        mine = set(parts or [out])
        return [p for p in [*([out] if parts and out.exists() else []), *split_files(out)] if p not in mine]

    def sources(self) -> list[Source]:
        """The planned tensors' sources the file is made of (a tensor, or the slices a tensor stacks)."""
        by_name = {t.name: t for t in self.plan.tensors}
        read = dict.fromkeys(name for t in self.gplan.tensors for name in ([p[0] for p in t.parts] or [t.source]))
        return [by_name[name].source for name in read if name in by_name]

    def _parts_list(self) -> list[dict[str, Any]]:
        """Each part: its file name (once :meth:`output_parts` named them), tensors, first and last tensor,
        and exact size in bytes."""
        names = [p.name for p in self.part_files] or [f"part {i + 1}" for i in range(len(self.split or []))]
        return [{"file": name, "tensors": len(p.tensors), "first": p.tensors[0].name, "last": p.tensors[-1].name,
                 "bytes": file_nbytes(p)} for name, p in zip(names, self.split or [], strict=True)]

    def _staged_parts(self, staging: Path) -> list[tuple[Path, GGUFPart]]:
        assert self.split and len(self.part_files) == len(self.split)  # (output_parts named them)
        return [(staging / f.name, p) for f, p in zip(self.part_files, self.split, strict=True)]

    def write(self, staging: Path, run: RunSettings, ledger: ShardLedger | None) -> tuple[int, int]:
        budget = max(run.max_memory - 96 * 1024 * 1024, 16 * 1024 * 1024)
        gchunk = max(1 << 16, min(1 << 22, budget // (chunks_held(run.threads) * _GGUF_BYTES_PER_ELEMENT)))
        bar = run.bar(self.gplan.nbytes)
        try:
            self.reports = write_gguf(self.gplan, staging, {t.name: t for t in self.plan.tensors},
                                      chunk_elements=gchunk, threads=run.threads, max_memory=run.max_memory,
                                      processes=None if run.processes else 0,
                                      progress=bar.update if bar is not None else None, sample=self.sample,
                                      memory=placed_memory(run.threads),
                                      parts=self._staged_parts(staging) if self.split else None)
        finally:
            if bar is not None:
                bar.close()
        return len(self.split or [None]), 0

    def verify(self, staging: Path) -> None:
        for path, layout in self._staged_parts(staging) if self.split else [(staging, self.gplan)]:
            _verify_gguf(path, layout)

    def _plan_notes(self) -> list[str]:
        """The notes known before writing: the dequantization plan's, the GGUF plan's, the other towers'."""
        return list(self.plan.notes) + self.gplan.notes + _tower_notes(self.gplan.towers, self.mmproj)

    def notes(self) -> list[str]:
        parts = self._parts_list()
        split = [f"split into {len(parts)} parts as llama-gguf-split does (llama.cpp loads the first): "
                 + ", ".join(f"{p['file']} ({p['tensors']} tensors, {p['bytes']} bytes)" for p in parts[:4])
                 + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")] if parts else []
        return self._plan_notes() + split + _type_notes(
            self.out_type, self.gplan.tensors) + _error_notes(self.out_type, self.reports, self.sample, self.weights)

    def details(self) -> dict[str, Any]:
        return {"gguf": {
            "architecture": self.gplan.arch.name,
            "type": self.out_type,
            "type_counts": dict(Counter(r.ggml_type.name for r in self.reports)),
            "tensors": [
                {"name": r.name, "source": r.source, "type": r.ggml_type.name, "shape": list(r.shape),
                 "bytes": r.nbytes, "max_abs_error": _json_number(r.max_abs_error),
                 "rms_error": _json_number(r.rms_error), "rel_rms_error": _json_number(r.rel_rms_error)}
                for r in self.reports
            ],
            **({"parts": self._parts_list()} if self.split else {}),
        }}

    def fp16_counts(self) -> tuple[int, int]:
        return sum(r.fp16_overflow for r in self.reports), sum(r.fp16_underflow for r in self.reports)


class MmprojJob(GgufJob):
    """``--mmproj PATH``: the vision projector GGUF of a multimodal checkpoint
    (:func:`convert.gguf.mmproj.plan_mmproj`), written, verified and committed like the text model's GGUF,
    in the type :func:`convert.gguf.mmproj.mmproj_type` gives for ``--to gguf:TYPE``.

    Raises:
        GgufConfigError: GGUF-006 (not a supported multimodal checkpoint, no image mean/std, ...).
        UnmappedTensorError: GGUF-003.
    """

    def __init__(self, plan: Plan, options: ConvertOptions, model_name: str) -> None:
        ckpt = plan.checkpoint
        if not ckpt.is_dir or ckpt.config is None:
            raise TokenizerError(
                "the vision projector needs the model's config.json and preprocessor_config.json",
                path=ckpt.source, expected="a model directory",
                found="a lone weight file" if not ckpt.is_dir else "no config.json",
            )
        assert options.to.gguf_type is not None
        self.out_type = mmproj_type(options.to.gguf_type)
        if self.out_type != "f32" and options.to.dequantize_to != "auto":
            # a mix's text model is made from exact float32 products; the projector's F16/BF16/Q8_0, as the
            # converter's from the dequantized model, from the checkpoint's dtype (header-only plan)
            plan = make_plan(ckpt, "auto", max_shard_size=options.max_shard_size)
        self.plan = plan
        self.mmproj = None
        self.split = None  # (the projector is one file)
        self.sample = 1 if options.merge_report else SUMMARY_SAMPLE
        self.to = f"gguf:{self.out_type} (mmproj)"
        self.gplan = plan_mmproj(plan.config or ckpt.config, [(t.name, t.shape) for t in plan.tensors], ckpt.source,
                                 options.to.gguf_type, model=_model(plan, options, model_name),
                                 config_path=str(ckpt.source / "config.json"))
        self._sizes(options.dry_run)
