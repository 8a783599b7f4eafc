"""Every error convert-bnb raises on purpose.

One base class, :class:`ConvertBnbError`, and one subclass per failure kind. Each subclass also
derives from the builtin that fits (``ValueError`` for bad content, ``OSError`` for the file
system), so callers that catch builtins keep working.

Every error keeps what it is about as attributes -- ``path`` (the file), ``tensor`` (the tensor
name, when there is one), ``rule`` (the rule id, e.g. ``BNB-003``), ``expected`` and ``found`` --
and renders them into one line::

    Failed to read 'model.safetensors': tensor 'model.layers.0.mlp.down_proj.weight':
    BNB-004 absmax count must be ceil(n / blocksize) (expected 2816, found 2815). Hint: ...

The CLI prints that line and exits with code 2; the library never prints or exits.
"""

from __future__ import annotations

import copy
import os
import reprlib
from typing import Any

__all__ = [
    "AbsmaxCountError",
    "AbsmaxDtypeError",
    "AdapterConfigError",
    "AdapterConfigValueError",
    "AdapterError",
    "AdapterKeyNameError",
    "AdapterTargetMissingError",
    "BatchFileError",
    "BatchJobError",
    "BatchNameClashError",
    "BatchOptionError",
    "BlocksizeError",
    "BlocksizeOptionError",
    "BnbLayerError",
    "ByteOrderError",
    "ByteSpanError",
    "CheckpointError",
    "ConfigJsonError",
    "ConfigWeightsError",
    "ConflictingQuantStateError",
    "ConvertBnbError",
    "DataGapError",
    "DataOffsetsError",
    "DiskSpaceError",
    "DuplicateAdapterTargetError",
    "DuplicateTensorError",
    "EncoderProcessError",
    "FileTooShortError",
    "ForeignFilesError",
    "GgufAdapterError",
    "GgufConfigError",
    "GgufNonFiniteError",
    "GgufSourceError",
    "GgufTypeError",
    "GgufVerificationError",
    "HeaderJsonError",
    "HeaderTooLargeError",
    "ImatrixError",
    "ImatrixFormatError",
    "ImatrixRequiredError",
    "ImatrixTensorError",
    "ImatrixValuesError",
    "HubError",
    "HubShardError",
    "IncompleteLoraModuleError",
    "IndexJsonError",
    "InputChangedError",
    "IndexTensorMissingError",
    "Int8LayoutError",
    "Int8ScaleMissingError",
    "Int8WeightFormatError",
    "JobSettingsChangedError",
    "LegacyQuantStateError",
    "LoraShapeError",
    "MalformedPickleError",
    "MetadataError",
    "MissingComponentError",
    "MissingShardError",
    "MissingTokenizersError",
    "ModulesToSaveMismatchError",
    "NestedAbsmaxError",
    "NestedFieldsError",
    "NestedQuantMapError",
    "NoAdapterWeightsError",
    "NoWeightsError",
    "NonContiguousTensorError",
    "NonFiniteAbsmaxError",
    "NonFiniteAdapterError",
    "NonFiniteWeightError",
    "NotLoraAdapterError",
    "NotRegularFileError",
    "NotSafetensorsError",
    "NotStateDictError",
    "NotTorchCheckpointError",
    "OrphanComponentError",
    "OutputBusyError",
    "OutputExistsError",
    "OutputInsideInputError",
    "OutputKindError",
    "PackedSizeError",
    "PatternTimeoutError",
    "PickleLimitError",
    "PickleTooLargeError",
    "QuantDtypeError",
    "QuantMapError",
    "QuantShapeError",
    "QuantStateJsonError",
    "QuantStorageOptionError",
    "QuantStorageSizeError",
    "QuantTypeError",
    "QuantTypeOptionError",
    "RopeScalingError",
    "SafetensorsError",
    "SentencePieceFormatError",
    "SentencePiecePiecesError",
    "SentencePieceWireTypeError",
    "ShardDuplicateTensorError",
    "ShardPathError",
    "SourceNotFoundError",
    "StorageRecordError",
    "TargetsFailedError",
    "TensorOverlapError",
    "TensorShapeError",
    "TensorViewError",
    "TokenizerError",
    "TooManyTensorsError",
    "TorchPickleError",
    "TruncatedFileError",
    "UnindexedShardError",
    "UnindexedTensorError",
    "UnknownBpePreTokenizerError",
    "UnknownDtypeError",
    "UnknownMoeLayoutError",
    "UnmappedTensorError",
    "UnsafePickleError",
    "UnsupportedAdapterConfigError",
    "UnsupportedArchitectureError",
    "UnsupportedError",
    "UntargetedModuleError",
    "UsageError",
    "VerificationError",
    "all_rules",
]


