"""What a conversion did: :class:`ConvertResult`, returned by :func:`convert.job.convert` (``--json`` prints
:meth:`ConvertResult.to_dict`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from convert import __version__

__all__ = ["ConvertResult"]


@dataclass
class ConvertResult:
    """What a conversion did (``--json`` prints :meth:`to_dict`).

    Attributes:
        source: what was read: the input's absolute path, or ``org/name@commit`` for a Hub repo.
        commit: the Hub commit the input was read at, or None for a local path.
        to: the target.
        output: the output path.
        dry_run: the plan (``dry_run``: nothing was written), else None.
        plan_text: the plan as a table, with ``dry_run``.
        output_exists: with ``dry_run``: whether the output path exists already.
        tensors: tensors written.
        elements: values converted: the model's, in its dequantized shapes (a packed 4-bit output's
            weights, not its bytes).
        bytes_in: tensor bytes read.
        bytes_out: bytes written (all files).
        seconds: wall time.
        gelem_per_s: ``elements`` per second, in billions.
        peak_rss_bytes: the process's peak resident set (bytes).
        fp16_overflow: values that became inf when rounded to float16.
        fp16_underflow: non-zero values that became 0 when rounded to float16.
        shards_written: output files written by this run; shards_reused: kept from a killed run.
        verified: the output was re-read and checked before it was committed (False with ``verify=False``).
        removed_stale: what the output claim recovered from dead runs.
        files: with ``manifest`` or ``list_files``: ``{path relative to output: {"bytes", "sha256"}}`` of
            the output (a file output: its own name).
        timings: seconds per step: ``plan`` (open, plan, merge, prepare), ``write``, ``verify``,
            ``commit`` (manifest and install), ``total``.
        notes: things the user should know.
        details: target-specific results (``gguf``, ``quantized``, ``report``, ``lora_merge``).
        outputs: a run of several targets: each target's result, in ``--to`` order (``output`` is then their
            folder); else empty.
        error: the result of a target of such a run that failed: ``{"error": class, "rule", "message"}``, else None.
    """

    source: str
    to: str
    output: str
    commit: str | None = None
    dry_run: dict[str, Any] | None = None
    plan_text: str = ""
    output_exists: bool = False
    tensors: int = 0
    elements: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    gelem_per_s: float = 0.0
    peak_rss_bytes: int = 0
    fp16_overflow: int = 0
    fp16_underflow: int = 0
    shards_written: int = 0
    shards_reused: int = 0
    verified: bool = False
    removed_stale: list[str] = field(default_factory=list)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    outputs: list[ConvertResult] = field(default_factory=list)
    error: dict[str, Any] | None = None

    def output_line(self, overwrite: bool) -> str:
        """A dry run's line of where the output goes: ``  output: PATH``, and when it exists and the run would not
        only upload it (``--push-to-hub`` over an earlier run's output with these settings: its push plan's
        ``kept``) ``(exists: --overwrite needed)``, or with ``overwrite`` ``(exists: --overwrite replaces it)``."""
        kept = ((self.dry_run or {}).get("push") or {}).get("kept")
        if not self.output_exists or kept:
            return f"  output: {self.output}"
        return f"  output: {self.output} (exists: --overwrite {'replaces it' if overwrite else 'needed'})"

    def fp16_line(self) -> str | None:
        """The summary's float16 line (values that overflowed to inf, non-zero values flushed to zero),
        or None when neither happened."""
        if not (self.fp16_overflow or self.fp16_underflow):
            return None
        return (f"float16: {self.fp16_overflow} values overflowed to inf, {self.fp16_underflow} non-zero values "
                "flushed to zero")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``--json``): ``ok``, the converter's version, the fields, with ``details``
        flattened in (a dry run gives the plan)."""
        if self.error is not None:
            return {"ok": False, "to": self.to, "output": self.output, **self.error}
        if self.dry_run is not None:  # (a local source by its absolute path, as a run's result names it)
            local = self.commit is None and self.source
            return {**self.dry_run, **({"source": self.source} if local else {}), "output": self.output,
                    "output_exists": self.output_exists,
                    **({"outputs": [o.to_dict() for o in self.outputs]} if self.outputs else {})}
        d: dict[str, Any] = {"ok": all(o.error is None for o in self.outputs),
                             "converter": f"convert-bnb {__version__}"}
        d.update({f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "outputs"})
        for k in ("dry_run", "plan_text", "output_exists", "details", "error"):
            d.pop(k)
        d.update(self.details)
        if self.outputs:
            d["outputs"] = [o.to_dict() for o in self.outputs]
        return d
