"""docs/errors.md is generated from the error classes and the real messages; it must be up to date."""

from __future__ import annotations

import importlib.util

from formats.errors import all_rules
from tests.helpers.fixtures import ROOT


def _generator():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("gen_errors_doc", ROOT / "scripts" / "gen_errors_doc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: Rules whose example quotes a third-party library's own words (huggingface_hub's exception text),
#: which change with its version: only their first words are compared.
VOLATILE = ("HUB-001",)


def _stable(text: str) -> str:
    out, skip = [], None
    for line in text.splitlines():
        if line.startswith("### "):
            skip = line[4:] in VOLATILE
        if skip and line.startswith("    ") and " " in line.strip():
            line = " ".join(line.split()[:4])
        out.append(line)
    return "\n".join(out)


def test_errors_doc_is_up_to_date() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    assert _stable(text) == _stable(_generator().render()), (
        "docs/errors.md is out of date: run python scripts/gen_errors_doc.py")


def test_errors_doc_names_every_rule_class_and_advice() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    for rule, cls in all_rules().items():
        assert f"### {rule}\n" in text
        assert f"`{cls.__name__}`" in text
        assert cls.advice in text
