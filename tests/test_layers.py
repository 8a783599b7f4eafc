"""The layering rules, read from the source (every file is parsed, never imported):

- ``formats/`` (containers: readers, writers, rules) never imports ``convert``; inside it, the generic
  pickle machine never imports the torch reader that runs on it (and the other one-way pairs of
  :data:`ONE_WAY`);
- inside ``convert/``, each folder (and each top-level module) imports only the parts of ``convert`` that
  :data:`LAYERS` allows it, e.g. ``dequant`` nothing, ``gguf/codecs`` and ``bnb4/encode`` only ``dequant``,
  ``stream`` no target folder, ``gguf`` and ``bnb4`` never each other;
- no import circle anywhere in ``convert/`` (imports inside functions count; ``TYPE_CHECKING`` blocks
  aside);
- an import inside a function is of a heavy or optional package (:data:`LATE_IMPORTS`) and says why in
  a comment;
- only the command-line modules (:data:`PRINTERS`) print;
- ``convert/`` keeps at most 12 modules at its top: every other module sits in the folder of its job.

Every import is collected: module level and inside functions or classes, ``import x``, ``from x import
y``, relative imports resolved against the file's package, and ``importlib.import_module("x")`` /
``__import__("x")`` with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT

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


# --- convert/ -------------------------------------------------------------------------------------

CONVERT_FILES = sorted((ROOT / "convert").rglob("*.py"))
CONVERT_MODULES = {_module_name(p)[0]: p for p in CONVERT_FILES}

#: What each part of ``convert`` may import of ``convert`` (besides itself): the most specific entry of a
#: module wins. Parts are folders (a reason to change each) and the top-level modules of the spine.
LAYERS: dict[str, set[str]] = {
    # pure numerics: NumPy, ml_dtypes, gguf and formats only
    "convert.dequant": set(),
    "convert.gguf.codecs": {"convert.dequant"},
    "convert.bnb4.encode": {"convert.dequant"},
    # records and small helpers every part may use
    "convert": set(),
    "convert.units": set(),
    "convert.signals": set(),
    "convert.gguf.types": set(),
    "convert.options": {"convert.gguf.types"},
    "convert.output": {"convert", "convert.options", "convert.signals"},
    "convert.output_names": {"convert.options"},
    # the float plan and the one chunk loop: no target folder
    "convert.stream": {"convert.dequant", "convert.options", "convert.output", "convert.output_names",
                       "convert.units"},
    "convert.lora": {"convert.dequant", "convert.stream"},
    "convert.hub": {"convert", "convert.options", "convert.stream"},
    # the targets: built on stream, never on each other
    "convert.bnb4": {"convert.dequant", "convert.options", "convert.stream"},
    "convert.gguf": {"convert", "convert.dequant", "convert.options", "convert.output", "convert.output_names",
                     "convert.signals", "convert.stream"},
    "convert.targets": {"convert.bnb4", "convert.gguf", "convert.options", "convert.output", "convert.output_names",
                        "convert.stream"},
    # one conversion: the parts of a run, and the entry that hands each run to its part; the commands around it
    "convert.run": {"convert", "convert.hub", "convert.lora", "convert.options", "convert.output",
                    "convert.output_names", "convert.stream", "convert.targets", "convert.units"},
    "convert.job": {"convert.hub", "convert.options", "convert.output", "convert.output_names", "convert.run"},
    "convert.check": {"convert.options", "convert.run", "convert.stream", "convert.targets"},
    "convert.inspection": {"convert.options", "convert.run", "convert.stream", "convert.targets", "convert.units"},
    # a conversion then its upload (--push-to-hub): built on the one conversion, as the commands are
    "convert.hub.publish": {"convert", "convert.hub", "convert.inspection", "convert.job", "convert.options",
                            "convert.output", "convert.output_names", "convert.run", "convert.units"},
    "convert.batch": {"convert", "convert.check", "convert.hub", "convert.hub.publish", "convert.inspection",
                      "convert.job", "convert.options", "convert.output", "convert.output_names", "convert.run",
                      "convert.signals", "convert.stream", "convert.units"},
    "convert.cli": {"convert", "convert.batch", "convert.bnb4", "convert.check", "convert.hub.publish",
                    "convert.inspection", "convert.job",
                    "convert.lora", "convert.options", "convert.output", "convert.output_names", "convert.signals",
                    "convert.units"},
    "convert.__main__": {"convert", "convert.cli", "convert.signals"},
}

#: Packages a function may import (heavy to import, or optional), each line saying why in a comment.
LATE_IMPORTS = ("huggingface_hub", "tqdm", "ray", "yaml", "tokenizers", "convert.cli")

#: The command-line modules: the only ones that print (the library raises and returns).
PRINTERS = {"convert.__main__", "convert.cli", "convert.check", "convert.inspection", "convert.batch.cli",
            "convert.batch.worker"}


def _part(module: str) -> str:
    """The most specific :data:`LAYERS` entry a module belongs to."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no part of LAYERS: add its folder")


