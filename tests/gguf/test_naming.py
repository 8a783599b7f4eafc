"""GGUF file names and ``general.*`` keys against llama.cpp's converter and gguf-py's own functions.

convert_hf_to_gguf.py names a file ``gguf.naming_convention(name, basename, finetune, version, size_label,
ENCODING)`` from ``gguf.Metadata.load(--metadata, model_dir, None, total_params)`` (the model card, config.json's
``_name_or_path``, the directory's name) and ``gguf.size_label`` of the parameters it writes, and writes those
values with ``Metadata.set_gguf_meta_model``. Here the expectations are made with gguf-py itself on a copy of
the model in a folder named *without* the bnb quantization words (``llama-3-8b``, not ``llama-3-8b-bnb-4bit``),
with the parameters counted by gguf-py's ``GGUFWriter.get_total_parameter_count``; and, where torch is
installed, by running the converter itself on the fixture's original bf16 model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from convert.cli import main
from convert.gguf.general import OVERRIDE_KEYS, MetadataSource, model_metadata, naming, parameter_counts
from convert.job import convert
from convert.options import ConvertOptions
from convert.output_names import gguf_file_name, strip_quant_suffix
from formats.errors import UsageError
from tests.helpers.fixtures import MODELS
from tests.helpers.llama_tools import llama_script

FT = gguf.LlamaFileType
LLAMA = MODELS / "llama_nf4_dq"
MIXTRAL = MODELS / "mixtral_nf4_dq"
GEMMA3 = MODELS / "gemma3cg_nf4_dq"

CARD = """---
license: apache-2.0
base_model: meta-llama/Llama-3.2-1B-Instruct
tags:
- llama
- bnb
pipeline_tag: text-generation
datasets:
- HuggingFaceH4/ultrachat_200k
language:
- en
- no
---
# A test model

Some text.
"""
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 40}


def _copy(src: Path, dst: Path, card: str | None = None, generation: dict[str, Any] | None = None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reference", "logits.safetensors"))
    if card is not None:
        (dst / "README.md").write_text(card)
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def _gguf_counts(tensors: list[tuple[str, tuple[int, ...]]]) -> tuple[int, int, int, int]:
    """gguf-py's own count of the parameters of these (GGUF name, shape) tensors."""
    w = gguf.GGUFWriter(path=None, arch="llama")
    for name, shape in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    return w.get_total_parameter_count()


def _planned(src: Path, to: str) -> list[tuple[str, tuple[int, ...]]]:
    result = convert(ConvertOptions(src=str(src), to=to, dry_run=True))
    assert result.dry_run is not None
    return [(t["name"], tuple(t["shape"])) for t in result.dry_run["tensors"]]


def _converter_name(clean_dir: Path, counts: tuple[int, int, int, int], encoding: str, *, mmproj: bool = False) -> str:
    """What convert_hf_to_gguf.py's prepare_metadata names a file of this model folder, with gguf-py."""
    meta = gguf.Metadata.load(None, clean_dir, None, counts[0])
    if meta.name is None:
        meta.name = clean_dir.name
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    stem = gguf.naming_convention(meta.name, meta.basename, meta.finetune, meta.version,
                                  None if mmproj else meta.size_label, encoding)
    return ("mmproj-" if mmproj else "") + stem + ".gguf"


def _general(path: Path) -> dict[str, Any]:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("general.")}


def _expected_general(clean_dir: Path, counts: tuple[int, int, int, int], override: Path | None = None,
                      model_name: str | None = None) -> dict[str, Any]:
    """The general.* keys (but type, architecture, file type, quantization version) the converter writes
    for this folder: gguf-py's Metadata.load and set_gguf_meta_model, as its prepare_metadata calls them."""
    meta = gguf.Metadata.load(override, clean_dir, model_name, counts[0])
    if meta.name is None:
        meta.name = clean_dir.name
    if meta.size_label is None and counts[0] > 0:
        meta.size_label = gguf.size_label(*counts)
    w = gguf.GGUFWriter(path=None, arch="llama")
    meta.set_gguf_meta_model(w)
    return {k: v.value for k, v in w.kv_data[0].items() if k != gguf.Keys.General.ARCHITECTURE}


def _own(general: dict[str, Any]) -> dict[str, Any]:
    """The keys Metadata writes (without those the model's type and file type give)."""
    return {k: v for k, v in general.items() if k not in (
        "general.architecture", "general.type", "general.file_type", "general.quantization_version")}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, float):
            assert np.float32(got[key]) == np.float32(value), key
        else:
            assert got[key] == value, key


