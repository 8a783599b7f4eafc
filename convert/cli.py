"""The ``convert-bnb`` command: arguments in, :class:`~convert.options.ConvertOptions` out; errors become
one line and an exit code here, and only here.

``convert-bnb SRC --to ...`` parses into :class:`~convert.options.ConvertOptions` and calls
:func:`convert.job.convert`; the other commands are the static table :data:`SUBCOMMANDS`.

Exit codes: 0 success; 2 bad input or usage (one line on stderr naming file, tensor and rule), or
the environment (a full disk, no permission, out of memory); 1 an internal error (one line asking for
a report; ``--debug`` shows the traceback); 130 interrupted (SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from convert import __version__, check, inspection, signals
from convert.batch import cli as batch_cli
from convert.bnb4.settings import QUANT_STORAGES
from convert.bnb4.torch_reduce import TORCH_NUM_THREADS
from convert.hub.publish import add_push_arguments, publish, push_from_args
from convert.job import convert
from convert.lora.report import format_table
from convert.options import ConvertOptions, QuantOptions, add_mix_arguments, mix_from_args, target_arg, target_names
from convert.output import InterruptedAfterCommit, user_path
from convert.output_names import MODELFILE_NAME
from convert.units import format_bytes, parse_size
from formats.errors import ConvertBnbError, TargetsFailedError
from formats.mapping import changed_input

__all__ = ["SUBCOMMANDS", "build_parser", "main", "options_from_args"]

_EXAMPLES = """\
examples:
  convert-bnb model.safetensors --to bf16                 one file -> model-bf16.safetensors
  convert-bnb ./model-bnb-4bit --to bf16 -o ./model-bf16  a model directory -> a plain bf16 model
  convert-bnb ./model-bnb-4bit --to fp16 --dry-run        print the plan, write nothing
  convert-bnb ./model-bnb-4bit --to bf16 --merge-lora ./adapter
  convert-bnb ./model-bnb-4bit --to gguf:q8_0 -o model.gguf
  convert-bnb ./model-bnb-4bit --to bf16,gguf:q4_k_m,gguf:q8_0 -o ./model   several outputs from one read
  convert-bnb ./model-bf16 --to nf4 -o ./model-nf4       re-quantize in bitsandbytes' layout
  convert-bnb org/model-bnb-4bit --to bf16                a Hub repo (HF cache, HF_TOKEN, HF_HUB_OFFLINE)
  convert-bnb org/model-bnb-4bit --to bf16 --low-disk     one shard at a time, not into the HF cache

