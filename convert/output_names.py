"""What an output is called and where it goes: the default names (a converted model's name without its
quantization words, llama.cpp's GGUF file names, the Ollama Modelfile's), ``-o`` as given (a file, a folder, a
folder of several targets' outputs), and the names' parts a GGUF conversion knows once planned
(:class:`GgufNaming`). :mod:`convert.output` claims and commits the path chosen here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf

from convert.options import Target
from formats.errors import UsageError

__all__ = [
    "GgufNaming",
    "MODELFILE_NAME",
    "default_output",
    "default_set_output",
    "gguf_encoding",
    "gguf_file_name",
    "modelfile_name",
    "output_name",
    "output_path",
    "plain_naming",
    "revision_label",
    "set_output_path",
    "strip_quant_suffix",
    "with_target_suffix",
]


#: The trailing ``-``-separated words of a bnb checkpoint's name that say how it was quantized
#: (``llama-3-8b-bnb-4bit``, ``Qwen2.5-7B-Instruct-unsloth-bnb-4bit``, ``...-bnb-nf4``, ``...-4bit``), which
#: a converted model's name drops; ``unsloth`` only right before them (unsloth's dynamic 4-bit mark).
_QUANT_SUFFIX = re.compile(r"(?:-unsloth)?(?:-(?:bnb|4bit|8bit|nf4|fp4|int4|int8))+$", re.IGNORECASE)


def strip_quant_suffix(name: str) -> str:
    """``name`` without its trailing bitsandbytes quantization words (:data:`_QUANT_SUFFIX`), any letter case:
    ``llama-3-8b-bnb-4bit`` -> ``llama-3-8b``, ``Qwen2.5-7B-Instruct-unsloth-bnb-4bit`` ->
    ``Qwen2.5-7B-Instruct``, ``Llama-3.2-1B-bnb-nf4`` -> ``Llama-3.2-1B``, ``m-4bit`` -> ``m``. Only
    ``-``-separated words after the first (the separator of Hub names and of llama.cpp's name heuristics):
    ``llama_nf4_dq`` stays as it is, ``bnb-4bit`` becomes ``bnb``, and a name that would be left empty
    (``-4bit``) stays as it is."""
    stripped = _QUANT_SUFFIX.sub("", name)
    return stripped if stripped.strip("-") else name


@dataclass(frozen=True)
class GgufNaming:
    """What a GGUF file's default name is made of: the arguments of gguf-py's
    ``gguf.naming_convention(model_name, base_name, finetune_string, version_string, size_label, output_type)``
    as llama.cpp's ``convert_hf_to_gguf.py`` passes them (``ModelBase.prepare_metadata``: the model's
    ``general.*`` values), giving ``{Name}-{SizeLabel}-{FineTune}-{Version}-{ENCODING}.gguf``.

    Attributes:
        name: ``general.name`` (used when there is no basename; ``/`` and blanks become ``-``).
        basename, finetune, version, size_label: ``general.basename`` etc., or None (left out).
        encoding: llama.cpp's upper-case name of the file type (``general.file_type``):
            :func:`gguf_encoding`, e.g. ``Q4_K_M``, ``F16``, ``BF16``.
        prefix: put before the name: ``mmproj-`` for a vision projector (as the converter's ``--mmproj``).
        kind: gguf-py's ``model_type`` suffix: ``LoRA`` for a LoRA adapter (``convert_lora_to_gguf.py``:
            ``Name-F16-LoRA.gguf``), None for a model.
    """

    name: str | None
    basename: str | None
    finetune: str | None
    version: str | None
    size_label: str | None
    encoding: str
    prefix: str = ""
    kind: Literal["LoRA"] | None = None


def gguf_encoding(file_type: gguf.LlamaFileType) -> str:
    """llama.cpp's name of a file type in file names, as its converter takes it from the ``LlamaFileType``
    member: ``MOSTLY_Q4_K_M`` -> ``Q4_K_M``, ``ALL_F32`` -> ``F32``, ``MOSTLY_BF16`` -> ``BF16``."""
    return file_type.name.partition("_")[2]


def gguf_file_name(naming: GgufNaming, revision: str | None = None) -> str:
    """A GGUF file's default name: ``prefix`` + gguf-py's ``naming_convention`` + ``.gguf``
    (``Llama-3.2-1B-Instruct-Q4_K_M.gguf``, ``Mixtral-8x7B-v0.1-Q8_0.gguf``, ``mmproj-gemma-3-4b-it-F16.gguf``,
    an adapter's ``Adapter-F16-LoRA.gguf``).

    Args:
        naming: the model's name parts and the file type.
        revision: a Hub revision asked for (``org/name@v2``, ``--revision``): appended to the version
            part (:func:`revision_label`), so two revisions of one repo never share a default name.
    """
    version = naming.version
    if revision:
        version = "-".join(v for v in (version, revision_label(revision)) if v)
    stem = gguf.naming_convention(naming.name, naming.basename, naming.finetune, version, naming.size_label,
                                  naming.encoding, naming.kind)
    # a name from a model card or --metadata may hold what no file name should: a path separator or NUL
    # (never a path), a leading '.' (hidden) or '-' (read as an option by the next command)
    stem = re.sub(r"[/\\\x00-\x1f]", "-", stem).lstrip(".-") or naming.encoding
    return f"{naming.prefix}{stem}.gguf"


def output_name(stem: str, to: Target, *, single_file: bool) -> str:
    """The default output name for an input named ``stem`` converted ``--to to``, as far as it is known
    before the input is read.

    ``model-bnb-4bit`` -> ``model-bnb-4bit-bf16`` (a directory), ``weights`` (a file input) ->
    ``weights-bf16.safetensors``, ``--to auto`` -> ``...-dequantized``. GGUF (one file whatever the input)
    follows llama.cpp's naming convention (:func:`gguf_file_name`) with what the name alone gives:
    ``model-bnb-4bit`` ``--to gguf:q8_0`` -> ``model-Q8_0.gguf``; a conversion names its file from the
    model's ``general.*`` keys once it has planned them (size label, basename, finetune, version:
    :func:`default_output` with ``naming``); a batch job keeps this name (it is named before anything is read).

    Args:
        stem: a directory's or repo's name, or a file's name without its suffix.
        to: the target.
        single_file: whether a safetensors output would be one file (a file input).
    """
    if to.family == "gguf":
        return gguf_file_name(plain_naming(stem, to))
    suffix = "dequantized" if to.name == "auto" else to.name.replace(":", "-")
    return f"{stem}-{suffix}" + (".safetensors" if single_file else "")


def plain_naming(stem: str, to: Target) -> GgufNaming:
    """The :class:`GgufNaming` a GGUF output has before its input is read: the name alone, without its
    quantization words (:func:`strip_quant_suffix`), and ``to``'s file type."""
    assert to.gguf_file_type is not None
    return GgufNaming(strip_quant_suffix(stem), None, None, None, None, gguf_encoding(to.gguf_file_type))