class ConvertBnbError(Exception):
    """Base class of every error convert-bnb raises on purpose.

    Args:
        message: the rule that was broken, in words (without file or tensor: those are added).
        path: the file or directory being read or written.
        tensor: the tensor name, when the problem is about one tensor.
        expected: what the rule wants (rendered with ``repr`` for strings).
        found: what was actually read.
        hint: what the user can do about it.
        action: the verb in "Failed to <action> '<path>'" (default "read").

    Class attributes:
        default_rule: the rule id this class stands for (one class per failure kind), e.g. ``"ST-005"``;
            every instance's ``rule`` attribute. A rule is raised by naming its class, so
            ``grep ClassName`` finds every place it is checked; there is no ``rule=`` argument.
        advice: what the user should do, in general, when this error occurs (docs/errors.md).
    """

    default_rule: str | None = None
    advice: str = ""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        tensor: str | None = None,
        expected: Any = None,
        found: Any = None,
        hint: str | None = None,
        action: str = "read",
    ) -> None:
        self.reason = message
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        self.rule = self.default_rule
        self.expected = expected
        self.found = found
        self.hint = hint
        self.action = action
        super().__init__(self._render())
        self.args = (self._render(),)  # OSError subclasses keep their own args otherwise

    def with_reason(self, reason: str) -> ConvertBnbError:
        """A copy of this error (its class, rule, path, tensor, expected/found and hint) saying ``reason`` instead."""
        error = copy.copy(self)
        error.reason = reason
        error.args = (error._render(),)
        return error

    def _render(self) -> str:
        parts: list[str] = []
        if self.path is not None:
            parts.append(f"Failed to {self.action} '{self.path}'")
        if self.tensor is not None:
            parts.append(f"tensor {self.tensor!r}" if _odd(self.tensor) else f"tensor '{self.tensor}'")
        body = f"{self.rule} {self.reason}" if self.rule else self.reason
        if self.expected is not None and self.found is not None:
            body += f" (expected {_show(self.expected)}, found {_show(self.found)})"
        elif self.expected is not None:
            body += f" (expected {_show(self.expected)})"
        elif self.found is not None:
            body += f" (found {_show(self.found)})"
        parts.append(body)
        text = ": ".join(parts)
        if self.hint:
            text += f". Hint: {self.hint}"
        # one line, always: a hostile name or value must not break the CLI's one-line contract
        return text.replace("\r", "\\r").replace("\n", "\\n")

    def to_dict(self) -> dict[str, Any]:
        """The error as JSON-ready data (``convert-bnb check --json``)."""
        return {
            "rule": self.rule,
            "error": type(self).__name__,
            "path": self.path,
            "tensor": self.tensor,
            "expected": _jsonable(self.expected),
            "found": _jsonable(self.found),
            "hint": self.hint,
            "message": str(self),
        }


def _odd(name: str) -> bool:
    return any(not c.isprintable() for c in name) or "'" in name


class _BoundedRepr(reprlib.Repr):
    """``repr`` of found values for messages, truncated while it is built (never a giant string first)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 4, 32, 32, 32, 32
        self.maxstring, self.maxother, self.maxlong = 200, 200, 60

    def repr_int(self, x: int, level: int) -> str:
        return _show_int(x)


_REPR = _BoundedRepr()


def _show_int(x: int) -> str:
    return str(x) if x.bit_length() <= 200 else f"an integer of {x.bit_length()} bits"


def _show(value: Any) -> str:
    """A found/expected value for a message: at most about 300 characters, built without first making a
    longer string (a 5000-digit integer, a huge or deeply nested container)."""
    if isinstance(value, str):
        return repr(value[:300]) + ("..." if len(value) > 300 else "")
    if isinstance(value, int) and not isinstance(value, bool):
        return _show_int(value)
    text = _REPR.repr(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else str(value)
    if len(text) > 300:
        text = text[:300] + "..."
    return text


def _jsonable(value: Any, depth: int = 0) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return _show_int(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and depth < 3:
        return [_jsonable(v, depth + 1) for v in value[:64]]
    return _show(value)


def all_rules() -> dict[str, type[ConvertBnbError]]:
    """Every rule id and the one error class that stands for it, sorted by id.

    Returns:
        ``{"ST-001": FileTooShortError, ...}`` built from the classes' ``default_rule``.
    """
    out: dict[str, type[ConvertBnbError]] = {}
    todo: list[type[ConvertBnbError]] = [ConvertBnbError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.default_rule is not None and cls.default_rule not in out:
            out[cls.default_rule] = cls
    prefixes = ["ST", "PT", "CKPT", "HUB", "BNB", "LORA", "GGUF", "IMX", "SPM", "QNT", "OUT", "USE", "BATCH", "UNS"]

    def key(rule: str) -> tuple[int, str]:
        prefix = rule.split("-")[0]
        return (prefixes.index(prefix) if prefix in prefixes else len(prefixes), rule)

    return {k: out[k] for k in sorted(out, key=key)}


# --------------------------------------------------------------------------------------------- usage


class UsageError(ConvertBnbError, ValueError):
    """The command line or API call asks for something that cannot be done (bad option value)."""

    default_rule = "USE-001"
    advice = "Fix the option named in the message; `convert-bnb --help` lists the accepted values."


class BatchFileError(UsageError):
    """The batch JOBS file cannot be read or parsed (text, JSON or YAML list), or breaks the JSON limits."""

    default_rule = "BATCH-001"
    advice = "Fix the JOBS file at the line named: one job per line, or a JSON/YAML list (see `convert-bnb batch -h`)."


class BatchJobError(UsageError):
    """A batch item is neither a job line nor an object with ``src`` (or ``repo``)."""

    default_rule = "BATCH-002"
    advice = "Give every job a source: a line `SRC [options]` or an object with \"src\"."


class BatchOptionError(UsageError):
    """A per-job option in the JOBS file is unknown or invalid."""

    default_rule = "BATCH-003"
    advice = ("Use only the per-job options --to, --revision, --max-shard-size, --name, and --mmproj and --modelfile "
              "(GGUF targets), with valid values.")


class BatchNameClashError(UsageError):
    """Two outputs of a batch (job outputs or their --mmproj or --modelfile files) would have the same name."""

    default_rule = "BATCH-004"
    advice = ("Give one of the jobs its own --name (or its projector its own --mmproj MMNAME, its Modelfile its own "
              "--modelfile MFNAME).")


class JobSettingsChangedError(UsageError):
    """A batch job's output exists from a run with other settings (source commit, --to, shard size, ...)."""

    default_rule = "BATCH-005"
    advice = "Pass --overwrite to redo the job with the new settings, or give the job another --name."


