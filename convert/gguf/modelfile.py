"""``--modelfile``: an Ollama Modelfile beside a GGUF (:class:`ModelfileJob`), committed once the GGUF is.

The Modelfile (`Ollama's format <https://github.com/ollama/ollama/blob/main/docs/modelfile.md>`_) is made from
the GGUF's planned metadata, so it says what the file holds:

- ``FROM ./NAME.gguf``: the GGUF, by its path relative to the Modelfile (``ollama create`` resolves it from the
  Modelfile's folder); a split GGUF gets a ``FROM`` line per part (each ``FROM`` adds its file to the
  create request, and the Ollama versions that import split GGUFs need every part), and ``--mmproj`` a
  ``FROM`` line for the vision projector (``ollama create`` files a GGUF whose ``general.type`` is ``mmproj``
  as the model's projector: ``server/create.go`` ``isProjectorGGUF``; ``ADAPTER`` is for LoRA adapters).
- ``TEMPLATE``: the Go template Ollama ships for the family of the GGUF's ``tokenizer.chat_template`` (the
  chat template of tokenizer_config.json or chat_template.jinja, as llama.cpp's converter writes it),
  recognised by :func:`convert.gguf.ollama.recognise`; none when it is not recognised, with a comment in the
  file and a note saying why (``ollama create`` then takes its template closest to the GGUF's
  ``tokenizer.chat_template``, or none).
- ``PARAMETER stop``: the template's stop strings (Ollama's ``template/NAME.json``), then the text of the
  GGUF's end-of-generation tokens (``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``) and
  of generation_config.json's ``eos_token_id`` (an id or a list of ids), each once.
- ``PARAMETER temperature|top_k|top_p|min_p|repeat_penalty|repeat_last_n``: the GGUF's ``general.sampling.*``
  values (generation_config.json's ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``,
  ``penalty_last_n``, or ``--metadata``, as gguf-py's ``Metadata`` reads them; transformers'
  ``repetition_penalty`` when there is no ``penalty_repeat``, as the gguf-py of llama.cpp's pinned revision reads
  it and PyPI's gguf 0.19.0 does not), named as Ollama names them (``docs/modelfile.md``); ``general.sampling.*``
  values Ollama has no parameter for (``sequence``, ``xtc_*``, ``mirostat*``: deprecated in Ollama's parser) are
  left out with a note.

Values are written so that Ollama's Modelfile parser (``parser/parser.go``) reads them back as they are: the
template between ``\"\"\"``, stop strings between ``"`` (a token holding ``"`` or a character that is not
printable cannot be written so and is left out, with a note), a ``FROM`` path between ``"`` when it holds a
blank (a path holding ``"`` or a character that is not printable is USE-001, before anything is written).

Same input, same bytes: the text depends on the GGUF's metadata and the file names alone.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from convert.gguf.general import read_generation_config
from convert.gguf.ollama import recognise
from convert.gguf.plan import GGUFPlan
from convert.options import ConvertOptions
from convert.output import ShardLedger, write_synced
from convert.stream.pipeline import RunSettings
from formats.checkpoint import path_kind
from formats.errors import ConvertBnbError, OutputExistsError, OutputKindError, UsageError, VerificationError

__all__ = ["SAMPLING_PARAMETERS", "Modelfile", "ModelfileJob", "check_name", "make_modelfile", "plan_modelfile"]

_G = gguf.Keys.General
#: ``general.sampling.*`` key -> the Ollama ``PARAMETER`` that sets it (Ollama's ``docs/modelfile.md`` table).
SAMPLING_PARAMETERS: dict[str, str] = {
    _G.SAMPLING_TEMP: "temperature",
    _G.SAMPLING_TOP_K: "top_k",
    _G.SAMPLING_TOP_P: "top_p",
    _G.SAMPLING_MIN_P: "min_p",
    _G.SAMPLING_PENALTY_REPEAT: "repeat_penalty",
    _G.SAMPLING_PENALTY_LAST_N: "repeat_last_n",
}
#: ``general.sampling.*`` keys Ollama has no parameter for (its parser warns that ``mirostat*`` is deprecated).
_NO_PARAMETER = (_G.SAMPLING_SEQUENCE, _G.SAMPLING_XTC_PROBABILITY, _G.SAMPLING_XTC_THRESHOLD, _G.SAMPLING_MIROSTAT,
                 _G.SAMPLING_MIROSTAT_TAU, _G.SAMPLING_MIROSTAT_ETA)
#: The GGUF's end-of-generation token ids, in the order their text becomes a stop string.
_END_IDS = (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID)
_TEMPLATE_DOCS = "https://github.com/ollama/ollama/blob/main/docs/template.md"


def check_name(name: str) -> None:
    """Refuse a Modelfile name that is not a plain file name (it is written beside the GGUF).

    Raises:
        UsageError: USE-001, an empty name, ``.``/``..``, one holding a path separator or NUL, or starting with ``.``.
    """
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name or name.startswith("."):
        raise UsageError("the Modelfile's name must be a plain file name (it is written beside the GGUF)",
                         expected="a name such as Modelfile", found=repr(name))


def _quotable(text: str) -> bool:
    """Whether Ollama's Modelfile parser reads ``"text"`` back as ``text``: no ``"`` (it has no escapes) and
    only printable characters (it drops the others)."""
    return bool(text) and '"' not in text and text.isprintable()


def _from_line(path: Path, where: Path) -> str:
    """``FROM PATH`` for ``path`` relative to the folder ``where`` of the Modelfile (``./NAME`` beside it).

    Raises:
        UsageError: USE-001, a path that a Modelfile cannot hold (``"`` or a character that is not printable).
    """
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(where))
    rel = rel if rel.startswith("..") else f"./{rel}"
    if not _quotable(rel):
        raise UsageError("--modelfile: a GGUF file name with '\"' or a character that is not printable cannot be "
                         "written in a Modelfile", path=path, hint="choose another name with -o")
    return f'FROM "{rel}"' if any(c.isspace() for c in rel) else f"FROM {rel}"


def _comment(text: str) -> list[str]:
    """``text`` as Modelfile comment lines of at most 100 characters (``# ...``)."""
    return [f"# {line}" for line in textwrap.wrap(text, 98, break_long_words=False, break_on_hyphens=False)]


def _number(value: Any) -> str | None:
    """A sampling value as a Modelfile writes it (the shortest text that reads back as the value), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return repr(value) if isinstance(value, float) else str(value)


def _ids(value: Any) -> list[int]:
    """generation_config.json's ``eos_token_id``: an id or a list of ids (anything else: none)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _token_text(tokens: Sequence[Any], token_id: Any) -> str | None:
    """The text of token ``token_id`` of the GGUF's token list (``bytes`` or ``str`` entries), or None (no such
    id, or not UTF-8)."""
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < len(tokens):
        return None
    token = tokens[token_id]
    if isinstance(token, bytes):
        try:
            return token.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return token if isinstance(token, str) else None


@dataclass(frozen=True)
class Modelfile:
    """A Modelfile's text and what the run says about it.

    Attributes:
        text: the Modelfile (UTF-8 text, ``\\n`` line ends).
        template: the name of Ollama's template used for ``TEMPLATE``, or None (no ``TEMPLATE`` line).
        notes: what the user should know (the template used or why none, stop tokens or sampling values left out).
    """

    text: str
    template: str | None
    notes: tuple[str, ...]


def make_modelfile(metadata: Mapping[str, tuple[Any, Any, Any]], path: Path, files: Sequence[Path],
                   projector: Path | None = None, generation_config: Mapping[str, Any] | None = None) -> Modelfile:
    """The Modelfile of a GGUF (see the module docstring for each line).

    Args:
        metadata: the GGUF's planned metadata (:attr:`convert.gguf.plan.GGUFPlan.metadata`: key -> (value,
            type, element type)).
        path: where the Modelfile goes (``FROM`` paths are relative to its folder).
        files: the GGUF's file, or a split GGUF's parts in order.
        projector: the ``--mmproj`` file, or None.
        generation_config: the model's generation_config.json (its ``eos_token_id``), or None.

    Raises:
        UsageError: USE-001, a file path a Modelfile cannot hold.
    """
    def value(key: str) -> Any:
        entry = metadata.get(key)
        return entry[0] if entry is not None else None

    gguf_name = files[0].name
    notes: list[str] = []
    lines = [f"# Ollama Modelfile for {gguf_name}, written by convert-bnb: ollama create NAME -f {path.name}"]
    if len(files) > 1:
        lines.append(f"# the {len(files)} parts of the split GGUF (Ollama merges them when it imports the model)")
    lines += [_from_line(f, path.parent) for f in files]
    if projector is not None:
        lines.append("# the vision projector (ollama create keeps a GGUF of general.type mmproj as the projector)")
        lines.append(_from_line(projector, path.parent))
    jinja = value(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    jinja = jinja if isinstance(jinja, str) else None
    found = recognise(jinja)
    template = found.template
    stops: list[str] = []
    if template is not None:
        left = f" (the original's {' and '.join(found.left_out)} are not in it)" if found.left_out else ""
        lines += _comment(f"TEMPLATE: Ollama's {template.name} template (its template/{template.name}.gotmpl) for "
                          f"the model's {template.family} chat template{left}")
        lines.append(f'TEMPLATE """{template.text}"""')
        stops += template.stop
        notes.append(f"Modelfile: TEMPLATE is Ollama's {template.name} template, for the model's {template.family} "
                     f"chat template{left}")
    else:
        fallback = ("Ollama sends the prompt as it is" if jinja is None else
                    "ollama create takes its template closest to the GGUF's tokenizer.chat_template, or none (the "
                    "prompt as it is) when none is close")
        lines += _comment(f"TEMPLATE: none, the chat template is not translated: {found.reason}; {fallback}. Add "
                          f"a TEMPLATE in Ollama's Go template syntax ({_TEMPLATE_DOCS}) to chat with the model")
        notes.append(f"Modelfile: the chat template is not translated: {found.reason}; no TEMPLATE line, so "
                     f"{fallback}")
    tokens = value(gguf.Keys.Tokenizer.LIST) or []
    ids = [value(k) for k in _END_IDS] + _ids((generation_config or {}).get("eos_token_id"))
    stops += [t for t in (_token_text(tokens, i) for i in ids) if t is not None]
    skipped = sorted({s for s in stops if not _quotable(s)})
    if skipped:
        notes.append(f"Modelfile: stop token(s) {', '.join(map(repr, skipped))} left out (a Modelfile cannot hold "
                     "'\"' or characters that are not printable in a value)")
    lines += [f'PARAMETER stop "{s}"' for s in dict.fromkeys(stops) if _quotable(s)]
    for key, name in SAMPLING_PARAMETERS.items():
        text = _number(value(key))
        if text is None and key == _G.SAMPLING_PENALTY_REPEAT:  # (PyPI's gguf 0.19.0 reads penalty_repeat alone)
            text = _number((generation_config or {}).get("repetition_penalty"))
        if text is not None:
            lines.append(f"PARAMETER {name} {text}")
    unused = [k for k in _NO_PARAMETER if value(k) is not None]
    if unused:
        notes.append(f"Modelfile: {', '.join(unused)} left out (Ollama has no such parameter)")
    return Modelfile("\n".join(lines) + "\n", template.name if template is not None else None, tuple(notes))


class ModelfileJob:
    """The Modelfile of one GGUF output, written, verified and committed as a one-file output of its own (a
    :class:`convert.targets.TargetJob`, through the same output claim as the GGUF: :mod:`convert.output`).

    Args:
        modelfile: the text (:func:`make_modelfile`).
        path: where it goes.
    """

    is_dir = False
    file_suffix = ""
    naming = None
    tensors = elements = in_nbytes = 0

    def __init__(self, modelfile: Modelfile, path: Path) -> None:
        self.modelfile = modelfile
        self.path = path
        self.data = modelfile.text.encode("utf-8")
        self.out_nbytes = self.disk_nbytes = len(self.data)

    def plan_dict(self) -> dict[str, Any]:
        return {"output": str(self.path), "template": self.modelfile.template, "text": self.modelfile.text,
                "notes": list(self.modelfile.notes)}

    def describe(self) -> str:
        lines = [f"Modelfile {self.path}: {len(self.data)} bytes, TEMPLATE "
                 + (f"Ollama's {self.modelfile.template}" if self.modelfile.template else "none")]
        lines += [f"  | {line}" for line in self.modelfile.text.splitlines()]
        lines += [f"  note: {n}" for n in self.modelfile.notes]
        return "\n".join(lines)

    def output_parts(self, out: Path) -> list[Path] | None:
        return None

    def write(self, staging: Path, run: RunSettings, ledger: ShardLedger | None) -> tuple[int, int]:
        write_synced(staging, self.modelfile.text)
        return 1, 0

    def verify(self, staging: Path) -> None:
        found = staging.read_bytes()
        if found != self.data:
            raise VerificationError("the Modelfile read back differs from what was written", path=self.path,
                                    action="verify", expected=f"{len(self.data)} bytes", found=f"{len(found)} bytes")

    def notes(self) -> list[str]:
        return list(self.modelfile.notes)

    def details(self) -> dict[str, Any]:
        return {"modelfile": {"output": str(self.path), "template": self.modelfile.template}}

    def fp16_counts(self) -> tuple[int, int]:
        return 0, 0


def plan_modelfile(options: ConvertOptions, gplan: GGUFPlan, model_dir: Path, out: Path, parts: list[Path] | None,
                   mmproj: Path | None) -> ModelfileJob | None:
    """The ``--modelfile`` job of a GGUF conversion (None without ``options.modelfile``), checked against the
    run's other outputs before anything is written.

    Args:
        options: ``modelfile`` (its name beside the GGUF), ``overwrite``, ``dry_run``.
        gplan: the GGUF's plan (its metadata).
        model_dir: the model directory (its generation_config.json).
        out: the GGUF's path; parts: a split GGUF's parts (``out`` the first), or None.
        mmproj: the ``--mmproj`` path, or None.

    Raises:
        UsageError: USE-001, a name that is not a plain file name, the name of another output of the run, or a
            GGUF path a Modelfile cannot hold.
        OutputKindError: USE-003, the Modelfile's path is a directory or anything else but a file (or a symlink),
            with ``--overwrite`` and in a dry run too.
        OutputExistsError: OUT-001, the Modelfile exists and ``--overwrite`` was not given (not with ``dry_run``).
    """
    if options.modelfile is None:
        return None
    check_name(options.modelfile)
    path = out.parent / options.modelfile
    files = parts or [out]
    others = {os.path.abspath(p) for p in [*files, *([mmproj] if mmproj is not None else [])]}
    if os.path.abspath(path) in others:
        raise UsageError("--modelfile names another output of the run", expected="a name of its own",
                         found=str(path))
    kind = path_kind(path, follow_symlinks=False)
    if kind not in ("missing", "file", "a symlink") and not kind.startswith("unreadable"):
        raise OutputKindError("--modelfile names an existing path that is not a file, which convert-bnb never "
                              "writes over, even with --overwrite", path=path, action="write", expected="a file",
                              found={"directory": "a directory"}.get(kind, kind),
                              hint="remove it yourself, or give the Modelfile another name with --modelfile NAME")
    if os.path.lexists(path) and not options.overwrite and not options.dry_run:
        raise OutputExistsError("output exists", path=path, action="write",
                                hint="pass --overwrite to replace it, or choose -o")
    try:
        gen = read_generation_config(model_dir)
    except (ConvertBnbError, OSError):  # (the GGUF's plan noted it: not read for general.* either)
        gen = {}
    return ModelfileJob(make_modelfile(gplan.metadata, path, files, mmproj, gen), path)