# --------------------------------------------------------------------------------------------------
# the quantization words
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "clean"), [
    ("llama-3-8b-bnb-4bit", "llama-3-8b"),
    ("Qwen2.5-7B-Instruct-unsloth-bnb-4bit", "Qwen2.5-7B-Instruct"),
    ("Llama-3.2-1B-Instruct-bnb-nf4", "Llama-3.2-1B-Instruct"),
    ("Meta-Llama-3.1-8B-Instruct-BNB-NF4", "Meta-Llama-3.1-8B-Instruct"),
    ("mistral-7b-instruct-v0.3-4bit", "mistral-7b-instruct-v0.3"),
    ("phi-2-bnb-8bit", "phi-2"),
    ("flux1-dev-bnb-fp4", "flux1-dev"),
    ("gemma-2-9b-it-unsloth", "gemma-2-9b-it-unsloth"),  # unsloth alone is no quantization word
    ("llama_nf4_dq", "llama_nf4_dq"),  # only -separated words
    ("bnb-4bit", "bnb"),  # the first word stays
    ("-4bit", "-4bit"),  # nothing would be left
    ("Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct"),
])
def test_strip_quant_suffix(name: str, clean: str) -> None:
    assert strip_quant_suffix(name) == clean


# --------------------------------------------------------------------------------------------------
# default file names
# --------------------------------------------------------------------------------------------------

#: (fixture, source folder name, the same without the bnb words, to, the name llama.cpp's convention gives)
NAMES = [
    (LLAMA, "llama-3-8b-bnb-4bit", "llama-3-8b", "gguf:q4_k_m", "llama-3-2.0M-8b-Q4_K_M.gguf"),
    (LLAMA, "Qwen2.5-7B-Instruct-unsloth-bnb-4bit", "Qwen2.5-7B-Instruct", "gguf:q8_0",
     "Qwen2.5-2.0M-7b-Instruct-Q8_0.gguf"),
    (LLAMA, "Llama-3.2-1B-Instruct-bnb-nf4", "Llama-3.2-1B-Instruct", "gguf", "Llama-3.2-2.0M-1b-Instruct-F16.gguf"),
    (LLAMA, "mistral-7b-instruct-v0.3-4bit", "mistral-7b-instruct-v0.3", "gguf:bf16",
     "mistral-2.0M-7b-instruct-v0.3-BF16.gguf"),
    # a size in the name close to the parameters is kept as the size label
    (LLAMA, "TinyLlama-2M-Chat-v1.0-bnb-4bit", "TinyLlama-2M-Chat-v1.0", "gguf:f32", "TinyLlama-2M-Chat-v1.0-F32.gguf"),
    (LLAMA, "llama_nf4_dq", "llama_nf4_dq", "gguf:iq4_xs", "Llama_Nf4_Dq-2.0M-IQ4_XS.gguf"),
    # MoE: the size label counts one expert's share of each *_exps tensor (4 experts of 1.1M)
    (MIXTRAL, "mixtral_nf4_dq", "mixtral_nf4_dq", "gguf:q4_k_m", "Mixtral_Nf4_Dq-4x1.1M-Q4_K_M.gguf"),
    (MIXTRAL, "Mixtral-8x7B-Instruct-v0.1-bnb-4bit", "Mixtral-8x7B-Instruct-v0.1", "gguf:q5_k_m",
     "Mixtral-8x7B-Instruct-v0.1-Q5_K_M.gguf"),
]


@pytest.mark.parametrize(("fixture", "name", "clean", "to", "want"), NAMES, ids=[n[1] + "-" + n[3] for n in NAMES])
def test_default_names_are_the_converters_for_the_name_without_bnb_words(tmp_path: Path, fixture: Path, name: str,
                                                                          clean: str, to: str, want: str) -> None:
    src = _copy(fixture, tmp_path / name)
    result = convert(ConvertOptions(src=str(src), to=to, dry_run=True))
    assert Path(result.output) == tmp_path / want
    # the same name from gguf-py: Metadata.load on a folder without the bnb words, gguf-py's parameter count
    counts = _gguf_counts(_planned(src, to))
    encoding = to.partition(":")[2].upper() or "F16"
    assert _converter_name(_copy(fixture, tmp_path / "clean" / clean), counts, encoding) == want