other commands: {subcommands}
"""

#: ``convert-bnb COMMAND ...``: name -> (description, add the arguments, run the parsed arguments).
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "batch": (batch_cli.DESCRIPTION, batch_cli.add_arguments, batch_cli.run_command),
    "check": (check.DESCRIPTION, check.add_arguments, check.run_command),
    "inspect": (inspection.DESCRIPTION, inspection.add_arguments, inspection.run_command),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (exit 2) instead of the usage block; with ``json_errors``
    (``--json`` on the command line) also the JSON failure object on stdout, as for every other error."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        _print_failure(self.json_errors, {"error": "UsageError", "rule": "USE-001", "message": message})
        self.exit(2, f"{self.prog}: error: USE-001 {message} (see '{self.prog} --help')\n")


def add_common(p: argparse.ArgumentParser) -> None:
    """``--debug``, ``--quiet``, ``--json``: every command has them."""
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _whole_number(text: str) -> int:
    """An integer written in ASCII digits (``int`` also takes other scripts' digits, which no tool reads)."""
    if re.fullmatch(r"[+-]?[0-9]+", text.strip()) is None:
        raise argparse.ArgumentTypeError(f"invalid whole number: {text[:40]!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the main job, ``convert-bnb SRC --to ...``."""
    p = _Parser(
        prog="convert-bnb",
        description="Convert a bitsandbytes 4-bit or 8-bit checkpoint (file, model directory or Hub repo) to "
        "bf16/fp16/fp32 safetensors bit-exact with bitsandbytes, to NF4/FP4 in bnb's own layout, or to GGUF, "
        "optionally merging LoRA adapters, with NumPy alone, under a memory cap.",
        epilog=_EXAMPLES.format(subcommands=", ".join(SUBCOMMANDS)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"convert-bnb {__version__}")
    p.add_argument("src", metavar="SRC",
                   help="a .safetensors / .bin / .pt file, a model directory (pickles are read "
                        "without running code) or a Hub repo id org/name")
    targets = target_names()
    p.add_argument("--to", default="auto", metavar="TARGET", type=target_arg,
                   help="output: auto (each tensor's QuantState dtype), " + ", ".join(targets[1:])
                   + " (default: auto; GGUF types in any case: gguf:Q4_K_M is llama-quantize's Q4_K_M mix); several, "
                   "comma-separated (bf16,gguf:q4_k_m,gguf:q8_0,nf4), from one read of the input, into one folder")
    p.add_argument("-o", "--output", help="output path (default: next to SRC, with a suffix); DIR/ puts a one-file "
                   "output (a file input, GGUF) into DIR under its default name; with several targets, the folder "
                   "their outputs go into, each under its default name (default: next to SRC, named as SRC without "
                   "its -bnb-4bit words)")
    p.add_argument("--revision", default=None,
                   help="with a Hub repo id as SRC: branch, tag or commit sha (default: the default branch)")
    p.add_argument("--low-disk", action="store_true",
                   help="with a Hub repo id: fetch one shard at a time into a folder beside the output and delete "
                   "each once converted (peak disk: the output + the two largest shards; chosen by itself when only "
                   "that fits; --to auto|bf16|fp16|fp32)")
    p.add_argument("--max-memory", type=parse_size, default=parse_size("1GiB"),
                   help="working-memory cap, e.g. 512MiB; at least 64MiB (default: 1GiB)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="largest output shard for directory outputs (default: 5GB)")
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="with --to gguf[:TYPE] of a multimodal checkpoint: also write its vision projector GGUF "
                   "(llama.cpp's mmproj file: Gemma 3, Mistral 3, Qwen2-VL, Qwen2.5-VL; F16 unless TYPE is f32, "
                   "bf16 or q8_0) to PATH; a directory (or DIR/) puts it there under its default name, "
                   "mmproj-NAME-F16.gguf")
    p.add_argument("--split-max-size", default=None, metavar="N(M|G)",
                   help="with --to gguf[:TYPE]: write the parts llama-gguf-split --split makes, each at most N "
                   "megabytes/gigabytes of tensor data (OUT-00001-of-0000K.gguf ...)")
    p.add_argument("--split-max-tensors", type=_whole_number, default=None, metavar="N",
                   help="with --to gguf[:TYPE]: the same, with at most N tensors in each part")
    p.add_argument("--metadata", type=Path, default=None, metavar="FILE",
                   help="with --to gguf[:TYPE]: a JSON file of general.* keys overriding those taken from the model "
                   "card, config.json and the name (llama.cpp's convert_hf_to_gguf.py --metadata)")
    p.add_argument("--modelfile", action="store_const", const=MODELFILE_NAME, default=None,
                   help="with --to gguf[:TYPE]: also write an Ollama Modelfile beside the GGUF (FROM, the chat "
                   "template as Ollama's Go template where it is a known family, stop tokens, sampling defaults)")
    p.add_argument("--base", default=None, metavar="MODEL",
                   help="with a PEFT LoRA adapter directory as SRC and --to gguf[:f32|f16|bf16|q8_0]: the base model "
                   "(a directory or a Hub repo id; only its config.json is read; default: the adapter config's "
                   "base_model_name_or_path): writes the GGUF LoRA adapter llama.cpp loads")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip re-reading the output before renaming it into place")
    add_common(p)

    g = p.add_argument_group("LoRA merge")
    g.add_argument("--merge-lora", action="append", default=[], metavar="ADAPTER", type=Path,
                   help="merge a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
                   "into the dequantized weights; repeatable, applied in order")
    g.add_argument("--report", type=Path, metavar="JSON",
                   help="write the per-tensor merge report (||B A|| scale, ||W||, ratio, quantization error)")
    g.add_argument("--original", type=Path, metavar="BASE16",
                   help="the 16-bit model before quantization: adds ||W16 - dequant(W4)|| to the report")

    g = p.add_argument_group("4-bit output (--to nf4 | fp4)")
    g.add_argument("--blocksize", type=int, default=None, choices=[32, 64, 128, 256, 512, 1024, 2048, 4096],
                   metavar="N", help="elements per absmax block, 32..4096 (default: 64, as transformers)")
    g.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                   help="8-bit quantize absmax (bnb_4bit_use_double_quant; default: on)")
    g.add_argument("--quant-storage", default=None, choices=list(QUANT_STORAGES),
                   help="dtype the packed bytes are stored as (bnb_4bit_quant_storage; default: uint8)")
    g.add_argument("--skip-modules", action="append", default=[], metavar="PATTERN",
                   help="keep matching modules unquantized (transformers llm_int8_skip_modules matching; "
                   "repeat or comma-separate)")
    g.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="quantize matching tensors whatever the rules say (e.g. a 1-D tensor of a test file)")
    g.add_argument("--requantize", action="store_true",
                   help="re-quantize bnb layers even when they already have the asked settings")
    g.add_argument("--quant-report", type=Path, metavar="FILE",
                   help="write the per-tensor quantization report (relative error, bits/weight, outlier "
                   "blocks) as JSON")
    g.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="reproduce torch.mean as with this many torch threads, for layers with 32768+ "
                   f"blocks (bnb's nested offset on CPU; default: {TORCH_NUM_THREADS})")

    g = p.add_argument_group("GGUF per-tensor types (--to gguf:q4_0 ... gguf:q6_k; llama-quantize's options)")
    add_mix_arguments(g)
    add_push_arguments(p)
    return p


