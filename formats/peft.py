"""PEFT LoRA adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``.

This module opens the directory, reads the adapter weights and checks them against the config;
the config itself (``adapter_config.json``: its keys, the matching rules as PEFT applies them, the
pattern limits) is parsed and matched in :mod:`formats.peft_config`.

``adapter_model.safetensors`` keys as PEFT (0.21, ``save_pretrained``) writes them (the adapter name
``default`` is already removed by PEFT)::

    base_model.model.<module>.lora_A.weight            F32/BF16/F16 [r, in]     Linear
    base_model.model.<module>.lora_B.weight                         [out, r]
    base_model.model.<module>.lora_embedding_A                      [r, num_embeddings]   Embedding
    base_model.model.<module>.lora_embedding_B                      [embedding_dim, r]
    base_model.model.<module>.lora_magnitude_vector                 [out]    DoRA (old: ``.weight``)
    base_model.model.<module>.weight | .bias                        full tensor: modules_to_save, or an
                                                                    embedding layer PEFT saved because
                                                                    the vocabulary was resized
    base_model.model.<module>.base_layer.weight                     full base tensor of a LoRA-targeted
                                                                    embedding (save_embedding_layers)
    base_model.model.<module>.modules_to_save.weight                PEFT's copy of the trained module
    base_model.model.<module>.original_module.weight                PEFT's copy of the untrained module

A key maps to the base tensor ``<module>.weight`` (or ``.bias``) by removing the exact prefix
``base_model.model.`` and one exact suffix from the table above -- never by stripping characters.

Rules checked here, each with its own subclass of :class:`~formats.errors.AdapterError`
(docs/errors.md). The config rules LORA-001..004 and LORA-013 are checked in
:mod:`formats.peft_config`; LORA-001 is also raised here for a path that is not an adapter directory,
and LORA-003 for weights with no supported merge (trained ``lora_B`` biases, DoRA on an embedding).

========  ==========================================================================================
LORA-005  the directory holds adapter weights (adapter_model.safetensors); a folder (or Hub repo) with
          adapter_config.json and neither adapter nor model weights is an adapter whose weights are missing
LORA-006  every adapter key has the prefix ``base_model.model.`` and a known suffix
LORA-007  every adapter key lands on a tensor of the base model
LORA-008  every targeted module has lora_A and lora_B (and a magnitude vector with DoRA)
LORA-009  the adapter holds no LoRA weights for a module the config does not target
LORA-010  shapes fit: A [r, in], B [out, r], r as configured, base [out, in] (or transposed)
LORA-011  no two adapter keys land on the same base tensor
LORA-012  a module's ``modules_to_save`` copy equals its saved tensor
========  ==========================================================================================
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .checkpoint import READERS, WEIGHT_FILES, ContainerReader, RemoteOpener, TensorRecord
from .errors import (
    AdapterConfigError,
    AdapterKeyNameError,
    AdapterTargetMissingError,
    DuplicateAdapterTargetError,
    IncompleteLoraModuleError,
    LoraShapeError,
    ModulesToSaveMismatchError,
    NoAdapterWeightsError,
    NonFiniteAdapterError,
    UnsupportedAdapterConfigError,
    UnsupportedError,
    UntargetedModuleError,
)
from .peft_config import ADAPTER_CONFIG, LoraConfig, load_lora_config

__all__ = [
    "ADAPTER_EXTRA_FILES",
    "ADAPTER_WEIGHTS",
    "KEY_PREFIX",
    "Adapter",
    "AdapterKey",
    "AdapterModule",
    "adapter_weights_file",
    "check_finite",
    "is_adapter_dir",
    "is_adapter_listing",
    "open_adapter",
    "parse_adapter_key",
]

#: Weight file names, in order of preference (``.bin`` goes through the reader registered for it).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: The other files of an adapter directory a conversion reads when they are there: the model card (a GGUF
#: adapter's ``general.*`` keys, a pushed card's license), generation_config.json (``general.*`` sampling values)
#: and config.json (its ``_name_or_path``). A Hub adapter repo is fetched with these, its config and its weights.
ADAPTER_EXTRA_FILES = ("README.md", "config.json", "generation_config.json")
#: The exact prefix PEFT puts before every module name of a LoRA adapter.
KEY_PREFIX = "base_model.model."

# suffix -> (kind, base parameter). Longest first so that ".lora_A.weight" wins over ".weight".
_SUFFIXES: tuple[tuple[str, str, str], ...] = (
    (".lora_magnitude_vector.weight", "magnitude", "weight"),
    (".modules_to_save.weight", "mts_copy", "weight"),
    (".original_module.weight", "original", "weight"),
    (".modules_to_save.bias", "mts_copy", "bias"),
    (".original_module.bias", "original", "bias"),
    (".lora_magnitude_vector", "magnitude", "weight"),
    (".base_layer.weight", "base_layer", "weight"),
    (".base_layer.bias", "base_layer", "bias"),
    (".lora_embedding_A", "embedding_A", "weight"),
    (".lora_embedding_B", "embedding_B", "weight"),
    (".lora_A.weight", "lora_A", "weight"),
    (".lora_B.weight", "lora_B", "weight"),
    (".lora_B.bias", "lora_B_bias", "bias"),
    (".weight", "full", "weight"),
    (".bias", "full", "bias"),
)
# Words that must not appear as a path component of a module name: they mean the key was not
# produced by PEFT's LoRA saving (adapter name left in, another tuner, a typo in a suffix).
_RESERVED = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "base_layer",
    "modules_to_save",
    "original_module",
)

# ---------------------------------------------------------------------------------------------
# keys


@dataclass(frozen=True)
class AdapterKey:
    """One adapter tensor name, split by exact prefix and suffix.

    Attributes:
        key: the full adapter key.
        module: the base model's module name (``model.layers.0.self_attn.q_proj``).
        kind: ``lora_A``, ``lora_B``, ``embedding_A``, ``embedding_B``, ``magnitude``, ``full``,
            ``base_layer``, ``mts_copy``, ``original`` or ``lora_B_bias``.
        param: ``weight`` or ``bias``: the base parameter it belongs to.
    """

    key: str
    module: str
    kind: str
    param: str

    @property
    def base_tensor(self) -> str:
        """The base model tensor this key lands on."""
        return f"{self.module}.{self.param}"


def parse_adapter_key(key: str, path: str | os.PathLike[str] | None = None) -> AdapterKey:
    """Split an adapter key into module, kind and parameter (exact prefix and suffix logic).

    Raises:
        AdapterError: LORA-006, the key lacks the prefix ``base_model.model.`` or a known suffix.
    """
    if not key.startswith(KEY_PREFIX):
        raise AdapterKeyNameError(
            "adapter key does not start with 'base_model.model.'",
            path=path,
            tensor=key,
            hint="only LoRA adapters saved by PEFT's save_pretrained are read",
        )
    rest = key[len(KEY_PREFIX) :]
    for suffix, kind, param in _SUFFIXES:
        if rest.endswith(suffix) and len(rest) > len(suffix):
            module = rest[: -len(suffix)]
            parts = module.split(".")
            if any(part in _RESERVED for part in parts) or "" in parts:
                break
            return AdapterKey(key, module, kind, param)
    raise AdapterKeyNameError(
        "unknown adapter key",
        path=path,
        tensor=key,
        expected="base_model.model.<module> + one of " + ", ".join(s for s, _, _ in _SUFFIXES),
        found=key,
        hint="keys with an adapter name left in (lora_A.default.weight) or from other PEFT methods "
        "are not read",
    )


# ---------------------------------------------------------------------------------------------
# adapter


@dataclass
class AdapterModule:
    """Everything one adapter holds for one base module.

    Attributes:
        module: the module name.
        lora_A: ``[r, in]`` (Linear) or ``[r, num_embeddings]`` (Embedding) record.
        lora_B: ``[out, r]`` or ``[embedding_dim, r]`` record.
        embedding: the pair is ``lora_embedding_A/B`` (an ``nn.Embedding`` target).
        magnitude: DoRA magnitude ``[out]`` record.
        full: param -> record of a tensor that replaces the base parameter whole (modules_to_save,
            a saved embedding layer, or a ``base_layer`` copy).
        full_kind: param -> ``"modules_to_save"``, ``"saved_layer"`` or ``"base_layer"``.
        keys: every adapter key of this module.
    """

    module: str
    lora_A: TensorRecord | None = None
    lora_B: TensorRecord | None = None
    embedding: bool = False
    magnitude: TensorRecord | None = None
    full: dict[str, TensorRecord] = field(default_factory=dict)
    full_kind: dict[str, str] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)

    @property
    def has_lora(self) -> bool:
        """Whether the module carries a LoRA pair (or part of one)."""
        return self.lora_A is not None or self.lora_B is not None


@dataclass
class Adapter:
    """An opened PEFT LoRA adapter.

    Attributes:
        path: the adapter directory.
        config: its validated :class:`LoraConfig`.
        weights_file: the weights file.
        tensors: adapter key -> record (zero-copy access).
        modules: module name -> :class:`AdapterModule`, in key order.
        ignored: (adapter key, reason) for keys read but not merged (PEFT's ``original_module``
            copies, and ``modules_to_save`` copies equal to their saved tensor).
    """

    path: Path
    config: LoraConfig
    weights_file: Path
    tensors: dict[str, TensorRecord]
    modules: dict[str, AdapterModule]
    ignored: list[tuple[str, str]] = field(default_factory=list)
    reader: ContainerReader | None = field(default=None, repr=False)

    def close(self) -> None:
        """Close the weights file."""
        if self.reader is not None:
            self.reader.close()

    def __enter__(self) -> Adapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_against(self, base: Mapping[str, Sequence[int]]) -> None:
        """Check that the adapter fits a base model (LORA-007..LORA-010).

        Every adapter key must land on a base tensor, every module the config targets must carry
        lora_A and lora_B (and a magnitude vector with DoRA), and no LoRA weights may sit on a module
        the config does not target.

        Args:
            base: base tensor name -> shape (elements), for the model the adapter is merged into.

        Raises:
            AdapterError: naming the adapter key or the module.
        """
        cfg = self.config
        names = list(base)
        for mod in self.modules.values():
            for key in mod.keys:
                ak = parse_adapter_key(key, self.weights_file)
                if ak.base_tensor not in base:
                    close = difflib.get_close_matches(ak.base_tensor, names, n=1)
                    raise AdapterTargetMissingError(
                        "adapter key matches no tensor of the base model",
                        path=self.weights_file,
                        tensor=key,
                        expected=ak.base_tensor,
                        found="absent",
                        hint=f"closest base tensor: '{close[0]}'"
                        if close
                        else "is this adapter for another model?",
                    )
        self.check_targets()
        if cfg.target_modules == "all-linear":
            return
        for name in names:
            if not name.endswith(".weight"):
                continue
            module = name[: -len(".weight")]
            if not cfg.is_targeted(module):
                continue
            found = self.modules.get(module)
            if found is None or found.lora_A is None or found.lora_B is None:
                missing = (
                    "lora_A and lora_B"
                    if found is None or not found.has_lora
                    else ("lora_A" if found.lora_A is None else "lora_B")
                )
                raise IncompleteLoraModuleError(
                    f"module is targeted by the adapter config but the adapter has no {missing} for it",
                    path=self.weights_file,
                    tensor=module,
                    expected=f"{KEY_PREFIX}{module}.lora_A.weight and .lora_B.weight",
                    found="absent",
                    hint=f"target_modules={_show_targets(cfg.target_modules)}",
                )


    def check_targets(self) -> None:
        """Check that every module with LoRA weights is one the config targets (LORA-009; PEFT drops the others),
        which needs no base model.

        Raises:
            AdapterError: LORA-009, naming the first such module. PatternTimeoutError: LORA-013.
        """
        cfg = self.config
        if cfg.target_modules == "all-linear":
            return
        for mod in self.modules.values():
            if mod.has_lora and not cfg.is_targeted(mod.module):
                raise UntargetedModuleError(
                    "adapter holds LoRA weights for a module the config does not target (PEFT drops them)",
                    path=self.weights_file,
                    tensor=mod.keys[0],
                    expected=f"target_modules={_show_targets(cfg.target_modules)}",
                    found=mod.module,
                )


def _show_targets(t: tuple[str, ...] | str | None) -> str:
    return repr(list(t)) if isinstance(t, tuple) else repr(t)


def is_adapter_listing(names: Collection[str]) -> bool:
    """Whether a folder's (or a Hub repo's) top-level file names make it a PEFT adapter: ``adapter_config.json``
    with adapter weights (:data:`ADAPTER_WEIGHTS`), or with no model weights either
    (:data:`formats.checkpoint.WEIGHT_FILES`): an adapter whose weights are missing (LORA-005, not a model without
    weights). A model directory that kept an adapter's config beside its own weights is a model."""
    present = set(names)
    if ADAPTER_CONFIG not in present:
        return False
    return any(w in present for w in ADAPTER_WEIGHTS) or not any(w in present for w, _ in WEIGHT_FILES)


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a PEFT adapter directory (:func:`is_adapter_listing` of its regular files)."""
    p = Path(path)
    if not p.is_dir():
        return False
    names = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, *(w for w, _ in WEIGHT_FILES))
    return is_adapter_listing([n for n in names if (p / n).is_file()])


def adapter_weights_file(names: Collection[str], where: str | os.PathLike[str]) -> str:
    """The weights file of an adapter folder or Hub repo holding the files ``names``: the first of
    :data:`ADAPTER_WEIGHTS` among them.

    Args:
        names: the folder's (repo's) top-level file names.
        where: the folder (or ``org/name`` of the repo), for the error.

    Raises:
        NoAdapterWeightsError: LORA-005, none of them is there (naming ``where``, the expected names and the files
            found).
    """
    for name in ADAPTER_WEIGHTS:
        if name in names:
            return name
    raise _no_weights(names, where)


def _no_weights(names: Collection[str], where: str | os.PathLike[str]) -> NoAdapterWeightsError:
    return NoAdapterWeightsError(
        "adapter weights not found",
        path=where,
        expected=" or ".join(ADAPTER_WEIGHTS),
        found=sorted(names) or "an empty directory",
    )


def check_finite(rec: TensorRecord, values: npt.NDArray[np.floating], offset: int = 0) -> None:
    """LORA-014 when ``values`` (elements ``offset ...`` of the adapter tensor ``rec``, any float dtype) hold NaN
    or infinite values, which PEFT would apply as they are.

    Raises:
        NonFiniteAdapterError: LORA-014, naming the tensor, the counts and the first such element's flat index.
    """
    finite = np.isfinite(values)
    if finite.all():
        return
    flat = values.reshape(-1)
    bad = ~finite.reshape(-1)
    n_nan = int(np.isnan(flat).sum())
    first = offset + int(np.argmax(bad))
    raise NonFiniteAdapterError(
        "adapter tensor holds NaN or infinite values (applied as they are, they make the model's outputs NaN)",
        path=rec.file,
        tensor=rec.name,
        expected="finite values",
        found=f"{n_nan} NaN and {int(bad.sum()) - n_nan} infinite of {flat.size}, the first at flat index {first}",
    )


def _open_weights(directory: Path, remote: RemoteOpener | None) -> tuple[Path, ContainerReader]:
    for name in ADAPTER_WEIGHTS:
        p = directory / name
        far = remote(p) if remote is not None and not p.is_file() else None
        if far is not None:
            return p, far
        if p.is_file():
            reader = READERS.get(p.suffix.lower())
            if reader is None:
                raise UnsupportedError(
                    f"no reader for '{p.suffix}' adapter files yet",
                    path=p,
                    expected=sorted(READERS),
                    found=p.suffix,
                )
            return p, reader(p)
    raise _no_weights([q.name for q in directory.iterdir()], directory)


def open_adapter(path: str | os.PathLike[str], *, remote: RemoteOpener | None = None) -> Adapter:
    """Open a PEFT LoRA adapter directory and group its tensors by module.

    Checks everything that can be checked without the base model: the config (LORA-001..004), every
    key (LORA-006), pairs and shapes inside the adapter (LORA-008, LORA-010), duplicate targets
    (LORA-011) and ``modules_to_save`` copies (LORA-012). Use :meth:`Adapter.check_against` for the
    fit to a base model.

    Args:
        path: the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        remote: opens an adapter weights file that is not on disk (a Hub repo's, read from its header in place:
            :data:`formats.checkpoint.RemoteOpener`), or None.

    Returns:
        an :class:`Adapter`; close it when done.

    Raises:
        AdapterError: a LORA-xxx rule.
        UnsupportedError: LORA-003, or a weights container without a reader.
        SafetensorsError: the weights file breaks the container format.
    """
    directory = Path(path)
    if not directory.is_dir():
        if directory.name == ADAPTER_CONFIG or directory.suffix.lower() in (".safetensors", ".bin"):
            directory = directory.parent
        else:
            raise AdapterConfigError(
                "adapter path must be a PEFT adapter directory",
                path=directory,
                found="not a directory",
            )
    config = load_lora_config(directory)
    wfile, reader = _open_weights(directory, remote)
    try:
        tensors = {
            name: TensorRecord(name, info.dtype, tuple(info.shape), info.nbytes, reader)
            for name, info in reader.tensors.items()
        }
        modules, ignored = _group(wfile, config, tensors)
    except BaseException:
        reader.close()
        raise
    return Adapter(directory, config, wfile, tensors, modules, ignored, reader)


def _group(
    wfile: Path, cfg: LoraConfig, tensors: Mapping[str, TensorRecord]
) -> tuple[dict[str, AdapterModule], list[tuple[str, str]]]:
    modules: dict[str, AdapterModule] = {}
    ignored: list[tuple[str, str]] = []
    copies: list[tuple[AdapterKey, TensorRecord]] = []
    landed: dict[str, str] = {}  # base tensor -> adapter key that replaces it

    for key, rec in tensors.items():
        ak = parse_adapter_key(key, wfile)
        if not rec.dtype.is_float:
            raise LoraShapeError(
                "adapter tensor must be floating point",
                path=wfile,
                tensor=key,
                expected="F32, BF16 or F16",
                found=rec.dtype.code,
            )
        if ak.kind == "lora_B_bias":
            raise UnsupportedAdapterConfigError(
                "config key 'lora_bias' is not supported: merging trained lora_B biases is not implemented",
                path=wfile,
                tensor=key,
            )
        if ak.kind in ("mts_copy", "original"):
            copies.append((ak, rec))
            continue
        mod = modules.setdefault(ak.module, AdapterModule(ak.module))
        mod.keys.append(key)
        if ak.kind in ("lora_A", "embedding_A", "lora_B", "embedding_B"):
            emb = ak.kind.startswith("embedding")
            if mod.has_lora and mod.embedding != emb:
                raise DuplicateAdapterTargetError(
                    "module mixes lora_A/B and lora_embedding_A/B keys",
                    path=wfile,
                    tensor=key,
                )
            mod.embedding = emb
            if ak.kind.endswith("A"):
                mod.lora_A = rec
            else:
                mod.lora_B = rec
        elif ak.kind == "magnitude":
            if mod.magnitude is not None:
                raise DuplicateAdapterTargetError(
                    "two magnitude vectors for one module", path=wfile, tensor=key
                )
            mod.magnitude = rec
        else:  # full or base_layer
            prev = landed.get(ak.base_tensor)
            if prev is not None:
                raise DuplicateAdapterTargetError(
                    "two adapter tensors replace the same base tensor",
                    path=wfile,
                    tensor=key,
                    expected=f"only '{prev}'",
                    found=[prev, key],
                )
            landed[ak.base_tensor] = key
            mod.full[ak.param] = rec
            if ak.kind == "base_layer":
                mod.full_kind[ak.param] = "base_layer"
            elif cfg.is_module_to_save(ak.module):
                mod.full_kind[ak.param] = "modules_to_save"
            else:
                mod.full_kind[ak.param] = "saved_layer"

    for ak, rec in copies:
        owner = modules.get(ak.module)
        saved = owner.full.get(ak.param) if owner is not None else None
        if ak.kind == "original":
            if saved is None:
                raise ModulesToSaveMismatchError(
                    "PEFT's original_module copy without the module's saved tensor",
                    path=wfile,
                    tensor=ak.key,
                    expected=f"{KEY_PREFIX}{ak.base_tensor}",
                    found="absent",
                )
            ignored.append((ak.key, "PEFT's copy of the untrained module; the saved tensor is used"))
            continue
        if saved is None:
            raise ModulesToSaveMismatchError(
                "modules_to_save copy without the module's saved tensor",
                path=wfile,
                tensor=ak.key,
                expected=f"{KEY_PREFIX}{ak.base_tensor}",
                found="absent",
            )
        if saved.shape != rec.shape or saved.dtype != rec.dtype or bytes(saved.raw()) != bytes(rec.raw()):
            raise ModulesToSaveMismatchError(
                "modules_to_save copy differs from the module's saved tensor",
                path=wfile,
                tensor=ak.key,
                expected=f"equal to '{KEY_PREFIX}{ak.base_tensor}'",
                found="different",
            )
        ignored.append((ak.key, "PEFT's modules_to_save copy, identical to the saved tensor"))

    for mod in modules.values():
        _check_module(wfile, cfg, mod)
    return modules, ignored


def _check_module(wfile: Path, cfg: LoraConfig, mod: AdapterModule) -> None:
    if not mod.has_lora:
        if mod.magnitude is not None:
            raise IncompleteLoraModuleError(
                "DoRA magnitude vector without lora_A/lora_B", path=wfile, tensor=mod.keys[0]
            )
        if "base_layer" in mod.full_kind.values():
            raise IncompleteLoraModuleError(
                "base_layer tensor without lora_A/lora_B", path=wfile, tensor=mod.keys[0]
            )
        return
    a_name = "lora_embedding_A" if mod.embedding else "lora_A.weight"
    b_name = "lora_embedding_B" if mod.embedding else "lora_B.weight"
    if mod.lora_A is None or mod.lora_B is None:
        missing = a_name if mod.lora_A is None else b_name
        raise IncompleteLoraModuleError(
            f"LoRA pair is incomplete: {missing} is missing",
            path=wfile,
            tensor=mod.keys[0],
            expected=f"{KEY_PREFIX}{mod.module}.{missing}",
            found="absent",
        )
    if any(k == "modules_to_save" or k == "saved_layer" for k in mod.full_kind.values()):
        raise DuplicateAdapterTargetError(
            "module has both LoRA weights and a full saved tensor",
            path=wfile,
            tensor=mod.keys[0],
            hint="a LoRA-targeted module saves its base as '.base_layer.weight'",
        )
    a, b = mod.lora_A, mod.lora_B
    r = cfg.rank_for(mod.module)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
        raise LoraShapeError(
            f"{a_name} must be [r, in] and {b_name} [out, r]",
            path=wfile,
            tensor=a.name,
            expected="matching r",
            found=f"A {list(a.shape)}, B {list(b.shape)}",
        )
    if a.shape[0] != r:
        raise LoraShapeError(
            "LoRA rank (lora_A rows) differs from the config",
            path=wfile,
            tensor=a.name,
            expected=r,
            found=a.shape[0],
            hint="check r and rank_pattern in adapter_config.json",
        )
    if cfg.use_dora:
        if mod.embedding:
            raise UnsupportedAdapterConfigError(
                "config key 'use_dora' is not supported on embedding layers",
                path=wfile,
                tensor=a.name,
            )
        if mod.magnitude is None:
            raise IncompleteLoraModuleError(
                "use_dora is set but the module has no lora_magnitude_vector",
                path=wfile,
                tensor=mod.module,
                expected=f"{KEY_PREFIX}{mod.module}.lora_magnitude_vector",
                found="absent",
            )
        if mod.magnitude.shape != (b.shape[0],):
            raise LoraShapeError(
                "DoRA magnitude vector must have one value per output feature",
                path=wfile,
                tensor=mod.magnitude.name,
                expected=[b.shape[0]],
                found=list(mod.magnitude.shape),
            )
    elif mod.magnitude is not None:
        raise IncompleteLoraModuleError(
            "adapter holds a DoRA magnitude vector but use_dora is false",
            path=wfile,
            tensor=mod.magnitude.name,
            expected="use_dora: true",
            found=False,
        )
