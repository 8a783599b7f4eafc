"""The ``general.*`` keys of a GGUF file and the parts of its default name, made as llama.cpp's
``convert_hf_to_gguf.py`` makes them (``ModelBase.prepare_metadata``), with gguf-py's own functions:

1. ``gguf.Metadata.load(metadata_override, model_dir, model_name, total_params)`` reads the model card's
   YAML front matter (README.md: name, license, base_model, tags, datasets, language, ...), config.json's
   ``_name_or_path``, the directory's name (basename, size label, finetune and version guessed from a name
   such as ``Llama-3.2-1B-Instruct``), generation_config.json's sampling values, and last the
   ``--metadata`` file's keys;
2. ``general.name`` is the directory's name when none of those gave one; a Hub repo's id is the name
   whatever they gave (the converter's ``--remote``);
3. ``general.size_label`` is ``gguf.size_label(total, shared, per expert, experts)`` of the parameters
   written (:func:`parameter_counts`) when neither the card, the name nor the override gave one;
4. ``gguf.Metadata.set_gguf_meta_model(writer)`` adds the keys (:func:`convert.gguf.plan.plan_gguf`, and
   :func:`convert.gguf.mmproj.plan_mmproj` with the projector's own parameters), and the file's default
   name is gguf-py's ``naming_convention`` of them (:func:`naming`, :func:`convert.output_names.gguf_file_name`).

What convert-bnb adds for bnb checkpoints, and for inputs gguf-py would stop on:

- The name gguf-py reads is the folder's (or the repo's) without its quantization words
  (:func:`convert.output_names.strip_quant_suffix`), and so is config.json's ``_name_or_path``: the GGUF of
  ``llama-3-8b-bnb-4bit`` is the converter's GGUF of ``llama-3-8b``. gguf-py reads a directory, so it is
  given a private one of that name (:class:`_View`) holding links to the model card and the generation
  config and a config.json with that ``_name_or_path`` alone (the one config key it reads).
- The model card (at most :data:`MAX_CARD_BYTES`) and generation_config.json (within
  :data:`formats.jsonfile.CONFIG`'s limits, an object) are checked before gguf-py reads them. A card whose
  front matter does not parse (YAML, UTF-8) is left out with a note, where the converter stops with a
  traceback; a value of the wrong type (a ``license`` that is no text, an empty ``tags`` list, a sampling
  value that is no number, ...), on which the converter's writer fails, is left out with a note naming it;
  gguf-py's own log messages about the card become notes.
- The ``--metadata`` file (:func:`read_override`) is checked first, strictly: JSON within limits, an object,
  only the keys the converter reads (:data:`OVERRIDE_KEYS`: a key it would ignore, such as
  ``general.license``, is refused), each value of the type its key is written as (USE-001). A missing file
  is refused too (the converter ignores it).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import struct
import tempfile
import typing
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gguf
import yaml  # (PyYAML: installed with gguf and huggingface_hub, which require it)

from convert.output_names import GgufNaming, gguf_encoding, strip_quant_suffix
from formats import jsonfile
from formats.checkpoint import path_kind
from formats.errors import ConvertBnbError, UsageError

__all__ = ["MAX_CARD_BYTES", "OVERRIDE_KEYS", "MetadataSource", "model_metadata", "naming", "parameter_counts",
           "read_generation_config", "read_override"]

_G = gguf.Keys.General

#: The keys llama.cpp's converter reads from its ``--metadata`` file (``gguf.Metadata.load``) -> the
#: ``gguf.Metadata`` field each sets. ``general.license`` is not among them (the license comes from the
#: model card); ``tests/gguf/test_naming.py`` checks this table against gguf-py's ``Metadata.load``.
OVERRIDE_KEYS: dict[str, str] = {
    _G.SAMPLING_SEQUENCE: "sampling_sequence",
    _G.SAMPLING_TOP_K: "sampling_top_k",
    _G.SAMPLING_TOP_P: "sampling_top_p",
    _G.SAMPLING_MIN_P: "sampling_min_p",
    _G.SAMPLING_XTC_PROBABILITY: "sampling_xtc_probability",
    _G.SAMPLING_XTC_THRESHOLD: "sampling_xtc_threshold",
    _G.SAMPLING_TEMP: "sampling_temp",
    _G.SAMPLING_PENALTY_LAST_N: "sampling_penalty_last_n",
    _G.SAMPLING_PENALTY_REPEAT: "sampling_penalty_repeat",
    _G.SAMPLING_MIROSTAT: "sampling_mirostat",
    _G.SAMPLING_MIROSTAT_TAU: "sampling_mirostat_tau",
    _G.SAMPLING_MIROSTAT_ETA: "sampling_mirostat_eta",
    _G.NAME: "name",
    _G.AUTHOR: "author",
    _G.VERSION: "version",
    _G.ORGANIZATION: "organization",
    _G.FINETUNE: "finetune",
    _G.BASENAME: "basename",
    _G.DESCRIPTION: "description",
    _G.QUANTIZED_BY: "quantized_by",
    _G.SIZE_LABEL: "size_label",
    _G.LICENSE_NAME: "license_name",
    _G.LICENSE_LINK: "license_link",
    _G.URL: "url",
    _G.DOI: "doi",
    _G.UUID: "uuid",
    _G.REPO_URL: "repo_url",
    _G.SOURCE_URL: "source_url",
    _G.SOURCE_DOI: "source_doi",
    _G.SOURCE_UUID: "source_uuid",
    _G.SOURCE_REPO_URL: "source_repo_url",
    "general.base_models": "base_models",
    "general.datasets": "datasets",
    _G.TAGS: "tags",
    _G.LANGUAGES: "languages",
}

#: The entry keys ``Metadata.set_gguf_meta_model`` writes of each base model and dataset
#: (``general.base_model.{id}.name`` ...), from gguf-py's key names.
_ENTRY_KEYS = frozenset(getattr(_G, attr).rsplit(".", 1)[-1] for attr in dir(_G)
                        if attr.startswith("BASE_MODEL_") and attr != "BASE_MODEL_COUNT")

#: The largest model card (README.md) read: gguf-py reads the whole file and parses its front matter.
MAX_CARD_BYTES = 4 * 1024 * 1024

#: The GGUF type a number field of gguf.Metadata is written as (the sampling values: ``GGUFWriter.add_int32``,
#: ``add_float32``).
_NUMBER_TYPES = {int: gguf.GGUFValueType.INT32, float: gguf.GGUFValueType.FLOAT32}
#: A writer whose ``_pack_val`` checks values (it writes nothing).
_PACKER = gguf.GGUFWriter(path=None, arch="general")


@dataclass(frozen=True)
class MetadataSource:
    """Where a model's ``general.*`` keys come from.

    Attributes:
        directory: the model directory (a Hub repo's snapshot): its README.md, generation_config.json.
        model_id: the folder's name, or a Hub repo's id ``org/name``.
        config: config.json as read (its ``_name_or_path``), or None.
        override: the ``--metadata`` file, or None.
    """

    directory: Path
    model_id: str
    config: Mapping[str, Any] | None = None
    override: Path | None = None

    @property
    def view_name(self) -> str:
        """The name gguf-py's heuristics read: the folder's or repo's name without its quantization words
        (``ggml-model``, naming_convention's own fallback, for a name that cannot be a folder's)."""
        name = strip_quant_suffix(self.model_id.rsplit("/", 1)[-1])
        return name if name not in ("", ".", "..") else "ggml-model"

    @property
    def repo_name(self) -> str | None:
        """A Hub repo's id as ``general.name`` (``org/name``, quantization words dropped), else None."""
        if "/" not in self.model_id:
            return None
        return f"{self.model_id.rsplit('/', 1)[0]}/{strip_quant_suffix(self.model_id.rsplit('/', 1)[1])}"


def parameter_counts(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[int, int, int, int]:
    """(total, shared, per-expert, experts) parameters of the tensors written (GGUF name, shape rows
    first), as gguf-py's ``GGUFWriter.get_total_parameter_count`` counts them for the converter's size label:
    every tensor (generated ones such as ``rope_freqs.weight`` too); a stacked ``*_exps.*`` tensor of 3+
    dimensions adds one expert's share (its size over its expert count, the third dimension from the last,
    second for a bias) to the per-expert count; the experts are the mean count over those tensors."""
    total = shared = expert = expert_sum = n_stacks = 0
    for name, shape in tensors:
        size = math.prod(shape)
        if "_exps." in name and len(shape) >= 3:
            count = shape[-2 if ".bias" in name else -3]
            expert += size // count
            expert_sum += count
            n_stacks += 1
        else:
            shared += size
        total += size
    return total, shared, expert, expert_sum // n_stacks if n_stacks else 0


def _field_types() -> dict[str, Any]:
    """gguf.Metadata's fields -> their types without ``Optional`` (``str``, ``int``, ``list[str]``, ...)."""
    hints = typing.get_type_hints(gguf.Metadata)
    out = {}
    for f in fields(gguf.Metadata):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        out[f.name] = args[0] if args else hints[f.name]
    return out


_FIELD_TYPES = _field_types()


def _packs(value: Any, vtype: gguf.GGUFValueType) -> str | None:
    """Why gguf-py's writer cannot pack ``value`` as ``vtype`` (None: it can)."""
    try:
        _PACKER._pack_val(value, vtype, add_vtype=False)
    except (ValueError, OverflowError, UnicodeError, TypeError, AttributeError, struct.error) as exc:
        return f"cannot be written as {vtype.name} ({str(exc)[:60]})"
    return None


def _problem(field: str, value: Any) -> str | None:
    """Why ``Metadata.set_gguf_meta_model`` could not write ``value`` as ``field`` (None: it can): a scalar must
    be of its field's type and pack as its GGUF type; a list of text (``tags``, ``languages``; ``license`` may
    be one, which gguf-py joins with commas) must be a non-empty list of strings; base models and datasets
    a list of objects whose written entries (:data:`_ENTRY_KEYS`) are text."""
    kind = _FIELD_TYPES[field]
    if field == "license" and isinstance(value, list):
        kind = list[str]
    if kind is str:
        return "is not text" if not isinstance(value, str) else _packs(value, gguf.GGUFValueType.STRING)
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            return "is not an integer" if kind is int else "is not a number"
        return _packs(value, _NUMBER_TYPES[kind])
    if not isinstance(value, list):
        return "is not a list"
    if typing.get_args(kind) == (str,):
        if not value:
            return "is an empty list"
        for i, item in enumerate(value):
            why = "is not text" if not isinstance(item, str) else _packs(item, gguf.GGUFValueType.STRING)
            if why is not None:
                return f"[{i}] {why}"
        return None
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            return f"[{i}] is not an object"
        for key in sorted(_ENTRY_KEYS & entry.keys()):
            item = entry[key]
            why = "is not text" if not isinstance(item, str) else _packs(item, gguf.GGUFValueType.STRING)
            if why is not None:
                return f"[{i}].{key} {why}"
    return None


def read_override(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a ``--metadata`` file: a JSON object of the keys llama.cpp's converter reads from its
    own ``--metadata`` (:data:`OVERRIDE_KEYS`), each of the type it is written as.

    Returns:
        the parsed object.

    Raises:
        UsageError: USE-001: no such file or not a regular file, not JSON within :data:`formats.jsonfile.CONFIG`'s
            limits, not an object, a key the converter does not read, a value of another type.
    """
    kind = path_kind(Path(path))
    if kind != "file":
        raise UsageError("--metadata file cannot be read", path=path, action="read",
                         expected="a JSON file of general.* keys",
                         found="no such file" if kind == "missing" else kind)
    try:
        value = jsonfile.load_json_file(path, jsonfile.CONFIG, UsageError, "--metadata file")
    except OSError as exc:
        raise UsageError("--metadata file cannot be read", path=path, action="read",
                         found=exc.strerror or type(exc).__name__) from None
    if not isinstance(value, dict):
        raise UsageError("--metadata file must hold a JSON object", path=path, action="read",
                         expected='{"general.name": "...", ...}', found=type(value).__name__)
    unknown = sorted(k for k in value if k not in OVERRIDE_KEYS)
    if unknown:
        if _G.LICENSE in unknown:
            hint = "general.license is not read from --metadata (the converter takes it from the model card's license)"
        else:
            close = difflib.get_close_matches(unknown[0], list(OVERRIDE_KEYS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "use the keys of the converter's --metadata file"
        raise UsageError(f"--metadata file has a key llama.cpp's converter does not read: {unknown[0]!r}",
                         path=path, action="read", expected=sorted(OVERRIDE_KEYS), found=unknown, hint=hint)
    for key, v in value.items():
        why = _problem(OVERRIDE_KEYS[key], v)
        if why is not None:
            raise UsageError(f"--metadata file: {key!r} {why}", path=path, action="read",
                             expected=_expected(OVERRIDE_KEYS[key]), found=v)
    return value


def _expected(field: str) -> str:
    kind = _FIELD_TYPES[field]
    if kind in (str, int, float):
        return {str: "text", int: "an integer (int32)", float: "a number (float32)"}[kind]
    if typing.get_args(kind) == (str,):
        return "a non-empty list of strings"
    return "a list of objects with text values (" + ", ".join(sorted(_ENTRY_KEYS)) + ")"


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class _Notes(logging.Handler):
    """gguf-py's ``metadata`` log records while a card is read, kept as notes (not printed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured() -> Iterator[_Notes]:
    logger = logging.getLogger("metadata")  # gguf.metadata's logger
    handler, propagate = _Notes(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _card(directory: Path, notes: list[str]) -> Path | None:
    """README.md of ``directory`` when it is a regular file of at most :data:`MAX_CARD_BYTES`, else None
    (a note says why a card that is there is not read)."""
    card = directory / "README.md"
    kind = path_kind(card)
    if kind == "missing":
        return None
    if kind != "file":
        notes.append(f"model card {card}: not a regular file ({kind}): not read for general.*")
        return None
    size = card.stat().st_size
    if size > MAX_CARD_BYTES:
        notes.append(f"model card {card}: {size} bytes, more than {MAX_CARD_BYTES}: not read for general.*")
        return None
    return card


def read_generation_config(directory: Path) -> dict[str, Any]:
    """generation_config.json of ``directory`` as a JSON object within :data:`formats.jsonfile.CONFIG`'s limits
    (``{}`` when there is none).

    Raises:
        ConvertBnbError: it is not a regular file, not JSON within the limits, or not an object.
        OSError: it cannot be read.
    """
    path = directory / "generation_config.json"
    kind = path_kind(path)
    if kind == "missing":
        return {}
    if kind != "file":
        raise ConvertBnbError(f"not a regular file ({kind})")
    value = jsonfile.load_json_file(path, jsonfile.CONFIG, ConvertBnbError, "generation_config.json")
    if not isinstance(value, dict):
        raise ConvertBnbError(f"a JSON {type(value).__name__}, not an object")
    return value


def _generation_config(directory: Path, notes: list[str]) -> Path | None:
    """generation_config.json of ``directory`` when :func:`read_generation_config` reads an object from it, else
    None (a note says why one that is there is not read; gguf-py leaves one it cannot parse out too)."""
    path = directory / "generation_config.json"
    if path_kind(path) == "missing":
        return None
    try:
        read_generation_config(directory)
    except (ConvertBnbError, OSError) as exc:
        notes.append(f"{path}: {getattr(exc, 'message', None) or exc}: its sampling values are not read for general.*")
        return None
    return path


class _View:
    """The directory gguf-py's ``Metadata.load`` reads: named :attr:`MetadataSource.view_name`, holding links
    to the model card and generation config that pass the checks, and a config.json with the cleaned
    ``_name_or_path`` alone (in a private temporary directory, removed by :meth:`close`)."""

    def __init__(self, source: MetadataSource, notes: list[str]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="convert-bnb-general-")
        self.path = Path(self._tmp.name) / source.view_name
        self.path.mkdir()
        self.card = _card(source.directory, notes)
        if self.card is not None:
            (self.path / "README.md").symlink_to(self.card.resolve())
        gen = _generation_config(source.directory, notes)
        if gen is not None:
            (self.path / "generation_config.json").symlink_to(gen.resolve())
        name_or_path = (source.config or {}).get("_name_or_path")
        if isinstance(name_or_path, str):
            head, _, tail = name_or_path.rpartition("/")
            cleaned = f"{head}/{strip_quant_suffix(tail)}" if head else strip_quant_suffix(tail)
            (self.path / "config.json").write_text(json.dumps({"_name_or_path": cleaned}))

    def drop_card(self) -> None:
        (self.path / "README.md").unlink()
        self.card = None

    def close(self) -> None:
        self._tmp.cleanup()


def model_metadata(source: MetadataSource, counts: tuple[int, int, int, int]) -> tuple[gguf.Metadata, list[str]]:
    """The model's ``general.*`` values, as llama.cpp's converter computes them (see the module docstring).

    Args:
        source: the model directory, its id, config.json and the ``--metadata`` file.
        counts: :func:`parameter_counts` of the tensors the file holds.

    Returns:
        (the ``gguf.Metadata`` to write with ``set_gguf_meta_model``, notes on what was left out).

    Raises:
        UsageError: USE-001, a bad ``--metadata`` file (:func:`read_override`).
    """
    override = Path(source.override) if source.override is not None else None
    if override is not None:
        read_override(override)
    notes: list[str] = []
    view = _View(source, notes)
    try:
        with _captured() as logged:
            try:
                meta = gguf.Metadata.load(override, view.path, source.repo_name, counts[0])
            except (yaml.YAMLError, UnicodeError, OSError, RecursionError) as exc:
                if view.card is None:
                    raise
                notes.append(f"model card {view.card}: its front matter cannot be read "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}): "
                             "not read for general.*")
                view.drop_card()
                meta = gguf.Metadata.load(override, view.path, source.repo_name, counts[0])
        notes += [f"model card {source.directory / 'README.md'}: {m}" for m in logged.messages]
    finally:
        view.close()
    for f in fields(meta):
        value = getattr(meta, f.name)
        why = None if value is None else _problem(f.name, value)
        if why is not None:
            where = "generation_config.json" if f.name.startswith("sampling_") else "the model card (README.md)"
            notes.append(f"{where}: {f.name} {why} ({_short(value)}): left out of general.*")
            setattr(meta, f.name, None)
    if meta.name is None:  # the converter: the model directory's name
        meta.name = source.view_name
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    return meta, notes


def naming(meta: gguf.Metadata, file_type: gguf.LlamaFileType, *, mmproj: bool = False) -> GgufNaming:
    """The default file name's parts of a GGUF file of ``file_type`` with these ``general.*`` values, as the
    converter passes them to ``naming_convention``: the size label left out of a vision projector's name,
    which gets the ``mmproj-`` prefix (``MmprojModel.prepare_metadata``)."""
    return GgufNaming(meta.name, meta.basename, meta.finetune, meta.version, None if mmproj else meta.size_label,
                      gguf_encoding(file_type), "mmproj-" if mmproj else "")