class ForeignFilesError(UsageError):
    """A batch job's output folder holds files the batch did not write, which redoing the job would remove."""

    default_rule = "BATCH-006"
    advice = "Move the named files out of the job's output folder, or give the job another --name."


class OutputInsideInputError(UsageError):
    """The output path is the input or lies inside the input directory."""

    default_rule = "USE-002"
    advice = "Choose an output path outside the input with -o; the input is never written to."


class OutputKindError(UsageError):
    """The output path names the wrong kind of thing: a model directory converts to a directory (not
    ``*.safetensors``), and ``--overwrite`` never replaces a file with a directory or the reverse."""

    default_rule = "USE-003"
    advice = ("A model directory gives a directory and a single file gives a file: pick -o accordingly, "
              "or remove the existing path yourself.")


class UnsupportedError(ConvertBnbError, ValueError):
    """Valid input that convert-bnb does not handle (yet); the message says what is supported."""

    default_rule = "UNS-001"
    advice = "The message says what is supported; convert that part another way or open an issue."


# ----------------------------------------------------------------------------------------- safetensors


class SafetensorsError(ConvertBnbError, ValueError):
    """A ``.safetensors`` file breaks the container format (header, dtype, shape, offsets, size)."""

    advice = "The file is damaged or not what its name says: download or copy it again."


class FileTooShortError(SafetensorsError):
    """The file holds fewer than the 8 bytes of the header length."""

    default_rule = "ST-001"
    advice = "The file is empty or cut short: download it again (with `git lfs pull` for LFS repos)."


class HeaderTooLargeError(SafetensorsError):
    """The header length is larger than the file, or than the 100 MiB limit."""

    default_rule = "ST-002"
    advice = "The first 8 bytes are not a sane header length: the file is damaged; download it again."


class HeaderJsonError(SafetensorsError):
    """The header is not UTF-8 JSON within the JSON limits, or not an object of tensor entries."""

    default_rule = "ST-003"
    advice = "The header is damaged: download the file again, or re-save it with the safetensors library."


class NotSafetensorsError(SafetensorsError):
    """The file is not a safetensors file at all (a Git LFS pointer, HTML, zip or pickle, text)."""

    default_rule = "ST-004"
    advice = ("Fetch the real file: for a Git LFS pointer run `git lfs pull`; an HTML page is an error page "
              "saved by a failed download; a zip/pickle is a PyTorch checkpoint and needs a .bin/.pt name.")


class UnknownDtypeError(SafetensorsError):
    """A tensor's dtype is not a safetensors dtype code."""

    default_rule = "ST-005"
    advice = "The header is damaged or was written by a tool with a non-standard dtype; re-save the file."


class TensorShapeError(SafetensorsError):
    """A tensor's shape is not a list of non-negative integers."""

    default_rule = "ST-006"
    advice = "The header is damaged; download the file again."


class DataOffsetsError(SafetensorsError):
    """A tensor's data_offsets are not ``[begin, end]`` integers with ``0 <= begin <= end``."""

    default_rule = "ST-007"
    advice = "The header is damaged; download the file again."


class ByteSpanError(SafetensorsError):
    """A tensor's byte span differs from ``prod(shape) * itemsize``."""

    default_rule = "ST-008"
    advice = "The header and the data disagree: the file is damaged; download it again."


class TensorOverlapError(SafetensorsError):
    """Two tensors share bytes of the data area."""

    default_rule = "ST-009"
    advice = "The header is damaged (or hand-made); re-save the file with the safetensors library."


class TruncatedFileError(SafetensorsError):
    """The data area is shorter than the header says: the file was cut short."""

    default_rule = "ST-010"
    advice = "The download or copy was cut short: fetch the file again and compare its size."


class MetadataError(SafetensorsError):
    """``__metadata__`` is not an object mapping strings to strings."""

    default_rule = "ST-011"
    advice = "The header's metadata is damaged; re-save the file with the safetensors library."


class DataGapError(SafetensorsError):
    """The tensors leave bytes of the data area uncovered (a gap, or trailing bytes)."""

    default_rule = "ST-012"
    advice = "The file holds bytes no tensor owns: it is damaged or was appended to; download it again."


class DuplicateTensorError(SafetensorsError):
    """A tensor name appears twice in one header."""

    default_rule = "ST-013"
    advice = "The header is damaged (or hand-made): each name must appear once; re-save the file."


class TooManyTensorsError(SafetensorsError):
    """A header lists more tensors than one file may hold (``formats.safetensors.MAX_TENSORS``)."""

    default_rule = "ST-014"
    advice = (
        "Real checkpoint files hold at most tens of thousands of tensors; each one costs memory before any "
        "data is read. Re-save the model in shards (save_pretrained(max_shard_size=...))."
    )


# ------------------------------------------------------------------------------------- torch pickles


class TorchPickleError(ConvertBnbError, ValueError):
    """A PyTorch ``.bin``/``.pt`` checkpoint breaks the container format (zip, records, pickle, views)."""

    advice = "The file is damaged or not a torch.save checkpoint: download it again."


class NotTorchCheckpointError(TorchPickleError):
    """The file is not a torch.save checkpoint (zip or legacy pickle) that convert-bnb reads."""

    default_rule = "PT-001"
    advice = ("Give a torch.save state dict (.bin/.pt); a TorchScript or tar-format (torch < 0.4) file must be "
              "re-saved with a current torch as a state dict, or better, as safetensors.")


class PickleTooLargeError(TorchPickleError):
    """data.pkl is larger than the limit (the pickle holds the structure only, never the tensor data)."""

    default_rule = "PT-002"
    advice = "A state dict's pickle is small; a huge one is damaged or hostile. Re-save the model as safetensors."


