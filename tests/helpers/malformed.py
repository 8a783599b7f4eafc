"""Hand-made malformed inputs, one or more per rule, built byte by byte with ``struct`` and ``json``.

Used by tests/test_errors.py (each case asserts the exact error class and the key parts of its
message, through the library and through the CLI) and by scripts/gen_errors_doc.py (each rule's
example message in docs/errors.md is the message of its first case here, so the doc cannot drift).

Nothing here uses ``formats`` to build files: the bytes are written independently of the reader
under test. The 4-bit tables come from tests/fixtures/constants.json (written by bitsandbytes).
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

from formats import errors as E
from tests.helpers.fixtures import FIXTURES
from tests.helpers.imatrix import write_dat_imatrix
from tests.helpers.sources import array_tensor, array_tensors

_CONST = json.loads((FIXTURES / "constants.json").read_text())
#: A tensor to write: (safetensors dtype code, shape, raw little-endian bytes).
Tensor = tuple[str, list[int], bytes]
W = "model.layers.0.mlp.down_proj.weight"


def table(name: str) -> bytes:
    """Raw fp32 bytes of a bitsandbytes table: ``nf4_code``, ``fp4_code``, ``dynamic_map_signed``."""
    return bytes.fromhex(_CONST[name]["hex_le_f32"])


def f32(values: Any) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def header_bytes(header: dict[str, Any] | str | bytes, pad: bool = True) -> bytes:
    """8-byte little-endian length + header (a dict is dumped as JSON; str/bytes are taken as is)."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode("utf-8") if isinstance(header, str) else header
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def st_bytes(tensors: dict[str, Tensor], metadata: dict[str, Any] | None = None) -> bytes:
    """A valid safetensors file holding ``tensors`` in order (contiguous data offsets)."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, (code, shape, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header_bytes(header) + data


def quant_state(state: dict[str, Any] | str | bytes) -> Tensor:
    raw = json.dumps(state).encode() if isinstance(state, dict) else (
        state.encode() if isinstance(state, str) else state)
    return ("U8", [len(raw)], raw)


def layer(
    prefix: str = W,
    qt: str = "nf4",
    bs: int = 64,
    shape: tuple[int, ...] = (4, 32),
    dtype: str = "bfloat16",
    nested: bool = False,
    seed: int = 0,
) -> dict[str, Tensor]:
    """A valid 4-bit layer as bnb saves it (``Linear4bit._save_to_state_dict``), random codes and absmax."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    nb = -(-n // bs)
    t: dict[str, Tensor] = {prefix: ("U8", [-(-n // 2), 1], rng.integers(0, 256, -(-n // 2), dtype=np.uint8).tobytes())}
    state: dict[str, Any] = {"quant_type": qt, "blocksize": bs, "dtype": dtype, "shape": list(shape)}
    if nested:
        t[f"{prefix}.absmax"] = ("U8", [nb], rng.integers(0, 256, nb, dtype=np.uint8).tobytes())
        t[f"{prefix}.nested_absmax"] = ("F32", [-(-nb // 256)], f32(rng.random(-(-nb // 256)) * 0.05 + 0.01))
        t[f"{prefix}.nested_quant_map"] = ("F32", [256], table("dynamic_map_signed"))
        state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.0123)
    else:
        t[f"{prefix}.absmax"] = ("F32", [nb], f32(rng.random(nb) * 0.1 + 0.01))
    t[f"{prefix}.quant_map"] = ("F32", [16], table(f"{qt}_code"))
    t[f"{prefix}.quant_state.bitsandbytes__{qt}"] = quant_state(state)
    return t


def state_of(t: dict[str, Tensor], prefix: str = W) -> tuple[str, dict[str, Any]]:
    key = next(k for k in t if k.startswith(f"{prefix}.quant_state."))
    return key, json.loads(t[key][2])


def with_state(t: dict[str, Tensor], prefix: str = W, **changes: Any) -> dict[str, Tensor]:
    """The layer with QuantState JSON fields changed (a value of ``DELETE`` removes the field)."""
    key, state = state_of(t, prefix)
    for k, v in changes.items():
        if v is DELETE:
            state.pop(k, None)
        else:
            state[k] = v
    return {**t, key: quant_state(state)}


DELETE = object()


def without(t: dict[str, Tensor], *names: str) -> dict[str, Tensor]:
    return {k: v for k, v in t.items() if k not in names}


def model_dir(
    root: Path,
    shards: dict[str, dict[str, Tensor]],
    index: dict[str, Any] | str | None = None,
    config: dict[str, Any] | str | None = None,
) -> Path:
    """A model directory: the shards, an index (``"auto"``-built when ``index`` is None and there
    are several shards), and config.json."""
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        (root / name).write_bytes(st_bytes(tensors, {"format": "pt"}))
    if index is None and len(shards) > 1:
        index = {"metadata": {}, "weight_map": {k: s for s, ts in shards.items() for k in ts}}
    if index is not None:
        text = index if isinstance(index, str) else json.dumps(index)
        (root / "model.safetensors.index.json").write_text(text)
    cfg = {"model_type": "llama", "torch_dtype": "bfloat16"} if config is None else config
    (root / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return root


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def one_file(tensors: dict[str, Tensor]) -> Callable[[Path], Path]:
    return lambda d: write(d / "model.safetensors", st_bytes(tensors, {"format": "pt"}))


def raw_file(data: bytes, name: str = "model.safetensors") -> Callable[[Path], Path]:
    return lambda d: write(d / name, data)


def convert(src: Path, out: Path, *, to: str = "auto", overwrite: bool = False) -> None:
    """The conversion as the CLI runs it, through the library, at the least memory its targets take."""
    from convert.job import convert as run
    from convert.options import ConvertOptions
    from convert.stream.pipeline import min_memory

    run(ConvertOptions(str(src), to=to, output=out, threads=1, max_memory=min_memory(len(to.split(","))),
                       overwrite=overwrite))


@dataclass
class Case:
    """One malformed input.

    Attributes:
        id: a short name.
        error: the exact class expected.
        parts: substrings the message must contain (file names, tensor, rule, expected/found, hint).
        build: makes the input under a directory, returns SRC.
        run: the library call that must raise (default: :func:`convert` of SRC to OUT).
        argv: the CLI arguments (``{src}`` and ``{out}`` are filled in), or None when the CLI cannot
            reach this case.
        same_message: the CLI line is exactly ``convert-bnb: error: <library message>``.
    """

    id: str
    error: type[E.ConvertBnbError]
    parts: list[str]
    build: Callable[[Path], Path]
    run: Callable[[Path, Path], None] = convert
    argv: list[str] | None = field(default_factory=lambda: ["{src}", "-o", "{out}", "-q"])
    same_message: bool = True

    @property
    def rule(self) -> str:
        assert self.error.default_rule is not None
        return self.error.default_rule


def _nested_absmax_inf(d: Path) -> Path:
    t = layer(nested=True)
    t[f"{W}.nested_absmax"] = ("F32", [1], f32([np.inf]))
    return one_file(t)(d)


def _nan_absmax(d: Path) -> Path:
    t = layer()
    vals = np.frombuffer(t[f"{W}.absmax"][2], dtype="<f4").copy()
    vals[1] = np.nan
    t[f"{W}.absmax"] = ("F32", [2], f32(vals))
    return one_file(t)(d)


def _truncated(d: Path) -> Path:
    data = st_bytes(layer(), {"format": "pt"})
    return write(d / "model.safetensors", data[:-10])


def _two_shards(d: Path, **kw: Any) -> Path:
    a = layer(prefix="model.layers.0.mlp.down_proj.weight", seed=1)
    b = {"model.norm.weight": ("BF16", [4], b"\x80\x3f" * 4), "lm_head.weight": ("BF16", [2, 2], b"\0\x3f" * 4)}
    return model_dir(d / "model", {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b}, **kw)


def _full_index(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    a = layer(prefix="model.layers.0.mlp.down_proj.weight", seed=1)
    wmap = {k: "model-00001-of-00002.safetensors" for k in a}
    wmap["model.norm.weight"] = "model-00002-of-00002.safetensors"
    wmap["lm_head.weight"] = "model-00002-of-00002.safetensors"
    for k in drop:
        wmap.pop(k)
    wmap.update(extra or {})
    return {"metadata": {"total_size": 0}, "weight_map": wmap}


def _missing_shard(d: Path) -> Path:
    root = _two_shards(d)
    (root / "model-00002-of-00002.safetensors").unlink()
    return root


def _stray_shard(d: Path) -> Path:
    root = _two_shards(d)
    write(root / "model-00003-of-00003.safetensors", st_bytes({"x": ("F32", [1], f32([1]))}))
    return root


def _stray_single(d: Path) -> Path:
    root = model_dir(d / "model", {"model.safetensors": layer()})
    write(root / "model-00002-of-00002.safetensors", st_bytes({"x": ("F32", [1], f32([1]))}))
    return root


def _duplicate_across(d: Path) -> Path:
    norm = {"model.norm.weight": ("BF16", [4], b"\x80\x3f" * 4)}
    head = {"lm_head.weight": ("BF16", [2, 2], b"\0\x3f" * 4)}
    return model_dir(d / "model", {"model-00001-of-00002.safetensors": {**layer(), **norm},
                                   "model-00002-of-00002.safetensors": {**norm, **head}},
                     index={"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in layer()},
                                           "model.norm.weight": "model-00001-of-00002.safetensors",
                                           "lm_head.weight": "model-00002-of-00002.safetensors"}})


def _unindexed_tensor(d: Path) -> Path:
    return _two_shards(d, index=_full_index(drop=("model.norm.weight",)))


def _index_tensor_missing(d: Path) -> Path:
    return _two_shards(d, index=_full_index({"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}))


def _int8(fmt: int) -> Callable[[Path], Path]:
    p = "model.layers.0.mlp.up_proj"
    return one_file({
        f"{p}.weight": ("I8", [4, 4], bytes(range(16))),
        f"{p}.SCB": ("F32", [4], f32([1, 2, 3, 4])),
        f"{p}.weight_format": ("U8", [], bytes([fmt])),
    })


def _disk_full(src: Path, out: Path) -> None:
    with mock.patch("convert.output.shutil.disk_usage", return_value=SimpleNamespace(free=4096)):
        convert(src, out)


def _verify_mismatch(src: Path, out: Path) -> None:
    from convert.stream.plan import make_plan
    from convert.stream.safetensors_job import verify_plan
    from formats.checkpoint import open_checkpoint

    written = write(out, st_bytes({W: ("F32", [4, 32], f32(np.zeros(128)))}))
    try:
        with open_checkpoint(src) as ck:
            verify_plan(make_plan(ck, "auto"), written)
    finally:
        written.unlink()


def _bad_to(src: Path, out: Path) -> None:
    from convert.stream.plan import make_plan
    from formats.checkpoint import open_checkpoint

    with open_checkpoint(src) as ck:
        make_plan(ck, "int3")


def _existing_output(src: Path, out: Path) -> None:
    write(out, b"already here")
    try:
        convert(src, out)
    finally:
        out.unlink()


def _overwrite_a_folder(src: Path, out: Path) -> None:
    """--overwrite aimed at a folder of other things (a model directory input, so the output is a directory)."""
    folder = out.with_name("things")
    (folder / "photos").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    import shutil

    model = src.parent / "model_dir"
    model.mkdir()
    shutil.copy(src, model / "model.safetensors")
    try:
        convert(model, folder, overwrite=True)
    finally:
        assert (folder / "notes.txt").read_text() == "mine"
        shutil.rmtree(folder)
        shutil.rmtree(model)


def _overwrite_other_kind(src: Path, out: Path) -> None:
    existing = write(out.with_name("existing"), b"a file, not a model directory")
    try:
        convert(src, existing, overwrite=True)
    finally:
        assert existing.read_bytes() == b"a file, not a model directory"  # refused before touching it
        existing.unlink()


def _overwrite_a_fifo(src: Path, out: Path) -> None:
    """--overwrite aimed at a FIFO (as at /dev/null): refused, the FIFO left as it was (a rename would have
    put a regular file in its place)."""
    import stat

    fifo = out.with_name("fifo")
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    try:
        convert(src, fifo, overwrite=True)
    finally:
        assert stat.S_ISFIFO(fifo.lstat().st_mode)
        fifo.unlink()


def _output_under_a_file(src: Path, out: Path) -> None:
    existing = write(out.with_name("existing.txt"), b"a file")
    try:
        convert(src, existing / "sub" / "out.safetensors", overwrite=True)
    finally:
        assert existing.read_bytes() == b"a file"
        existing.unlink()


def _inside_input(src: Path, out: Path) -> None:
    convert(src, src / "converted")


def _missing_src(d: Path) -> Path:
    return d / "no-such-model"


def _fifo_shard(d: Path) -> Path:
    root = _two_shards(d)
    shard = root / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    return root


def _looping_shard(d: Path) -> Path:
    root = _two_shards(d)
    shard = root / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(shard.name)  # a link to itself
    return root


def _fifo_src(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / "model.safetensors")
    return d / "model.safetensors"


def _fifo_single(d: Path) -> Path:
    root = model_dir(d / "model", {"model.safetensors": V})
    (root / "model.safetensors").unlink()
    os.mkfifo(root / "model.safetensors")
    return root


def _full_mid_run(src: Path, out: Path) -> None:
    def full(self: Any, data: Any, in_place: bool = False) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch("formats.safetensors.SafetensorsWriter.write", full):
        convert(src, out, to="bf16")


def _report_in_missing_dir(src: Path, out: Path) -> None:
    from convert.job import convert as run
    from convert.options import ConvertOptions

    run(ConvertOptions(str(BASE_MODEL), to="bf16", output=out, merge_lora=(src,),
                       report=out.parent / "no-such-dir" / "merge.json"))


# ---- torch pickles, built with tests/helpers/torchsave.py (no torch)
ARR = np.arange(24, dtype=np.float32).reshape(4, 6)


def _pt(obj: Any, name: str = "pytorch_model.bin", **kw: Any) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        from tests.helpers.torchsave import save_zip

        d.mkdir(parents=True, exist_ok=True)
        return save_zip(d / name, obj, **kw)

    return build


def _pt_raw(pickle_bytes: bytes) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        from tests.helpers.torchsave import save_zip_raw_pickle

        d.mkdir(parents=True, exist_ok=True)
        return save_zip_raw_pickle(d / "pytorch_model.bin", pickle_bytes)

    return build


def _torchsave() -> Any:
    from tests.helpers import torchsave

    return torchsave


def _tensor(*args: Any, **kw: Any) -> Any:
    from tests.helpers.torchsave import Tensor

    return Tensor(*args, **kw)


def _patched(attr: str, value: Any) -> Callable[[Path, Path], None]:
    """Convert with ``formats.<attr>`` (``"module.NAME"``) set to ``value``."""

    def run(src: Path, out: Path) -> None:
        with mock.patch(f"formats.{attr}", value):
            convert(src, out)

    return run


def _legacy_state_bad_absmax(d: Path) -> Path:
    from tests.helpers.torchsave import dtype_global, save_zip, size

    d.mkdir(parents=True, exist_ok=True)
    state = [None, size(4, 32), dtype_global("bfloat16"), 64, None, "nf4"]
    return save_zip(d / "pytorch_model.bin", {W: _tensor(np.frombuffer(V[W][2], dtype=np.uint8)),
                                              f"{W}.quant_state": state})


# ---- LoRA adapters: the repo's real PEFT adapter, damaged; merged into the tiny llama fixture
BASE_MODEL = FIXTURES / "models" / "llama_nf4_dq"
ADAPTER = FIXTURES / "lora" / "adapter"
LP = "base_model.model."
LQ = f"{LP}model.layers.0.self_attn.q_proj"


def adapter_tensors() -> dict[str, Tensor]:
    raw = (ADAPTER / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def adapter(config: dict[str, Any] | None = None, tensors: dict[str, Tensor] | None = None,
            write_config: bool = True, write_weights: bool = True) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        a = d / "adapter"
        a.mkdir(parents=True, exist_ok=True)
        if write_config:
            cfg = json.loads((ADAPTER / "adapter_config.json").read_text())
            cfg.update(config or {})
            (a / "adapter_config.json").write_text(json.dumps(cfg))
        if write_weights:
            (a / "adapter_model.safetensors").write_bytes(
                st_bytes(adapter_tensors() if tensors is None else tensors, {"format": "pt"}))
        return a

    return build


def merge(src: Path, out: Path) -> None:
    """``convert-bnb BASE --to bf16 --merge-lora SRC``; --debug lets the error through."""
    from convert.cli import main

    main([str(BASE_MODEL), "--to", "bf16", "--merge-lora", str(src), "-o", str(out), "-q", "--debug"])


MERGE_ARGV = [str(BASE_MODEL), "--to", "bf16", "--merge-lora", "{src}", "-o", "{out}", "-q"]


def gguf_adapter(src: Path, out: Path) -> None:
    """``convert-bnb ADAPTER --to gguf:f16 --base BASE`` (its GGUF LoRA adapter), through the library."""
    from convert.job import convert as run
    from convert.options import ConvertOptions

    run(ConvertOptions(str(src), to="gguf:f16", output=out, base=str(BASE_MODEL), threads=1, max_memory=64 << 20))


GGUF_ADAPTER_ARGV = ["{src}", "--to", "gguf:f16", "--base", str(BASE_MODEL), "-o", "{out}", "-q"]


def _dora_adapter() -> dict[str, Tensor]:
    """The fixture adapter with DoRA magnitude vectors (one per q/v module, ``[out]``)."""
    t = adapter_tensors()
    for key in [k for k in t if k.endswith(".lora_B.weight")]:
        rows = t[key][1][0]
        t[key.replace(".lora_B.weight", ".lora_magnitude_vector")] = ("F32", [rows], f32(np.ones(rows)))
    return t


def _lora(name: str, shape: list[int]) -> Tensor:
    return ("F32", shape, f32(np.full(shape, 0.01)))


def _rank4() -> dict[str, Tensor]:
    t = adapter_tensors()
    a = np.frombuffer(t[f"{LQ}.lora_A.weight"][2], dtype="<f4").reshape(8, 256)[:4]
    b = np.frombuffer(t[f"{LQ}.lora_B.weight"][2], dtype="<f4").reshape(256, 8)[:, :4]
    t[f"{LQ}.lora_A.weight"] = ("F32", [4, 256], f32(a))
    t[f"{LQ}.lora_B.weight"] = ("F32", [256, 4], f32(np.ascontiguousarray(b)))
    return t


def _lm_head_copy_differs() -> dict[str, Tensor]:
    head = np.zeros((1000, 256), dtype=np.float32)
    return {**adapter_tensors(), f"{LP}lm_head.weight": ("F32", [1000, 256], f32(head)),
            f"{LP}lm_head.modules_to_save.weight": ("F32", [1000, 256], f32(head + 1))}


def _adapter_value(key: str, index: int, value: float) -> dict[str, Tensor]:
    """The fixture adapter's tensors with one F32 value of ``key`` replaced."""
    t = adapter_tensors()
    code, shape, raw = t[key]
    arr = np.frombuffer(raw, dtype="<f4").copy()
    arr[index] = value
    return {**t, key: (code, shape, arr.tobytes())}


def _pt_damaged_member_header(d: Path) -> Path:
    """A torch zip whose 'byteorder' local header names another file (a flipped byte)."""
    import zipfile

    path = _pt({"w": _tensor(ARR)})(d)
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/byteorder"))
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len(info.filename) - 1] ^= 1
    path.write_bytes(bytes(raw))
    return path


def batch(text: str, name: str = "jobs.txt") -> Callable[[Path], Path]:
    return raw_file(text.encode(), name)


def run_batch(src: Path, out: Path) -> None:
    from convert.cli import main

    main(["batch", str(src), "--out-dir", str(out), "--dry-run", "--debug"])


BATCH_ARGV = ["batch", "{src}", "--out-dir", "{out}", "--dry-run"]


def _batch_job(src: Path, out_dir: Path, to: str, overwrite: bool = False) -> None:
    """One batch job named ``job`` as a batch worker runs it (in this process)."""
    import os

    from convert.batch.jobs import Job
    from convert.batch.worker import run_job

    spec = {"job": Job(str(src), None, to, 5 * 10**9, "job").to_dict(), "out_dir": str(out_dir),
            "max_memory": 64 << 20, "threads": 1, "verify": True, "overwrite": overwrite, "parent_pid": os.getpid()}
    run_job(spec)


def _batch_settings_changed(src: Path, out: Path) -> None:
    import shutil

    d = out.parent.parent / "batch"
    try:
        _batch_job(src, d, "bf16")
        _batch_job(src, d, "fp16")  # the same job name, another --to, no --overwrite
    finally:
        shutil.rmtree(d)


def _batch_foreign_files(src: Path, out: Path) -> None:
    import shutil

    d = out.parent.parent / "batch"
    try:
        _batch_job(src, d, "bf16")
        (d / "job" / "notes.txt").write_text("the user's own file")
        _batch_job(src, d, "fp16", overwrite=True)  # would replace the folder, and notes.txt with it
    finally:
        shutil.rmtree(d)


def _busy_output(src: Path, out: Path) -> None:
    from convert.output import OutputClaim

    with OutputClaim(out, is_dir=False, nbytes=0, inputs=[src]):  # another run holds the output
        convert(src, out)


def _hub_offline(src: Path, out: Path) -> None:
    from huggingface_hub import constants

    from convert.hub.download import resolve_repo

    with mock.patch.object(constants, "HF_HUB_OFFLINE", True):
        resolve_repo("org/not-in-the-cache", cache_dir=src)


def _cut_by_4096(src: Path, out: Path) -> None:
    """convert() of SRC as if SRC had been 4096 bytes longer when its header was read (cut while read),
    without changing it: every map is made with the size it had plus 4096."""
    from formats import mapping

    init = mapping.InputMap.__init__

    def grown(self: mapping.InputMap, path: Any, size: int) -> None:
        init(self, path, size + 4096)

    with mock.patch.object(mapping.InputMap, "__init__", grown):
        convert(src, out)


def _hub_upload_offline(src: Path, out: Path) -> None:
    """``--push-to-hub`` of a finished batch output with the Hub unreachable (offline mode)."""
    from huggingface_hub import constants

    from convert.batch.card import push_output
    from convert.batch.jobs import Job

    with tempfile.TemporaryDirectory() as tmp:  # the batch's out dir, holding the finished output
        batch = Path(tmp)
        final = Path(shutil.copy(src / "model.safetensors", batch / "model.safetensors"))
        state = {"key": {"to": "bf16"},
                 "files": {"model.safetensors": {"bytes": final.stat().st_size, "sha256": "0"}}}
        with mock.patch.object(constants, "HF_HUB_OFFLINE", True):
            push_output(Job(str(src), None, "bf16", 10**9, "model.safetensors"), batch, state, batch / "state.json",
                        {"push_to_hub": "org"}, None, [])


def _hub_shard_withheld(src: Path, out: Path) -> None:
    """A low-disk run fetches a shard whose header the Hub served but whose file it no longer serves."""
    from huggingface_hub import constants

    from convert.hub.shards import HubShards, RemoteFile
    from tests.helpers.fakehub import FakeHub

    hub, data, commit = FakeHub(), (src / "model.safetensors").read_bytes(), "c0ffee" * 6 + "c0ff"
    hub.add("org/withheld", commit, {"model.safetensors": data})
    hub.withheld.add("org/withheld/model.safetensors")
    url = hub.start()
    try:
        with mock.patch.object(constants, "ENDPOINT", url), mock.patch.object(
                constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"):
            remote = RemoteFile("org/withheld", commit, "model.safetensors", len(data))
            shards = HubShards("org/withheld", commit, out.parent / "staging", {"model.safetensors": remote})
            shard = shards.open(shards.folder / "model.safetensors")
            assert shard is not None
            shard.fetch()
    finally:
        hub.stop()
        shutil.rmtree(out.parent / "staging", ignore_errors=True)  # as the run's owner of the folder does


def _pt_zip_version_64(d: Path) -> Path:
    """A torch zip whose central directory says 'version 6.4 needed to extract' (zipfile: NotImplementedError)."""
    path = _pt({"w": _tensor(ARR)})(d)
    raw = bytearray(path.read_bytes())
    i = raw.index(b"PK\x01\x02")
    raw[i + 6 : i + 8] = struct.pack("<H", 64)
    path.write_bytes(bytes(raw))
    return path


def _empty(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _qnt(module: str, call: Callable[[Any], Any]) -> Callable[[Path, Path], None]:
    def run(src: Path, out: Path) -> None:
        call(importlib.import_module(module))

    return run


# ---- GGUF output (--to gguf[:TYPE]) on a copy of the tiny llama
def model_copy(config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        import shutil

        root = d / "model"
        shutil.copytree(BASE_MODEL, root, ignore=shutil.ignore_patterns("reference"))
        for name in drop:
            (root / name).unlink()
        if config is not None:
            cfg = json.loads((root / "config.json").read_text())
            cfg.update(config)
            (root / "config.json").write_text(json.dumps(cfg))
        return root

    return build


def _moe_of_unknown_layout(d: Path) -> Path:
    """The Mixtral fixture under a MoE model_type whose saved layout is not known (``deepseek_v3``)."""
    import shutil

    root = d / "moe"
    shutil.copytree(BASE_MODEL.parent / "mixtral_nf4_dq", root, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((root / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _with_file(build: Callable[[Path], Path], name: str, data: bytes) -> Callable[[Path], Path]:
    def run(d: Path) -> Path:
        root = build(d)
        (root / name).write_bytes(data)
        return root

    return run


def gguf_cli(to: str) -> tuple[Callable[[Path, Path], None], list[str]]:
    def run(src: Path, out: Path) -> None:
        from convert.cli import main

        main([str(src), "--to", to, "-o", str(out.with_suffix(".gguf")), "-q", "--debug"])

    return run, ["{src}", "--to", to, "-o", "{out}.gguf", "-q"]


def _gguf_inputs(src: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from formats.safetensors import SafetensorsReader

    cfg = json.loads((src / "config.json").read_text())
    with SafetensorsReader(BASE_MODEL / "reference" / "dequantized.safetensors") as r:
        weights = {n: np.array(r.array(n)) for n in r.tensors}
    return cfg, weights


def _gguf_unmapped(src: Path, out: Path) -> None:
    from convert.gguf.plan import plan_gguf

    cfg, w = _gguf_inputs(src)
    plan_gguf(cfg, [(n, a.shape) for n, a in w.items()] + [("model.extra_head.weight", (8, 8))], src)


def _gguf_moe(src: Path, out: Path) -> None:
    from convert.gguf.plan import plan_gguf

    cfg, w = _gguf_inputs(src)
    moe = dict(cfg, architectures=["MistralForCausalLM"], num_local_experts=8)
    plan_gguf(moe, [(n, a.shape) for n, a in w.items()], src)


def _gguf_wrong_source(src: Path, out: Path) -> None:
    from convert.gguf.encode import write_gguf
    from convert.gguf.plan import plan_gguf

    cfg, w = _gguf_inputs(src)
    plan = plan_gguf(cfg, [(n, a.shape) for n, a in w.items()], src, "f16")
    sources = array_tensors(w)
    sources["model.norm.weight"] = array_tensor("model.norm.weight", np.zeros(255, dtype=np.float32))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_gguf(plan, out.parent / "m.gguf", sources)
    finally:
        for p in out.parent.iterdir():
            p.unlink()


def _gguf_inf_weight(src: Path, out: Path) -> None:
    from convert.gguf.encode import write_gguf
    from convert.gguf.plan import plan_gguf

    cfg, w = _gguf_inputs(src)
    plan = plan_gguf(cfg, [(n, a.shape) for n, a in w.items()], src, "q4_k_m")
    q = np.array(w["model.layers.0.self_attn.q_proj.weight"], dtype=np.float32)
    q[3, 5] = np.inf
    w["model.layers.0.self_attn.q_proj.weight"] = q
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_gguf(plan, out.parent / "m.gguf", array_tensors(w))
    finally:
        for p in out.parent.iterdir():
            p.unlink()


def _gguf_verify(src: Path, out: Path) -> None:
    from convert.gguf.encode import write_gguf
    from convert.gguf.plan import plan_gguf
    from formats.gguf import verify_gguf

    cfg, w = _gguf_inputs(src)
    shapes = [(n, a.shape) for n, a in w.items()]
    plan = plan_gguf(cfg, shapes, src, "q8_0")
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / "m.gguf"
    try:
        write_gguf(plan, path, array_tensors(w))
        verify_gguf(path, plan_gguf(cfg, shapes, src, "f16"))
    finally:
        path.unlink()


def _gguf_type(src: Path, out: Path) -> None:
    from convert.gguf.types import parse_output_type

    parse_output_type("iq2_xxs")


def imatrix_cli(mix: str = "q4_k_m") -> tuple[Callable[[Path, Path], None], list[str]]:
    """``--to gguf:MIX --imatrix SRC`` of the base model (SRC: the importance matrix file built)."""
    def run(src: Path, out: Path) -> None:
        from convert.cli import main

        main([str(BASE_MODEL), "--to", f"gguf:{mix}", "--imatrix", str(src), "-o", str(out.with_suffix(".gguf")),
              "-q", "--debug"])

    return run, [str(BASE_MODEL), "--to", f"gguf:{mix}", "--imatrix", "{src}", "-o", "{out}.gguf", "-q"]


def imatrix_dat(entries: dict[str, list[float]], ncall: int = 1) -> Callable[[Path], Path]:
    """A legacy ``.dat`` importance matrix (llama-imatrix ``--output-format dat``) of these entries."""
    def build(d: Path) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        return write_dat_imatrix(d / "imatrix.dat", {n: (v, ncall) for n, v in entries.items()}, chunks=None)

    return build


def _spm(data: bytes) -> Callable[[Path], Path]:
    return raw_file(data, "tokenizer.model")


def _read_pieces(src: Path, out: Path) -> None:
    from formats import sentencepiece

    sentencepiece.read_pieces(src)


GGUF_F16 = gguf_cli("gguf:f16")


def _tiny_bpe(build: Callable[[Path], Path]) -> Callable[[Path], Path]:
    """tokenizer.model removed; a byte-level BPE tokenizer.json (256 byte tokens, one merge) that no
    model of llama.cpp's table has, so its check hash is unknown."""

    def run(d: Path) -> Path:
        from gguf.vocab import bytes_to_unicode

        root = build(d)
        (root / "tokenizer.model").unlink()
        vocab = {t: i for i, t in enumerate(bytes_to_unicode().values())}
        vocab["\u0120t"] = len(vocab)
        doc = {"model": {"type": "BPE", "byte_fallback": False, "vocab": vocab, "merges": [["\u0120", "t"]]},
               "added_tokens": [],
               "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                 "use_regex": True}}
        (root / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")
        return root

    return run


def _gguf_without_tokenizers(src: Path, out: Path) -> None:
    """As the CLI, in an environment without the optional tokenizers package."""
    from convert.gguf import bpe_pre as gguf_bpe_pre

    saved = gguf_bpe_pre._tokenizers
    gguf_bpe_pre._tokenizers = lambda: None  # type: ignore[assignment]
    try:
        GGUF_F16[0](src, out)
    finally:
        gguf_bpe_pre._tokenizers = saved  # type: ignore[assignment]


# a GLOBAL opcode naming os.system, as a hostile pickle would (never imported, never called)
SYSTEM_PICKLE = b"\x80\x02cposix\nsystem\nq\x00X\x05\x00\x00\x00touchq\x01\x85q\x02Rq\x03."


# ---- hostile JSON (issue 12, classes 1 and 5): formats/jsonfile.py's limits, raised as each reader's own rule
#: an integer token Python refuses to convert (4,300+ digits), and 100,000 levels of nesting
BIG_INT = "1" * 5000
DEEP = "[" * 100_000 + "]" * 100_000
MiB = 1 << 20
INT_PARTS = ["holds an integer too long to be a real value", "expected 'at most 100 digits'",
             "found '5000 digits (111111111111...)'"]
DEEP_PARTS = ["is nested too deeply", "expected 'at most 256 levels'", "found 'level 257 at byte"]


def _st_header(text: str) -> Callable[[Path], Path]:
    return raw_file(header_bytes(text) + b"\0")


def _too_many_tensors(d: Path) -> Path:
    """A valid header of 200,001 zero-size tensors (12 MB): refused before it is parsed."""
    entries = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(200_001))
    return _st_header("{" + entries + "}")(d)


def _index_text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    return lambda d: _two_shards(d, index=edit(json.dumps(_full_index())))


def _config_text(text: str) -> Callable[[Path], Path]:
    return lambda d: model_dir(d / "model", {"model.safetensors": layer()}, config=text)


def _state_text(text: str) -> Callable[[Path], Path]:
    return one_file({**V, QS: quant_state(text)})


def adapter_text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """The real adapter with its adapter_config.json text edited."""
    def build(d: Path) -> Path:
        a = adapter()(d)
        cfg = a / "adapter_config.json"
        cfg.write_text(edit(cfg.read_text()))
        return a

    return build


def tokenizer_file(name: str, edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """A copy of the tiny llama with one tokenizer JSON file's text edited."""
    def build(d: Path) -> Path:
        root = model_copy()(d)
        (root / name).write_text(edit((root / name).read_text()))
        return root

    return build


def _first_key(raw: str, key: str = "x") -> Callable[[str], str]:
    """Insert ``"KEY": RAW`` as the first key of a JSON object text."""
    return lambda text: text.replace("{", f'{{"{key}": {raw}, ', 1)


V = layer()
VN = layer(nested=True)
QS = f"{W}.quant_state.bitsandbytes__nf4"
# a text pointer file left by a download without git-lfs
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 5368709120\n"

CASES: list[Case] = [
    # ---- safetensors container
    Case("empty-file", E.FileTooShortError, ["/model.safetensors'", "ST-001", "expected '>= 8 bytes'",
                                             "found '0 bytes'"], raw_file(b"")),
    Case("3-byte-file", E.FileTooShortError, ["ST-001", "found '3 bytes'"], raw_file(b"\x10\x00\x00")),
    Case("header-length-past-eof", E.HeaderTooLargeError, ["ST-002", "expected '<= 2'", "found 1000000"],
         raw_file(struct.pack("<Q", 10**6) + b"{}")),
    Case("header-length-past-limit", E.HeaderTooLargeError, ["ST-002", "found 18446744073709551615"],
         raw_file(b"\xff" * 8 + b"\x00" * 64)),
    Case("header-not-utf8", E.HeaderJsonError, ["ST-003", "not valid UTF-8"],
         raw_file(header_bytes(b'{"w\xff": {}}'))),
    Case("header-not-json", E.HeaderJsonError, ["ST-003", "not valid JSON"],
         raw_file(header_bytes('{"w": {"dtype": "F32",'))),
    Case("header-not-object", E.HeaderJsonError, ["ST-003", "must be a JSON object", "found 'list'"],
         raw_file(header_bytes("[1, 2]"))),
    Case("entry-not-object", E.HeaderJsonError, ["ST-003", "tensor 'w'", "found 'int'"],
         raw_file(header_bytes('{"w": 5}'))),
    Case("git-lfs-pointer", E.NotSafetensorsError, ["ST-004", "Git LFS pointer", "git lfs pull"], raw_file(LFS)),
    Case("html-page", E.NotSafetensorsError, ["ST-004", "HTML page"],
         raw_file(b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n")),
    Case("zip-archive", E.NotSafetensorsError, ["ST-004", "zip archive", "PyTorch"],
         raw_file(b"PK\x03\x04" + b"\x00" * 60)),
    Case("pickle", E.NotSafetensorsError, ["ST-004", "a pickle"], raw_file(b"\x80\x02}q\x00." + b"\x00" * 20)),
    Case("unknown-dtype", E.UnknownDtypeError, ["ST-005", "tensor 'w'", "found 'F128'"],
         raw_file(header_bytes({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}) + b"\0" * 16)),
    Case("negative-dim", E.TensorShapeError, ["ST-006", "tensor 'w'", "found [-1, 4]"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}) + b"\0" * 16)),
    Case("float-dim", E.TensorShapeError, ["ST-006", "found [2.5]"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}) + b"\0" * 8)),
    Case("offsets-reversed", E.DataOffsetsError, ["ST-007", "tensor 'w'", "found [8, 4]"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}) + b"\0" * 8)),
    Case("offsets-not-ints", E.DataOffsetsError, ["ST-007", "found ['0', '4']"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}) + b"\0" * 4)),
    Case("span-not-shape-times-itemsize", E.ByteSpanError, ["ST-008", "tensor 'w'", "expected 16, found 12"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}) + b"\0" * 12)),
    Case("span-overflows-int64", E.ByteSpanError, ["ST-008", "expected 73786976294838206464, found 8"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 8]}})
                  + b"\0" * 8)),
    Case("overlap", E.TensorOverlapError, ["ST-009", "tensor 'b'", "overlaps tensor 'a'"],
         raw_file(header_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}) + b"\0" * 12)),
    Case("truncated", E.TruncatedFileError, ["ST-010", "truncated", "found", "fetch the file again"], _truncated),
    Case("offsets-past-eof", E.TruncatedFileError, ["ST-010", "expected '400 data bytes', found 4"],
         raw_file(header_bytes({"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}) + b"\0" * 4)),
    Case("metadata-not-strings", E.MetadataError, ["ST-011", "found \"non-string values for ['format']\""],
         raw_file(header_bytes({"__metadata__": {"format": 1}}))),
    Case("gap", E.DataGapError, ["ST-012", "tensor 'b'", "gap", "expected 'begin == 4', found 8"],
         raw_file(header_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}) + b"\0" * 12)),
    Case("trailing-bytes", E.DataGapError, ["ST-012", "trailing bytes", "expected '4 data bytes', found 12"],
         raw_file(header_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}) + b"\0" * 12)),
    Case("duplicate-name", E.DuplicateTensorError, ["ST-013", "tensor 'w'", "appears twice"],
         raw_file(header_bytes('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                               '"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}') + b"\0")),
    Case("too-many-tensors", E.TooManyTensorsError,
         ["ST-014", "expected 'at most 200,000 tensors', found '200,001 tensors'", "shards"],
         _too_many_tensors),
    Case("header-int-5000-digits", E.HeaderJsonError, ["/model.safetensors'", "ST-003 header", *INT_PARTS],
         _st_header('{"w": {"dtype": "U8", "shape": [' + BIG_INT + '], "data_offsets": [0, 1]}}')),
    Case("header-nested-100k", E.HeaderJsonError, ["ST-003 header", *DEEP_PARTS], _st_header('{"w": ' + DEEP + "}")),
    Case("header-nan", E.HeaderJsonError, ["ST-003 header holds NaN, which is not JSON", "found 'NaN'"],
         _st_header('{"w": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}')),
    Case("header-lone-surrogate", E.HeaderJsonError,
         ["ST-003 header holds a lone UTF-16 surrogate escape", "found 'w\\ud800'"],
         _st_header('{"w\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}')),
    # ---- torch pickles
    Case("pt-junk", E.NotTorchCheckpointError, ["/junk.bin'", "PT-001", "not a PyTorch checkpoint"],
         raw_file(b"\x00\x01junk" * 10, "junk.bin")),
    Case("pt-pickle-too-large", E.PickleTooLargeError, ["PT-002", "larger than the limit"], _pt({"w": _tensor(ARR)}),
         run=_patched("pickle_machine.MAX_PICKLE_BYTES", 16), argv=None),
    Case("pt-os-system", E.UnsafePickleError, ["PT-003", "found 'posix.system'", "nothing was imported or run"],
         _pt_raw(SYSTEM_PICKLE)),
    Case("pt-malformed", E.MalformedPickleError, ["PT-004", "malformed pickle"], _pt_raw(b"\x80\x02}q\x00(X")),
    # found by scripts/fuzz.py: a damaged member header, and a length field of 2**62 (BYTEARRAY8)
    Case("pt-damaged-member-header", E.NotTorchCheckpointError, ["PT-001", "cannot read byteorder"],
         _pt_damaged_member_header),
    Case("pt-zip-version-6.4", E.NotTorchCheckpointError, ["PT-001", "zip file version 6.4"], _pt_zip_version_64),
    Case("pt-bytearray8-2-to-62", E.MalformedPickleError, ["PT-004", "malformed pickle"],
         _pt_raw(b"\x80\x05\x96" + struct.pack("<Q", 2**62) + b".")),
    Case("pt-compressed-storage", E.StorageRecordError, ["PT-005", "is compressed", "found 'method 8'"],
         _pt({"w": _tensor(ARR)}, compress_data=True)),
    Case("pt-view-past-storage", E.TensorViewError, ["PT-006", "tensor 'w'", "reaches past its storage"],
         _pt({"w": _tensor(ARR, shape=(4, 6), offset=1)})),
    Case("pt-large-non-contiguous", E.NonContiguousTensorError, ["PT-007", "tensor 't'"],
         _pt({"t": _tensor(ARR, shape=(6, 4), stride=(1, 6))}), run=_patched("torch_pickle.MAX_COPY_BYTES", 64),
         argv=None),
    Case("pt-big-endian", E.ByteOrderError, ["PT-008", "little-endian", "found 'big'"],
         _pt({"w": _tensor(ARR)}, byteorder=b"big")),
    # issue 39: a lone surrogate in a name was exit 0 with a safetensors file nothing can read (exit 1 in check)
    Case("pt-name-lone-surrogate", E.NotStateDictError,
         ["PT-009", "a name is not writable as a tensor name", "no lone surrogates", "found \"'w\\\\ud800'\""],
         _pt({"w\ud800": _tensor(ARR)})),
    Case("pt-name-nul", E.NotStateDictError, ["PT-009", "a name is not writable as a tensor name", "x\\\\x00y"],
         _pt({"x\0y": _tensor(ARR)})),
    # issue 39 (struct-pickle-strings fuzzer): a tensor named '__metadata__' was exit 0 with a safetensors file whose
    # header the safetensors library refuses (the key is its metadata)
    Case("pt-name-metadata-key", E.NotStateDictError,
         ["PT-009", "a name is not writable as a tensor name", "not '__metadata__'", "found \"'__metadata__'\""],
         _pt({"w": _tensor(ARR), "__metadata__": _tensor(ARR)})),
    Case("pt-list-not-dict", E.NotStateDictError, ["PT-009", "not a state dict", "found 'list'"],
         _pt([_tensor(ARR)])),
    # issue 12: a dict key shared 2**60 ways (exponential to hash) stops at a limit of the pickle machine
    Case("pt-shared-tuple-key", E.PickleLimitError,
         ["PT-010", "a dict key is too large to hash", "expected 'a tuple of <= 256 elements in all'"],
         lambda d: _pt_raw(_torchsave().shared_tuple_key(60))(d)),
    # ---- Hugging Face Hub (SRC = org/name)
    Case("hub-offline-not-cached", E.HubError, ["HUB-001", "org/not-in-the-cache", "HF_HUB_OFFLINE"],
         lambda d: d.mkdir(parents=True) or d, run=_hub_offline, argv=None),
    Case("hub-shard-withheld", E.HubShardError,
         ["HUB-002", "cannot download a shard of the low-disk run", "EntryNotFoundError (HTTP 404)"],
         lambda d: one_file(layer())(d).parent, run=_hub_shard_withheld, argv=None),
    Case("hub-upload-offline", E.HubUploadError,
         ["HUB-003", "cannot push to 'org/model' (OfflineModeIsEnabled", "the conversion is kept"],
         lambda d: one_file(layer())(d).parent, run=_hub_upload_offline, argv=None),
    # ---- model directory
    Case("index-not-json", E.IndexJsonError, ["CKPT-001", "model.safetensors.index.json'", "not valid JSON"],
         lambda d: _two_shards(d, index='{"weight_map": ')),
    Case("index-without-weight-map", E.IndexJsonError, ["CKPT-001", "'weight_map'", "found 'NoneType'"],
         lambda d: _two_shards(d, index={"metadata": {}})),
    Case("index-total-size-5000-digits", E.IndexJsonError,
         ["model.safetensors.index.json'", "CKPT-001 the index", *INT_PARTS],
         _index_text(lambda t: t.replace('"total_size": 0', '"total_size": ' + BIG_INT))),
    Case("index-nested-100k", E.IndexJsonError, ["CKPT-001 the index", *DEEP_PARTS],
         _index_text(lambda t: t.replace('"total_size": 0', '"total_size": ' + DEEP))),
    Case("index-too-large", E.IndexJsonError,
         ["CKPT-001 the index is larger than the limit for a JSON shard index",
          f"expected 'at most {64 * MiB} bytes'"], _index_text(lambda t: t + " " * (64 * MiB))),
    Case("index-tensor-twice", E.IndexJsonError, ["CKPT-001 the index has the key 'lm_head.weight' twice"],
         _index_text(lambda t: t.replace('"weight_map": {', '"weight_map": {"lm_head.weight": "x.safetensors", '))),
    Case("missing-shard", E.MissingShardError, ["CKPT-002", "expected \"a file 'model-00002-of-00002.safetensors'\"",
                                                "fetch the missing shard"], _missing_shard),
    Case("index-names-absent-tensor", E.IndexTensorMissingError,
         ["CKPT-003", "model-00002-of-00002.safetensors'", "tensor 'model.embed_tokens.weight'", "found 'absent'"],
         _index_tensor_missing),
    Case("shard-not-in-index", E.UnindexedShardError,
         ["CKPT-004", "found ['model-00003-of-00003.safetensors']"], _stray_shard),
    Case("stray-shard-beside-single-file", E.UnindexedShardError,
         ["CKPT-004", "no index names them", "found ['model-00002-of-00002.safetensors']"], _stray_single),
    Case("no-weights", E.NoWeightsError, ["CKPT-005", "no weights found", "found 'no weight files'"],
         lambda d: model_dir(d / "model", {})),
    Case("no-tensors", E.NoWeightsError, ["Failed to read", "model.safetensors'", "CKPT-005 the weight files hold no "
                                          "tensors", "expected 'at least one tensor', found '0 tensors'"],
         one_file({})),
    Case("tensor-in-two-shards", E.ShardDuplicateTensorError,
         ["CKPT-006", "tensor 'model.norm.weight'", "also in shard 'model-00001-of-00002.safetensors'"],
         _duplicate_across),
    Case("config-not-json", E.ConfigJsonError, ["CKPT-007", "config.json'", "not valid JSON"],
         lambda d: model_dir(d / "model", {"model.safetensors": layer()}, config="{model_type")),
    Case("config-not-object", E.ConfigJsonError, ["CKPT-007", "must be a JSON object", "found 'list'"],
         lambda d: model_dir(d / "model", {"model.safetensors": layer()}, config="[1]")),
    Case("config-int-5000-digits", E.ConfigJsonError, ["config.json'", "CKPT-007 config.json", *INT_PARTS],
         _config_text('{"model_type": "llama", "vocab_size": ' + BIG_INT + "}")),
    Case("config-nested-100k", E.ConfigJsonError, ["CKPT-007 config.json", *DEEP_PARTS],
         _config_text('{"model_type": "llama", "x": ' + DEEP + "}")),
    Case("config-too-large", E.ConfigJsonError,
         ["CKPT-007 config.json is larger than the limit for a JSON config", f"expected 'at most {16 * MiB} bytes'",
          f"found '{16 * MiB + 24} bytes'"], _config_text('{"model_type": "llama"}' + " " * (16 * MiB + 1))),
    Case("tensor-not-in-index", E.UnindexedTensorError,
         ["CKPT-008", "tensor 'model.norm.weight'",
          "expected 'model-00002-of-00002.safetensors', found 'not in the index'"],
         _unindexed_tensor),
    Case("shard-outside-directory", E.ShardPathError, ["CKPT-009", "found '../evil.safetensors'"],
         lambda d: _two_shards(d, index=_full_index({"model.norm.weight": "../evil.safetensors"}))),
    # issue 39: a NUL byte in a shard name was "internal error: ValueError: embedded null byte" (exit 1)
    Case("shard-name-with-nul", E.ShardPathError,
         ["CKPT-009", "index names a shard with a NUL byte in its name",
          "found 'model-00002\\x00-of-00002.safetensors'"],
         lambda d: _two_shards(d, index=_full_index({"model.norm.weight": "model-00002\0-of-00002.safetensors"}))),
    # the index's only shard leaves the directory: that is the cause, not the real shards it leaves unnamed
    Case("shard-outside-directory-before-stray", E.ShardPathError, ["CKPT-009", "found '../../../../etc/passwd'"],
         lambda d: _two_shards(d, index=_full_index(dict.fromkeys(_full_index()["weight_map"],
                                                                  "../../../../etc/passwd")))),
    Case("shard-is-a-fifo", E.NotRegularFileError,
         ["model-00002-of-00002.safetensors'", "CKPT-011", "not a regular file", "found 'a FIFO (named pipe)'"],
         _fifo_shard),
    Case("shard-symlink-loop", E.NotRegularFileError,
         ["model-00002-of-00002.safetensors'", "CKPT-011", "found 'a symlink loop'"], _looping_shard),
    Case("src-is-a-fifo", E.NotRegularFileError,
         ["model.safetensors'", "CKPT-011", "SRC is not a regular file or a directory", "a FIFO (named pipe)"],
         _fifo_src),
    Case("src-is-a-device", E.NotRegularFileError, ["'/dev/zero'", "CKPT-011", "found 'a character device'"],
         lambda d: Path("/dev/zero")),
    Case("model-safetensors-is-a-fifo", E.NotRegularFileError,
         ["model/model.safetensors'", "CKPT-011", "weight file is not a regular file"], _fifo_single),
    Case("config-vocab-size-differs", E.ConfigWeightsError,
         ["config.json'", "tensor 'model.embed_tokens.weight'", "CKPT-013", "'vocab_size' differs from the token "
          "embedding's rows", "expected 1000, found 1024"], model_copy({"vocab_size": 1024}),
         argv=["{src}", "--to", "bf16", "-o", "{out}", "-q"]),
    Case("config-hidden-size-differs", E.ConfigWeightsError,
         ["CKPT-013", "'hidden_size' differs from the token embedding's width", "expected 256, found 512"],
         model_copy({"hidden_size": 512}), run=lambda s, o: convert(s, o, to="nf4")),
    Case("config-layer-count-differs", E.ConfigWeightsError,
         ["config.json'", "tensor 'model.layers.*'", "CKPT-013", "'num_hidden_layers' differs from the layers the "
          "tensors hold (0 to 1)", "expected 2, found 3"], model_copy({"num_hidden_layers": 3})),
    Case("input-cut-while-read", E.InputChangedError,
         ["model.safetensors'", "CKPT-012", "the file changed while it was read", "its size in bytes (expected "],
         one_file(layer()), run=_cut_by_4096, argv=None),
    Case("source-missing", E.SourceNotFoundError, ["CKPT-010", "no-such-model'", "does not exist"], _missing_src,
         same_message=False),  # the CLI's hint also offers a Hub repo id
    # ---- bnb 4-bit layer
    Case("quant-type-int4", E.QuantTypeError, [f"tensor '{W}'", "BNB-001", "expected \"'nf4' or 'fp4'\"",
                                               "found 'int4'"], one_file(with_state(V, quant_type="int4"))),
    Case("blocksize-48", E.BlocksizeError, ["BNB-002", "found 48"], one_file(with_state(V, blocksize=48))),
    Case("packed-bytes-short", E.PackedSizeError, [f"tensor '{W}'", "BNB-003", "ceil(n/2)", "expected 64, found 63"],
         one_file({**V, W: ("U8", [63, 1], b"\0" * 63)})),
    Case("absmax-count", E.AbsmaxCountError, [f"tensor '{W}.absmax'", "BNB-004", "expected 2, found 3"],
         one_file({**V, f"{W}.absmax": ("F32", [3], f32([1, 1, 1]))})),
    Case("fp4-state-with-nf4-table", E.QuantMapError,
         [f"tensor '{W}.quant_map'", "BNB-005", "not the fp4 table", "found 'the nf4 table'"],
         one_file({**without(layer(qt="fp4"), f"{W}.quant_map"), f"{W}.quant_map": ("F32", [16], table("nf4_code"))})),
    Case("quant-map-15-values", E.QuantMapError, ["BNB-005", "expected 'F32 [16]', found 'F32 [15]'"],
         one_file({**V, f"{W}.quant_map": ("F32", [15], table("nf4_code")[:60])})),
    Case("nested-fields-in-part", E.NestedFieldsError, ["BNB-006", "found \"missing ['nested_offset']\""],
         one_file(with_state(VN, nested_offset=DELETE))),
    Case("nested-without-nested-absmax", E.NestedFieldsError, ["BNB-006", "found \"missing ['nested_absmax']\""],
         one_file(without(VN, f"{W}.nested_absmax"))),
    Case("nested-tensors-but-plain-state", E.NestedFieldsError, ["BNB-006", "not nested"],
         one_file({**V, f"{W}.nested_absmax": ("F32", [1], f32([1]))})),
    Case("nested-quant-map-255", E.NestedQuantMapError, ["BNB-007", "expected 'F32 [256]', found 'F32 [255]'"],
         one_file({**VN, f"{W}.nested_quant_map": ("F32", [255], table("dynamic_map_signed")[:1020])})),
    Case("nested-absmax-count", E.NestedAbsmaxError, [f"tensor '{W}.nested_absmax'", "BNB-008",
                                                      "expected 1, found 2"],
         one_file({**VN, f"{W}.nested_absmax": ("F32", [2], f32([1, 1]))})),
    Case("quant-state-not-json", E.QuantStateJsonError, [f"tensor '{QS}'", "BNB-009", "quant_state is not valid JSON"],
         one_file({**V, QS: quant_state(b'{"quant_type": "nf4", ')})),
    Case("quant-state-missing-shape", E.QuantStateJsonError, ["BNB-009", "'shape' is missing"],
         one_file(with_state(V, shape=DELETE))),
    Case("quant-state-blocksize-string", E.QuantStateJsonError,
         ["BNB-009", "'blocksize' must be an integer", "found '64'"], one_file(with_state(V, blocksize="64"))),
    Case("quant-state-shape-5000-digits", E.QuantStateJsonError, [f"tensor '{QS}'", "BNB-009 quant_state", *INT_PARTS],
         _state_text('{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [' + BIG_INT + ", 32]}")),
    Case("quant-state-nested-100k", E.QuantStateJsonError, [f"tensor '{QS}'", "BNB-009 quant_state", *DEEP_PARTS],
         _state_text('{"quant_type": "nf4", "shape": ' + DEEP + "}")),
    Case("quant-state-too-large", E.QuantStateJsonError,
         ["BNB-009 quant_state is larger than the limit", f"expected 'at most {MiB} bytes'",
          f"found '{MiB + 1} bytes'"],
         _state_text('{"quant_type": "nf4"}'.ljust(MiB + 1))),
    Case("absmax-under-another-prefix", E.OrphanComponentError,
         ["tensor 'model.layers.0.mlp.down_prj.weight.absmax'", "BNB-010", "'absmax' has no weight",
          f"may belong to '{W}'"],
         one_file({**without(V, f"{W}.absmax"), "model.layers.0.mlp.down_prj.weight.absmax": V[f"{W}.absmax"]})),
    Case("weight-without-absmax", E.MissingComponentError, [f"tensor '{W}'", "BNB-011", "companion 'absmax'",
                                                            f"'{W}.absmax'"],
         one_file(without(V, f"{W}.absmax"))),
    Case("weight-without-quant-state", E.MissingComponentError, ["BNB-011", "has no QuantState"],
         one_file(without(V, QS))),
    Case("absmax-nan", E.NonFiniteAbsmaxError, [f"tensor '{W}.absmax'", "BNB-012", "found 'nan at block 1"],
         _nan_absmax),
    Case("nested-absmax-inf", E.NonFiniteAbsmaxError, [f"tensor '{W}.nested_absmax'", "BNB-012", "at block 0"],
         _nested_absmax_inf),
    # a layer already in the asked NF4 settings is copied unchanged, never dequantized: checked all the same
    Case("nested-absmax-inf-to-nf4", E.NonFiniteAbsmaxError, [f"tensor '{W}.nested_absmax'", "BNB-012", "at block 0"],
         _nested_absmax_inf,
         run=lambda src, out: convert(src, out, to="nf4"), argv=["{src}", "--to", "nf4", "-o", "{out}", "-q"]),
    Case("dtype-int8", E.QuantDtypeError, ["BNB-013", "found 'int8'"], one_file(with_state(V, dtype="int8"))),
    Case("nested-dtype-float64", E.QuantDtypeError, ["BNB-013", "nested_dtype", "found 'float64'"],
         one_file(with_state(VN, nested_dtype="float64"))),
    Case("shape-with-zero", E.QuantShapeError, ["BNB-014", "found [0, 4]"], one_file(with_state(V, shape=[0, 4]))),
    Case("int8-scb-count", E.Int8LayoutError,
         ["tensor 'model.layers.0.mlp.up_proj.SCB'", "BNB-015", "expected 'F32 [4]', found 'F32 [3]'"],
         one_file({"model.layers.0.mlp.up_proj.weight": ("I8", [4, 4], bytes(range(16))),
                   "model.layers.0.mlp.up_proj.SCB": ("F32", [3], f32([1, 2, 3]))})),
    Case("int8-col32", E.Int8WeightFormatError,
         ["tensor 'model.layers.0.mlp.up_proj.weight_format'", "BNB-016", "expected '0 (row)', found '1 (col32)'"],
         _int8(1)),
    Case("legacy-quant-state-without-absmax", E.LegacyQuantStateError,
         [f"tensor '{W}.quant_state'", "BNB-017", "absmax must be a tensor"], _legacy_state_bad_absmax),
    Case("absmax-u8-not-nested", E.AbsmaxDtypeError, ["BNB-018", "expected 'F32 or F16 or BF16', found 'U8'"],
         one_file({**V, f"{W}.absmax": ("U8", [2], b"\1\2")})),
    Case("two-quant-states", E.ConflictingQuantStateError, ["BNB-019", "more than one packed quant_state"],
         one_file({**V, f"{W}.quant_state.bitsandbytes__fp4": V[QS]})),
    Case("key-fp4-json-nf4", E.ConflictingQuantStateError, ["BNB-019", "expected 'fp4', found 'nf4'"],
         one_file({**without(V, QS), f"{W}.quant_state.bitsandbytes__fp4": V[QS]})),
    Case("int8-weight-format-without-scb", E.Int8ScaleMissingError,
         ["tensor 'model.layers.0.mlp.up_proj.weight'", "BNB-020", "no SCB row scales",
          "it has 'model.layers.0.mlp.up_proj.weight_format'",
          "expected \"a tensor named 'model.layers.0.mlp.up_proj.SCB'\", found 'none'"],
         one_file({"model.layers.0.mlp.up_proj.weight": ("I8", [4, 4], bytes(range(16))),
                   "model.layers.0.mlp.up_proj.weight_format": ("U8", [], bytes([0]))})),
    Case("int8-config-weight-without-scb", E.Int8ScaleMissingError,
         ["tensor 'model.layers.0.mlp.up_proj.weight'", "BNB-020", "the config says load_in_8bit"],
         lambda d: model_dir(d / "model", {"model.safetensors": {
             "model.layers.0.mlp.up_proj.weight": ("I8", [4, 4], bytes(range(16))),
             "model.layers.0.mlp.down_proj.weight": ("I8", [4, 4], bytes(range(16))),
             "model.layers.0.mlp.down_proj.SCB": ("F32", [4], f32([1, 2, 3, 4]))}},
             config={"model_type": "llama", "torch_dtype": "bfloat16",
                     "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})),
    # ---- LoRA adapters (--merge-lora)
    Case("lora-no-config", E.AdapterConfigError, ["LORA-001", "adapter"], adapter(write_config=False), run=merge,
         argv=MERGE_ARGV),
    Case("lora-config-r-5000-digits", E.AdapterConfigError, ["adapter_config.json'", "LORA-001 adapter config",
                                                             *INT_PARTS],
         adapter_text(lambda t: t.replace('"r": 8', '"r": ' + BIG_INT)), run=merge, argv=MERGE_ARGV),
    Case("lora-config-nested-100k", E.AdapterConfigError, ["LORA-001 adapter config", *DEEP_PARTS],
         adapter_text(_first_key(DEEP)), run=merge, argv=MERGE_ARGV),
    Case("lora-config-too-large", E.AdapterConfigError,
         ["LORA-001 adapter config is larger than the limit", f"expected 'at most {16 * MiB} bytes'"],
         adapter_text(lambda t: t + " " * (16 * MiB)), run=merge, argv=MERGE_ARGV),
    Case("lora-ia3", E.NotLoraAdapterError, ["LORA-002", "only LoRA adapters"], adapter({"peft_type": "IA3"}),
         run=merge, argv=MERGE_ARGV),
    Case("lora-qalora", E.UnsupportedAdapterConfigError, ["LORA-003", "config key 'use_qalora'"],
         adapter({"use_qalora": True}), run=merge, argv=MERGE_ARGV),
    Case("lora-r-0", E.AdapterConfigValueError, ["LORA-004", "config key 'r'"], adapter({"r": 0}), run=merge,
         argv=MERGE_ARGV),
    Case("lora-no-weights", E.NoAdapterWeightsError, ["LORA-005", "adapter_model.safetensors"],
         adapter(write_weights=False), run=merge, argv=MERGE_ARGV),
    Case("lora-adalora-key", E.AdapterKeyNameError, ["LORA-006", f"'{LQ}.lora_E'"],
         adapter(tensors={**adapter_tensors(), f"{LQ}.lora_E": _lora("e", [8, 1])}), run=merge, argv=MERGE_ARGV),
    Case("lora-layer-5", E.AdapterTargetMissingError,
         ["LORA-007", f"'{LP}model.layers.5.self_attn.q_proj.lora_A.weight'", "matches no tensor of the base model"],
         adapter(tensors={**adapter_tensors(),
                          f"{LP}model.layers.5.self_attn.q_proj.lora_A.weight": _lora("a", [8, 256]),
                          f"{LP}model.layers.5.self_attn.q_proj.lora_B.weight": _lora("b", [256, 8])}),
         run=merge, argv=MERGE_ARGV),
    Case("lora-missing-b", E.IncompleteLoraModuleError, ["LORA-008", "lora_B.weight is missing"],
         adapter(tensors=without(adapter_tensors(), f"{LQ}.lora_B.weight")), run=merge, argv=MERGE_ARGV),
    Case("lora-untargeted-v-proj", E.UntargetedModuleError, ["LORA-009", "v_proj.lora_A.weight"],
         adapter({"target_modules": ["q_proj"]}), run=merge, argv=MERGE_ARGV),
    Case("lora-rank-4-of-8", E.LoraShapeError, ["LORA-010", "differs from the config (expected 8, found 4)"],
         adapter(tensors=_rank4()), run=merge, argv=MERGE_ARGV),
    Case("lora-mixed-embedding-keys", E.DuplicateAdapterTargetError, ["LORA-011", "mixes lora_A/B"],
         adapter(tensors={**adapter_tensors(), f"{LQ}.lora_embedding_A": _lora("e", [8, 256])}), run=merge,
         argv=MERGE_ARGV),
    Case("lora-modules-to-save-copy-differs", E.ModulesToSaveMismatchError, ["LORA-012"],
         adapter({"modules_to_save": ["lm_head"]}, tensors=_lm_head_copy_differs()), run=merge, argv=MERGE_ARGV),
    Case("lora-target-modules-backtracks", E.PatternTimeoutError,
         ["adapter_config.json'", "LORA-013", "config key 'target_modules'", r"pattern '(.|..|...)+\d\d\d'",
          "did not finish matching module 'model.layers.0.", "backtracks catastrophically"],
         adapter({"target_modules": r"(.|..|...)+\d\d\d"}), run=merge, argv=MERGE_ARGV),
    Case("lora-rank-pattern-backtracks", E.PatternTimeoutError,
         ["adapter_config.json'", "LORA-013", "config key 'rank_pattern'", r"pattern '(.|..|...)+\d\d\d'"],
         adapter({"rank_pattern": {r"(.|..|...)+\d\d\d": 4}}), run=merge, argv=MERGE_ARGV),
    Case("lora-pattern-nested-counts", E.PatternTimeoutError,
         ["adapter_config.json'", "LORA-013", "config key 'alpha_pattern'", "too large", "(a{1000}){1000}"],
         adapter({"alpha_pattern": {"((a{1000}){1000}){1000}": 4}}), run=merge, argv=MERGE_ARGV),
    Case("lora-b-nan", E.NonFiniteAdapterError,
         ["adapter_model.safetensors'", f"tensor '{LQ}.lora_B.weight'", "LORA-014", "NaN or infinite",
          "found '1 NaN and 0 infinite of 2048, the first at flat index 5'"],
         adapter(tensors=_adapter_value(f"{LQ}.lora_B.weight", 5, np.nan)), run=merge, argv=MERGE_ARGV),
    Case("lora-a-inf", E.NonFiniteAdapterError,
         [f"tensor '{LP}model.layers.1.self_attn.v_proj.lora_A.weight'", "LORA-014", "0 NaN and 1 infinite"],
         adapter(tensors=_adapter_value(f"{LP}model.layers.1.self_attn.v_proj.lora_A.weight", 2047, -np.inf)),
         run=merge, argv=MERGE_ARGV),
    Case("lora-rank-pattern-flags-inside", E.AdapterConfigValueError,
         ["adapter_config.json'", "LORA-004", "config key 'rank_pattern'", "pattern '(?i)q_proj'",
          "not a valid regular expression", "global flags"],
         adapter({"rank_pattern": {"(?i)q_proj": 4}}), run=merge, argv=MERGE_ARGV),
    Case("lora-layers-pattern-invalid", E.AdapterConfigValueError,
         ["adapter_config.json'", "LORA-004", "config key 'layers_pattern'", "not a valid regular expression"],
         adapter({"layers_pattern": "layers(", "layers_to_transform": [0]}), run=merge, argv=MERGE_ARGV),
    Case("lora-gguf-dora", E.GgufAdapterError,
         ["adapter_model.safetensors'", f"tensor '{LQ}.lora_magnitude_vector'", "LORA-015", "DoRA magnitude vector",
          "--merge-lora"],
         adapter({"use_dora": True}, tensors=_dora_adapter()), run=gguf_adapter, argv=GGUF_ADAPTER_ARGV),
    # ---- importance matrices (--imatrix)
    Case("imatrix-not-a-matrix", E.ImatrixFormatError, ["imatrix.dat'", "IMX-001", "neither GGUF nor"],
         raw_file(b"this is text, not an importance matrix", "imatrix.dat"), run=imatrix_cli()[0],
         argv=imatrix_cli()[1]),
    Case("imatrix-nan", E.ImatrixValuesError, ["imatrix.dat'", "tensor 'blk.0.attn_q.weight'", "IMX-002",
                                               "nan at index 1"],
         imatrix_dat({"blk.0.attn_q.weight": [1.0, float("nan")] + [1.0] * 254}), run=imatrix_cli()[0],
         argv=imatrix_cli()[1]),
    Case("imatrix-other-model", E.ImatrixTensorError, ["imatrix.dat'", "tensor 'blk.30.attn_q.weight'", "IMX-003",
                                                       "names no weight of this model"],
         imatrix_dat({"blk.30.attn_q.weight": [1.0] * 256}), run=imatrix_cli()[0], argv=imatrix_cli()[1]),
    Case("imatrix-required", E.ImatrixRequiredError, ["IMX-004", "gguf:q2_k_s needs an importance matrix",
                                                      "found 'no --imatrix'"],
         model_copy(), run=gguf_cli("gguf:q2_k_s")[0], argv=gguf_cli("gguf:q2_k_s")[1]),
    # ---- GGUF output
    Case("gguf-falcon", E.UnsupportedArchitectureError, ["GGUF-001", "found 'FalconForCausalLM'"],
         model_copy({"architectures": ["FalconForCausalLM"]}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-iq2-xxs", E.GgufTypeError, ["GGUF-002", "q8_0"], lambda d: d.mkdir(parents=True) or d,
         run=_gguf_type, argv=None),  # the CLI's --to choices refuse it first (argparse, exit 2)
    Case("gguf-extra-head", E.UnmappedTensorError, ["GGUF-003", "tensor 'model.extra_head.weight'"],
         model_copy(), run=_gguf_unmapped, argv=None),
    Case("gguf-no-tokenizer", E.TokenizerError, ["GGUF-004", "tokenizer.model or tokenizer.json"],
         model_copy(drop=("tokenizer.model", "tokenizer.json", "tokenizer_config.json")),
         run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-tokenizer-config-nested-100k", E.TokenizerError,
         ["tokenizer_config.json'", "GGUF-004 tokenizer_config.json", *DEEP_PARTS],
         tokenizer_file("tokenizer_config.json", _first_key(DEEP)), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-tokenizer-json-int-5000-digits", E.TokenizerError, ["GGUF-004 tokenizer.json", *INT_PARTS],
         tokenizer_file("tokenizer.json", _first_key(BIG_INT)), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-tokenizer-json-too-large", E.TokenizerError,
         ["GGUF-004 tokenizer file is larger than a vocabulary of the model's size can need",
          "16 MiB + 1 KiB x 1000 embedding rows"],  # the model's bound comes first; jsonfile's 64 MiB is the cap
         tokenizer_file("tokenizer.json", lambda t: t + " " * (64 * MiB)), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-longrope", E.RopeScalingError, ["GGUF-005", "found 'longrope'"],
         model_copy({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}),
         run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-moe", E.GgufConfigError, ["GGUF-006", "num_local_experts = 8"], model_copy(), run=_gguf_moe,
         argv=None),
    # config.json / tokenizer values the GGUF writer reads: type, range, agreement with the weights
    Case("gguf-hidden-size-negative", E.GgufConfigError, ["config.json'", "GGUF-006", "'hidden_size' is out of range",
                                                         "found -256"],
         model_copy({"hidden_size": -256}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-layers-past-tensors", E.GgufConfigError, ["GGUF-006", "'num_hidden_layers' differs from the layers",
                                                        "found '10000000 (no tensor of layer 2)'"],
         model_copy({"num_hidden_layers": 10**7}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-vocab-size-past-embedding", E.GgufConfigError, ["GGUF-006", "'vocab_size' differs from the token "
                                                              "embedding's rows", "expected 1000, found 1024"],
         model_copy({"vocab_size": 1024}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-heads-past-weights", E.GgufConfigError,
         ["config.json'", "tensor 'model.layers.0.self_attn.q_proj.weight'", "GGUF-006 config.json disagrees with "
          "the weights: blk.0.attn_q.weight has 256 rows; num_attention_heads 8 x head_dim 64 = 512",
          "expected 512, found 256"],
         model_copy({"num_attention_heads": 8}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-intermediate-size-past-weights", E.GgufConfigError,
         ["GGUF-006", "blk.0.ffn_gate.weight has 704 rows; intermediate_size 100", "expected 100, found 704"],
         model_copy({"intermediate_size": 100}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-yarn-no-original-context", E.RopeScalingError, ["GGUF-005", "type yarn lacks a key",
                                                              "original_max_position_embeddings"],
         model_copy({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-architectures-a-string", E.GgufConfigError,
         ["config.json'", "GGUF-006", "'architectures' must be a list of class names",
          "found \"str 'LlamaForCausalLM'\""],
         model_copy({"architectures": "LlamaForCausalLM"}), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-tokenizer-json-list", E.TokenizerError, ["tokenizer.json'", "GGUF-004", "not a JSON object"],
         _with_file(model_copy(), "tokenizer.json", b"[1, 2]"), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-bpe-unknown-pre", E.UnknownBpePreTokenizerError,
         ["tokenizer.json'", "GGUF-009", "llama.cpp does not know this BPE pre-tokenizer", "chkhsh ",
          "known kinds: ", "llama-bpe", "qwen2"],
         _tiny_bpe(model_copy()), run=GGUF_F16[0], argv=GGUF_F16[1]),
    Case("gguf-bpe-without-tokenizers", E.MissingTokenizersError,
         ["tokenizer.json'", "GGUF-010", "needs the 'tokenizers' package", "pip install"],
         _tiny_bpe(model_copy()), run=_gguf_without_tokenizers, argv=None),
    Case("gguf-source-shape", E.GgufSourceError, ["GGUF-007", "tensor 'model.norm.weight'"], model_copy(),
         run=_gguf_wrong_source, argv=None),
    Case("gguf-inf-weight", E.GgufNonFiniteError,
         ["GGUF-011", "tensor 'model.layers.0.self_attn.q_proj.weight'", "holds inf", "cannot be quantized to Q4_K",
          "found '1 non-finite in rows 0..255, the first at row"], model_copy(), run=_gguf_inf_weight,
         argv=None),
    Case("gguf-verify-type", E.GgufVerificationError, ["GGUF-008", "GGML type differs"], model_copy(),
         run=_gguf_verify, argv=None),
    # ---- SentencePiece tokenizer.model (GGUF)
    Case("spm-truncated-varint", E.SentencePieceFormatError, ["SPM-001", "tokenizer.model'"], _spm(b"\x0a\x80"),
         run=_read_pieces, argv=None),
    Case("spm-group-wire-type", E.SentencePieceWireTypeError, ["SPM-002"], _spm(b"\x0b"), run=_read_pieces,
         argv=None),
    Case("spm-no-pieces", E.SentencePiecePiecesError, ["SPM-003"], _spm(b"\x12\x00"), run=_read_pieces, argv=None),
    # ---- re-quantization (--to nf4|fp4)
    Case("qnt-int4", E.QuantTypeOptionError, ["QNT-001", "found 'int4'"], _empty,
         run=_qnt("convert.bnb4.settings", lambda q: q.QuantSettings(quant_type="int4")), argv=None),
    Case("qnt-blocksize-48", E.BlocksizeOptionError, ["QNT-002", "found 48"], _empty,
         run=_qnt("convert.bnb4.settings", lambda q: q.QuantSettings(blocksize=48)), argv=None),
    Case("qnt-nan-weight", E.NonFiniteWeightError, ["QNT-003", "NaN or infinite"], _empty,
         run=_qnt("convert.bnb4.encode",
                  lambda q: q.codec("nf4").quantize(np.array([1.0, np.nan, 2.0], np.float32), 64)), argv=None),
    Case("qnt-storage-int8", E.QuantStorageOptionError, ["QNT-004", "found 'int8'"], _empty,
         run=_qnt("convert.bnb4.settings", lambda q: q.QuantSettings(quant_storage="int8")), argv=None),
    Case("qnt-storage-odd", E.QuantStorageSizeError, ["QNT-005", "tensor 'w'", "found 3"], _empty,
         run=_qnt("convert.bnb4.settings", lambda q: q.QuantSettings(quant_storage="float32").storage_shape(5, "w")),
         argv=None),
    Case("qnt-nested-offset-overflow", E.NestedOffsetOverflowError, ["QNT-006", "found 'inf (largest absmax 3e+38)'"],
         _empty, run=_qnt("convert.bnb4.absmax8", lambda q: q.double_quantize_absmax(np.full(8, 3e38, np.float32))),
         argv=None),
    Case("qnt-moe-unknown-layout", E.UnknownMoeLayoutError,
         ["QNT-007", "tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight'",
          "found \"model_type 'deepseek_v3' with num_local_experts = 4\"", "--skip-modules"],
         _moe_of_unknown_layout, run=lambda src, out: convert(src, out, to="nf4"),
         argv=["{src}", "--to", "nf4", "-o", "{out}", "-q"]),
    # ---- output
    Case("output-exists", E.OutputExistsError, ["Failed to write", "OUT-001", "--overwrite"], one_file(V),
         run=_existing_output, argv=None),
    Case("disk-full", E.DiskSpaceError, ["Failed to write", "OUT-002", "found '4096 bytes free'"], one_file(V),
         run=_disk_full, argv=None),
    Case("disk-full-mid-run", E.DiskSpaceError,
         ["Failed to write", "out.safetensors'", "OUT-002", "filled up while the output was written",
          "No space left on device (errno 28)"], one_file(V), run=_full_mid_run, argv=None),
    Case("verify-mismatch", E.VerificationError, ["Failed to verify", "out.safetensors'", "OUT-003",
                                                  "expected 'BF16 [4, 32]', found 'F32 [4, 32]'"], one_file(V),
         run=_verify_mismatch, argv=None),
    Case("overwrite-a-folder", E.OverwriteRefusedError, ["Failed to write", "things'", "OUT-005",
                                                        "found \"subdirectories ['photos']\""], one_file(V),
         run=_overwrite_a_folder, argv=None),
    Case("output-busy", E.OutputBusyError, ["Failed to write", "out.safetensors'", "OUT-004",
                                            "another convert-bnb run", ".out.safetensors.convert-bnb-lock'"],
         one_file(V), run=_busy_output,
         argv=None),
    Case("targets-failed", E.TargetsFailedError,
         ["Failed to write", "OUT-006", "1 of 2 targets failed: gguf:q8_0 (GGUF-004)",
          "the 1 other output is complete"],
         # (the bf16 output is kept by design: the set's folder lies beside the checked output's)
         one_file(V), run=lambda src, out: convert(src, out.parent.parent / "set", to="bf16,gguf:q8_0"), argv=None),
    # ---- usage
    Case("unknown-target", E.UsageError, ["USE-001", "unknown --to value 'int3'"], one_file(V), run=_bad_to,
         argv=["{src}", "--threads", "0", "-o", "{out}"], same_message=False),
    Case("report-in-missing-directory", E.UsageError,
         ["Failed to write", "no-such-dir/merge.json'", "USE-001", "--report: the report's directory does not exist"],
         adapter(), run=_report_in_missing_dir,
         argv=[str(BASE_MODEL), "--to", "bf16", "--merge-lora", "{src}", "-o", "{out}", "--report",
               "{out}/../no-such-dir/merge.json"], same_message=False),
    Case("output-inside-input", E.OutputInsideInputError, ["USE-002", "converted'", "inside it"],
         lambda d: model_dir(d / "model", {"model.safetensors": V}), run=_inside_input,
         argv=["{src}", "-o", "{src}/converted"]),
    Case("output-dir-named-safetensors", E.OutputKindError, ["USE-003", "out.safetensors'", "directory"],
         lambda d: model_dir(d / "model", {"model.safetensors": V}),
         run=lambda src, out: convert(src, out.with_name("out.safetensors")),
         argv=["{src}", "-o", "{out}.safetensors", "-q"], same_message=False),
    Case("overwrite-file-with-directory", E.OutputKindError, ["USE-003", "expected 'a directory', found 'a file'"],
         lambda d: model_dir(d / "model", {"model.safetensors": V}), run=_overwrite_other_kind, argv=None),
    Case("overwrite-a-fifo", E.OutputKindError,
         ["Failed to write", "fifo'", "USE-003", "neither a file nor a directory",
          "expected 'a file or a directory', found 'a FIFO (named pipe)'"], one_file(V), run=_overwrite_a_fifo,
         argv=None),
    Case("output-under-a-file", E.OutputKindError,
         ["Failed to write", "existing.txt'", "USE-003 a parent of -o is not a directory",
          "expected 'a directory', found 'a file'"], one_file(V), run=_output_under_a_file, argv=None),
    # ---- batch JOBS files (convert-bnb batch)
    Case("batch-bad-json", E.BatchFileError, ["BATCH-001", "jobs.json'", "not valid JSON"],
         batch('[{"src": ', "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-json-nested-100k", E.BatchFileError, ["jobs.json'", "BATCH-001 the JOBS file", *DEEP_PARTS],
         batch(DEEP, "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-json-int-5000-digits", E.BatchFileError, ["BATCH-001 the JOBS file", *INT_PARTS],
         batch('[{"src": "org/a", "max_shard_size": ' + BIG_INT + "}]", "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-json-nan", E.BatchFileError, ["BATCH-001 the JOBS file holds NaN, which is not JSON"],
         batch('[{"src": "org/a", "max_shard_size": NaN}]', "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-json-lone-surrogate", E.BatchFileError,
         ["BATCH-001 the JOBS file holds a lone UTF-16 surrogate escape", "found 'a\\udc80'"],
         batch('[{"src": "org/a", "name": "a\\udc80"}]', "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-too-large", E.BatchFileError,
         ["BATCH-001 the JOBS file is larger than the limit", f"expected 'at most {16 * MiB} bytes'"],
         batch("# a comment\n" * (16 * MiB // 12 + 1)), run=run_batch, argv=BATCH_ARGV),
    Case("batch-job-without-src", E.BatchJobError, ["BATCH-002", "needs a source"],
         batch('[{"to": "bf16"}]', "jobs.json"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-unknown-option", E.BatchOptionError, ["BATCH-003", "--bogus"],
         batch(f"{BASE_MODEL} --bogus 1\n"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-same-output-name", E.BatchNameClashError, ["BATCH-004", "--name"],
         batch(f"{BASE_MODEL} --to bf16\n{BASE_MODEL} --to bf16\n"), run=run_batch, argv=BATCH_ARGV),
    Case("batch-settings-changed", E.JobSettingsChangedError,
         ["BATCH-005", "job'", "other settings", "to=fp16", "to=bf16", "--overwrite"], one_file(V),
         run=_batch_settings_changed, argv=None),
    Case("batch-foreign-files", E.ForeignFilesError, ["BATCH-006", "job'", "did not write", "notes.txt"],
         lambda d: model_dir(d / "model", {"model.safetensors": V}), run=_batch_foreign_files, argv=None),
    # ---- unsupported
    Case("nested-blocksize-huge", E.BlocksizeError, ["BNB-002", "nested_blocksize", "found 633787143"],
         one_file(with_state(VN, nested_blocksize=633787143))),
    Case("no-reader-for-suffix", E.UnsupportedError, ["UNS-001", "no reader for '.npz' files"],
         raw_file(b"PK\x03\x04" + b"\0" * 60, "weights.npz")),
]


def out_for(src: Path, tmp: Path) -> Path:
    """Where a case converts ``src`` to: a directory for a directory input, else one .safetensors file."""
    return tmp / "outdir" / ("out" if src.is_dir() else "out.safetensors")