def with_target_suffix(name: str, to: Target) -> str:
    """``name`` as a ``--to`` output is named: ``NAME.gguf`` for GGUF (one file whatever the input), else
    unchanged (a safetensors output's suffix depends on the input: :func:`output_name`)."""
    return name if to.family != "gguf" or name.lower().endswith(".gguf") else f"{name}.gguf"


#: The Ollama Modelfile's name beside a GGUF (``--modelfile``), as Ollama's docs and ``ollama create`` name it.
MODELFILE_NAME = "Modelfile"


def modelfile_name(gguf_name: str) -> str:
    """The name of the Modelfile of one GGUF among others in a folder (a batch job's default): ``m-Q8_0.gguf``
    -> ``m-Q8_0.Modelfile``."""
    stem = gguf_name[: -len(".gguf")] if gguf_name.lower().endswith(".gguf") and len(gguf_name) > 5 else gguf_name
    return f"{stem}.{MODELFILE_NAME}"


def revision_label(revision: str) -> str:
    """A Hub revision as part of a file name: ``/`` (``refs/pr/1``) and other characters a name should
    not hold become ``-``; a 40-digit commit sha is shortened to 12 digits (as the Hub shows commits)."""
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision[:12]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", revision).strip("-.") or "rev"


def default_output(src: Path | None, to: Target, repo_id: str | None = None, revision: str | None = None,
                   naming: GgufNaming | None = None) -> Path:
    """Where the output goes without ``-o``: next to a local SRC, or in the working directory for a
    Hub repo (``org/name`` -> ``./name-<suffix>``; with a revision, ``./name-<revision>-<suffix>``, so
    two revisions of one repo never share a default name; :func:`revision_label`). See :func:`output_name`.

    Args:
        src: the local SRC (None for a Hub repo).
        to: the target.
        repo_id: the Hub repo id, or None.
        revision: with ``repo_id``: the revision asked for, or None.
        naming: a GGUF conversion's name parts, once planned (:class:`GgufNaming`): the file is named by
            llama.cpp's convention from them (:func:`gguf_file_name`, the revision in the version part);
            None: the name known before the input is read.
    """
    if repo_id is not None:
        stem, where, single_file = repo_id.rsplit("/", 1)[-1], Path.cwd(), False
    else:
        assert src is not None
        single_file = not src.is_dir()
        stem, where, revision = (src.stem if single_file else src.name), src.parent, None
    if to.family == "gguf":
        return where / gguf_file_name(naming or plain_naming(stem, to), revision)
    if revision:
        stem += f"-{revision_label(revision)}"
    return where / output_name(stem, to, single_file=single_file)