class UnsafePickleError(TorchPickleError):
    """A pickle names a global outside the allow-list; nothing was imported or called.

    ``found`` holds the refused ``module.name``.
    """

    default_rule = "PT-003"
    advice = ("Do not load this file with torch.load: it would run the named code. Get the weights from a "
              "trusted source, preferably as safetensors.")


class MalformedPickleError(TorchPickleError):
    """The pickle is malformed: bad opcodes, persistent ids or rebuild arguments."""

    default_rule = "PT-004"
    advice = "The pickle is damaged or hostile: download the file again, preferably as safetensors."


class StorageRecordError(TorchPickleError):
    """A tensor storage is missing, compressed, of the wrong size, or past the end of the file."""

    default_rule = "PT-005"
    advice = "The file is damaged or cut short: download it again."


class TensorViewError(TorchPickleError):
    """A tensor's view (offset, size, stride) reaches outside its storage."""

    default_rule = "PT-006"
    advice = "The file is damaged or hostile: download it again."


class NonContiguousTensorError(TorchPickleError):
    """A large tensor is not row-major contiguous (only small ones are copied)."""

    default_rule = "PT-007"
    advice = "Re-save the state dict with contiguous tensors (`{k: v.contiguous() ...}`), or as safetensors."


class ByteOrderError(TorchPickleError):
    """The checkpoint was written big-endian."""

    default_rule = "PT-008"
    advice = "Re-save the model on a little-endian machine, or as safetensors."


class NotStateDictError(TorchPickleError):
    """The top-level object is not a dict of tensors with unique string keys."""

    default_rule = "PT-009"
    advice = "Save `model.state_dict()`, not the model object or a list; or save as safetensors."


class PickleLimitError(TorchPickleError):
    """The pickle exceeds a limit of the reader (opcodes, memo, elements, depth, integer or key size).

    A torch.save state dict stays far within them; the limits are in formats/pickle_machine.py.
    """

    default_rule = "PT-010"
    advice = ("A state dict's pickle is small and flat; one over these limits is damaged or hostile. Get the "
              "weights from a trusted source, preferably as safetensors.")


# --------------------------------------------------------------------------------------- directories


class CheckpointError(ConvertBnbError, ValueError):
    """A model directory is inconsistent: index JSON, missing shards, no weights, config."""

    advice = "The model directory is incomplete or inconsistent: download it again."


class IndexJsonError(CheckpointError):
    """The shard index is not valid JSON within the JSON limits, with a ``weight_map`` object of strings."""

    default_rule = "CKPT-001"
    advice = "The index file is damaged: download `model.safetensors.index.json` again."


class MissingShardError(CheckpointError):
    """The index names a shard file that is not in the directory."""

    default_rule = "CKPT-002"
    advice = "The download is incomplete: fetch the missing shard (e.g. `huggingface-cli download` again)."


class IndexTensorMissingError(CheckpointError):
    """The index names a tensor that is not in the shard it names."""

    default_rule = "CKPT-003"
    advice = "The index and the shards come from different saves: download the whole model again."


class UnindexedShardError(CheckpointError):
    """A shard-named weight file that no index mentions."""

    default_rule = "CKPT-004"
    advice = "Remove the stray shard (left over from another save) or download the matching index."


class NoWeightsError(CheckpointError):
    """The directory holds no weights convert-bnb can find, or its weight files hold no tensors."""

    default_rule = "CKPT-005"
    advice = "Point SRC at the model directory (with model.safetensors or an index) or at one weight file."


class ShardDuplicateTensorError(CheckpointError):
    """A tensor name appears in more than one shard."""

    default_rule = "CKPT-006"
    advice = "The shards come from different saves: download the whole model again."


class ConfigJsonError(CheckpointError):
    """``config.json`` is not a JSON object within the JSON limits."""

    default_rule = "CKPT-007"
    advice = "config.json is damaged: download it again (the weights do not need it, the output does)."


class UnindexedTensorError(CheckpointError):
    """A shard holds a tensor that the index does not map to that shard."""

    default_rule = "CKPT-008"
    advice = "The index and the shards come from different saves: download the whole model again."


class ShardPathError(CheckpointError):
    """The index names a shard outside the model directory (a path, ``..``, or an empty name)."""

    default_rule = "CKPT-009"
    advice = "The index is damaged or hostile: shards must be plain file names in the model directory."


class SourceNotFoundError(CheckpointError, FileNotFoundError):
    """SRC does not exist."""

    default_rule = "CKPT-010"
    advice = "Check the path; give a .safetensors file or a model directory."


class NotRegularFileError(CheckpointError):
    """SRC, or a weight file it names, is neither a regular file nor a directory: a FIFO, a device, a socket,
    or a symlink loop."""

    default_rule = "CKPT-011"
    advice = ("Point SRC at the model directory or a weight file; a named pipe, a device or a symlink loop is not "
              "read (it could block or never end). Fix the link or copy the real file into place.")


class InputChangedError(CheckpointError):
    """An input file changed size while it was read: another program rewrote, truncated or is still
    writing it (a download in progress, a save into the same path)."""

    default_rule = "CKPT-012"
    advice = ("Let the other program finish (or stop it), check the file is complete, then run again; a "
              "temporary left by the stopped run is removed by the next one.")


class ConfigWeightsError(CheckpointError):
    """config.json disagrees with the weights: ``vocab_size`` or ``hidden_size`` with the token embedding, or
    ``num_hidden_layers`` with the layers the tensors hold (transformers refuses such a model, or drops or
    re-initialises layers)."""

    default_rule = "CKPT-013"
    advice = "Use the config.json saved with these weights (download it again with the model)."


# --------------------------------------------------------------------------------------- bnb layers