def options_from_args(args: argparse.Namespace) -> ConvertOptions:
    """The parsed command line as :class:`~convert.options.ConvertOptions`."""
    quiet = args.quiet or args.json
    return ConvertOptions(
        src=args.src, to=args.to, output=args.output, revision=args.revision, max_memory=args.max_memory,
        threads=args.threads, max_shard_size=args.max_shard_size, merge_lora=tuple(args.merge_lora),
        report=args.report, original=args.original, merge_report=args.json,
        quant=QuantOptions(args.blocksize, args.double_quant, args.quant_storage, tuple(args.skip_modules),
                           tuple(args.include), args.requantize, args.quant_report, args.torch_threads),
        dry_run=args.dry_run, overwrite=args.overwrite, verify=args.verify,
        progress=not quiet and sys.stderr.isatty(), list_files=args.json, low_disk=args.low_disk,
        processes=True, mmproj=args.mmproj, split_max_size=args.split_max_size,
        split_max_tensors=args.split_max_tensors,
        mix=mix_from_args(args), metadata=args.metadata, modelfile=args.modelfile, base=args.base,
    )


def _run_convert(args: argparse.Namespace) -> int:
    push = push_from_args(args)
    options = options_from_args(args)
    result = convert(options) if push is None else publish(options, push, getattr(args, "argv", None))
    try:
        return _report(args, result)
    except KeyboardInterrupt as exc:
        if result.dry_run is not None or isinstance(exc, InterruptedAfterCommit):
            raise
        raise InterruptedAfterCommit(Path(result.output)) from exc


def _report(args: argparse.Namespace, result: Any) -> int:
    if result.dry_run is not None:
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            if result.outputs:  # several targets: each output's line is in its plan; then the folder they go into
                print(f"{result.plan_text}\nfolder: {result.output}")
            else:
                print(f"{result.plan_text}\n{result.output_line(args.overwrite)}")
        return 0
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif not args.quiet:
        print_summary(result)
    return 0


