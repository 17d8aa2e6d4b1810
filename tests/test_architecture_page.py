"""docs/architecture.md stays true: every "design decision N" the code and tests cite has its
section there, and every package file or folder the page names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"[Dd]esign decisions? (\d+)(?: and (\d+))?")
#: A package path the page names: `core/losses.py`, `strategies/`, `tests/test_layering.py`.
PATH = re.compile(r"`((?:core|data|systems|strategies|clients|apps|experiments|tests)/"
                  r"[\w/]*?(?:\.py)?|[a-z_]+\.py)(?:::[\w.]+)?`")


def cited_decisions() -> dict[int, list[str]]:
    """{decision number: the files that cite it} over the package and the tests."""
    out: dict[int, list[str]] = {}
    for folder in ("fmtl_flower", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in CITATION.finditer(path.read_text(encoding="utf-8")):
                for number in filter(None, match.groups()):
                    out.setdefault(int(number), []).append(str(path.relative_to(ROOT)))
    return out


def test_the_code_cites_decisions():
    assert len(cited_decisions()) >= 5  # the scan finds what it checks


def test_every_cited_design_decision_is_on_the_page():
    page = PAGE.read_text(encoding="utf-8")
    missing = {n: files for n, files in cited_decisions().items()
               if f"### Decision {n}:" not in page}
    assert not missing, f"cited but not in docs/architecture.md: {missing}"


def _exists(name: str) -> bool:
    if name.startswith("tests/"):
        return (ROOT / name).exists()
    package = ROOT / "fmtl_flower"
    if "/" in name:
        return (package / name).exists()
    return (package / name).exists() or any(package.rglob(name))


@pytest.mark.parametrize("name", sorted({m.group(1) for m in PATH.finditer(
    PAGE.read_text(encoding="utf-8")) if "<" not in m.group(1)}))
def test_every_file_the_page_names_exists(name):
    assert _exists(name), f"docs/architecture.md names {name}, which does not exist"