class BnbLayerError(ConvertBnbError, ValueError):
    """A bitsandbytes layer (packed weight + QuantState) breaks a BNB-xxx rule."""

    advice = "The layer is damaged or was changed by hand: download the checkpoint again."


class QuantTypeError(BnbLayerError):
    """quant_type is not ``nf4`` or ``fp4``."""

    default_rule = "BNB-001"
    advice = "Only bitsandbytes nf4 and fp4 are 4-bit types; the QuantState is damaged or from another tool."


class BlocksizeError(BnbLayerError):
    """blocksize is not a power of two from 32 to 4096."""

    default_rule = "BNB-002"
    advice = "bitsandbytes never writes this blocksize: the QuantState is damaged or from another tool."


class PackedSizeError(BnbLayerError):
    """The packed weight does not hold ceil(n / 2) bytes for the QuantState shape."""

    default_rule = "BNB-003"
    advice = "The weight and its QuantState disagree (a renamed or mixed-up layer?): download again."


class AbsmaxCountError(BnbLayerError):
    """absmax does not hold ceil(n / blocksize) values."""

    default_rule = "BNB-004"
    advice = "absmax and the QuantState disagree (wrong blocksize or a mixed-up layer): download again."


class QuantMapError(BnbLayerError):
    """quant_map is not the 16 fp32 values of the table the QuantState names."""

    default_rule = "BNB-005"
    advice = "quant_map must be bnb's own nf4/fp4 table; a mismatch means a mixed-up or edited layer."


class NestedFieldsError(BnbLayerError):
    """Nested (double-quantization) fields or tensors present only in part."""

    default_rule = "BNB-006"
    advice = "Double quantization needs all of nested_blocksize/dtype/offset, nested_absmax and " \
             "nested_quant_map: the checkpoint is incomplete; download it again."


class NestedQuantMapError(BnbLayerError):
    """nested_quant_map is not 256 float32 values."""

    default_rule = "BNB-007"
    advice = "The nested_quant_map tensor is damaged: download the checkpoint again."


class NestedAbsmaxError(BnbLayerError):
    """nested_absmax has the wrong count or dtype."""

    default_rule = "BNB-008"
    advice = "nested_absmax and the QuantState disagree: download the checkpoint again."


class QuantStateJsonError(BnbLayerError):
    """The QuantState JSON (or its unpacked fields) is invalid: not JSON within the JSON limits, fields missing or
    ill-typed."""

    default_rule = "BNB-009"
    advice = "The quant_state entry is damaged: download the checkpoint again."


class OrphanComponentError(BnbLayerError):
    """A QuantState component (absmax, quant_map, quant_state, ...) has no weight of its prefix."""

    default_rule = "BNB-010"
    advice = "The checkpoint is incomplete or its names were changed: every component needs `P.weight`."


class MissingComponentError(BnbLayerError):
    """A 4-bit weight lacks a required companion (QuantState, absmax or quant_map)."""

    default_rule = "BNB-011"
    advice = "The checkpoint is incomplete (a shard or tensor missing, or names changed): download again."


class NonFiniteAbsmaxError(BnbLayerError):
    """absmax (after undoing double quantization) holds inf or NaN."""

    default_rule = "BNB-012"
    advice = "The layer's scales are damaged (NaN/inf): the weights cannot be recovered from this file."


class QuantDtypeError(BnbLayerError):
    """The QuantState dtype (or nested_dtype) is not float16, bfloat16 or float32."""

    default_rule = "BNB-013"
    advice = "The QuantState names a dtype bnb does not write: it is damaged or from another tool."


class QuantShapeError(BnbLayerError):
    """The QuantState shape is not a non-empty list of positive integers."""

    default_rule = "BNB-014"
    advice = "The QuantState is damaged: download the checkpoint again."


class Int8LayoutError(BnbLayerError):
    """An LLM.int8 layer is not weight I8 [out, in] with SCB F32 [out]."""

    default_rule = "BNB-015"
    advice = "The int8 weight and its SCB disagree (a mixed-up or damaged layer): download the checkpoint again."


class Int8WeightFormatError(BnbLayerError, UnsupportedError):
    """An LLM.int8 weight is stored in a layout other than ``row`` (col32, col_turing, col_ampere)."""

    default_rule = "BNB-016"
    advice = ("col32/col_turing/col_ampere are GPU tile layouts of bitsandbytes < 0.45: load the model with a "
              "current bitsandbytes, save it again (row format), then convert.")


class LegacyQuantStateError(BnbLayerError):
    """A legacy QuantState (the list of old ``.bin`` pickles, or a pickled QuantState) has the wrong layout."""

    default_rule = "BNB-017"
    advice = "The old-format QuantState is damaged or from an unknown bitsandbytes version: report it with the file."


class AbsmaxDtypeError(BnbLayerError):
    """absmax has a dtype bnb never writes (F32/F16/BF16; U8 codes when nested)."""

    default_rule = "BNB-018"
    advice = "absmax and the QuantState disagree about double quantization: download the checkpoint again."


class ConflictingQuantStateError(BnbLayerError):
    """A weight has two packed QuantStates, or the key's quant type differs from its JSON's."""

    default_rule = "BNB-019"
    advice = "The layer's QuantState entries contradict each other: download the checkpoint again."


class Int8ScaleMissingError(BnbLayerError):
    """An LLM.int8 weight has no ``SCB`` row scales (it has a ``weight_format``, or the config says 8-bit)."""

    default_rule = "BNB-020"
    advice = ("The checkpoint is incomplete (its int8 row scales were not saved or not downloaded): without SCB "
              "the int8 codes cannot be turned back into weights. Download the checkpoint again.")


# ------------------------------------------------------------------------------------- LoRA adapters