def _push_line(push: dict[str, Any]) -> str:
    """The summary's line of a ``--push-to-hub`` run (:func:`convert.hub.publish.publish`'s ``push``)."""
    where = push["repo"] + (f" (branch {push['revision']})" if push["revision"] else "")
    if not push["uploaded"]:
        return f"already pushed to {where} (commit {push['commit']}): nothing uploaded"
    how = "one commit" if push["method"] == "commit" else "the resumable folder upload"
    return f"pushed to {where}: {push['files']} files, {format_bytes(push['bytes'])} in {how} (commit {push['commit']})"


def print_summary(result: Any) -> None:
    """The summary of a finished conversion on stderr (what was written, speed, memory, notes; with
    ``--push-to-hub``, the upload); a run of several targets: each output's, then the run's."""

    if result.outputs:
        for one in result.outputs:
            if one.error is None:
                print_summary(one)
        kept = sum((o.details.get("push") or {}).get("converted") is False for o in result.outputs)
        made = sum(o.error is None for o in result.outputs) - kept
        if made:
            print(f"wrote {made} output{'s' if made > 1 else ''} into {result.output}: "
                  f"{format_bytes(result.bytes_out)} out, {result.seconds:.2f} s, peak RSS "
                  f"{format_bytes(result.peak_rss_bytes)}", file=sys.stderr)
        else:
            print(f"kept {kept} outputs in {result.output}, made by an earlier run", file=sys.stderr)
        for n in result.notes:
            print(f"note: {n}", file=sys.stderr)
        return
    push = result.details.get("push")
    if push is not None and not push["converted"]:
        print(f"kept {result.output}: {format_bytes(result.bytes_out)}, made by an earlier run", file=sys.stderr)
    else:
        print(f"wrote {result.output}: {result.tensors} tensors, {format_bytes(result.bytes_in)} in, "
              f"{format_bytes(result.bytes_out)} out, {result.seconds:.2f} s, {result.gelem_per_s:.3f} G elements/s, "
              f"peak RSS {format_bytes(result.peak_rss_bytes)}", file=sys.stderr)
    if result.fp16_line():
        print(result.fp16_line(), file=sys.stderr)
    for r in result.removed_stale:
        print(r, file=sys.stderr)
    for n in result.notes:
        print(f"note: {n}", file=sys.stderr)
    if push is not None:
        print(_push_line(push), file=sys.stderr)
    if "lora_merge" in result.details:
        print(format_table(result.details["lora_merge"], limit=40), file=sys.stderr)



