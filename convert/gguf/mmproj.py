"""The vision projector GGUF (``mmproj``) of a multimodal checkpoint, as llama.cpp's converter writes it with
``--mmproj``: Gemma 3 (``Gemma3VisionModel``) so far.

:func:`plan_mmproj` turns config.json, the (name, shape) list of the float tensors and the model directory
(``preprocessor_config.json``: image mean and std) into a :class:`convert.gguf.plan.GGUFPlan` of
architecture ``clip`` that :func:`convert.gguf.encode.write_gguf` writes like any other: the ``clip.*``
keys of ``MmprojModel.set_gguf_parameters`` and ``Gemma3VisionModel.set_gguf_parameters``, the vision
tower's and projector's tensors named by gguf-py's ``MODEL_ARCH.MMPROJ`` map, their types as the
converter's ``tensor_force_quant`` chooses them (embeddings F32, the input projection F16), and the
projector's ``soft_emb_norm`` + 1 (Gemma's RMSNorm).

Both layouts transformers saves are read: ``vision_tower.vision_model.*`` (4.x) and ``vision_tower.*``
(5.x, which the pinned converter cannot map); SigLIP's pooling head (``head.*``) is not written.

Not yet: the command line (``--mmproj PATH``) and batch JOBS files, and Mistral 3 / Qwen2-VL projectors.

Rules raised here (see docs/errors.md): GGUF-006 (:class:`GgufConfigError`: no ``vision_config``, a
vision hyperparameter missing or not a positive integer, no image mean/std in preprocessor_config.json),
GGUF-003 (:class:`UnmappedTensorError`: a vision tensor without a GGUF name).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf

from convert.gguf.config import check_packable, real, whole
from convert.gguf.families import Architecture
from convert.gguf.plan import GGUFPlan, GGUFTensor
from convert.gguf.types import OUTPUT_TYPES
from formats import jsonfile
from formats.errors import GgufConfigError, UnmappedTensorError
from formats.gguf import tensor_nbytes

__all__ = ["MMPROJ_TYPES", "mmproj_type", "plan_mmproj"]

GT = gguf.GGMLQuantizationType

#: The mmproj's own architecture (``general.architecture`` ``clip``); no config.json class selects it.
_CLIP = Architecture(name="clip", model_arch=gguf.MODEL_ARCH.MMPROJ, hf_architectures=(), params=())

#: Output types the converter writes an mmproj in; any other ``--to gguf:TYPE`` gives F16 (the mixes
#: quantize the text model only).
MMPROJ_TYPES = ("f32", "f16", "bf16", "q8_0")

_TOWER_PREFIXES = ("multi_modal_projector.", "vision_tower.", "multimodal_projector.", "vision_model.")


def mmproj_type(output_type: str) -> str:
    """The mmproj's output type for the text model's ``--to gguf:TYPE``: the same for f32/f16/bf16/q8_0,
    else f16."""
    return output_type if output_type in MMPROJ_TYPES else "f16"


def _vision_name(hf_name: str) -> str | None:
    """The name ``Gemma3VisionModel.filter_tensors`` maps, None for a tensor not in the mmproj (the text
    model, SigLIP's pooling head); transformers 5's ``vision_tower.X`` read as 4.x's
    ``vision_tower.vision_model.X``."""
    if not hf_name.startswith(_TOWER_PREFIXES) or "language_model." in hf_name:
        return None
    if hf_name.startswith("vision_tower.") and not hf_name.startswith("vision_tower.vision_model."):
        hf_name = "vision_tower.vision_model." + hf_name.removeprefix("vision_tower.")
    if "vision_model.head." in hf_name:
        return None
    return hf_name.replace("_weight", ".weight")


def _choose(hf_name: str, gguf_name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType
            ) -> gguf.GGMLQuantizationType:
    """``Gemma3VisionModel.tensor_force_quant``, then ``MmprojModel``'s, then ``prepare_tensors``' rules."""
    if "input_projection" in hf_name:
        return GT.F16
    if ".embeddings." in hf_name:
        return GT.F32
    if ".patch_embd.weight" in gguf_name:
        return GT.F16 if wanted == GT.F16 else GT.F32
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return GT.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    return GT.F16 if shape[-1] % block else wanted


def plan_mmproj(
    config: Mapping[str, Any],
    tensors: Iterable[tuple[str, Sequence[int]]],
    model_dir: str | os.PathLike[str],
    output_type: str = "f16",
    *,
    model_name: str | None = None,
    config_path: str | None = None,
) -> GGUFPlan:
    """Plan the mmproj GGUF of a Gemma3ForConditionalGeneration checkpoint from headers alone.

    Args:
        config: config.json (``vision_config``, ``text_config``).
        tensors: (Hugging Face name, shape) of every float tensor of the checkpoint (text tensors are
            left out here).
        model_dir: the directory with ``preprocessor_config.json``.
        output_type: the text model's ``--to gguf:TYPE`` (:func:`mmproj_type` picks the mmproj's).
        model_name: ``general.name`` (default: the directory's name).
        config_path: the config file, for error messages.

    Returns:
        The plan (architecture ``clip``); no weight has been read.

    Raises:
        GgufConfigError: GGUF-006 (not a Gemma 3 multimodal checkpoint, a vision value missing or out of
            range, no image mean/std).
        UnmappedTensorError: GGUF-003.
    """
    archs = config.get("architectures")
    if not isinstance(archs, list) or archs[:1] != ["Gemma3ForConditionalGeneration"]:
        raise GgufConfigError(
            "a vision projector (mmproj) is written for Gemma3ForConditionalGeneration only so far",
            path=config_path, expected="Gemma3ForConditionalGeneration", found=str(archs)[:80], action="convert",
        )
    vision = config.get("vision_config")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not isinstance(vision, dict):
        raise GgufConfigError("config.json has no vision_config object", path=config_path,
                              expected="an object", found=type(vision).__name__, action="convert")
    out_name = mmproj_type(output_type)
    wanted, file_type = OUTPUT_TYPES[out_name]
    pre = _preprocessor(Path(model_dir))

    def count(key: str) -> int:
        return whole(vision.get(key), f"vision_config.{key}", config_path)

    n_blocks = count("num_hidden_layers")
    image_size, patch_size = count("image_size"), count("patch_size")
    n_embd_text = whole({**config, **text}.get("hidden_size"), "text_config.hidden_size", config_path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_blocks)
    planned: list[GGUFTensor] = []
    for hf_name, shape_seq in tensors:
        name = _vision_name(hf_name)
        if name is None:
            continue
        shape = tuple(int(d) for d in shape_seq)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UnmappedTensorError(
                "vision tensor has no GGUF name in the mmproj", path=config_path, tensor=hf_name,
                expected="a tensor of a SigLIP vision tower or Gemma 3 projector", found=name, action="convert")
        qtype = _choose(name, gguf_name, shape, wanted)
        offset = 1.0 if "soft_emb_norm.weight" in name else 0.0
        planned.append(GGUFTensor(hf_name, gguf_name, shape, qtype, tensor_nbytes(shape, qtype), offset=offset))

    w = gguf.GGUFWriter(path=None, arch=_CLIP.name)
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(model_name if model_name is not None else Path(model_dir).resolve().name)
    total = sum(math.prod(t.shape) for t in planned)
    if total > 0:
        w.add_size_label(gguf.size_label(total, total, 0, 0))
    w.add_file_type(file_type)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(count("hidden_size"))
    w.add_vision_feed_forward_length(count("intermediate_size"))
    w.add_vision_block_count(n_blocks)
    w.add_vision_head_count(count("num_attention_heads"))
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    eps = vision.get("layer_norm_eps", 1e-6)
    w.add_vision_attention_layernorm_eps(real(eps, "vision_config.layer_norm_eps", config_path, inclusive=True))
    w.add_vision_use_gelu(True)
    seq = pre.get("image_seq_length", 256)
    per_side = int(whole(seq, "preprocessor_config.json image_seq_length", config_path) ** 0.5)
    scale = (image_size // patch_size) // per_side if per_side else 0
    if scale > 0 and scale != 4:
        w.add_vision_projector_scale_factor(scale)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    check_packable(w, Path(model_dir), config_path)
    metadata = {k: (v.value, v.type, v.sub_type) for k, v in w.kv_data[0].items()
                if k != gguf.Keys.General.ARCHITECTURE}
    return GGUFPlan(_CLIP, out_name, file_type, metadata, planned)


def _preprocessor(model_dir: Path) -> dict[str, Any]:
    """preprocessor_config.json merged with processor_config.json's ``image_processor`` (MmprojModel), with
    ``image_mean`` and ``image_std`` lists of 3 numbers.

    Raises:
        GgufConfigError: GGUF-006.
    """
    merged: dict[str, Any] = {}
    for name, nested in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
        path = model_dir / name
        if path.is_file():
            cfg = jsonfile.load_json_file(path, jsonfile.CONFIG, GgufConfigError, path.name)
            if isinstance(cfg, dict):
                merged.update(cfg)
                if isinstance(cfg.get(nested), dict):
                    merged.update(cfg[nested])
    for key in ("image_mean", "image_std"):
        value = merged.get(key)
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise GgufConfigError(
                f"the vision projector needs {key} from preprocessor_config.json",
                path=str(model_dir / "preprocessor_config.json"), expected="a list of numbers such as [0.5, 0.5, 0.5]",
                found=str(value)[:60], action="convert",
            )
    return merged
