"""PEFT LoRA ``adapter_config.json``: the keys, the matching rules, the pattern limits.

The adapter weights (``adapter_model.safetensors``, key names, grouping by module) are read in
:mod:`formats.peft`, which uses this module; this module never imports it.

``adapter_config.json``
    A ``LoraConfig`` as JSON (PEFT 0.21, ``save_pretrained``). Keys that change the merge are parsed
    and validated; keys that do not (dropout, task type, versions, ...) are accepted; a key whose value
    would change the math in a way this module does not implement is refused with
    :class:`~formats.errors.UnsupportedError` naming the key. Unknown keys are accepted only when their
    value is neutral (``null``, ``false``, ``{}``, ``[]``, ``""``); otherwise they are refused.

Matching rules, as PEFT applies them (``tuners_utils.check_target_module_exists``,
``utils.other.get_pattern_key``, ``utils.other._set_trainable``):

- ``target_modules`` as a list: a module is targeted when its name equals an entry or ends with
  ``"." + entry``; as a string: ``re.fullmatch(target_modules, name)``. ``exclude_modules`` likewise
  (list: equal or ends with ``"." + entry``; string: fullmatch). ``layers_to_transform`` /
  ``layers_pattern`` restrict list targets to the given layer indices. A module matching
  ``(^|.*\\.)<m>($|\\..*)`` for an ``m`` in ``modules_to_save`` is never a LoRA target.
- ``rank_pattern`` / ``alpha_pattern``: the first key (in file order) for which
  ``re.match(rf"(.*\\.)?({key})$", module)`` matches gives the rank / alpha; else ``r`` / ``lora_alpha``.
- Every pattern is validated with Python's ``re`` (PEFT's engine: what it refuses PEFT refuses) and
  matched with the ``regex`` package, same syntax and semantics, under a time limit
  (:data:`PATTERN_CALL_TIMEOUT` per module name, :data:`PATTERN_BUDGET` per pattern in all): a
  pattern that backtracks catastrophically, such as ``(.*.*)*x``, is LORA-013, not a hang; so is a
  pattern larger than :data:`PATTERN_MAX_SIZE` once its counted repetitions ``x{n}`` are expanded.
- scale = ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (a Python double, as in
  ``LoraLayer.update_layer``).

Rules checked here, each with its own subclass of :class:`~formats.errors.AdapterError`
(docs/errors.md; LORA-003 is also an ``UnsupportedError``; the other LORA rules are in
:mod:`formats.peft`):

========  ==========================================================================================
LORA-001  adapter_config.json exists and is a JSON object
LORA-002  peft_type is "LORA"
LORA-003  a config key that changes the merge has a value this module does not implement
LORA-004  config values have the right types (r > 0 int, lora_alpha number, patterns objects, ...)
LORA-013  every config pattern matches a module name within its time limit
========  ==========================================================================================
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

try:  # the parser behind re.compile: Python >= 3.11
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

from . import jsonfile
from .errors import (
    AdapterConfigError,
    AdapterConfigValueError,
    NotLoraAdapterError,
    PatternTimeoutError,
    UnsupportedAdapterConfigError,
)

__all__ = [
    "ADAPTER_CONFIG",
    "PATTERN_BUDGET",
    "PATTERN_CALL_TIMEOUT",
    "LoraConfig",
    "load_lora_config",
    "parse_lora_config",
]

ADAPTER_CONFIG = "adapter_config.json"
#: CPU seconds one config pattern may take to match one module name (legitimate patterns take microseconds;
#: ``regex`` counts CPU time, so a loaded machine does not make a pattern fail).
PATTERN_CALL_TIMEOUT = 1.0
#: CPU seconds one config pattern may take over all the module names of one run.
PATTERN_BUDGET = 10.0
#: Largest pattern, counting each counted repetition ``x{n}`` expanded n times, that ``regex`` compiles
#: (it expands them: ``((a{1000}){1000}){1000}`` would take gigabytes).
PATTERN_MAX_SIZE = 100_000

#: Keys read and applied by the merge.
_USED_KEYS = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "fan_in_fan_out",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "modules_to_save",
        "use_dora",
        "bias",
        "init_lora_weights",
        "lora_bias",
    }
)
#: Keys that do not change a merge (training-time or bookkeeping only).
_NO_MATH_KEYS = frozenset(
    {
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        "megatron_config",
        "megatron_core",
        "runtime_config",
        "qalora_group_size",
        "eva_config",
        "loftq_config",
        "corda_config",
        "lora_ga_config",
    }
)
#: Keys that change the math when set; only their neutral value is accepted.
_NEUTRAL_ONLY: dict[str, str] = {
    "use_qalora": "QA-LoRA merges through group-wise pooling",
    "velora_config": "VeLoRA",
    "alora_invocation_tokens": "aLoRA applies the adapter only after invocation tokens",
    "monteclora_config": "MonteCLoRA",
    "layer_replication": "layer replication changes the model's layer list",
    "target_parameters": "LoRA on nn.Parameter targets (MoE experts)",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA",
    "trainable_token_indices": "trainable tokens (row updates of the embedding)",
    "ensure_weight_tying": "tying of modules_to_save copies between embedding and lm_head",
}
#: ``init_lora_weights`` values whose adapter applies to the unchanged base weight.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


def _neutral(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (dict, list, str)) and len(value) == 0)


class _Pattern:
    """One PEFT pattern as PEFT composes it, compiled once and matched under a time limit.

    Validated with ``re`` (PEFT's engine), matched with ``regex`` (same syntax, plus ``timeout=``).
    """

    def __init__(self, path: Path | None, key: str, pattern: str, composed: str, full: bool) -> None:
        self.path, self.key, self.pattern, self.full = path, key, pattern, full
        what = f"pattern '{_clip(pattern)}'" if composed != pattern else "pattern"
        try:
            re.compile(composed)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _bad(path, key, f"{what} is not a valid regular expression ({exc})", pattern) from None
        size = _expanded_size(_sre_parse.parse(composed), 1)
        if size > PATTERN_MAX_SIZE:
            raise PatternTimeoutError(
                f"config key '{key}': pattern '{_clip(pattern)}' is too large once its counted repetitions "
                "are expanded",
                path=path,
                expected=f"<= {PATTERN_MAX_SIZE} items",
                found=f"more than {PATTERN_MAX_SIZE}",
                hint="nested counts such as (a{1000}){1000} multiply",
            )
        try:
            self.compiled = regex.compile(composed)
        except (regex.error, RecursionError, OverflowError) as exc:
            raise _bad(path, key, f"{what} is not a valid regular expression ({exc})", pattern) from None
        self.spent = 0.0

    def __call__(self, module: str) -> Any:
        """``re.fullmatch`` (``full``) or ``re.match`` of the composed pattern on ``module``.

        Raises:
            PatternTimeoutError: LORA-013, over :data:`PATTERN_CALL_TIMEOUT` for this name or
                :data:`PATTERN_BUDGET` in all.
        """
        timeout = min(PATTERN_CALL_TIMEOUT, PATTERN_BUDGET - self.spent)
        start = time.thread_time()
        try:
            if timeout <= 0:
                raise TimeoutError
            run = self.compiled.fullmatch if self.full else self.compiled.match
            return run(module, timeout=timeout)
        except TimeoutError:
            raise PatternTimeoutError(
                f"config key '{self.key}': pattern '{_clip(self.pattern)}' did not finish matching module "
                f"'{_clip(module)}' in time",
                path=self.path,
                expected=f"<= {PATTERN_CALL_TIMEOUT} s of CPU per module name and {PATTERN_BUDGET} s in all",
                found="timed out",
                hint="the regular expression backtracks catastrophically",
            ) from None
        finally:
            self.spent += time.thread_time() - start


_REPEATS = {_sre_parse.MAX_REPEAT, _sre_parse.MIN_REPEAT, getattr(_sre_parse, "POSSESSIVE_REPEAT", None)}


def _expanded_size(node: Any, factor: int) -> int:
    """Items of a parsed pattern with every repetition's minimum count expanded (stops past the limit)."""
    total = 0
    if isinstance(node, _sre_parse.SubPattern):
        for op, av in node:
            if op in _REPEATS:
                total += _expanded_size(av[2], factor * max(av[0], 1))
            else:
                total += factor + _expanded_size(av, factor)
            if total > PATTERN_MAX_SIZE:
                break
    elif isinstance(node, (tuple, list)):
        for item in node:
            total += _expanded_size(item, factor)
            if total > PATTERN_MAX_SIZE:
                break
    return total


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _compose(kind: str, pattern: str) -> tuple[str, bool]:
    """The regular expression PEFT builds from a config pattern, and whether it is a fullmatch."""
    if kind in ("rank_pattern", "alpha_pattern"):
        return rf"(.*\.)?({pattern})$", False  # get_pattern_key
    if kind == "modules_to_save":
        return rf"(^|.*\.){pattern}($|\..*)", False
    if kind == "layers_pattern":
        return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", False
    return pattern, True  # target_modules / exclude_modules as a string


@dataclass(frozen=True)
class LoraConfig:
    """A validated PEFT ``LoraConfig`` (the fields that decide a merge).

    Attributes:
        path: the ``adapter_config.json`` it came from.
        r: default rank (``lora_A`` rows).
        lora_alpha: default alpha.
        use_rslora: scale by ``lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``.
        rank_pattern: regex key -> rank, in file order.
        alpha_pattern: regex key -> alpha, in file order.
        fan_in_fan_out: base weights are stored ``[in, out]`` (GPT-2 ``Conv1D``).
        target_modules: names (tuple), a regex (str), or None.
        exclude_modules: names (tuple), a regex (str), or None.
        layers_to_transform: layer indices (tuple) or None.
        layers_pattern: layer-list names (tuple) or None.
        modules_to_save: names of modules saved whole.
        use_dora: DoRA (magnitude vectors).
        bias: ``"none"``, ``"all"`` or ``"lora_only"`` (trained biases are saved as full tensors).
        ignored: config keys accepted without effect on the merge, with their values.
    """

    path: Path | None
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    fan_in_fan_out: bool = False
    target_modules: tuple[str, ...] | str | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False
    bias: str = "none"
    ignored: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    _patterns: dict[tuple[str, str], _Pattern] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Compile every pattern now, so that an invalid one is LORA-004 before anything is read."""
        for key, _ in self.rank_pattern:
            self._match("rank_pattern", key, "")
        for key, _ in self.alpha_pattern:
            self._match("alpha_pattern", key, "")
        for kind in ("target_modules", "exclude_modules"):
            value = getattr(self, kind)
            if isinstance(value, str) and value != "all-linear":
                self._match(kind, value, "")
        for m in self.modules_to_save:
            self._match("modules_to_save", m, "")
        for m in self.layers_pattern or ():
            self._match("layers_pattern", m, "")

    def _match(self, kind: str, pattern: str, module: str) -> Any:
        """PEFT's match of config ``kind``'s ``pattern`` on ``module`` (an empty module only compiles).

        Raises:
            AdapterConfigValueError: LORA-004, the pattern is not a valid regular expression.
            PatternTimeoutError: LORA-013.
        """
        compiled = self._patterns.get((kind, pattern))
        if compiled is None:
            composed, full = _compose(kind, pattern)
            compiled = self._patterns[(kind, pattern)] = _Pattern(self.path, kind, pattern, composed, full)
        return compiled(module) if module else None

    @property
    def base_model(self) -> str | None:
        """``base_model_name_or_path``: the model the adapter was trained on (a local path or a Hub repo id, as
        given to PEFT), or None when absent or not text. It does not change the math (kept in :attr:`ignored`)."""
        value = dict(self.ignored).get("base_model_name_or_path")
        return value if isinstance(value, str) and value.strip() else None

    def rank_for(self, module: str) -> int:
        """Rank of ``module`` (``rank_pattern`` as ``get_pattern_key`` resolves it, else ``r``).

        Raises:
            PatternTimeoutError: LORA-013.
        """
        for key, value in self.rank_pattern:
            if self._match("rank_pattern", key, module):
                return value
        return self.r

    def alpha_for(self, module: str) -> float:
        """lora_alpha of ``module`` (``alpha_pattern`` first match, else ``lora_alpha``).

        Raises:
            PatternTimeoutError: LORA-013.
        """
        for key, value in self.alpha_pattern:
            if self._match("alpha_pattern", key, module):
                return value
        return self.lora_alpha

    def scale_for(self, module: str) -> float:
        """The LoRA scale of ``module`` as PEFT computes it (a Python double).

        ``lora_alpha / r``, or ``lora_alpha / math.sqrt(r)`` with ``use_rslora``
        (``LoraLayer.update_layer``).
        """
        r = self.rank_for(module)
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def is_module_to_save(self, module: str) -> bool:
        """Whether PEFT wraps ``module`` as a module to save (``_set_trainable``: ``name.endswith(m)``)."""
        return any(module.endswith(m) for m in self.modules_to_save)

    def is_targeted(self, module: str) -> bool:
        """Whether PEFT puts LoRA on ``module`` (``check_target_module_exists``).

        Raises:
            PatternTimeoutError: LORA-013.
        """
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if self._match("exclude_modules", ex, module):
                    return False
            elif module in ex or any(module.endswith(f".{e}") for e in ex):
                return False
        if self.modules_to_save and any(
            self._match("modules_to_save", m, module) for m in self.modules_to_save
        ):
            return False
        tm = self.target_modules
        if tm is None:
            return False
        if isinstance(tm, str):
            return self._match("target_modules", tm, module) is not None
        if module in tm:
            return True
        if not any(module.endswith(f".{t}") for t in tm):
            return False
        if not self.layers_to_transform:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for pattern in self.layers_pattern:
                match = self._match("layers_pattern", pattern, module)
                if match is not None:
                    break
        if match is None:
            return False
        return int(match.group("idx")) in self.layers_to_transform


def _bad(path: Path | None, key: str, message: str, found: Any, expected: Any = None) -> AdapterConfigValueError:
    return AdapterConfigValueError(
        f"config key '{key}': {message}", path=path, expected=expected, found=found
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _names(path: Path | None, key: str, value: Any, allow_regex: bool) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if not allow_regex:
            return (value,)
        if value == "all-linear":
            return value
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _bad(path, key, f"not a valid regular expression ({exc})", value) from None
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _bad(path, key, "must be a list of module names or a regex string", value)


def _pattern(path: Path | None, key: str, value: Any, want_int: bool) -> tuple[tuple[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(path, key, "must be an object mapping module patterns to values", value)
    out = []
    for k, v in value.items():
        ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 if want_int else _number(v)
        if not ok:
            raise _bad(
                path,
                key,
                f"value for '{k}' must be a positive integer"
                if want_int
                else f"value for '{k}' must be a number",
                v,
            )
        try:
            re.compile(k)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _bad(path, key, f"pattern '{k}' is not a valid regular expression ({exc})", k) from None
        out.append((k, v))
    return tuple(out)


def parse_lora_config(obj: Any, path: str | os.PathLike[str] | None = None) -> LoraConfig:
    """Validate a PEFT adapter config (the parsed ``adapter_config.json``).

    Args:
        obj: the JSON object.
        path: the file, for error messages.

    Returns:
        a :class:`LoraConfig`.

    Raises:
        AdapterError: LORA-001 (not an object), LORA-002 (not LoRA), LORA-004 (bad value types).
        UnsupportedError: LORA-003, a key that changes the merge has a value not implemented here
            (the message names the key).
    """
    p = Path(path) if path is not None else None
    if not isinstance(obj, dict):
        raise AdapterConfigError(
            "adapter config must be a JSON object", path=p, found=type(obj).__name__
        )
    peft_type = obj.get("peft_type")
    if peft_type != "LORA":
        raise NotLoraAdapterError(
            "only LoRA adapters can be merged",
            path=p,
            expected="LORA",
            found=peft_type,
            hint="other PEFT methods (AdaLoRA, IA3, LoHa, prompt tuning, ...) are not supported",
        )

    def refuse(key: str, why: str, expected: Any = None) -> UnsupportedAdapterConfigError:
        return UnsupportedAdapterConfigError(
            f"config key '{key}' is not supported: {why}",
            path=p,
            expected=expected,
            found=obj.get(key),
        )

    ignored: list[tuple[str, Any]] = []
    for key, value in obj.items():
        if key in _USED_KEYS:
            continue
        if key in _NO_MATH_KEYS:
            ignored.append((key, value))
        elif key in _NEUTRAL_ONLY:
            if not _neutral(value):
                raise refuse(key, _NEUTRAL_ONLY[key], expected="null, false or empty")
        elif _neutral(value):
            ignored.append((key, value))
        else:
            raise refuse(
                key,
                "unknown to this version of convert-bnb and it is set, so it may change the merge",
                expected="null, false or empty",
            )

    r = obj.get("r", 8)
    if not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
        raise _bad(p, "r", "must be a positive integer", r)
    alpha = obj.get("lora_alpha", 8)
    if not _number(alpha):
        raise _bad(p, "lora_alpha", "must be a finite number", alpha)
    flags = {}
    for key in ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias"):
        v = obj.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise _bad(p, key, "must be true or false", v)
        flags[key] = v
    if flags["lora_bias"]:
        raise refuse("lora_bias", "merging trained lora_B biases is not implemented", expected=False)
    init = obj.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise refuse(
            "init_lora_weights",
            "this initialisation (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, ...) changes the base weights, so the "
            "adapter does not apply to the dequantized base as saved",
            expected="true, false, 'gaussian', 'eva' or 'orthogonal' (convert the adapter with PEFT's "
            "path_initial_model_for_weight_conversion first)",
        )
    bias = obj.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise _bad(p, "bias", "must be 'none', 'all' or 'lora_only'", bias)

    target = _names(p, "target_modules", obj.get("target_modules"), allow_regex=True)
    exclude = _names(p, "exclude_modules", obj.get("exclude_modules"), allow_regex=True)
    mts = _names(p, "modules_to_save", obj.get("modules_to_save"), allow_regex=False)
    assert not isinstance(mts, str)
    layers = obj.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        raise _bad(p, "layers_to_transform", "must be an integer or a list of integers", layers)
    lpat = obj.get("layers_pattern")
    if isinstance(lpat, str):
        lpat = [lpat] if lpat else None
    if lpat is not None and not (isinstance(lpat, list) and all(isinstance(s, str) for s in lpat)):
        raise _bad(p, "layers_pattern", "must be a string or a list of strings", lpat)
    return LoraConfig(
        path=p,
        r=r,
        lora_alpha=alpha,
        use_rslora=flags["use_rslora"],
        rank_pattern=_pattern(p, "rank_pattern", obj.get("rank_pattern"), want_int=True),
        alpha_pattern=_pattern(p, "alpha_pattern", obj.get("alpha_pattern"), want_int=False),
        fan_in_fan_out=flags["fan_in_fan_out"],
        target_modules=target,
        exclude_modules=exclude,
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=tuple(lpat) if lpat else None,
        modules_to_save=tuple(mts or ()),
        use_dora=flags["use_dora"],
        bias=bias,
        ignored=tuple(ignored),
    )


def load_lora_config(path: str | os.PathLike[str]) -> LoraConfig:
    """Read and validate ``adapter_config.json`` (a file, or the adapter directory holding it).

    Raises:
        AdapterError: LORA-001 (missing, not JSON, not an object), LORA-002, LORA-004.
        UnsupportedError: LORA-003.
    """
    p = Path(path)
    if p.is_dir():
        p = p / ADAPTER_CONFIG
    if not p.is_file():
        raise AdapterConfigError(
            "adapter config not found",
            path=p,
            hint="a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors",
        )
    obj = jsonfile.load_json_file(p, jsonfile.CONFIG, AdapterConfigError, "adapter config")
    return parse_lora_config(obj, p)
