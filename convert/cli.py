"""The ``convert-bnb`` command: argparse, and the one place where errors become messages and exit codes.

Exit codes: 0 success; 2 bad input or usage (one line on stderr naming file, tensor and rule);
1 an internal error (one line asking for a report; ``--debug`` shows the traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from formats.errors import ConvertBnbError, SourceNotFoundError, UsageError

__all__ = ["SUBCOMMANDS", "build_parser", "main", "parse_size", "resolve_source"]

_EXAMPLES = """\
examples:
  convert-bnb model.safetensors --to bf16                 one file -> model-bf16.safetensors
  convert-bnb ./model-bnb-4bit --to bf16 -o ./model-bf16  a model directory -> a plain bf16 model
  convert-bnb ./model-bnb-4bit --to fp16 --dry-run        print the plan, write nothing
  convert-bnb ./model-bnb-4bit --max-memory 512MiB --threads 2 --json

other commands: {subcommands}
"""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Parse a byte size: ``1GiB``, ``512MiB``, ``5GB`` (decimal), ``1000000`` (bytes).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = _SIZE_RE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: '{text}' (examples: 1GiB, 512MiB, 5GB)")
    return int(float(m.group(1)) * _UNITS[unit])


#: Subcommand name -> (help, function adding its arguments, function running it). Modules add theirs.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the main job, ``convert-bnb SRC --to ...``."""
    from .plan import TARGETS

    p = _Parser(
        prog="convert-bnb",
        description="Convert a bitsandbytes 4-bit or 8-bit checkpoint (file, model directory or Hub repo) to "
        "bf16/fp16/fp32 safetensors bit-exact with bitsandbytes, to NF4/FP4 in bnb's own layout, or to GGUF, "
        "optionally merging LoRA adapters, with NumPy alone, under a memory cap.",
        epilog=_EXAMPLES.format(subcommands=", ".join(sorted(SUBCOMMANDS)) or "none"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC",
                   help="a .safetensors / .bin / .pt file, a model directory (pickles are read "
                        "without running code) or a Hub repo id org/name")
    p.add_argument("--to", default="auto", choices=list(TARGETS) + list(EXTRA_TARGETS),
                   metavar="TARGET",
                   help="output: auto (each tensor's QuantState dtype), bf16, fp16, fp32"
                   + ("".join(", " + k for k in EXTRA_TARGETS)) + " (default: auto)")
    p.add_argument("-o", "--output", type=Path, help="output path (default: next to SRC, with a suffix)")
    p.add_argument("--max-memory", type=parse_size, default=parse_size("1GiB"),
                   help="working-memory cap, e.g. 512MiB (default: 1GiB)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="largest output shard for directory outputs (default: 5GB)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip re-reading the output before renaming it into place")
    _add_common(p)
    for hook in PARSER_HOOKS:
        hook(p)
    return p


#: Extra ``--to`` values handled by other modules: name -> runner(args, checkpoint) -> summary dict.
EXTRA_TARGETS: dict[str, Callable[[argparse.Namespace, Any], dict[str, Any] | None]] = {}
#: Functions that add options to the main parser.
PARSER_HOOKS: list[Callable[[argparse.ArgumentParser], None]] = []
#: Functions ``(args, plan) -> plan`` applied after planning (e.g. LoRA merge).
PLAN_HOOKS: list[Callable[[argparse.Namespace, Any], Any]] = []
#: Functions ``(args) -> Path | None`` turning a SRC that is no local path into one (Hub repo ids).
SOURCE_HOOKS: list[Callable[[argparse.Namespace], Path | None]] = []


def resolve_source(args: argparse.Namespace) -> Path:
    """A SRC that does not exist locally, through :data:`SOURCE_HOOKS` (e.g. ``org/name`` on the Hub).

    Raises:
        SourceNotFoundError: no hook knows SRC (CKPT-010).
    """
    for hook in SOURCE_HOOKS:
        found = hook(args)
        if found is not None:
            return found
    raise SourceNotFoundError("SRC does not exist", path=args.src,
                     hint="give a .safetensors file, a model directory or a Hub repo id org/name")


#: Functions ``(args)`` that validate option combinations before anything is opened.
CHECK_HOOKS: list[Callable[[argparse.Namespace], None]] = []
#: Functions ``(args, plan, summary)`` called after a run (e.g. the LoRA merge report); may add to summary.
RESULT_HOOKS: list[Callable[[argparse.Namespace, Any, dict[str, Any]], None]] = []


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _print_summary(s: dict[str, Any]) -> None:
    line = (
        f"wrote {s['output']}: {s['tensors']} tensors, {_human(s['bytes_in'])} in, "
        f"{_human(s['bytes_out'])} out, {s['seconds']:.2f} s, {s['gelem_per_s']:.3f} G elements/s, "
        f"peak RSS {_human(s['peak_rss_bytes'])}"
    )
    print(line, file=sys.stderr)
    if s.get("fp16_overflow") or s.get("fp16_underflow"):
        print(f"float16: {s['fp16_overflow']} values overflowed to inf, "
              f"{s['fp16_underflow']} non-zero values flushed to zero", file=sys.stderr)
    for r in s.get("removed_stale", []):
        print(f"removed a stale temporary left by an interrupted run: {r}", file=sys.stderr)
    for n in s.get("notes", []):
        print(f"note: {n}", file=sys.stderr)


def _convert(args: argparse.Namespace) -> int:
    from formats.checkpoint import open_checkpoint

    from .pipeline import run_plan
    from .plan import default_output, make_plan

    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1", found=args.threads)
    if args.max_shard_size < 1:
        raise UsageError("--max-shard-size must be at least 1 byte", found=args.max_shard_size)
    for check in CHECK_HOOKS:
        check(args)
    src = Path(args.src)
    if not src.exists():
        src = resolve_source(args)
    with open_checkpoint(src) as ckpt:
        if args.to in EXTRA_TARGETS:
            summary = EXTRA_TARGETS[args.to](args, ckpt)
            if summary is None:  # the target printed its --dry-run plan
                return 0
        else:
            plan = make_plan(ckpt, args.to, max_shard_size=args.max_shard_size)
            for hook in PLAN_HOOKS:
                plan = hook(args, plan)
            out = args.output or default_output(src, args.to)
            if args.dry_run:
                exists = " (exists: --overwrite needed)" if out.exists() else ""
                if args.json:
                    print(json.dumps({**plan.to_dict(), "output": str(out), "output_exists": out.exists()}, indent=2))
                else:
                    print(f"{plan.describe()}\n  output: {out}{exists}")
                return 0
            summary = run_plan(
                plan, out, threads=args.threads, max_memory=args.max_memory, overwrite=args.overwrite,
                progress=not args.quiet and not args.json and sys.stderr.isatty(), verify=args.verify,
            ).to_dict()
            for result_hook in RESULT_HOOKS:
                result_hook(args, plan, summary)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif not args.quiet:
        _print_summary(summary)
    return 0


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line. Returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _load_plugins()
        if argv and argv[0] in SUBCOMMANDS:
            name = argv.pop(0)
            help_text, add_args, run = SUBCOMMANDS[name]
            parser: argparse.ArgumentParser = _Parser(prog=f"convert-bnb {name}", description=help_text)
            add_args(parser)
            if not any(a.dest == "debug" for a in parser._actions):
                _add_common(parser)
        else:
            parser = build_parser()
            run = _convert
        args = parser.parse_args(argv)  # usage errors: exit 2 with one line
    except KeyboardInterrupt:
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    debug = getattr(args, "debug", False)
    old = None
    if threading_main():
        old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return run(args)
    except ConvertBnbError as exc:
        if debug:
            raise
        print(f"convert-bnb: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("convert-bnb: interrupted; no output was left behind", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `convert-bnb ... --dry-run | head`
        sys.stderr.close()
        return 0
    except OSError as exc:  # the environment (a missing file, a full disk, no permission): not a bug
        if debug:
            raise
        print(f"convert-bnb: error: {_os_message(exc)}".replace("\n", " "), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the one place that maps unexpected errors
        if debug:
            raise
        print(
            f"convert-bnb: internal error: {type(exc).__name__}: {exc}. This is a bug; please report it "
            "with the output of the same command plus --debug.",
            file=sys.stderr,
        )
        return 1
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _os_message(exc: OSError) -> str:
    """An OS error as one line naming the path the user knows (an output, not its temporary)."""
    if exc.strerror is None:
        return str(exc)
    hints = {errno.EACCES: "check the permissions", errno.EPERM: "check the permissions",
             errno.ENOSPC: "free some disk space or write elsewhere with -o",
             errno.EROFS: "the file system is read-only: write elsewhere with -o"}
    hint = hints.get(exc.errno or 0)
    text = f"{exc.strerror} (errno {exc.errno})" + (f". Hint: {hint}" if hint else "")
    if exc.filename is None:
        return text
    name = Path(os.fsdecode(exc.filename))
    from .pipeline import TMP_MARK

    if TMP_MARK in name.name and name.name.startswith("."):
        name = name.with_name(name.name[1 : name.name.index(TMP_MARK)])  # .OUT.convert-bnb-tmp-PID -> OUT
    return f"Failed to use '{name}': {text}"


def threading_main() -> bool:
    """True in the main thread (signal handlers can only be installed there)."""
    import threading

    return threading.current_thread() is threading.main_thread()


def _load_plugins() -> None:
    """Import the modules that register subcommands, targets and hooks."""
    for mod in PLUGINS:
        __import__(mod)


#: Modules imported at start-up to register subcommands / targets / hooks (kept light).
PLUGINS: list[str] = [
    "convert.lora_cli", "convert.hub", "convert.batch", "convert.inspection", "convert.to_gguf",
    "convert.requant", "convert.check",
]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