def test_parameter_counts_are_gguf_pys(tmp_path: Path) -> None:
    for fixture in (LLAMA, MIXTRAL):
        tensors = _planned(fixture, "gguf:q8_0")
        assert parameter_counts(tensors) == _gguf_counts(tensors)
    assert parameter_counts(_planned(MIXTRAL, "gguf:q8_0"))[3] == 4


@pytest.mark.parametrize(("name", "counts", "want"), [
    ("llama-3-8b-bnb-4bit", (8_030_261_248, 8_030_261_248, 0, 0), "llama-3-8B-Q4_K_M.gguf"),
    ("Meta-Llama-3.1-8B-Instruct-bnb-4bit", (8_030_261_248, 8_030_261_248, 0, 0),
     "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"),
    ("Qwen2.5-7B-Instruct-unsloth-bnb-4bit", (7_615_616_512, 7_615_616_512, 0, 0), "Qwen2.5-7B-Instruct-Q4_K_M.gguf"),
    ("Mixtral-8x7B-v0.1-bnb-4bit", (46_702_792_704, 1_604_362_240, 5_637_144_576, 8), "Mixtral-8x7B-v0.1-Q4_K_M.gguf"),
    ("mixtral-bnb-4bit", (46_702_792_704, 1_604_362_240, 5_637_144_576, 8), "Mixtral-8x7.2B-Q4_K_M.gguf"),
])
def test_full_size_models_are_named_as_llama_cpp_names_them(tmp_path: Path, name: str, counts: tuple[int, ...],
                                                              want: str) -> None:
    """At real sizes the name's own size label holds (the tiny fixtures' parameters make it a "context length")."""
    src = _copy(LLAMA, tmp_path / name)
    meta, notes = model_metadata(MetadataSource(src, name, {}), counts)  # type: ignore[arg-type]
    assert gguf_file_name(naming(meta, FT.MOSTLY_Q4_K_M)) == want and notes == []
    clean = _copy(LLAMA, tmp_path / "clean" / strip_quant_suffix(name))
    assert _converter_name(clean, counts, "Q4_K_M") == want  # type: ignore[arg-type]


def test_a_revision_goes_into_the_version_part() -> None:
    meta = gguf.Metadata(name="Llama 3.2 1B", basename="Llama-3.2", size_label="1B", version="v1")
    assert gguf_file_name(naming(meta, FT.MOSTLY_Q8_0), "refs/pr/3") == "Llama-3.2-1B-v1-refs-pr-3-Q8_0.gguf"
    assert gguf_file_name(naming(meta, FT.MOSTLY_BF16), "a" * 40) == f"Llama-3.2-1B-v1-{'a' * 12}-BF16.gguf"


def test_o_dir_and_the_mmproj_directory_get_the_default_names(tmp_path: Path) -> None:
    """``-o DIR/`` and ``--mmproj DIR/``: the converter's names (the projector's: ``mmproj-``, no size label,
    its own type, F16 for a q4_k_m text model)."""
    src = _copy(GEMMA3, tmp_path / "gemma-3-4b-it-bnb-4bit")
    out = tmp_path / "out"
    result = convert(ConvertOptions(src=str(src), to="gguf:q4_k_m", output=f"{out}/", mmproj=f"{out}/",
                                    dry_run=True))
    assert result.dry_run is not None
    clean = _copy(GEMMA3, tmp_path / "clean" / "gemma-3-4b-it")
    want = _converter_name(clean, _gguf_counts(_planned(src, "gguf:q4_k_m")), "Q4_K_M")
    assert (Path(result.output), want) == (out / "gemma-3-1.4M-4b-it-Q4_K_M.gguf", "gemma-3-1.4M-4b-it-Q4_K_M.gguf")
    assert result.dry_run["mmproj"]["output"] == str(out / "mmproj-gemma-3-4b-it-F16.gguf")
    assert _converter_name(clean, (1, 1, 0, 0), "F16", mmproj=True) == "mmproj-gemma-3-4b-it-F16.gguf"


# --------------------------------------------------------------------------------------------------
# general.* keys
# --------------------------------------------------------------------------------------------------