class AdapterError(ConvertBnbError, ValueError):
    """A PEFT adapter breaks a LORA-xxx rule: its config, its keys, or its fit to the base model."""

    advice = "The adapter does not fit this base model or is damaged (see the rule)."


class AdapterConfigError(AdapterError):
    """adapter_config.json is missing, not valid JSON within the JSON limits, or not a JSON object."""

    default_rule = "LORA-001"
    advice = "Point --merge-lora at the adapter directory PEFT saved (`save_pretrained`), with adapter_config.json."


class NotLoraAdapterError(AdapterError):
    """The adapter is not a LoRA adapter (peft_type is not LORA)."""

    default_rule = "LORA-002"
    advice = "Only LoRA adapters (and rsLoRA, DoRA) can be merged; merge other PEFT types with PEFT itself."


class UnsupportedAdapterConfigError(AdapterError, UnsupportedError):
    """A config key that changes the merge has a value convert-bnb does not implement."""

    default_rule = "LORA-003"
    advice = 'The message names the key and the supported values; merge this adapter with PEFT, or open an issue.'


class AdapterConfigValueError(AdapterError):
    """A config value has the wrong type or range (r, lora_alpha, patterns, target_modules, ...)."""

    default_rule = "LORA-004"
    advice = 'Fix the named key in adapter_config.json (as PEFT would write it) or get the adapter again.'


class NoAdapterWeightsError(AdapterError):
    """The adapter directory holds no adapter weights."""

    default_rule = "LORA-005"
    advice = 'The adapter download is incomplete: fetch adapter_model.safetensors (or adapter_model.bin).'


class AdapterKeyNameError(AdapterError):
    """An adapter key lacks the ``base_model.model.`` prefix or a known LoRA suffix."""

    default_rule = "LORA-006"
    advice = "The adapter was not saved by PEFT or its keys were renamed; re-save it with PEFT's save_pretrained."


class AdapterTargetMissingError(AdapterError):
    """An adapter key lands on no tensor of the base model."""

    default_rule = "LORA-007"
    advice = 'The adapter was trained on another base model: merge it into the model it was trained on.'


class IncompleteLoraModuleError(AdapterError):
    """A targeted module lacks lora_A, lora_B (or its DoRA magnitude vector)."""

    default_rule = "LORA-008"
    advice = 'The adapter is incomplete: download it again.'


class UntargetedModuleError(AdapterError):
    """The adapter holds LoRA weights for a module its config does not target."""

    default_rule = "LORA-009"
    advice = "The adapter's config and weights disagree: download the adapter again or fix target_modules."


class LoraShapeError(AdapterError):
    """LoRA shapes do not fit: A [r, in], B [out, r], r as configured, the base [out, in]."""

    default_rule = "LORA-010"
    advice = 'The adapter was trained on another base model or another rank: merge it into the model it was trained on.'


class DuplicateAdapterTargetError(AdapterError):
    """Two adapter keys land on the same base tensor."""

    default_rule = "LORA-011"
    advice = 'The adapter file is damaged or hand-edited: download it again.'


class ModulesToSaveMismatchError(AdapterError):
    """A module's ``modules_to_save`` copy differs from its saved tensor."""

    default_rule = "LORA-012"
    advice = 'The adapter file is inconsistent: download it again.'


class PatternTimeoutError(AdapterError):
    """A regular expression of adapter_config.json (``target_modules``, ``rank_pattern``, ...) takes too long to
    match a module name (catastrophic backtracking), or is too large to compile (nested counted repetitions)."""

    default_rule = "LORA-013"
    advice = ("Rewrite the named pattern without nested repetition (such as `(a+)+` or `(.*.*)*`), or list the "
              "module names instead of a regular expression.")


class NonFiniteAdapterError(AdapterError):
    """A LoRA tensor (lora_A, lora_B, or DoRA's magnitude vector) holds NaN or infinite values, or the delta
    ``(B @ A) * scale`` of finite ones overflows float32."""

    default_rule = "LORA-014"
    advice = ("The adapter's training diverged or its file is damaged: use an earlier checkpoint of the adapter "
              "or download it again. Merging it would write NaN/inf into the model.")


class GgufAdapterError(AdapterError, UnsupportedError):
    """The adapter holds what a GGUF LoRA adapter cannot express (DoRA magnitude vectors, ``modules_to_save``
    or other full tensors, a resized vocabulary, LoRA on MoE experts, a vision tower, or a head llama.cpp's base
    file does not have), so no GGUF adapter would apply it as PEFT does."""

    default_rule = "LORA-015"
    advice = ("Merge the adapter into the model instead (convert-bnb BASE --to gguf:TYPE --merge-lora ADAPTER): "
              "the merged GGUF holds all of it.")


# ------------------------------------------------------------------------------------------ output


class OutputExistsError(ConvertBnbError, FileExistsError):
    """The output path exists and ``--overwrite`` was not given."""

    default_rule = "OUT-001"
    advice = "Pass --overwrite to replace it, or choose another path with -o."


class DiskSpaceError(ConvertBnbError, OSError):
    """Not enough free space for the planned output."""

    default_rule = "OUT-002"
    advice = "Free disk space, or write the output to another disk with -o (the message gives the bytes)."


class VerificationError(ConvertBnbError, OSError):
    """The written output does not match the plan when re-opened (nothing is renamed into place)."""

    default_rule = "OUT-003"
    advice = "Nothing was renamed into place. Check the disk (full? failing?) and run again; report it if it repeats."


class OutputBusyError(ConvertBnbError, BlockingIOError):
    """Another run holds the output path (its ``.NAME.convert-bnb-lock`` claim): two runs never write one output."""

    default_rule = "OUT-004"
    advice = ("Wait for the other conversion to finish (the message names its pid), or write elsewhere with -o. "
              "A run that died released its claim: run again.")