#: The options whose value is a size (:func:`convert.units.parse_size`; ``--split-max-size``:
#: :func:`convert.gguf.types.parse_split_size`).
_SIZE_OPTIONS = ("--max-memory", "--max-shard-size", "--split-max-size", "--push-large-size")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--max-memory -5GB`` as ``--max-memory=-5GB``: argparse takes a value starting with ``-`` and a digit
    but not a plain number for an option and says "expected one argument"; attached, the option's own type
    refuses it with its message ("not a size")."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _SIZE_OPTIONS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line. Returns the exit code (the console script exits with it)."""
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        if argv and argv[0] in SUBCOMMANDS:
            name = argv.pop(0)
            help_text, add_args, run = SUBCOMMANDS[name]
            parser: argparse.ArgumentParser = _Parser(prog=f"convert-bnb {name}", description=help_text)
            add_args(parser)
            add_common(parser)
        else:
            parser = build_parser()
            run = _run_convert
        if isinstance(parser, _Parser):
            parser.json_errors = "--json" in argv
        args = parser.parse_args(argv)  # usage errors: exit 2 with one line
        args.argv = list(argv)  # (a pushed model card gives the command)
    except KeyboardInterrupt:
        signals.settle()
        print("convert-bnb: interrupted", file=sys.stderr)
        return 130
    debug = args.debug
    old = signals.install()
    as_json = bool(getattr(args, "json", False))
    signals.on_bus_error(lambda: _report_failure(as_json, changed_input()))
    # a batch keeps finished jobs and the finished shards of the others for a re-run; one conversion
    # removes its temporary (check and inspect write nothing)
    tail = batch_cli.INTERRUPTED_TAIL if run is batch_cli.run_command else "no output was left behind"
    try:
        return run(args)
    except TargetsFailedError as exc:  # some targets of several: each failed one's line, the others' summaries
        if debug:
            raise
        _report_targets(args, exc)
        return 2
    except ConvertBnbError as exc:
        if debug:
            raise
        _report_failure(as_json, exc)
        return 2
    except InterruptedAfterCommit as exc:  # the output was already complete and in place
        signals.settle()  # (a second signal would cut this report)
        print(f"convert-bnb: {exc.message()}", file=sys.stderr)
        _print_failure(as_json, {"error": "KeyboardInterrupt", "rule": None, "message": exc.message()})
        return 130
    except KeyboardInterrupt:
        signals.settle()
        print(f"convert-bnb: interrupted; {tail}", file=sys.stderr)
        _print_failure(as_json, {"error": "KeyboardInterrupt", "rule": None, "message": "interrupted"})
        return 130
    except BrokenPipeError:  # e.g. `convert-bnb ... --dry-run | head`
        sys.stderr.close()
        return 0
    except MemoryError as exc:  # the environment too: not a bug, and the caps are the user's to lower
        if debug:
            raise
        message = f"out of memory ({exc or 'no detail'}): try a lower --max-memory or fewer --threads"
        print(f"convert-bnb: error: {message}", file=sys.stderr)
        _print_failure(as_json, {"error": "MemoryError", "rule": None, "message": message})
        return 2
    except OSError as exc:  # the environment (a missing file, a full disk, no permission): not a bug
        if debug:
            raise
        message = _os_message(exc).replace("\n", " ")
        print(f"convert-bnb: error: {message}", file=sys.stderr)
        _print_failure(as_json, {"error": type(exc).__name__, "rule": None, "message": message})
        return 2
    except Exception as exc:  # noqa: BLE001 - the one place that maps unexpected errors
        if debug:
            raise
        print(
            f"convert-bnb: internal error: {type(exc).__name__}: {exc}. This is a bug; please report it "
            "with the output of the same command plus --debug.",
            file=sys.stderr,
        )
        _print_failure(as_json, {"error": type(exc).__name__, "rule": None, "message": str(exc), "internal": True})
        return 1
    finally:
        signals.restore(old)


def _report_failure(as_json: bool, exc: ConvertBnbError) -> None:
    """A named failure: its one line on stderr (and with ``--json`` the object on stdout)."""
    print(f"convert-bnb: error: {exc}", file=sys.stderr, flush=True)
    _print_failure(as_json, {**exc.to_dict()})
    sys.stdout.flush()


def _report_targets(args: argparse.Namespace, exc: TargetsFailedError) -> None:
    """A run of several targets of which some failed: what the others did (their summaries or plans, or the
    JSON object of the whole run), then one line per failed target on stderr."""
    result = exc.result
    if getattr(args, "json", False):  # (the whole run, with the error's class, rule and message as every failure)
        failure = {"error": type(exc).__name__, "rule": exc.rule, "message": str(exc)}
        print(json.dumps({**result.to_dict(), "ok": False, **failure} if result is not None
                         else {"ok": False, **exc.to_dict()}, indent=2))
    elif result is not None and result.dry_run is not None:
        print(f"{result.plan_text}")
    elif result is not None and not args.quiet:
        for one in result.outputs:
            if one.error is None:
                print_summary(one)
    for target, error in exc.failures:
        text = error if isinstance(error, ConvertBnbError) else _os_message(error) if isinstance(error, OSError) \
            else f"{type(error).__name__}: {error}"
        print(f"convert-bnb: error: --to {target}: {str(text).replace(chr(10), ' ')}", file=sys.stderr)
    sys.stdout.flush()


def _print_failure(as_json: bool, error: dict[str, Any]) -> None:
    """With ``--json``: the failure as one JSON object on stdout (``ok`` false, the error class, rule and
    message), so a caller parsing stdout always gets an object; the exit code is unchanged."""
    if as_json:
        print(json.dumps({"ok": False, **error}, indent=2))


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
    return f"Failed to use '{user_path(Path(os.fsdecode(exc.filename)))}': {text}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