def _imports(module: str, *, type_checking: bool = False) -> Iterator[tuple[int, str, bool, ast.AST]]:
    """(line, imported module, inside a function, node) of each import of ``convert`` by ``module``,
    ``TYPE_CHECKING`` blocks left out unless asked for."""
    path = CONVERT_MODULES[module]
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[int, str, bool, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_checking:
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield child.lineno, alias.name, inner, child
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_package, child.level, child.module)
                names = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in CONVERT_MODULES]
                for name in names or [base]:
                    yield child.lineno, name, inner, child
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), False)


def _convert_imports(module: str) -> set[str]:
    return {name for _, name, _, _ in _imports(module) if name in CONVERT_MODULES}


def test_every_convert_module_belongs_to_a_part() -> None:
    assert {_part(m) for m in CONVERT_MODULES} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(CONVERT_MODULES))
def test_convert_imports_follow_the_layer_table(module: str) -> None:
    own = _part(module)
    # (its own part, a part inside its folder: gguf may import gguf.codecs, never the other way round)
    bad = sorted(n for n in _convert_imports(module)
                 if _part(n) != own and not _part(n).startswith(own + ".") and _part(n) not in LAYERS[own])
    assert not bad, f"{module} ({own}) imports {bad}; {own} may import {sorted(LAYERS[own])}"


def test_the_targets_stand_apart() -> None:
    """gguf and bnb4 never import each other; stream, dequant and lora import no target folder."""
    for module in CONVERT_MODULES:
        parts = {_part(n).split(".")[1] if "." in _part(n) else "" for n in _convert_imports(module)}
        if module.startswith("convert.gguf"):
            assert "bnb4" not in parts, module
        if module.startswith("convert.bnb4"):
            assert "gguf" not in parts, module
        if module.startswith(("convert.stream", "convert.dequant", "convert.lora")):
            assert not parts & {"bnb4", "gguf", "targets", "job", "run"}, module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_circles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_convert() -> None:
    """Imports inside functions count (a circle through a late import is a circle all the same)."""
    edges = {m: _convert_imports(m) - {m} for m in CONVERT_MODULES}
    assert _cycles(edges) == []


@pytest.mark.parametrize("module", sorted(CONVERT_MODULES))
def test_late_imports_are_heavy_or_optional_and_say_why(module: str) -> None:
    lines = CONVERT_MODULES[module].read_text(encoding="utf-8").splitlines()
    for line, name, in_function, _ in _imports(module, type_checking=True):
        if not in_function:
            continue
        assert name.startswith(LATE_IMPORTS), f"{module}:{line} imports {name} inside a function"
        said = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
        assert said, f"{module}:{line}: say why {name} is imported inside a function (a comment)"


@pytest.mark.parametrize("module", sorted(CONVERT_MODULES))
def test_only_the_command_line_modules_print(module: str) -> None:
    tree = ast.parse(CONVERT_MODULES[module].read_text(encoding="utf-8"))
    prints = [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
    assert module in PRINTERS or not prints, f"{module} prints (lines {prints}); return or raise instead"


def test_convert_keeps_a_handful_of_modules_at_its_top() -> None:
    top = sorted(p.stem for p in (ROOT / "convert").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 12, top
    folders = sorted(p.name for p in (ROOT / "convert").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["batch", "bnb4", "dequant", "gguf", "hub", "lora", "run", "stream"]
