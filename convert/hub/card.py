"""The model card (``README.md``) pushed with an output: one builder for ``--push-to-hub`` of a single run
and of a batch.

:func:`model_card` makes the card with ``huggingface_hub.ModelCard`` / ``ModelCardData``:

- metadata: ``library_name`` (``gguf`` for a GGUF output, else ``transformers``), ``base_model`` (the
  source repo id; none for a local source), ``base_model_relation`` (:func:`base_model_relation`), ``tags``
  (:func:`card_claims`), and the source card's ``license`` / ``license_name`` / ``license_link``
  (:func:`source_license`);
- body: the source (repo, revision and commit, or a local folder's name only: no path of this machine is
  published), what the values are (:func:`card_claims`: bit-exact only for ``auto`` and ``fp32``), the
  settings, the figures the run measured, the command, and every file with its size and sha256.

``base_model_relation`` takes the Hub's documented values (``adapter``, ``merge``, ``quantized``,
``finetune``; https://huggingface.co/docs/hub/model-cards#specifying-a-base-model): ``merge`` when LoRA
adapters were merged in, ``quantized`` for a GGUF or NF4/FP4 output, and none for a dequantized float copy,
which none of the four describes (the card's text says what it is). A GGUF LoRA adapter (an adapter as SRC) is
``adapter`` of its base model: ``base_model`` is the base's repo id (none for a local base), and the card says
what the file is and how PEFT's scales were carried (the adapter's scale notes).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convert import __version__
from convert.options import Target

__all__ = ["LICENSE_KEYS", "LOSSLESS_TARGETS", "CardSource", "base_model_relation", "card_claims", "model_card",
           "published_command", "source_license"]

#: Targets whose output holds bitsandbytes' dequantized values exactly and every other tensor unchanged:
#: ``auto`` keeps each tensor's dtype, ``fp32`` holds every bf16/fp16 value exactly.
LOSSLESS_TARGETS = ("auto", "fp32")

#: The source card's metadata keys a pushed card carries over.
LICENSE_KEYS = ("license", "license_name", "license_link")


@dataclass(frozen=True)
class CardSource:
    """What a card says of the source.

    Attributes:
        repo_id: the Hub repo id (``org/name``), or None for a local source.
        name: how the card names it: the repo id, or a local source's last path component.
        revision: the revision asked for (None: the default branch); a Hub source only.
        commit: the commit converted; a Hub source only.
        quantization: one line per group of the source's quantized layers.
        license: the source card's license keys (:data:`LICENSE_KEYS`), as :func:`source_license` gives them.
    """

    repo_id: str | None
    name: str
    revision: str | None = None
    commit: str | None = None
    quantization: tuple[str, ...] = ()
    license: dict[str, str] = field(default_factory=dict)


def card_claims(target: Target) -> tuple[str, list[str]]:
    """What a card may say about an output made ``--to target``: (one sentence on the values, the tags).

    Only ``auto`` and ``fp32`` are called bit-exact; bf16/fp16 round other tensors, nf4/fp4 and GGUF
    quantize or round again.
    """
    to = target.name
    if to in LOSSLESS_TARGETS:
        what = "each tensor in its original dtype" if to == "auto" else "float32"
        return (f"Dequantized to {what}: every weight is bit-exact with bitsandbytes' own dequantization "
                "(`dequantize_4bit`, LLM.int8), and every other tensor is kept exactly.",
                ["bitsandbytes-dequantized"])
    if to in ("bf16", "fp16"):
        name = {"bf16": "bfloat16", "fp16": "float16"}[to]
        return (f"Dequantized to {name}: every 4-bit/8-bit weight is bitsandbytes' float32 dequantization rounded "
                f"once to {name} (what bitsandbytes returns when asked for {name}); other tensors are cast to "
                f"{name}, which may round them.", ["bitsandbytes-dequantized"])
    if to in ("nf4", "fp4"):
        return (f"Re-quantized to {to.upper()} in bitsandbytes' own layout (bit-identical to "
                "`bitsandbytes.functional.quantize_4bit` of the dequantized weights). 4-bit quantization is lossy: "
                "this is not a copy of the source's values.", ["bitsandbytes", "4-bit", to])
    return (f"A GGUF file (`--to {to}`) for llama.cpp and Ollama: each tensor is the dequantized weight converted "
            "to its GGML type, a second rounding for every type but F32, so it is not bit-exact with bitsandbytes "
            "(the per-tensor error is in the conversion's `--json` output).", ["gguf"])


def base_model_relation(target: Target, merged: bool = False) -> str | None:
    """The card's ``base_model_relation``: ``merge`` with LoRA adapters merged in, ``quantized`` for a GGUF or
    NF4/FP4 output, None (left out) for a dequantized float copy."""
    if merged:
        return "merge"
    return "quantized" if target.family in ("gguf", "bnb4") else None


def source_license(source_dir: Path | None, repo_id: str | None = None, commit: str | None = None) -> dict[str, str]:
    """The license keys (:data:`LICENSE_KEYS`) of the source's model card (``README.md`` in a model directory or
    Hub snapshot), for the pushed card.

    A relative ``license_link`` (``LICENSE`` in the source repo) is made absolute for a Hub source
    (``https://huggingface.co/ORG/NAME/blob/COMMIT/LICENSE``): the pushed repo may not hold that file.

    Returns:
        ``{key: value}`` of the keys the source card has as strings; ``{}`` without a card, or when its
        metadata cannot be read (a card that does not parse is no reason to refuse a push).
    """
    if source_dir is None or not (source_dir / "README.md").is_file():
        return {}
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(source_dir / "README.md", ignore_metadata_errors=True).data.to_dict()
    except Exception:  # noqa: BLE001 - any failure to parse someone else's card: carry nothing from it
        return {}
    out = {k: data[k] for k in LICENSE_KEYS if isinstance(data.get(k), str) and data[k].strip()}
    link = out.get("license_link")
    if link is not None and repo_id is not None and "://" not in link:
        out["license_link"] = f"https://huggingface.co/{repo_id}/blob/{commit or 'main'}/{link.lstrip('./')}"
    return out


#: Options whose value is a path on this machine even before the run creates it.
_PATH_OPTIONS = ("-o", "--output", "--report", "--quant-report", "--metadata", "--original", "--merge-lora",
                 "--imatrix", "--mmproj")


def published_command(argv: Sequence[str]) -> str:
    """The command line as a card publishes it: ``convert-bnb`` and the arguments as given, shell-quoted, each
    local path (an argument naming an existing path, or the value of an option that takes one) shown by its
    last component only, so the card holds no path of this machine."""
    words, expect_path = [], False
    for arg in argv:
        opt, eq, value = arg.partition("=")
        if expect_path:
            words.append(_last_part(arg))
        elif eq and opt in _PATH_OPTIONS:
            words.append(f"{opt}={_last_part(value)}")
        elif not arg.startswith("-") and os.path.lexists(arg):
            words.append(_last_part(arg))
        else:
            words.append(arg)
        expect_path = not eq and arg in _PATH_OPTIONS
    return shlex.join(["convert-bnb", *words])


def _last_part(path: str) -> str:
    """A path's last component (``./out/m-bf16/`` -> ``m-bf16``); a name stays as it is."""
    name = Path(path.rstrip("/" + os.sep)).name
    return name + ("/" if path.endswith(("/", os.sep)) and name else "") if name else path


def model_card(title: str, target: Target, source: CardSource, files: dict[str, dict[str, Any]], *,
               settings: Iterable[tuple[str, str]] = (), command: str, figures: Iterable[str] = (),
               merged: Iterable[str] = (), adapter: Mapping[str, Any] | None = None) -> str:
    """The model card (``README.md``) pushed with an output, built with ``huggingface_hub.ModelCard``.

    Args:
        title: the card's heading (the pushed repo's name).
        target: the output's target.
        source: the source (:class:`CardSource`).
        files: the files as the repo holds them, ``{path: {"bytes", "sha256"}}`` (``bytes`` None and a
            placeholder sha256 for a file not written yet: a dry run's card).
        settings: ``(setting, value)`` rows of the settings table, after ``--to`` (``converter`` comes last).
        command: the command that makes the output (:func:`published_command`).
        figures: lines of what the run measured (verification, errors), or none (a section only when given).
        merged: the names of LoRA adapters merged in (``base_model_relation: merge``).
        adapter: for a GGUF LoRA adapter, what its job says of it
            (:meth:`convert.gguf.adapter.GgufAdapterJob.adapter_info`: ``base_name``, ``base_repo``,
            ``scale_notes``); ``base_model`` is then the base's repo and ``base_model_relation`` ``adapter``.

    Returns:
        the card text: YAML metadata, then the body (see the module docstring).
    """
    # (heavy: huggingface_hub's API takes ~170 ms to import; only Hub paths need it)
    from huggingface_hub import ModelCard, ModelCardData

    merged = list(merged)
    claim, tags = card_claims(target)
    relation = base_model_relation(target, bool(merged)) if source.repo_id is not None else None
    base = source.repo_id
    src = f"[{source.name}](https://huggingface.co/{source.name})" if source.repo_id is not None else f"`{source.name}`"
    intro = f"{src} converted from its bitsandbytes quantization with convert-bnb {__version__}."
    if adapter is not None:
        base = adapter.get("base_repo")
        relation = "adapter" if base is not None else None
        base_name = str(adapter.get("base_name"))
        based = f"[{base}](https://huggingface.co/{base})" if base is not None else f"`{base_name}`"
        intro = f"The PEFT LoRA adapter {src} converted by convert-bnb {__version__}."
        claim = (f"A GGUF LoRA adapter (`general.type` adapter) for llama.cpp, for the base model {based}: apply it "
                 "to a GGUF of that base (`llama-cli -m BASE.gguf --lora FILE.gguf`, or an Ollama Modelfile's "
                 "`ADAPTER` line); it is not a model by itself. Its tensors are the adapter's lora_A/lora_B "
                 f"converted to `{target}`.")
        tags = ["gguf", "lora"]
    data = ModelCardData(library_name="gguf" if target.family == "gguf" else "transformers",
                         base_model=base, tags=["convert-bnb", *tags], **source.license,
                         **({"base_model_relation": relation} if relation is not None else {}))
    lines = [f"# {title}", "", intro, "", claim, ""]
    lines += ["## Source", "", f"- repo: {source.name}" if source.repo_id is not None else f"- path: {source.name}"]
    if source.repo_id is not None:
        lines += [f"- revision: {source.revision or 'main (default branch)'}", f"- commit: {source.commit}"]
    lines += [f"- quantization: {q}" for q in source.quantization]
    lines += [f"- merged LoRA adapter: {name}" for name in merged]
    if adapter is not None:
        lines.append(f"- base model: {adapter.get('base_repo') or adapter.get('base_name')}")
        lines += [f"- scale: {n}" for n in adapter.get("scale_notes") or []]
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|", f"| --to | {target} |"]
    lines += [f"| {k} | {v} |" for k, v in settings]
    lines += [f"| converter | convert-bnb {__version__} |", ""]
    figures = list(figures)
    if figures:
        lines += ["## Verification", "", *[f"- {f}" for f in figures], ""]
    lines += ["Reproduce with:", "", "```", command, "```", ""]
    lines += ["## Files", "", "| file | bytes | sha256 |", "|---|---:|---|"]
    for rel, rec in sorted(files.items()):
        size = rec["bytes"] if rec["bytes"] is not None else "(after conversion)"
        lines.append(f"| {rel} | {size} | {rec['sha256']} |")
    lines.append("")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