def default_set_output(src: Path | None, repo_id: str | None = None, revision: str | None = None) -> Path:
    """Where a run of several targets (``--to bf16,gguf:q8_0,nf4``) puts its outputs without ``-o``: one folder,
    beside a local SRC (in the working directory for a Hub repo), named as the input without its quantization
    words (:func:`strip_quant_suffix`: ``llama-3-8b-bnb-4bit`` -> ``llama-3-8b``; a file's name without its
    suffix), with the revision as :func:`default_output` adds it, and ``-converted`` added where that name
    would be SRC itself (``llama_nf4_dq`` -> ``llama_nf4_dq-converted``). Each output in it has the name of
    its single run (:func:`default_output`'s name).

    Args:
        src: the local SRC (None for a Hub repo).
        repo_id: the Hub repo id, or None.
        revision: with ``repo_id``: the revision asked for, or None.
    """
    if repo_id is not None:
        stem, where = strip_quant_suffix(repo_id.rsplit("/", 1)[-1]), Path.cwd()
        if revision:
            stem += f"-{revision_label(revision)}"
        return where / stem
    assert src is not None
    stem = strip_quant_suffix(src.name if src.is_dir() else src.stem)
    folder = src.parent / stem
    return folder.with_name(f"{stem}-converted") if folder.name == src.name else folder


def set_output_path(given: str | os.PathLike[str] | None, default: Path) -> Path:
    """The folder of a run of several targets: ``-o`` as given, or ``default`` (:func:`default_set_output`).

    Raises:
        UsageError: USE-001, ``-o`` names a file (an existing one, or a name ending in ``.gguf`` or
            ``.safetensors``: the outputs are several), or no folder of its own (``.``, ``..``, ``/``, empty); the
            folder (given or default) is a model's (config.json or model weights at its top).
    """
    if given is not None:
        text = os.fspath(given)
        path = Path(text)
        if path.suffix.lower() in (".gguf", ".safetensors") or (os.path.lexists(path) and not path.is_dir()):
            raise UsageError("with several --to targets, -o names the folder their outputs go into", path=text,
                             action="write", expected="a folder (each output inside it gets its single run's name)",
                             found="an existing file" if os.path.lexists(path) else f"a {path.suffix} file name")
    folder = default if given is None else output_path(given, default, is_dir=True)
    model = [n for n in ("config.json", "model.safetensors", "model.safetensors.index.json")
             if folder.is_dir() and (folder / n).is_file()]
    if model:  # (a model's folder: the outputs inside it would make it a model --overwrite refuses to replace)
        raise UsageError("the folder of several --to targets' outputs is a model" + (
            "" if given is not None else " (the default folder: the input's name without its quantization words)"),
            path=folder, action="write", expected="a folder for the outputs", found=f"a model folder ({model[0]})",
            hint="choose another folder with -o")
    return folder


def output_path(given: str | os.PathLike[str] | None, default: Path, *, is_dir: bool) -> Path:
    """The output path of a run: ``-o`` as given, or ``default`` without it.

    ``-o DIR/`` (ending in a path separator) for an output that is one file (a file input, GGUF) puts
    the file under its default name in DIR; for a directory output it is DIR itself.

    Args:
        given: ``-o`` as the user typed it (a str keeps a trailing separator), or None.
        default: :func:`default_output` for this run.
        is_dir: whether the output is a directory.

    Raises:
        UsageError: USE-001, ``-o`` names no output of its own (``.``, ``..``, ``/``, an empty string).
    """
    if given is None:
        return default
    text = os.fspath(given)
    path = Path(text)
    if text.endswith(("/", os.sep)) and not is_dir:
        return path / default.name
    if text == "" or path.name in ("", ".", ".."):
        raise UsageError("-o must name the output itself", path=text or "''", action="write",
                         expected="a path such as ./model-bf16 (or DIR/ to put a one-file output into DIR)",
                         found=repr(text))
    return path
