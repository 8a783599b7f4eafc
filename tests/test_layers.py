"""The layering rule: ``formats/`` (containers: readers, writers, rules) never imports ``convert``; and
inside it, the generic pickle machine never imports the torch reader that runs on it.

Every ``.py`` file under formats/ is parsed (not imported) and every import in it is collected: module
level and inside functions or classes, ``import x``, ``from x import y``, relative imports resolved
against the file's package, and ``importlib.import_module("x")`` / ``__import__("x")`` with a literal
name. None may be ``convert`` or ``convert.*``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ROOT / "formats"
FORBIDDEN = "convert"


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted module name of a file under ROOT, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(package):
        raise ImportError(f"relative import beyond the top level in {module}")
    base = package[: len(package) - (level - 1)]
    if target:
        base = [*base, *target.split(".")]
    return ".".join(base)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module a source file may import: (line, dotted name), at any depth of the tree.

    ``from pkg import name`` yields both ``pkg`` and ``pkg.name`` (the name may be a submodule).
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            if base:
                found.append((node.lineno, base))
            for alias in node.names:
                if alias.name != "*":
                    found.append((node.lineno, f"{base}.{alias.name}" if base else alias.name))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_forbidden(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


def _violations(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    return [(line, name) for line, name in imported_modules(source, module, is_package) if _is_forbidden(name)]


FILES = sorted(FORMATS.rglob("*.py"))


def test_the_walk_sees_the_format_modules() -> None:
    names = {_module_name(p)[0] for p in FILES}
    want = {"formats", "formats.bnb_layers", "formats.errors", "formats.gguf", "formats.peft",
            "formats.peft_config", "formats.pickle_machine", "formats.safetensors", "formats.torch_pickle"}
    assert want <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_formats_never_imports_convert(path: Path) -> None:
    module, is_package = _module_name(path)
    bad = _violations(path.read_text(encoding="utf-8"), module, is_package)
    assert not bad, f"{path.relative_to(ROOT)} imports convert (formats/ must not): " + ", ".join(
        f"line {line}: {name}" for line, name in bad
    )


#: (lower, upper): ``upper`` is built on ``lower``, which never imports it (one-way dependencies between modules)
ONE_WAY = [("formats.peft_config", "formats.peft"), ("formats.pickle_machine", "formats.torch_pickle"),
           ("convert.gguf.rope", "convert.gguf.arch"), ("formats.bnb", "formats.bnb_layers")]


@pytest.mark.parametrize(("lower", "upper"), ONE_WAY)
def test_one_way_dependency(lower: str, upper: str) -> None:
    def imports(name: str) -> set[str]:
        path = ROOT / (name.replace(".", "/") + ".py")
        return {n for _, n in imported_modules(path.read_text(encoding="utf-8"), name)}

    below = imports(lower)
    assert not {n for n in below if n == upper or n.startswith(upper + ".")}, below
    assert lower in imports(upper)


SYNTHETIC = '''
import os
import convert
import convert.plan as plan
from convert import kernels
from convert.gguf_plan import plan_gguf
from .. import convert as c
from ..convert.output import claim
import importlib

def lazy():
    from convert.units import parse_size
    importlib.import_module("convert.hub")
    return __import__("convert")

class K:
    def m(self):
        import convert.batch

from . import safetensors
from .errors import ConvertBnbError
from formats import dtypes
import converter
from formats.convert_notes import x
importlib.import_module("json")
'''


def test_self_check_catches_every_import_form() -> None:
    bad = {name for _, name in _violations(SYNTHETIC, "formats.fake")}
    assert bad == {
        "convert",
        "convert.plan",
        "convert.kernels",
        "convert.gguf_plan",
        "convert.gguf_plan.plan_gguf",
        "convert.output",
        "convert.output.claim",
        "convert.units",
        "convert.units.parse_size",
        "convert.hub",
        "convert.batch",
    }
    lines = {line for line, _ in _violations(SYNTHETIC, "formats.fake")}
    assert {3, 4, 5, 6, 7, 8, 12, 13, 14, 18} <= lines  # module level, in a function, in a method
    allowed = {name for _, name in imported_modules(SYNTHETIC, "formats.fake")} - bad
    assert {"formats.safetensors", "formats.errors", "formats.dtypes", "converter", "formats.convert_notes"} <= allowed


def test_relative_imports_resolve_against_the_package() -> None:
    assert _resolve("formats.gguf", False, 1, None) == "formats"
    assert _resolve("formats.gguf", False, 2, "convert") == "convert"
    assert _resolve("formats", True, 1, "gguf") == "formats.gguf"
    assert _resolve("formats.sub", True, 2, "convert.plan") == "formats.convert.plan"
    assert _resolve("formats.sub.deep", False, 3, "convert.plan") == "convert.plan"
    assert _violations("from .. import convert\n", "formats.gguf") == [(1, "convert")]
    assert _violations("from ..convert import plan\n", "formats.sub", is_package=True) == []  # formats.convert
    assert _violations("from ... import convert\n", "formats.sub.deep") == [(1, "convert")]
