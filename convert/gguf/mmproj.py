"""The vision projector GGUF (``mmproj``) of a multimodal checkpoint, as llama.cpp's converter writes it with
``--mmproj``: Gemma 3 (``Gemma3VisionModel``), Mistral 3's Pixtral tower (``LlavaVisionModel``: q/k rows
permuted as LlamaModel does), Qwen2-VL and Qwen2.5-VL (``Qwen2VLVisionModel``).

:func:`plan_mmproj` turns config.json, the (name, shape) list of the float tensors and the model directory
(``preprocessor_config.json``: image mean and std) into a :class:`convert.gguf.plan.GGUFPlan` of
architecture ``clip`` that :func:`convert.gguf.encode.write_gguf` writes like any other: the ``clip.*``
keys of ``MmprojModel.set_gguf_parameters`` and ``Gemma3VisionModel.set_gguf_parameters``, the vision
tower's and projector's tensors named by gguf-py's ``MODEL_ARCH.MMPROJ`` map, their types as the
converter's ``tensor_force_quant`` chooses them (embeddings F32, the input projection F16), and the
projector's ``soft_emb_norm`` + 1 (Gemma's RMSNorm).

Gemma 3: both layouts transformers saves are read, ``vision_tower.vision_model.*`` (4.x) and
``vision_tower.*`` (5.x, which the pinned converter cannot map); SigLIP's pooling head (``head.*``) is not
written. Qwen2/2.5-VL: ``visual.*`` (or 5.x's ``model.visual.*``); the fused ``qkv`` is split into q, k, v
and the Conv3D patch embedding into its two temporal slices (``v.patch_embd.weight``, ``.weight.1``), both as
element slices of the source (:class:`convert.stream.sources.StackSource`), never copied whole.

Not yet: ``--mmproj`` in batch JOBS files.

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
from convert.gguf.general import MetadataSource, model_metadata, naming, parameter_counts
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
    if ".embeddings." in hf_name or ".position_embd." in gguf_name:
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
    model: MetadataSource | None = None,
    config_path: str | None = None,
) -> GGUFPlan:
    """Plan the mmproj GGUF of a multimodal checkpoint from headers alone.

    Args:
        config: config.json (``vision_config``, ``text_config``).
        tensors: (Hugging Face name, shape) of every float tensor of the checkpoint (text tensors are
            left out here).
        model_dir: the directory with ``preprocessor_config.json``.
        output_type: the text model's ``--to gguf:TYPE`` (:func:`mmproj_type` picks the mmproj's).
        model: where the ``general.*`` keys come from (:mod:`convert.gguf.general`; default: ``model_dir``,
            named as it is, and ``config``).
        config_path: the config file, for error messages.

    Returns:
        The plan (architecture ``clip``); no weight has been read.

    Raises:
        GgufConfigError: GGUF-006 (not a supported multimodal class, a vision value missing or out of
            range, no image mean/std, a qkv or patch embedding that does not split).
        UnmappedTensorError: GGUF-003.
    """
    archs = config.get("architectures")
    hf = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if hf not in _PROJECTORS:
        raise GgufConfigError(
            "a vision projector (mmproj) is written for " + ", ".join(_PROJECTORS) + " only so far",
            path=config_path, expected=" or ".join(_PROJECTORS), found=str(archs)[:80], action="convert",
        )
    vision = config.get("vision_config")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not isinstance(vision, dict):
        raise GgufConfigError("config.json has no vision_config object", path=config_path,
                              expected="an object", found=type(vision).__name__, action="convert")
    qwen = hf in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    pixtral = hf == "Mistral3ForConditionalGeneration"
    if qwen:  # Qwen2VLVisionModel.__init__ renames its vision keys
        vision = {**vision, "num_attention_heads": vision.get("num_heads"), "num_hidden_layers": vision.get("depth"),
                  "image_size": vision.get("image_size", 560)}
        if "embed_dim" in vision:
            vision = {**vision, "intermediate_size": vision.get("hidden_size"), "hidden_size": vision["embed_dim"]}
    out_name = mmproj_type(output_type)
    wanted, file_type = OUTPUT_TYPES[out_name]
    pre = _preprocessor(Path(model_dir))

    given = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads"} if qwen else {}
    if qwen and "embed_dim" in config["vision_config"]:
        given = {**given, "hidden_size": "embed_dim", "intermediate_size": "hidden_size"}

    def count(key: str) -> int:
        return whole(vision.get(key), f"vision_config.{given.get(key, key)}", config_path)

    n_blocks = count("num_hidden_layers")
    image_size, patch_size = count("image_size"), count("patch_size")
    n_embd_text = whole({**config, **text}.get("hidden_size"), "text_config.hidden_size", config_path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_blocks)
    planned: list[GGUFTensor] = []
    for hf_name, shape_seq in tensors:
        shape = tuple(int(d) for d in shape_seq)
        name = _qwen_name(hf_name) if qwen else _pixtral_name(hf_name) if pixtral else _vision_name(hf_name)
        if name is None:
            continue
        for part_name, part_shape, parts, label in (_qwen_parts(hf_name, name, shape, config_path) if qwen
                                                    else [(name, shape, (), hf_name)]):
            gguf_name = _patch_name(part_name) or name_map.get_name(part_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise UnmappedTensorError(
                    "vision tensor has no GGUF name in the mmproj", path=config_path, tensor=hf_name,
                    expected=f"a tensor of {hf}'s vision tower or projector", found=part_name, action="convert")
            qtype = _choose(part_name, gguf_name, part_shape, wanted)
            offset = 1.0 if "soft_emb_norm.weight" in part_name else 0.0
            # LlavaVisionModel: Pixtral's q/k rows permuted as LlamaModel.permute, with the vision heads
            heads = count("num_attention_heads") if pixtral and part_name.endswith(_QK) else 0
            if heads and part_shape[0] % (2 * heads):
                raise GgufConfigError("vision q/k rows do not split into heads", path=config_path, tensor=hf_name,
                                      expected=f"a multiple of 2 x {heads}", found=part_shape[0], action="convert")
            planned.append(GGUFTensor(label, gguf_name, part_shape, qtype, tensor_nbytes(part_shape, qtype),
                                      permute_heads=heads, offset=offset, parts=parts))

    _check_required(planned, n_blocks, hf, config_path)
    w = gguf.GGUFWriter(path=None, arch=_CLIP.name)
    w.add_type(gguf.GGUFType.MMPROJ)
    if model is None:
        model = MetadataSource(Path(model_dir), Path(model_dir).resolve().name, config)
    general, notes = model_metadata(model, parameter_counts((t.name, t.shape) for t in planned))
    general.set_gguf_meta_model(w)
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
    if qwen:
        _qwen_keys(w, config, vision, config_path)
    elif pixtral:
        _pixtral_keys(w, config, vision, config_path)
    else:
        _gemma3_keys(w, vision, pre, image_size, patch_size, config_path)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    check_packable(w, Path(model_dir), config_path)
    metadata = {k: (v.value, v.type, v.sub_type) for k, v in w.kv_data[0].items()
                if k != gguf.Keys.General.ARCHITECTURE}
    return GGUFPlan(_CLIP, out_name, file_type, metadata, planned, notes=notes,
                    naming=naming(general, file_type, mmproj=True))


#: The classes with a projector here (``Gemma3VisionModel``, ``LlavaVisionModel``, ``Qwen2VLVisionModel``).
_PROJECTORS = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
               "Qwen2_5_VLForConditionalGeneration")

_QK = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
_PIXTRAL_PREFIXES = ("multi_modal_projector.", "vision_tower.", "vision_encoder.", "vision_language_adapter.",
                     "patch_merger.", "pre_mm_projector_norm")


def _pixtral_name(hf_name: str) -> str | None:
    """``LlavaVisionModel.modify_tensors``' vision tensors (the text model's are not the mmproj's: its
    [IMG_BREAK] row is taken from ``embed_tokens``, which ``MmprojModel.filter_tensors`` has already left out
    of a ``language_model.`` checkpoint, so the converter writes none)."""
    if "language_model." in hf_name or not hf_name.startswith(_PIXTRAL_PREFIXES):
        return None
    return hf_name


def _pixtral_keys(w: gguf.GGUFWriter, config: Mapping[str, Any], vision: Mapping[str, Any], path: str | None
                  ) -> None:
    """``LlavaVisionModel.set_gguf_parameters``' keys for a Pixtral tower.

    Raises:
        GgufConfigError: GGUF-006 (a vision model_type other than pixtral, a hidden_act other than gelu/silu).
    """
    if vision.get("model_type") != "pixtral":
        raise GgufConfigError("a Mistral 3 projector needs a Pixtral vision tower", path=path,
                              expected="vision_config model_type pixtral", found=str(vision.get("model_type"))[:40],
                              action="convert")
    w.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    eps = vision.get("layer_norm_eps", 1e-5)  # modeling_pixtral's own value when config.json has none
    w.add_vision_attention_layernorm_eps(real(eps, "vision_config.layer_norm_eps", path, inclusive=True))
    act = vision.get("hidden_act", "gelu")
    if act == "silu":
        w.add_vision_use_silu(True)
    elif act == "gelu":
        w.add_vision_use_gelu(True)
    else:
        raise GgufConfigError("a Pixtral tower's hidden_act is gelu or silu in llama.cpp", path=path,
                              expected="gelu or silu", found=str(act)[:40], action="convert")
    if "spatial_merge_size" in config:
        w.add_vision_spatial_merge_size(whole(config["spatial_merge_size"], "spatial_merge_size", path))

#: The Conv3D patch embedding's two temporal slices, named as ``Qwen2VLVisionModel.modify_tensors`` names them.
_PATCH = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"


#: Per vision layer, the weights every projector here has (llama.cpp's clip loader needs them).
_VISION_LAYER = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_out.weight", "ln1.weight", "ln2.weight",
                 "ffn_up.weight", "ffn_down.weight")
#: Per class, the tensors outside the layers: the patch embedding and the projector's own.
_PROJECTOR_TENSORS = {
    "Gemma3ForConditionalGeneration": ("v.patch_embd.weight", "v.position_embd.weight", "v.post_ln.weight",
                                       "mm.input_projection.weight", "mm.soft_emb_norm.weight"),
    "Mistral3ForConditionalGeneration": ("v.patch_embd.weight", "v.pre_ln.weight", "mm.1.weight", "mm.2.weight",
                                         "mm.input_norm.weight", "mm.patch_merger.weight"),
    "Qwen2VLForConditionalGeneration": ("v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight",
                                        "mm.2.weight"),
    "Qwen2_5_VLForConditionalGeneration": ("v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight",
                                           "mm.2.weight"),
}


def _check_required(planned: Sequence[GGUFTensor], n_blocks: int, hf: str, path: str | None) -> None:
    """Every vision layer's attention, norms and FFN and the class's patch embedding and projector weights
    come from some input tensor (a checkpoint with one missing gives no mmproj rather than an incomplete one).

    Raises:
        GgufConfigError: GGUF-006, naming the first missing tensor.
    """
    have = {t.name for t in planned}
    wanted = [*_PROJECTOR_TENSORS[hf], *(f"v.blk.{i}.{n}" for i in range(n_blocks) for n in _VISION_LAYER)]
    missing = next((n for n in wanted if n not in have), None)
    if missing is not None:
        raise GgufConfigError(
            f"the weights lack a tensor of the vision projector: {missing} (no tensor of the input becomes it)",
            path=path, expected=f"{n_blocks} vision layers and the {hf} projector's weights", found=f"no {missing}",
            action="convert",
        )


def _patch_name(part_name: str) -> str | None:
    return part_name if part_name.startswith(_PATCH) else None


def _gemma3_keys(w: gguf.GGUFWriter, vision: Mapping[str, Any], pre: Mapping[str, Any], image_size: int,
                 patch_size: int, path: str | None) -> None:
    """``Gemma3VisionModel.set_gguf_parameters``' keys."""
    w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    eps = vision.get("layer_norm_eps", 1e-6)
    w.add_vision_attention_layernorm_eps(real(eps, "vision_config.layer_norm_eps", path, inclusive=True))
    w.add_vision_use_gelu(True)
    seq = pre.get("image_seq_length", 256)
    per_side = int(whole(seq, "preprocessor_config.json image_seq_length", path) ** 0.5)
    scale = (image_size // patch_size) // per_side if per_side else 0
    if scale > 0 and scale != 4:
        w.add_vision_projector_scale_factor(scale)


def _qwen_keys(w: gguf.GGUFWriter, config: Mapping[str, Any], vision: Mapping[str, Any], path: str | None) -> None:
    """``Qwen2VLVisionModel.set_gguf_parameters``' keys: the projector type by ``model_type``, Qwen2.5-VL's
    SiLU and window-attention pattern (``fullatt_block_indexes`` evenly spaced).

    Raises:
        GgufConfigError: GGUF-006 (another model_type, fullatt_block_indexes missing or uneven).
    """
    model_type = config.get("model_type")
    if model_type == "qwen2_vl":
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    elif model_type == "qwen2_5_vl":
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        w.add_vision_use_silu(True)
        full = vision.get("fullatt_block_indexes")
        ok = isinstance(full, list) and full and all(isinstance(i, int) and not isinstance(i, bool) for i in full)
        step = full[0] + 1 if ok else 0
        if not ok or step < 1 or any(b - a != step for a, b in zip(full, full[1:], strict=False)):
            raise GgufConfigError(
                "vision_config.fullatt_block_indexes must be evenly spaced layer indexes (the window pattern)",
                path=path, expected="a list such as [7, 15, 23, 31]", found=str(full)[:60], action="convert")
        w.add_vision_n_wa_pattern(step)
    else:
        raise GgufConfigError("a Qwen2-VL projector needs model_type qwen2_vl or qwen2_5_vl", path=path,
                              expected="qwen2_vl or qwen2_5_vl", found=str(model_type)[:40], action="convert")
    eps = config.get("rms_norm_eps", 1e-6)
    w.add_vision_attention_layernorm_eps(real(eps, "rms_norm_eps", path, inclusive=True))


def _qwen_name(hf_name: str) -> str | None:
    """``Qwen2VLVisionModel.filter_tensors``: the ``visual.*`` tensors (5.x's ``model.visual.*`` too)."""
    name = hf_name.removeprefix("model.")
    return name if name.startswith("visual.") else None


def _qwen_parts(hf_name: str, name: str, shape: tuple[int, ...], path: str | None
                ) -> list[tuple[str, tuple[int, ...], tuple[tuple[str, int, int], ...], str]]:
    """``Qwen2VLVisionModel.modify_tensors``: (name to map, shape, element slices of ``hf_name`` (() for the
    tensor as it is), the source's label) of each tensor one source becomes.

    Raises:
        GgufConfigError: GGUF-006 (a qkv whose rows are not 3 equal parts, a patch embedding that is not a
            Conv3D of temporal size 2).
    """
    if ".qkv." in name:
        if shape[0] % 3:
            raise GgufConfigError("a vision qkv tensor does not split into q, k and v", path=path, tensor=hf_name,
                                  expected="rows a multiple of 3", found=list(shape), action="convert")
        c = shape[0] // 3
        per = c * math.prod(shape[1:])
        return [(name.replace("qkv", x), (c, *shape[1:]), ((hf_name, i * per, (i + 1) * per),), f"{hf_name}[{x}]")
                for i, x in enumerate("qkv")]
    if "patch_embed.proj.weight" in name:
        if len(shape) != 5 or shape[2] != 2:
            raise GgufConfigError("the vision patch embedding is not a Conv3D of temporal size 2", path=path,
                                  tensor=hf_name, expected="[out, in, 2, h, w]", found=list(shape), action="convert")
        c1, c2, kt, kh, kw = shape
        hw = kh * kw
        return [(_PATCH + ("" if t == 0 else f".{t}"), (c1, c2, kh, kw),
                 tuple((hf_name, ((i * kt) + t) * hw, ((i * kt) + t + 1) * hw) for i in range(c1 * c2)),
                 f"{hf_name}[:, :, {t}]") for t in range(kt)]
    return [(name, shape, (), hf_name)]


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
    if not merged:
        raise GgufConfigError(
            "the vision projector needs the image mean and std of preprocessor_config.json, and there is none",
            path=str(model_dir), expected="preprocessor_config.json (or processor_config.json)", found="neither file",
            action="convert",
        )
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