def test_general_keys_from_the_model_card_are_gguf_pys(tmp_path: Path) -> None:
    src = _copy(LLAMA, tmp_path / "Llama-3.2-1B-Instruct-bnb-4bit", CARD, GENERATION)
    result = convert(ConvertOptions(src=str(src), to="gguf:q8_0", output=f"{tmp_path / 'out'}/"))
    out = Path(result.output)
    assert out.name == "Llama-3.2-2.0M-1b-Instruct-Q8_0.gguf"
    got = _general(out)
    clean = _copy(LLAMA, tmp_path / "clean" / "Llama-3.2-1B-Instruct", CARD, GENERATION)
    _same(_own(got), _expected_general(clean, _gguf_counts(_planned(src, "gguf:q8_0"))))
    # what that is, spelled out
    assert got["general.name"] == "Llama 3.2 1B Instruct" and got["general.basename"] == "Llama-3.2"
    assert got["general.license"] == "apache-2.0" and got["general.size_label"] == "2.0M"
    assert got["general.tags"] == ["llama", "bnb", "text-generation"] and got["general.languages"] == ["en", "no"]
    assert got["general.base_model.count"] == 1
    assert got["general.base_model.0.repo_url"] == "https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct"
    assert got["general.base_model.0.organization"] == "Meta Llama"
    assert got["general.dataset.0.repo_url"] == "https://huggingface.co/HuggingFaceH4/ultrachat_200k"
    assert got["general.sampling.top_k"] == 40 and np.float32(got["general.sampling.temp"]) == np.float32(0.6)
    assert not any("model card" in n for n in result.notes)


def test_name_or_path_without_bnb_words(tmp_path: Path) -> None:
    """config.json's ``_name_or_path`` (read before the folder's name) loses its bnb words too."""
    src = _copy(LLAMA, tmp_path / "snapshot")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "unsloth/TinyLlama-2M-Chat-v1.0-bnb-4bit"}))
    result = convert(ConvertOptions(src=str(src), to="gguf:q8_0", dry_run=True))
    assert Path(result.output).name == "TinyLlama-2M-Chat-v1.0-Q8_0.gguf"


def test_override_file_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy(LLAMA, tmp_path / "Llama-3.2-1B-Instruct-bnb-4bit", CARD)
    override = tmp_path / "meta.json"
    values = {"general.name": "My Model", "general.basename": "MyModel", "general.finetune": "Chat",
              "general.version": "v2", "general.size_label": "1B", "general.author": "me",
              "general.tags": ["x"], "general.base_models": [{"name": "Base", "repo_url": "https://example.org/b"}],
              "general.sampling.temp": 0.5}
    override.write_text(json.dumps(values))
    out = tmp_path / "out"
    assert main([str(src), "--to", "gguf:q8_0", "-o", f"{out}/", "--metadata", str(override), "-q"]) == 0
    (path,) = out.iterdir()
    assert path.name == "MyModel-1B-Chat-v2-Q8_0.gguf"
    got = _general(path)
    clean = _copy(LLAMA, tmp_path / "clean" / "Llama-3.2-1B-Instruct", CARD)
    _same(_own(got), _expected_general(clean, _gguf_counts(_planned(src, "gguf:q8_0")), override))
    assert (got["general.name"], got["general.author"], got["general.tags"]) == ("My Model", "me", ["x"])
    assert got["general.license"] == "apache-2.0"  # from the card: not an override key
    assert (got["general.base_model.count"], got["general.base_model.0.name"]) == (1, "Base")


def test_override_keys_are_those_gguf_py_reads(tmp_path: Path) -> None:
    """:data:`OVERRIDE_KEYS` is exactly what ``Metadata.load`` takes from an override file, each into its field."""
    candidates = {v for k, v in vars(gguf.Keys.General).items() if isinstance(v, str) and not k.startswith("_")}
    candidates |= {"general.base_models", "general.datasets"}
    base = gguf.Metadata.load(None, None, None, 0)
    read: dict[str, str] = {}
    for key in sorted(candidates):
        path = tmp_path / "o.json"
        path.write_text(json.dumps({key: ["probe"]}))
        loaded = gguf.Metadata.load(path, None, None, 0)
        changed = [f for f in vars(base) if getattr(loaded, f) != getattr(base, f)]
        if changed:
            assert len(changed) == 1, (key, changed)
            read[key] = changed[0]
    assert read == OVERRIDE_KEYS
    assert gguf.Keys.General.LICENSE not in read


