"""Several targets in one run (``--to bf16,gguf:q8_0,nf4``): each output byte for byte its single run's, each
dequantized weight made once, one target's failure keeping the others, the memory cap, the command line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convert.cli import main
from convert.job import convert
from convert.options import ConvertOptions, target_for
from convert.run import several as several_mod
from convert.run.result import ConvertResult
from convert.stream import shared as shared_mod
from convert.stream.sources import Dequant4Source
from formats.errors import (
    OutputBusyError,
    OutputExistsError,
    TargetsFailedError,
    UnsupportedArchitectureError,
    UsageError,
)
from tests.helpers.fixtures import FIXTURES, MODELS, ROOT
from tests.helpers.rss import run_measured

LLAMA = MODELS / "llama_nf4_dq"
LORA = FIXTURES / "lora" / "adapter"


def _tree(path: Path) -> dict[str, bytes]:
    """Every file of an output (a file: its own name), by path relative to it."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _singles(src: Path, result: ConvertResult, where: Path, **kw: Any) -> None:
    """Each target of ``result`` converted alone (same options) under ``where``, with the multi run's file
    name; every file of every output the same bytes."""
    assert result.outputs and all(o.error is None for o in result.outputs)
    for o in result.outputs:
        got = Path(o.output)
        alone = convert(ConvertOptions(str(src), to=o.to, output=where / got.name, **kw))
        assert Path(alone.output).name == got.name  # the name it has alone
        want = _tree(Path(alone.output))
        have = _tree(got)
        assert sorted(have) == sorted(want), o.to
        for name in want:
            assert have[name] == want[name], f"--to {o.to}: {name} differs from the single run"