class TargetsFailedError(ConvertBnbError, RuntimeError):
    """Some targets of a run of several (``--to bf16,gguf:q8_0,nf4``) failed; every other target's output was
    committed, complete, in the run's folder, and each failed one left nothing.

    Attributes:
        failures: ``(target, its error)`` of each failed target, in ``--to`` order (the command line prints
            one line each).
        result: what the run did (the library's ``ConvertResult`` of the whole run: every output, the failed
            ones with their error), or None.
    """

    default_rule = "OUT-006"
    advice = ("The lines before it give each failed target's own error: fix that, then run again with --to naming "
              "only the targets that failed (the complete outputs are kept, and an existing one is not replaced).")

    def __init__(self, message: str, *, failures: list[tuple[str, BaseException]] | None = None, result: Any = None,
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.failures = failures or []
        self.result = result


class OverwriteRefusedError(ConvertBnbError, IsADirectoryError):
    """``--overwrite`` would replace a directory that is not a model output (it holds subdirectories or no
    model files), or the working directory or one of its parents."""

    default_rule = "OUT-005"
    advice = ("--overwrite replaces a model output, never a folder of other things: give -o the output's own "
              "path (e.g. ./model-bf16), or move the folder's contents away first.")


class HubError(ConvertBnbError, OSError):
    """A Hugging Face Hub repo cannot be resolved or fetched (not found, gated, offline without a cache)."""

    default_rule = "HUB-001"
    advice = ("Check the repo id and revision, log in (`huggingface-cli login` or HF_TOKEN) for gated or private "
              "repos, or download the model first and give its directory.")


class HubShardError(HubError):
    """A Hub shard read in place cannot be fetched mid-run, or differs from what the Hub listed.

    Read in place: ``--low-disk`` downloads each shard when it is needed, and a header-only ``inspect`` or
    ``--dry-run`` reads a few bytes of it; the file may have vanished, or its size or header changed."""

    default_rule = "HUB-002"
    advice = ("The repo changed (a force-push, a deleted file) or the network failed during the run: run again; "
              "without --low-disk the whole repo is downloaded into the cache before anything is read.")


class HubUploadError(HubError):
    """A finished output could not be uploaded with ``--push-to-hub`` (offline, no token or a read-only one,
    the network down, the Hub refusing the repo, branch or commit); the conversion is kept and recorded (a
    single run's record beside the output, a batch job's state as done).

    Attributes:
        refused: ``(the repo as the message names it, huggingface_hub's error)`` of each push that failed.
    """

    default_rule = "HUB-003"
    advice = ("Check the network and that HF_TOKEN may write to the repo or organisation, then run the same command "
              "(or batch) again: it uploads the kept output without converting it again.")

    def __init__(self, message: str, *, refused: list[tuple[str, str]] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.refused = refused or []


# ------------------------------------------------------------------------------------------- GGUF


class UnsupportedArchitectureError(UnsupportedError):
    """The model's architecture has no GGUF mapping in convert-bnb."""

    default_rule = "GGUF-001"
    advice = ("The message lists the supported architectures; convert other ones to safetensors (--to bf16) "
              "and use llama.cpp's own converter.")


class GgufTypeError(UnsupportedError):
    """The GGUF output type is not one convert-bnb writes, or this build has no encoder for a GGML type
    the type's mix needs (checked before anything is written)."""

    default_rule = "GGUF-002"
    advice = ("Choose one of the listed types (e.g. --to gguf:q8_0); quantize further with llama.cpp's llama-quantize.")


class UnmappedTensorError(UnsupportedError):
    """A tensor has no GGUF name for the architecture."""

    default_rule = "GGUF-003"
    advice = ("The checkpoint holds extra modules (vision tower, adapters, ...): convert to safetensors "
              "instead, or report it.")


class TokenizerError(CheckpointError, UnsupportedError):
    """No usable tokenizer for the GGUF: none, or a tokenizer file of the wrong structure or size, or one that
    breaks the JSON limits."""

    default_rule = "GGUF-004"
    advice = ('Download the tokenizer files into the model directory (GGUF files carry the tokenizer); '
              'tokenizer files must be the model\'s own: no more tokens than the embedding has rows.')


class RopeScalingError(UnsupportedError):
    """The RoPE scaling type is not supported for GGUF, or its keys are missing or out of range."""

    default_rule = "GGUF-005"
    advice = ("Use the model's own config.json; for a RoPE type convert-bnb does not write, convert to "
              "safetensors (--to bf16) and use llama.cpp's own converter.")


class GgufConfigError(UnsupportedError):
    """config.json lacks a hyperparameter, has one of a wrong type or range, disagrees with the weights, or is MoE."""

    default_rule = "GGUF-006"
    advice = ('Use the config.json that came with the model (its values must match the weights); MoE models '
              'are not supported for GGUF yet.')


class GgufSourceError(UnsupportedError):
    """A tensor to write has another shape or a non-float dtype than planned."""

    default_rule = "GGUF-007"
    advice = ('This is an internal inconsistency: report it with the command and --debug.')


class GgufVerificationError(VerificationError):
    """The written GGUF does not re-open with the planned names, types and shapes."""

    default_rule = "GGUF-008"
    advice = ('Nothing was renamed into place. Check the disk and run again; report it if it repeats.')


class UnknownBpePreTokenizerError(UnsupportedError):
    """A byte-level BPE tokenizer whose check hash llama.cpp's table does not hold (no pre-tokenizer name)."""

    default_rule = "GGUF-009"
    advice = ("llama.cpp would refuse this tokenizer too: use the model's own tokenizer.json, or add the "
              "tokenizer to llama.cpp (convert_hf_to_gguf_update.py) and convert with its converter.")


class MissingTokenizersError(UnsupportedError):
    """A byte-level BPE vocabulary needs the optional ``tokenizers`` package, which is not installed."""

    default_rule = "GGUF-010"
    advice = ("Install it: pip install 'convert-bnb[gguf-bpe]' (or pip install tokenizers); "
              "SentencePiece vocabularies and the other outputs do not need it.")


class GgufNonFiniteError(UnsupportedError):
    """A weight to quantize to a GGML block type holds inf or NaN."""

    default_rule = "GGUF-011"
    advice = ("llama.cpp refuses such a tensor too (ggml_validate_row_data): fix the weight, or write a float "
              "type (gguf:f16, bf16 or f32), which keeps inf and NaN as they are.")


class EncoderProcessError(ConvertBnbError, ChildProcessError):
    """A GGUF encoder worker process ended abruptly (killed from outside: the OOM killer, a signal to it
    alone). Not a rule of the input: the run's environment, so no rule id; the run's temporary output is
    removed as for any failed run. What to do is the hint it is raised with (:func:`convert.encoder_pool.call`)."""


# ------------------------------------------------------------------ importance matrices (--imatrix)


class ImatrixError(ConvertBnbError, ValueError):
    """Base of the errors about an importance matrix file (``--imatrix``)."""


class ImatrixFormatError(ImatrixError):
    """The ``--imatrix`` file is not an importance matrix llama-imatrix writes (GGUF or legacy ``.dat``),
    is damaged, or holds no entries."""

    default_rule = "IMX-001"
    advice = ("Give the file llama-imatrix wrote (imatrix.gguf, or the older imatrix.dat) for this model; "
              "make it again if it was cut short.")


class ImatrixValuesError(ImatrixError):
    """An importance matrix holds a NaN, infinite or negative sum or count."""

    default_rule = "IMX-002"
    advice = ("The statistics are damaged (llama-quantize refuses non-finite values too): compute the "
              "importance matrix again with llama-imatrix.")


class ImatrixTensorError(ImatrixError):
    """An importance matrix entry names no weight of the output, or its size is not the weight's row
    length times its experts: a matrix made for another model."""

    default_rule = "IMX-003"
    advice = ("Use the importance matrix computed for this model (llama-imatrix on a GGUF of the same "
              "checkpoint), or leave entries out with --include-weights / --exclude-weights.")


class ImatrixRequiredError(UnsupportedError):
    """The GGUF type needs an importance matrix for a tensor (llama-quantize: "this quantization requires
    an importance matrix"), and none was given or it has no entry for that tensor."""

    default_rule = "IMX-004"
    advice = ("Give one with --imatrix FILE (made by llama-imatrix for this model), or choose a type that "
              "does not need one (e.g. gguf:q2_k instead of q2_k_s).")


# -------------------------------------------------------------------------- SentencePiece tokenizers


class SentencePieceFormatError(CheckpointError):
    """tokenizer.model is not a well-formed protobuf (a truncated varint or field)."""

    default_rule = "SPM-001"
    advice = ('The tokenizer file is damaged: download tokenizer.model again.')


class SentencePieceWireTypeError(CheckpointError):
    """tokenizer.model uses a protobuf wire type a SentencePiece model never has."""

    default_rule = "SPM-002"
    advice = ('The file is not a SentencePiece model or is damaged: download tokenizer.model again.')


class SentencePiecePiecesError(CheckpointError):
    """tokenizer.model has no pieces, or a piece that is not UTF-8."""

    default_rule = "SPM-003"
    advice = ('The tokenizer file is damaged: download tokenizer.model again.')


# ------------------------------------------------------------------------ re-quantization (--to nf4|fp4)


class QuantTypeOptionError(UsageError):
    """The quant_type asked for (``--to nf4|fp4``, ``--quant-type``) is not nf4 or fp4."""

    default_rule = "QNT-001"
    advice = ('Use nf4 or fp4.')


class BlocksizeOptionError(UsageError):
    """The blocksize asked for is not a power of two from 32 to 4096."""

    default_rule = "QNT-002"
    advice = ('Use a blocksize bitsandbytes supports: 32, 64 (its default), 128, ..., 4096.')


class NonFiniteWeightError(UnsupportedError):
    """A tensor to quantize holds NaN or infinite values."""

    default_rule = "QNT-003"
    advice = ("The source weights are damaged (or overflowed in an fp16 cast): fix them first; bitsandbytes "
              "would write garbage.")


class NestedOffsetOverflowError(UnsupportedError):
    """The mean of a tensor's absmax (double quantization's nested_offset) overflows float32."""

    default_rule = "QNT-006"
    advice = ("The weights are finite but so large that their blocks' absmax sum past float32's range: "
              "quantize with --no-double-quant, or scale the weights down first.")


class UnknownMoeLayoutError(UnsupportedError):
    """A Mixture-of-Experts model whose experts and router transformers + bnb save in a layout not known here."""

    default_rule = "QNT-007"
    advice = ("Convert to bf16 instead (--to bf16), or, when you know transformers keeps this class's experts "
              "16-bit, name them: --skip-modules '.*\\.experts' (and its router module).")


class QuantStorageOptionError(UsageError):
    """The quant storage asked for is not uint8, bfloat16, float16 or float32."""

    default_rule = "QNT-004"
    advice = ("Use one of the listed storage dtypes (uint8 is bitsandbytes' default).")


class QuantStorageSizeError(UnsupportedError):
    """The packed codes of a tensor do not fill whole elements of the quant storage dtype."""

    default_rule = "QNT-005"
    advice = ('Use --quant-storage uint8, or skip this tensor (bitsandbytes fails on it too).')