BAD_OVERRIDES = [
    ("missing", None, ["USE-001 --metadata file cannot be read", "found 'no such file'"]),
    ("not-json", b"{'general.name': 1}", ["USE-001 --metadata file is not valid JSON"]),
    ("a-list", b'["general.name"]', ["USE-001 --metadata file must hold a JSON object", "found 'list'"]),
    ("license", b'{"general.license": "mit"}', [
        "USE-001 --metadata file has a key llama.cpp's converter does not read: 'general.license'",
        "general.license is not read from --metadata"]),
    ("typo", b'{"general.nmae": "x"}', ["does not read: 'general.nmae'", "did you mean 'general.name'?"]),
    ("name-number", b'{"general.name": 5}', ["USE-001 --metadata file: 'general.name' is not text", "found 5"]),
    ("top-k-float", b'{"general.sampling.top_k": 1.5}', ["'general.sampling.top_k' is not an integer"]),
    ("top-k-huge", b'{"general.sampling.top_k": 4294967296}', ["'general.sampling.top_k' cannot be written as INT32"]),
    ("temp-text", b'{"general.sampling.temp": "0.7"}', ["'general.sampling.temp' is not a number"]),
    ("tags-text", b'{"general.tags": "a,b"}', ["'general.tags' is not a list"]),
    ("tags-empty", b'{"general.tags": []}', ["'general.tags' is an empty list"]),
    ("tags-mixed", b'{"general.tags": ["a", 1]}', ["'general.tags' [1] is not text"]),
    ("base-model-text", b'{"general.base_models": ["org/m"]}', ["'general.base_models' [0] is not an object"]),
    ("base-model-name", b'{"general.base_models": [{"name": 3}]}', ["'general.base_models' [0].name is not text"]),
    ("nested", b"[" * 300 + b"]" * 300, ["--metadata file is nested too deeply"]),
]