CASES = {
    # every kind of writer and rounding: bf16/fp16 safetensors, nf4 (copied: the input's settings), fp4 (re-quantized:
    # absmax and codes passes, in dtype-then-name order), GGUF F16 (from bf16), Q8_0 (bf16) and Q4_K_M (float32)
    "llama": (LLAMA, "bf16,fp16,nf4,fp4,gguf:f16,gguf:q8_0,gguf:q4_k_m", {}),
    "sharded": (MODELS / "llama_nf4_dq_sharded", "gguf:q8_0,bf16,nf4", {"max_shard_size": 1 << 20}),
    "moe": (MODELS / "mixtral_nf4_dq", "bf16,gguf:q8_0,gguf:q4_k_m,nf4", {}),
    "int8": (MODELS / "llama_int8", "fp16,gguf:q8_0,gguf:f32", {}),
    "nf4-from-fp4": (MODELS / "llama_fp4_nodq", "nf4,bf16,gguf:bf16", {}),
    "merge": (LLAMA, "bf16,gguf:q8_0,gguf:q4_k_m,nf4", {"merge_lora": (LORA,)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_output_equals_its_single_run(case: str, tmp_path: Path) -> None:
    src, to, kw = CASES[case]
    result = convert(ConvertOptions(str(src), to=to, output=tmp_path / "set", threads=2, **kw))
    assert [o.to for o in result.outputs] == to.split(",")
    assert all(Path(o.output).parent == tmp_path / "set" for o in result.outputs)
    _singles(src, result, tmp_path / "alone", threads=2, **kw)
    assert result.details["shared"]["blocks_made"] > 0 and result.details["shared"]["blocks_dropped"] == 0


@pytest.mark.parametrize("budget", [0, 12 << 10, 40 << 10])
def test_small_blocks_and_a_tiny_shared_budget_write_the_same_bytes(budget: int, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 1024 values (every read spans several, starts and ends inside one) and a budget of none, of
    three blocks (readers wait for room; the orders of fp4 and GGUF differ from bf16's, so blocks are dropped and
    made again) or of ten: the bytes never change, and nothing waits for ever."""
    monkeypatch.setattr(shared_mod, "BLOCK_ELEMENTS", 1024)
    real = several_mod.share_memory
    monkeypatch.setattr(several_mod, "share_memory", lambda m, n: (real(m, n)[0], budget))
    to = "bf16,fp4,gguf:q8_0,gguf:q4_k_m"
    result = convert(ConvertOptions(str(LLAMA), to=to, output=tmp_path / "set", threads=2))
    shared = result.details["shared"]
    assert shared["peak_bytes"] <= budget
    if budget:
        assert shared["blocks_made"] > 0
    _singles(LLAMA, result, tmp_path / "alone", threads=2)


@pytest.mark.parametrize(("to", "held"), [("bf16,gguf:q8_0,gguf:q4_k_m", "float32"),
                                         ("bf16,gguf:q8_0,nf4", "bfloat16")])
def test_each_weight_is_dequantized_once(to: str, held: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every target reads every 4-bit weight (nf4 copies the input's: it reads none): the kernel makes each
    value once, as float32 products where the targets ask for other dtypes (bf16 and Q8_0 round them to bf16,
    Q4_K_M takes them as they are), as bf16 where they all ask for bf16; never for one target alone."""
    made: list[tuple[str, int, str]] = []
    direct = Dequant4Source.dequant_into

    def count(self: Dequant4Source, start: int, stop: int, dtype: Any, out: Any) -> None:
        made.append((self.name, stop - start, dtype.name))
        direct(self, start, stop, dtype, out)

    monkeypatch.setattr(Dequant4Source, "dequant_into", count)
    result = convert(ConvertOptions(str(LLAMA), to=to, output=tmp_path / "set", threads=2))
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint

    with open_checkpoint(LLAMA) as ckpt:
        weights = {t.name: t.numel for t in make_plan(ckpt).tensors if isinstance(t.source, Dequant4Source)}
    per_weight: dict[str, int] = {}
    for name, n, _ in made:
        per_weight[name] = per_weight.get(name, 0) + n
    assert per_weight == weights and {d for _, _, d in made} == {held}
    readers = 3 if held == "float32" else 2
    assert result.details["shared"]["values_shared"] == readers * sum(weights.values())


@pytest.mark.parametrize(("threads", "want"), [(2, {"bf16": 1, "gguf:q8_0": 2, "nf4": 1}),
                                              (8, {"bf16": 3, "gguf:q8_0": 6, "nf4": 1})])
def test_threads_are_shared_out_by_each_targets_work(threads: int, want: dict[str, int], tmp_path: Path) -> None:
    """The targets move in step, so --threads goes to them by the CPU each spends on the weights it reads: Q8_0
    2.5 per weight against bf16's 1, the nf4 of an nf4 model copies its layers (reads none: one thread); the bytes
    are each single run's."""
    result = convert(ConvertOptions(str(LLAMA), to="bf16,gguf:q8_0,nf4", output=tmp_path / "set", threads=threads))
    assert result.details["shared"]["threads"] == want
    assert result.notes[0].endswith("; threads " + ", ".join(f"{t} {n}" for t, n in want.items())
                                    + f" (each target's share of --threads {threads} by the work it does per "
                                      "weight, rounded up)")
    _singles(LLAMA, result, tmp_path / "alone", threads=threads)


def test_the_note_says_when_a_target_got_fewer_threads(tmp_path: Path) -> None:
    """Two targets of equal work at 2 threads get 1 each: the note says so; at 1 thread nothing was shared out."""
    two = convert(ConvertOptions(str(LLAMA), to="bf16,fp16", output=tmp_path / "a", threads=2))
    assert two.details["shared"]["threads"] == {"bf16": 1, "fp16": 1}
    assert two.notes[0].endswith("; threads bf16 1, fp16 1 (each target's share of --threads 2 by the work it does "
                                 "per weight, rounded up)")
    one = convert(ConvertOptions(str(LLAMA), to="bf16,fp16", output=tmp_path / "b", threads=1))
    assert one.details["shared"]["threads"] == {"bf16": 1, "fp16": 1} and "threads" not in one.notes[0]


def test_allot_threads() -> None:
    """ceil(threads * work / total), at least one; nothing shared: each target its threads, as alone."""
    assert shared_mod.allot_threads(2, {0: 1.0, 1: 2.5, 2: 0.0}) == {0: 1, 1: 2, 2: 1}
    assert shared_mod.allot_threads(8, {0: 1.0, 1: 2.5, 2: 0.0}) == {0: 3, 1: 6, 2: 1}
    assert shared_mod.allot_threads(4, {0: 1.0, 1: 1.0}) == {0: 2, 1: 2}
    assert shared_mod.allot_threads(2, {0: 1.0, 1: 60.0, 2: 2.5}) == {0: 1, 1: 2, 2: 1}
    assert shared_mod.allot_threads(3, {0: 0.0, 1: 0.0}) == {0: 3, 1: 3}


def test_rows_of_one_shared_block_are_read_without_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks of a 2-D weight are whole rows, a GGUF target's row chunks and a safetensors target's chunks whole
    blocks: both targets read every 4-bit weight as read-only views of the blocks held in their dtype (nothing is
    copied out of a block); the bytes are each single run's."""
    copied: list[int] = []
    views: list[bool] = []
    real_round, real_view = shared_mod._round_into, shared_mod.SharedProducts._view

    def count_round(x: Any, dtype: Any, out: Any, counts: Any) -> None:
        copied.append(x.size)
        real_round(x, dtype, out, counts)

    def count_view(self: shared_mod.SharedProducts, *args: Any) -> Any:
        v = real_view(self, *args)
        if v is not None:
            views.append(v.flags.writeable)
        return v

    monkeypatch.setattr(shared_mod, "_round_into", count_round)
    monkeypatch.setattr(shared_mod.SharedProducts, "_view", count_view)
    result = convert(ConvertOptions(str(LLAMA), to="bf16,gguf:q8_0", output=tmp_path / "set", threads=2))
    shared = result.details["shared"]
    assert views and not any(views)  # read-only
    assert not copied and shared["values_shared"] > 0
    _singles(LLAMA, result, tmp_path / "alone", threads=2)


class _Counting:
    """A stand-in dequantizing source: element i is i (as the dtype asked for); counts what it makes."""

    unit, row_elements, numel, shared, layer = 64, 256, 1 << 15, None, None

    def __init__(self) -> None:
        self.name, self.made = "w", 0

    def reads(self) -> list[Any]:
        return []

    def exact_into(self, start: int, stop: int, out: np.ndarray) -> None:
        self.dequant_into(start, stop, None, out)

    def dequant_into(self, start: int, stop: int, dtype: Any, out: np.ndarray) -> None:
        self.made += stop - start
        out[...] = np.arange(start, stop)


def test_a_shared_block_is_made_where_the_writer_places_it() -> None:
    """A block made for a view given the file offset it goes to lies at that offset modulo ALIGN (the safetensors
    writer then sends it to the disk from there, without a copy); the other target's view of it is the same
    memory, made once; a block another target made first is handed out where it lies."""
    from formats.dtypes import BY_NAME
    from formats.writeback import ALIGN

    products = shared_mod.SharedProducts(budget=1 << 24, consumers=2, block=1 << 14, threads=1)
    srcs = [_Counting(), _Counting()]
    for c, src in zip((products.consumer(), products.consumer()), srcs, strict=True):
        c.link([src], "bf16")
    waiter = threading.Thread(target=products._arrive, args=(1,))
    waiter.start()
    products._arrive(0)
    waiter.join()
    bf16 = BY_NAME["bfloat16"]
    at = 5 * ALIGN + 136  # (the bf16 file's offset of element 0 of the block)
    first = srcs[0].shared.view(srcs[0], 0, 1 << 14, bf16, at)
    assert first is not None and not first.flags.writeable
    assert (first.ctypes.data - at) % ALIGN == 0
    assert np.array_equal(first, np.arange(1 << 14).astype(bf16.numpy))
    other = srcs[1].shared.view(srcs[1], 4096, 8192, bf16)
    assert other is not None and np.shares_memory(other, first)
    assert (srcs[0].made, srcs[1].made) == (1 << 14, 0)
    # the next block made by the other target first: where it lies (page-aligned), not at the first's offset
    later = srcs[1].shared.view(srcs[1], 1 << 14, 2 << 14, bf16)
    again = srcs[0].shared.view(srcs[0], 1 << 14, 2 << 14, bf16, at)
    assert later is not None and again is not None and np.shares_memory(later, again)
    assert (srcs[0].made, srcs[1].made) == (1 << 14, 1 << 14)


def test_blocks_are_smaller_under_a_small_budget() -> None:
    """Four float32 blocks fit the shared budget: 108 MiB (three targets at 1 GiB) takes the full 2^22 elements,
    44 MiB (three at 512 MiB) 2.75 Mi, 12 MiB (three at 256 MiB) and less the floor of 2^20."""
    assert shared_mod.block_elements(108 << 20) == shared_mod.BLOCK_ELEMENTS == 1 << 22
    assert shared_mod.block_elements(44 << 20) == (44 << 20) // 16
    assert shared_mod.block_elements(12 << 20) == shared_mod.block_elements(0) == 1 << 20
    assert shared_mod.SharedProducts(44 << 20, 2).block == (44 << 20) // 16


def test_shared_blocks_are_whole_rows_where_rows_are_whole_units() -> None:
    assert shared_mod._grid(1 << 20, 64, 4096) == 256 * 4096
    assert shared_mod._grid(1 << 20, 64, 11008) == 95 * 11008  # (not a power of two: still whole rows)
    assert shared_mod._grid(1 << 20, 4096, 4096) == 256 * 4096  # an int8 layer: its unit is a row
    assert shared_mod._grid(1 << 20, 64, 100) == (1 << 20) // 64 * 64  # rows are not whole blocksizes
    assert shared_mod._grid(1 << 20, 64, 0) == 1 << 20  # row unknown
    assert shared_mod._grid(1024, 64, 4096) == 4096  # a block of at least one row


def _unsupported_arch(tmp_path: Path) -> Path:
    src = tmp_path / "foo_nf4_dq"
    shutil.copytree(LLAMA, src, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_a_target_failing_at_planning_keeps_the_others(tmp_path: Path) -> None:
    src = _unsupported_arch(tmp_path)
    with pytest.raises(TargetsFailedError) as info:
        convert(ConvertOptions(str(src), to="bf16,gguf:q8_0,nf4", output=tmp_path / "set"))
    exc = info.value
    assert exc.rule == "OUT-006" and [t for t, _ in exc.failures] == ["gguf:q8_0"]
    assert isinstance(exc.failures[0][1], UnsupportedArchitectureError)
    assert "1 of 3 targets failed: gguf:q8_0 (GGUF-001); the 2 other outputs are complete" in str(exc)
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == ["foo_nf4_dq-bf16", "foo_nf4_dq-nf4"]
    result = exc.result
    assert [o.to for o in result.outputs] == ["bf16", "gguf:q8_0", "nf4"]
    assert result.outputs[1].to_dict()["rule"] == "GGUF-001" and result.to_dict()["ok"] is False
    _singles(src, ConvertResult("", "", "", outputs=[result.outputs[0], result.outputs[2]]), tmp_path / "alone")


def test_a_target_failing_while_writing_leaves_nothing_and_keeps_the_others(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF writer dies after part of its file (its other chunks still in flight): its temporary is removed,
    the others go on to their end (the blocks it would have read are not waited for)."""
    from convert.gguf import target as gguf_target
    from formats.errors import GgufNonFiniteError

    real = gguf_target.write_gguf

    def dies(*a: Any, **k: Any) -> Any:
        progress = k["progress"]

        def fail_later(n: int, seen: list[int] = []) -> None:  # noqa: B006 - a counter across calls
            seen.append(n)
            progress(n)
            if len(seen) == 5:
                raise GgufNonFiniteError("weight holds nan", tensor="x")

        return real(*a, **{**k, "progress": fail_later})

    monkeypatch.setattr(gguf_target, "write_gguf", dies)
    monkeypatch.setattr(shared_mod, "BLOCK_ELEMENTS", 4096)
    with pytest.raises(TargetsFailedError) as info:
        convert(ConvertOptions(str(LLAMA), to="gguf:q8_0,bf16,fp4", output=tmp_path / "set", threads=2))
    assert [t for t, _ in info.value.failures] == ["gguf:q8_0"]
    assert sorted(p.name for p in (tmp_path / "set").iterdir()) == ["llama_nf4_dq-bf16", "llama_nf4_dq-fp4"]
    _singles(LLAMA, ConvertResult("", "", "", outputs=info.value.result.outputs[1:]), tmp_path / "alone", threads=2)


def test_every_target_failing_alike_is_one_error(tmp_path: Path) -> None:
    """A broken input fails every target the same way: the error itself, as a single run gives it, and no folder."""
    src = tmp_path / "m"
    shutil.copytree(LLAMA, src, ignore=shutil.ignore_patterns("reference"))
    (src / "model.safetensors").write_bytes(b"\0" * 7)
    with pytest.raises(Exception) as info:
        convert(ConvertOptions(str(src), to="bf16,nf4", output=tmp_path / "set"))
    with pytest.raises(type(info.value)) as alone:
        convert(ConvertOptions(str(src), to="bf16", output=tmp_path / "one"))
    assert str(info.value) == str(alone.value) and not (tmp_path / "set").exists()


def test_cli_prints_one_line_per_failed_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _unsupported_arch(tmp_path)
    assert main([str(src), "--to", "bf16,gguf:q8_0,gguf:q4_k_m", "-o", str(tmp_path / "set"), "-q"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("convert-bnb: error: --to gguf:q") for line in err)
    assert "GGUF-001" in err[0] and err[0].startswith("convert-bnb: error: --to gguf:q8_0: ")
    assert main([str(src), "--to", "bf16,gguf:q8_0", "-o", str(tmp_path / "set2"), "--json"]) == 2
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert d["ok"] is False and [o["ok"] for o in d["outputs"]] == [True, False]
    assert (d["error"], d["rule"]) == ("TargetsFailedError", "OUT-006") and d["message"] == (
        f"Failed to write '{tmp_path / 'set2'}': OUT-006 1 of 2 targets failed: gguf:q8_0 (GGUF-001); the 1 other "
        "output is complete")
    assert d["outputs"][1]["rule"] == "GGUF-001" and d["outputs"][0]["files"]
    assert len(out.err.splitlines()) == 1


@pytest.mark.parametrize(("to", "message"), [
    ("bf16,gguf:q8_0,BF16", "--to names the target bf16 twice"),
    ("gguf,gguf:f16", "(gguf and gguf:f16 write the same output)"),
    ("bf16,,nf4", "--to lists an empty target"),
    ("bf16,int3", "invalid choice: 'int3'"),
    # an unknown GGUF type is named as given, with its prefix (its error, GGUF-002, holds the type alone)
    ("bf16,gguf:q9_9", "invalid choice: 'gguf:q9_9' (choose from 'auto'"),
    ("bf16,GGUF:Q4km,nf4", "invalid choice: 'gguf:q4km'; did you mean 'gguf:q4_k_m'? (choose from"),
])
def test_target_lists_are_checked_where_parsed(to: str, message: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(LLAMA), "--to", to, "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("convert-bnb: error: USE-001 argument --to: ")
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()
    if "invalid" not in message:
        with pytest.raises(UsageError, match="USE-001"):
            target_for(to)


@pytest.mark.parametrize("to", ["auto,bf16", "bf16,gguf:q8_0,AUTO"])
def test_auto_beside_the_float_target_it_resolves_to_is_a_duplicate(to: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``auto`` of an input whose every tensor it keeps in bf16 writes what bf16 writes: refused as bf16,bf16 is (the
    same class and rule, USE-001, the same words), from the headers, before any weight is dequantized or anything
    written; in a dry run too."""
    made = _count_dequantized(monkeypatch)
    with pytest.raises(UsageError) as twice:
        target_for("bf16,bf16")
    out = tmp_path / "set"
    for dry_run in (True, False):
        with pytest.raises(UsageError) as info:
            convert(ConvertOptions(str(LLAMA), to=to, output=out, dry_run=dry_run))
        exc = info.value
        assert (type(exc), exc.rule) == (type(twice.value), twice.value.rule) == (UsageError, "USE-001")
        assert exc.reason.startswith(twice.value.reason + " (auto and bf16 write the same output: every tensor of "
                                                          "this input is bfloat16 in auto)")
        assert (exc.expected, exc.found) == ("each target once", to.lower())
    assert main([str(LLAMA), "--to", to, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        "convert-bnb: error: USE-001 --to names the target bf16 twice (auto and bf16 write the same output: every "
        f"tensor of this input is bfloat16 in auto) (expected 'each target once', found '{to.lower()}'). Hint: drop "
        "auto or bf16\n")
    assert made == [] and list(tmp_path.iterdir()) == []
    # `check` (and so a batch dry run, which checks each job's input with it) finds the same problem
    from convert.check import check_source

    problems = check_source(LLAMA, to).problems
    assert [(p.rule, str(p)) for p in problems] == [("USE-001", str(exc))]
    assert check_source(LLAMA, "auto,fp16").ok


def test_auto_beside_a_float_target_is_kept_where_their_outputs_differ(tmp_path: Path) -> None:
    """``auto`` resolves per input: a float16 model's auto is fp16 (refused beside fp16, kept beside bf16); with a
    float32 tensor kept as it is, auto differs from every cast and both outputs are written."""
    import numpy as np

    from tests.helpers.malformed import layer, model_dir

    cfg = {"model_type": "llama", "torch_dtype": "float16"}
    fp16 = model_dir(tmp_path / "fp16", {"model.safetensors": layer(shape=(64, 64), dtype="float16")}, config=cfg)
    with pytest.raises(UsageError, match=r"USE-001 --to names the target fp16 twice \(auto and fp16 write the same "
                                         r"output: every tensor of this input is float16 in auto\)"):
        convert(ConvertOptions(str(fp16), to="auto,fp16", output=tmp_path / "o1"))
    assert convert(ConvertOptions(str(fp16), to="auto,bf16", output=tmp_path / "o1", dry_run=True)).dry_run["ok"]
    norm = ("F32", [64], np.ones(64, np.float32).tobytes())
    mixed = model_dir(tmp_path / "mixed", {"model.safetensors": {**layer(shape=(64, 64), dtype="float16"),
                                                                 "model.norm.weight": norm}}, config=cfg)
    result = convert(ConvertOptions(str(mixed), to="auto,fp16", output=tmp_path / "o2"))
    auto, cast = (Path(o.output) for o in result.outputs)
    assert (auto.name, cast.name) == ("mixed-dequantized", "mixed-fp16")
    assert (auto / "model.safetensors").read_bytes() != (cast / "model.safetensors").read_bytes()


def test_auto_beside_bf16_of_a_hub_repo_is_refused_before_any_download(tmp_path: Path) -> None:
    """A Hub repo: auto is resolved from the headers read in place; the weights are never downloaded."""
    from tests.helpers.fakehub import FakeHub
    from tests.helpers.hubcache import commit_sha, offline_env, run_cli

    hub = FakeHub()
    hub.add("org/m", commit_sha("auto-twin"), {p.name: p for p in LLAMA.iterdir() if p.is_file()})
    hub.start()
    try:
        env = {k: v for k, v in offline_env(tmp_path, tmp_path / "cache").items() if k != "HF_HUB_OFFLINE"}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1")
        r = run_cli(["org/m", "--to", "auto,bf16", "-o", str(tmp_path / "set")], env)
    finally:
        hub.stop()
    assert r.returncode == 2 and r.stderr.startswith(
        "convert-bnb: error: USE-001 --to names the target bf16 twice (auto and bf16 write the same output"), r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "set").exists()
    assert "org/m/model.safetensors" not in hub.full_downloads


@pytest.mark.parametrize(("argv", "message"), [
    (["-o", "{tmp}/model.gguf"], "with several --to targets, -o names the folder their outputs go into"),
    (["-o", "{tmp}/file"], "found 'an existing file'"),
    (["--blocksize", "128"], "--blocksize needs nf4 or fp4 among the --to targets"),
    (["--pure"], "--pure needs a gguf:TYPE of llama-quantize's types"),
    (["--to", "bf16,gguf:q8_0,gguf:f16", "--mmproj", "{tmp}/mm.gguf"],
     "--mmproj works with one --to target (or one GGUF target among several)"),
    (["--to", "gguf:q8_0,gguf:f16", "--modelfile"], "--modelfile works with one --to target"),
    (["--low-disk"], "--low-disk works with one --to target"),
    (["--max-memory", "32MiB"], "--max-memory is too small for 2 targets (expected '>= 112.00 MiB (64.00 MiB, and "
                                "48.00 MiB for each target after the first"),
    (["--max-memory", "111MiB"], "--max-memory is too small for 2 targets"),
    (["--max-memory", "117440511"], "(expected '>= 112.00 MiB"),
    (["--max-memory", "117440511"], "found '117440511 B'"),
    (["--to", "bf16,fp16,nf4,gguf:q8_0,gguf:f16,gguf:bf16", "--max-memory", "300MiB"],
     "--max-memory is too small for 6 targets (expected '>= 304.00 MiB"),
    (["--push-to-hub", "org/name"], "--push-to-hub with several --to targets takes an organisation or user: each "
                                    "output goes to a repo of its own, ORG/<its name> (expected 'org', found "
                                    "'org/name')"),
])
def test_options_a_set_refuses(argv: list[str], message: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([str(LLAMA), "--to", "bf16,gguf:q8_0", "-o", str(tmp_path / "set"), *args]) == 2
    err = capsys.readouterr().err
    assert "USE-001" in err and message in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_model_folder_is_not_the_sets_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-o naming a model's folder (a single run's output), or a default folder that is one (the original model
    beside its -bnb-4bit copy): refused, nothing written into it (its outputs inside would make it a model that
    --overwrite refuses to replace)."""
    src = tmp_path / "tiny-bnb-4bit"
    shutil.copytree(LLAMA, src, ignore=shutil.ignore_patterns("reference"))
    model = tmp_path / "tiny"
    assert main([str(src), "--to", "bf16", "-o", str(model), "-q"]) == 0
    before = sorted(p.name for p in model.iterdir())
    for argv in ([str(src), "--to", "bf16,gguf:q8_0", "-o", str(model)], [str(src), "--to", "bf16,nf4"],
                 [str(src), "--to", "bf16,nf4", "--dry-run"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"convert-bnb: error: Failed to write '{model}': USE-001 the folder of several --to "
                              "targets' outputs is a model") and "found 'a model folder (config.json)'" in err, err
        assert sorted(p.name for p in model.iterdir()) == before


def test_default_folder_is_named_after_the_input(tmp_path: Path) -> None:
    src = tmp_path / "tiny-llama-bnb-4bit"
    shutil.copytree(LLAMA, src, ignore=shutil.ignore_patterns("reference"))
    result = convert(ConvertOptions(str(src), to="bf16,gguf:q8_0"))
    assert result.output == str(tmp_path / "tiny-llama")
    assert sorted(p.name for p in (tmp_path / "tiny-llama").iterdir()) == [
        "Tiny-Llama-2.0M-Q8_0.gguf", "tiny-llama-bnb-4bit-bf16"]
    plain = tmp_path / "llama_nf4_dq"
    shutil.copytree(LLAMA, plain, ignore=shutil.ignore_patterns("reference"))
    assert convert(ConvertOptions(str(plain), to="nf4,fp4", dry_run=True)).output == str(
        tmp_path / "llama_nf4_dq-converted")


def test_dry_run_and_json_show_every_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "set"
    assert main([str(LLAMA), "--to", "bf16,gguf:q4_k_m,nf4", "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"  output: {out / 'llama_nf4_dq-bf16'}" in text
    assert f"  output: {out / 'Llama_Nf4_Dq-2.0M-Q4_K_M.gguf'}" in text
    assert "-> GGUF llama, q4_k_m: 21 tensors" in text and "-> --to bf16: 21 tensors" in text
    assert "0 weights quantized to nf4 (blocksize 64, double quant on, storage uint8), 14 copied unchanged" in text
    assert not out.exists()
    assert main([str(LLAMA), "--to", "bf16,gguf:q4_k_m,nf4", "-o", str(out), "--dry-run", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["to"] == "bf16,gguf:q4_k_m,nf4" and d["output"] == str(out) and d["ok"] is True
    assert [o["to"] for o in d["outputs"]] == ["bf16", "gguf:q4_k_m", "nf4"]
    assert d["outputs"][1]["tensors"][0]["type"] and d["outputs"][0]["files"][0]["file"] == "model.safetensors"
    assert not out.exists()
    assert main([str(LLAMA), "--to", "bf16,gguf:q4_k_m,nf4", "-o", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True and d["output"] == str(out) and len(d["outputs"]) == 3
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(d["files"]) == on_disk
    for o in d["outputs"]:
        assert o["ok"] is True and Path(o["output"]).parent == out and o["files"]
    assert d["outputs"][1]["gguf"]["type"] == "q4_k_m" and d["outputs"][2]["quantized"] == 0
    assert d["bytes_out"] == sum(o["bytes_out"] for o in d["outputs"])


def test_a_modelfile_goes_with_the_one_gguf_of_a_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "set"
    assert main([str(LLAMA), "--to", "bf16,gguf:q8_0", "-o", str(out), "--modelfile", "--json"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["Llama_Nf4_Dq-2.0M-Q8_0.gguf", "Modelfile", "llama_nf4_dq-bf16"]
    files = json.loads(capsys.readouterr().out)["files"]
    assert sorted(files) == sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert main([str(LLAMA), "--to", "gguf:q8_0", "-o", str(tmp_path / "alone") + "/", "--modelfile", "-q"]) == 0
    assert (out / "Modelfile").read_bytes() == (tmp_path / "alone" / "Modelfile").read_bytes()


def test_existing_outputs_need_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "set"
    assert main([str(LLAMA), "--to", "bf16,gguf:q8_0", "-o", str(out), "-q"]) == 0
    before = _tree(out)
    assert main([str(LLAMA), "--to", "bf16,gguf:q8_0", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err == (f"convert-bnb: error: Failed to write '{out / 'llama_nf4_dq-bf16'}': OUT-001 output exists (--to "
                   "bf16; also refused: Llama_Nf4_Dq-2.0M-Q8_0.gguf (OUT-001)); nothing converted: each of the 2 "
                   "targets is checked before any converts. Hint: pass --overwrite to replace it, or choose -o\n")
    assert _tree(out) == before
    assert main([str(LLAMA), "--to", "bf16,gguf:q8_0,nf4", "-o", str(out), "-q", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["Llama_Nf4_Dq-2.0M-Q8_0.gguf", "llama_nf4_dq-bf16",
                                                     "llama_nf4_dq-nf4"]


def _count_dequantized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the weights dequantized from now on (either kernel: in a dtype, or exact float32 products)."""
    made: list[str] = []
    for kernel in ("dequant_into", "exact_into"):
        real = getattr(Dequant4Source, kernel)

        def counted(self: Dequant4Source, *a: Any, _real: Any = real, **k: Any) -> Any:
            made.append(self.name)
            return _real(self, *a, **k)

        monkeypatch.setattr(Dequant4Source, kernel, counted)
    return made


def _hidden_and_all(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, hidden ones too (locks, temporaries), by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("order", ["bf16,gguf:q8_0,nf4", "gguf:q8_0,nf4,bf16"])
def test_one_existing_output_refuses_the_run_before_anything_is_converted(
        order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder holding one of the outputs, without --overwrite: every output is checked before any target converts,
    so the run is refused with that output's own error (OUT-001, one line, exit 2), and nothing is written, whatever
    the order of the targets (the other writers never start)."""
    out = tmp_path / "set"
    convert(ConvertOptions(str(LLAMA), to="bf16", output=out / "llama_nf4_dq-bf16"))
    before = _hidden_and_all(out)
    made = _count_dequantized(monkeypatch)
    with pytest.raises(OutputExistsError) as info:
        convert(ConvertOptions(str(LLAMA), to=order, output=out, threads=2))
    exc = info.value
    assert (exc.rule, exc.path, exc.hint) == ("OUT-001", str(out / "llama_nf4_dq-bf16"),
                                              "pass --overwrite to replace it, or choose -o")
    assert str(exc) == (f"Failed to write '{out / 'llama_nf4_dq-bf16'}': OUT-001 output exists (--to bf16); nothing "
                        "converted: each of the 3 targets is checked before any converts. Hint: pass "
                        "--overwrite to replace it, or choose -o")
    assert made == [] and _hidden_and_all(out) == before
    assert main([str(LLAMA), "--to", order, "-o", str(out), "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.err == f"convert-bnb: error: {exc}\n"
    assert {k: json.loads(cap.out)[k] for k in ("ok", "error", "rule")} == {
        "ok": False, "error": "OutputExistsError", "rule": "OUT-001"}
    assert made == [] and _hidden_and_all(out) == before
    assert main([str(LLAMA), "--to", order, "-o", str(out), "-q", "--overwrite"]) == 0  # --overwrite: all written
    assert sorted(p.name for p in out.iterdir()) == ["Llama_Nf4_Dq-2.0M-Q8_0.gguf", "llama_nf4_dq-bf16",
                                                     "llama_nf4_dq-nf4"]


def test_another_runs_lock_or_an_existing_modelfile_refuses_the_run(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a single run checks before writing refuses every target of a set: another run's claim on one output
    (OUT-004), or a file of one target's (its Modelfile, found while it is planned) that exists (OUT-001)."""
    import fcntl

    made = _count_dequantized(monkeypatch)
    out = tmp_path / "set"
    out.mkdir()
    lock = out / ".llama_nf4_dq-nf4.convert-bnb-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run writing the nf4 output
        with pytest.raises(OutputBusyError) as info:
            convert(ConvertOptions(str(LLAMA), to="bf16,gguf:q8_0,nf4", output=out, threads=2))
    finally:
        os.close(fd)
    assert (info.value.rule, info.value.path) == ("OUT-004", str(out / "llama_nf4_dq-nf4"))
    assert "(--to nf4); nothing converted: each of the 3 targets is checked" in str(info.value)
    assert made == [] and [p.name for p in out.iterdir()] == [lock.name]
    lock.unlink()
    (out / "Modelfile").write_text("FROM x\n")
    with pytest.raises(OutputExistsError) as info:
        convert(ConvertOptions(str(LLAMA), to="bf16,gguf:q8_0", output=out, modelfile="Modelfile"))
    assert (info.value.rule, info.value.path) == ("OUT-001", str(out / "Modelfile"))
    assert "(--to gguf:q8_0); nothing converted" in str(info.value)
    assert made == [] and _hidden_and_all(out) == {"Modelfile": b"FROM x\n"}


def _bench_model(tmp_path: Path) -> Path:
    """A 7B-shaped model of one block of layers (4096x4096 and 4096x11008 NF4 with double quantization)."""
    model = tmp_path / "m"
    r = subprocess.run([sys.executable, "scripts/bench.py", "make", "--packed-gb", "0.05", "--dir", str(model)],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    assert '"blocks": 1' in r.stdout
    return model


def test_memory_cap_holds_for_the_whole_run(tmp_path: Path) -> None:
    """Three writers and the shared blocks under one 320 MiB cap (about 100 MiB a target is the floor:
    :func:`convert.stream.pipeline.share_memory`), on a model of 200 M values (one 4096 x 11008 weight in float32 is
    180 MB; the same run under a 1 GiB cap peaks near 450 MiB): the peak resident set stays under the cap."""
    model = _bench_model(tmp_path)
    cap = 320 << 20
    r = run_measured([sys.executable, "-m", "convert", str(model), "--to", "bf16,gguf:q8_0,fp4", "-o",
                      str(tmp_path / "set"), "--max-memory", "320MiB", "--threads", "2", "--json"], cwd=ROOT)
    assert r["rc"] == 0, r["err"]
    d = json.loads(r["out"])
    assert d["ok"] and d["elements"] > 200_000_000 and d["shared"]["peak_bytes"] <= d["shared"]["budget_bytes"]
    assert r["rss"] < cap, f"peak RSS {r['rss'] / 2**20:.0f} MiB over the 320 MiB cap"


def test_a_batch_job_whose_target_failed_is_not_done(tmp_path: Path) -> None:
    """A job of several targets one of which fails (GGUF-001: an architecture GGUF does not know) is failed, and
    stays failed on the next run (never skipped on the strength of the outputs that were committed); once its
    input is fixed the next run makes the whole set, replacing the batch's own earlier outputs (not BATCH-006),
    and the run after it skips the job."""
    from tests.helpers.hubcache import offline_env, run_cli

    src = _unsupported_arch(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{src} --to bf16,gguf:q8_0\n")
    out = tmp_path / "out"
    args, env = ["batch", str(jobs), "--out-dir", str(out), "--json"], offline_env(tmp_path)
    state_file = out / ".convert-bnb" / "foo_nf4_dq-converted.json"
    for _ in range(2):
        r = run_cli(args, env)
        (job,) = json.loads(r.stdout)
        assert r.returncode == 3 and (job["status"], job["rule"]) == ("failed", "OUT-006"), r.stdout
        state = json.loads(state_file.read_text())
        assert state["status"] == "failed" and sorted(state["partial_files"]) == sorted(
            f"foo_nf4_dq-bf16/{n}" for n in _tree(out / "foo_nf4_dq-converted" / "foo_nf4_dq-bf16"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    r = run_cli(args, env)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["status"] == "converted", r.stdout + r.stderr
    direct = convert(ConvertOptions(str(src), to="bf16,gguf:q8_0", output=tmp_path / "direct"))
    assert _tree(out / "foo_nf4_dq-converted") == _tree(Path(direct.output))
    assert json.loads(run_cli(args, env).stdout)[0]["status"] == "skipped"


def test_batch_jobs_with_several_targets(tmp_path: Path) -> None:
    """A JOBS line with several targets is one job: one read, its outputs in the folder NAME (the single run's
    names inside), recorded as one; a re-run skips it; a removed output is made again; per-job options that need
    one GGUF target are refused before any work. (Its --push-to-hub: tests/batch/test_batch.py.)"""
    from tests.helpers.hubcache import offline_env, run_cli

    env = offline_env(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"{LLAMA} --to bf16,gguf:q8_0,gguf:q4_k_m --max-shard-size 1MB\n"
                    f"{LLAMA} --to nf4 --name alone-nf4\n")
    out = tmp_path / "out"
    args = ["batch", str(jobs), "--out-dir", str(out), "--max-memory", "512MiB", "--json"]
    r = run_cli(args, env)
    assert r.returncode == 0, r.stderr
    several, alone = json.loads(r.stdout)
    assert (several["name"], several["status"], alone["status"]) == ("llama_nf4_dq-converted", "converted",
                                                                      "converted")
    folder = out / "llama_nf4_dq-converted"
    names = ["Llama_Nf4_Dq-2.0M-Q4_K_M.gguf", "Llama_Nf4_Dq-2.0M-Q8_0.gguf", "llama_nf4_dq-bf16"]
    assert sorted(p.name for p in folder.iterdir()) == names
    direct = convert(ConvertOptions(str(LLAMA), to="bf16,gguf:q8_0,gguf:q4_k_m", output=tmp_path / "direct",
                                    max_shard_size=10**6))
    assert _tree(folder) == _tree(Path(direct.output))
    state = json.loads((out / ".convert-bnb" / "llama_nf4_dq-converted.json").read_text())
    assert state["status"] == "done" and state["key"]["to"] == "bf16,gguf:q8_0,gguf:q4_k_m"
    assert sorted(state["files"]) == sorted(_tree(folder)) and "llama_nf4_dq-bf16/model.safetensors.index.json" in (
        state["files"])
    r = run_cli(args, env)
    assert [x["status"] for x in json.loads(r.stdout)] == ["skipped", "skipped"], r.stderr
    shutil.rmtree(folder / "llama_nf4_dq-bf16")
    r = run_cli(args, env)
    assert [x["status"] for x in json.loads(r.stdout)] == ["converted", "skipped"], r.stderr
    assert _tree(folder) == _tree(Path(direct.output))
    for line, part in ((f"{LLAMA} --to bf16,gguf:q8_0 --mmproj", "--mmproj needs a job of one GGUF target"),
                       (f"{LLAMA} --to bf16,nf4 --pure", "--pure needs a gguf:TYPE of llama-quantize's types"),
                       (f"{LLAMA} --to bf16,gguf:q8_0 --name x.gguf",
                        "the name of a job of several targets names the folder their outputs go into")):
        jobs.write_text(line + "\n")
        r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "o2")], env)
        assert r.returncode == 2 and "BATCH-003" in r.stderr and part in r.stderr, r.stderr
    assert not (tmp_path / "o2").exists()
    jobs.write_text(f"{LLAMA} --to bf16,gguf:q8_0,nf4\n{LLAMA} --to nf4 --name n\n")  # (160 MiB for 3 targets)
    for extra in ([], ["--dry-run"]):
        r = run_cli(["batch", str(jobs), "--out-dir", str(tmp_path / "o2"), "--jobs", "2", "--max-memory", "300MiB",
                     *extra], env)
        assert r.returncode == 2 and r.stderr == (
            "convert-bnb: error: USE-001 --max-memory split over --jobs leaves job llama_nf4_dq-converted "
            f"({jobs.name}:1) less than its 3 targets keep to (expected '>= 160.00 MiB per job', found '150.00 MiB "
            "per job'). Hint: raise --max-memory, lower --jobs, or split the job's targets\n"), r.stderr
    assert not (tmp_path / "o2").exists()


_SLOW = """
import sys, time
from convert.stream.sources import Dequant4Source
_kernel = Dequant4Source.dequant_into
def slow(self, *args, **kwargs):
    time.sleep(0.05)
    return _kernel(self, *args, **kwargs)
Dequant4Source.dequant_into = slow
from convert.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_every_target_and_leaves_nothing(sig: int, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped while its targets write (each thread stops at its next chunk or shared block): exit 130, one line,
    no temporary, no folder, the input unchanged."""
    from tests.helpers.malformed import layer, model_dir

    src = model_dir(tmp_path / "in" / "model", {"model.safetensors": layer(shape=(2048, 4096), bs=64,
                                                                           dtype="bfloat16")})
    before = _tree(src)
    out = tmp_path / "set"
    argv = [str(src), "--to", "bf16,fp32,fp16", "-o", str(out), "--max-memory", "160MiB", "--threads", "1"]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW, *argv], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
    while not any(p.is_dir() and ".convert-bnb-tmp-" in p.name and any(p.glob("*.safetensors"))
                  and next(p.glob("*.safetensors")).stat().st_size > 1 << 20
                  for p in (out.iterdir() if out.is_dir() else [])):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "convert-bnb: interrupted; no output was left behind\n", err
    assert not out.exists() and _tree(src) == before


#: :data:`_SLOW`, and the bf16 target's clean-up, once stopped, taking a while (a large temporary): the run must wait
#: for it (on CPython 3.11 a ``Thread.join`` cut by the signal counts the thread as ended).
_SLOW_CLEANUP = _SLOW.replace("from convert.cli import main", """from convert import output
_remove = output.remove_path
def slow_remove(p):
    if p.name.startswith(".model-bf16.convert-bnb-tmp-"):
        time.sleep(1)
    _remove(p)
output.remove_path = slow_remove
from convert.cli import main""")


def test_a_signal_after_one_output_is_committed_leaves_that_one_alone(tmp_path: Path) -> None:
    """The nf4 output (the input's packed weights copied) is committed while the float targets still write: a
    signal then stops them, removes their temporaries and locks (none left behind, the threads' clean-up waited
    for), keeps the nf4 output, and the line says which outputs are complete and that the others were not written."""
    from tests.helpers.malformed import layer, model_dir

    src = model_dir(tmp_path / "in" / "model", {"model.safetensors": layer(shape=(4096, 4096), bs=64,
                                                                           dtype="bfloat16")})
    out = tmp_path / "set"
    argv = [str(src), "--to", "bf16,nf4,fp16", "--no-double-quant", "-o", str(out), "--max-memory", "160MiB",
            "--threads", "1"]  # (the layer is not nested: nf4 copies it as it is)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CLEANUP, *argv], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # a guard against a broken test, not a speed check
    while not ((out / "model-nf4").is_dir() and any(".convert-bnb-tmp-" in p.name for p in out.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, f"convert-bnb: interrupted after 1 of 3 outputs were complete: "
                                           f"{out / 'model-nf4'}; the other 2 were not written (convert them "
                                           "alone, or all again with --overwrite)\n")
    assert sorted(p.name for p in out.iterdir()) == ["model-nf4"]


@pytest.mark.parametrize(("extra", "to", "rule", "part"), [
    (["--metadata", "{missing}"], "bf16,gguf:q8_0,nf4", "USE-001", "--metadata file cannot be read"),
    (["--tensor-type", "attn_v=iq2_xxs"], "bf16,gguf:q4_k_m", "IMX-004", "needs an importance matrix"),
], ids=["metadata-missing", "imatrix-needed"])
def test_an_option_one_target_cannot_take_refuses_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          extra: list[str], to: str, rule: str, part: str) -> None:
    """A usage error met by one target while it is planned (a --metadata file missing, a --tensor-type that needs an
    importance matrix) refuses the whole run before any target converts: one line, exit 2, no folder; an input
    rule of one target (GGUF-001 above) fails that target only."""
    out = tmp_path / "set"
    argv = [str(LLAMA), "--to", to, "-o", str(out), "-q", *[a.format(missing=tmp_path / "no.json") for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{rule} " in err and part in err
    gguf = to.split(",")[1]
    assert f"(--to {gguf}); nothing converted: each of the {len(to.split(','))} targets is checked before any " \
           "converts" in err
    assert not out.exists()


def test_dry_run_into_an_existing_folder_says_which_outputs_exist(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The set's folder existing is no reason for --overwrite (the run writes into it): the dry run says so of an
    output that exists only, and ends with the folder, not an output line."""
    out = tmp_path / "set"
    out.mkdir()
    assert main([str(LLAMA), "--to", "bf16,nf4", "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "--overwrite needed" not in text and text.endswith(f"\nfolder: {out}\n")
    assert main([str(LLAMA), "--to", "bf16,nf4", "-o", str(out), "-q"]) == 0  # (as the dry run said: no --overwrite)
    assert main([str(LLAMA), "--to", "bf16,nf4", "-o", str(out), "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output_exists"] is True
    assert main([str(LLAMA), "--to", "bf16,nf4", "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"  output: {out / 'llama_nf4_dq-bf16'} (exists: --overwrite needed)" in text