@pytest.mark.parametrize(("case", "content", "parts"), BAD_OVERRIDES, ids=[c[0] for c in BAD_OVERRIDES])
def test_a_bad_metadata_file_is_refused_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  case: str, content: bytes | None,
                                                                  parts: list[str]) -> None:
    path = tmp_path / "meta.json"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "out.gguf"
    with pytest.raises(UsageError) as info:
        convert(ConvertOptions(src=str(LLAMA), to="gguf:q8_0", output=out, metadata=path))
    assert type(info.value) is UsageError and info.value.rule == "USE-001"
    assert main([str(LLAMA), "--to", "gguf:q8_0", "-o", str(out), "--metadata", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    for part in parts:
        assert part in err and part in str(info.value), (part, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["meta.json"])


def test_metadata_needs_a_gguf_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "meta.json"
    path.write_text("{}")
    assert main([str(LLAMA), "--to", "bf16", "-o", str(tmp_path / "o"), "--metadata", str(path)]) == 2
    assert "USE-001 --metadata needs --to gguf[:TYPE]" in capsys.readouterr().err


@pytest.mark.parametrize(("card", "note", "left_out"), [
    ("---\nlicense: [unclosed\n---\n", "its front matter cannot be read (ParserError", "general.license"),
    (b"---\nlicense: mit\n\xff\n---\n", "its front matter cannot be read (UnicodeDecodeError", "general.license"),
    ("---\nlicense: 5\ntags: x\n---\n", "license is not text (5): left out of general.*", "general.license"),
    ("---\ntags: 5\nlicense: mit\n---\n", "tags is an empty list ([]): left out of general.*", "general.tags"),
    ("---\nbase_model: [{name: 1}]\n---\n", "base_models [0].name is not text", "general.base_model.count"),
])
def test_a_card_value_the_converter_would_fail_on_is_left_out_with_a_note(tmp_path: Path, card: str | bytes,
                                                                          note: str, left_out: str) -> None:
    src = _copy(LLAMA, tmp_path / "m")
    (src / "README.md").write_bytes(card.encode() if isinstance(card, str) else card)
    result = convert(ConvertOptions(src=str(src), to="gguf:q8_0", output=tmp_path / "m.gguf"))
    assert any(note in n for n in result.notes), result.notes
    got = _general(tmp_path / "m.gguf")
    assert left_out not in got and got["general.name"] == "M"
    if "license: mit" in str(card) and "tags: 5" in str(card):
        assert got["general.license"] == "mit"


def test_a_generation_config_that_is_not_an_object_is_not_read(tmp_path: Path) -> None:
    src = _copy(LLAMA, tmp_path / "m")
    (src / "generation_config.json").write_text('["temperature"]')
    result = convert(ConvertOptions(src=str(src), to="gguf:q8_0", dry_run=True))
    assert any("generation_config.json: a JSON list, not an object" in n for n in result.dry_run["notes"])


# --------------------------------------------------------------------------------------------------
# llama.cpp's converter itself
# --------------------------------------------------------------------------------------------------

def _converter_script() -> Path:
    return llama_script("convert_hf_to_gguf.py")


@pytest.mark.parametrize(("name", "override"), [
    ("Llama-3.2-1B-Instruct", None),
    ("TinyLlama-2M-Chat-v1.0", {"general.author": "me", "general.tags": ["x"], "general.sampling.top_k": 7}),
])
def test_names_and_general_keys_equal_the_converters(tmp_path: Path, name: str, override: dict | None) -> None:
    """convert_hf_to_gguf.py on the original bf16 model in a folder NAME, and convert-bnb on its bnb
    checkpoint in NAME-bnb-4bit, with the same model card, generation config and --metadata file: the same
    default file name and the same general.* keys."""
    script = _converter_script()
    for module in ("torch", "sentencepiece"):
        pytest.importorskip(module)
    meta = None
    if override is not None:
        meta = tmp_path / "meta.json"
        meta.write_text(json.dumps(override))
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    theirs_dir.mkdir()
    orig = _copy(MODELS / "llama_orig_bf16", tmp_path / "a" / name, CARD, GENERATION)
    argv = [sys.executable, str(script), str(orig), "--outtype", "q8_0", "--outfile", str(theirs_dir)]
    run = subprocess.run(argv + (["--metadata", str(meta)] if meta else []), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    src = _copy(LLAMA, tmp_path / "b" / f"{name}-bnb-4bit", CARD, GENERATION)
    assert main([str(src), "--to", "gguf:q8_0", "-o", f"{ours_dir}/", "-q", *(["--metadata", str(meta)] if meta
                                                                                else [])]) == 0
    (theirs,), (ours,) = list(theirs_dir.iterdir()), list(ours_dir.iterdir())
    assert ours.name == theirs.name
    _same(_general(ours), _general(theirs))


def test_a_hub_repo_is_named_after_the_repo_and_its_revision(tmp_path: Path) -> None:
    """A Hub repo's snapshot is read as a folder named after the repo (not its commit), the repo id is
    general.name (the converter's --remote), and the revision asked for goes into the version part."""
    from tests.helpers.hubcache import add_model_dir, commit_sha, offline_env, run_cli

    cache = tmp_path / "hub"
    repo = "unsloth/Llama-3.2-1B-Instruct-bnb-4bit"
    add_model_dir(cache, repo, LLAMA, commit_sha("naming"), refs=("main", "v2"), extra={"README.md": CARD.encode()})
    work = tmp_path / "cwd"
    work.mkdir()
    r = run_cli([f"{repo}@v2", "--to", "gguf:q8_0", "--json"], offline_env(tmp_path, cache), cwd=work)
    assert r.returncode == 0, r.stderr
    out = work / "Llama-3.2-2.0M-1b-Instruct-v2-Q8_0.gguf"
    assert json.loads(r.stdout)["output"] == str(out)
    got = _general(out)
    clean = _copy(LLAMA, tmp_path / "clean" / "Llama-3.2-1B-Instruct", CARD)
    counts = _gguf_counts(_planned(LLAMA, "gguf:q8_0"))
    _same(_own(got), _expected_general(clean, counts, model_name="unsloth/Llama-3.2-1B-Instruct"))
    assert (got["general.name"], got["general.license"]) == ("unsloth/Llama-3.2-1B-Instruct", "apache-2.0")


@pytest.mark.parametrize(("name", "want"), [
    ("a\x00b", "a-b-2M-Q8_0.gguf"),  # NUL: never in a path
    ("../up", "up-2M-Q8_0.gguf"),  # a separator: a name, never a path
    ("-rf", "rf-2M-Q8_0.gguf"),  # not read as an option by the next command
    (".hidden", "hidden-2M-Q8_0.gguf"),  # not a hidden file
    ("", "2M-Q8_0.gguf"),
])
def test_names_from_cards_or_metadata_make_plain_file_names(name: str, want: str) -> None:
    from convert.output_names import GgufNaming

    assert gguf_file_name(GgufNaming(name, None, None, None, "2M", "Q8_0")) == want
