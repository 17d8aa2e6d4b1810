"""Reproductions of the papers' tables and figures (``fmtl reproduce NAME``).

Each module has ``run(out_dir, quick=False, **options) -> dict`` that writes
``out_dir/NAME.json`` (``{"rows": [...], ...}``), ``NAME.csv`` and, when matplotlib is
installed, ``NAME.png``; ``quick=True`` runs a reduced version in under a minute (tests).
A module may also declare ``OPTIONS``, ``{name: parser}``: the further keyword arguments of
its ``run`` that ``fmtl reproduce NAME --set KEY=VALUE`` may set (:func:`parse_options`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPRODUCTIONS = {
    "mocha-table1": "fmtl_flower.experiments.mocha_table1",
    "mocha-fig1": "fmtl_flower.experiments.mocha_fig1",
    "mocha-fig2": "fmtl_flower.experiments.mocha_fig2",
    "mocha-fig3": "fmtl_flower.experiments.mocha_fig3",
    "fedem-table1": "fmtl_flower.experiments.fedem_table1",
    "ofmtl-arrivals": "fmtl_flower.experiments.ofmtl_arrivals",
    "fsvrg-fig2": "fmtl_flower.experiments.fsvrg_fig2",
}


def reproduce(name: str, out_dir: str | Path, quick: bool = False, **options: Any) -> dict:
    """Run reproduction ``name`` and write its files to ``out_dir``; return its JSON dict."""
    if name not in REPRODUCTIONS:
        raise ValueError(f"unknown reproduction {name!r}; available: {', '.join(REPRODUCTIONS)}")
    module = importlib.import_module(REPRODUCTIONS[name])
    return module.run(Path(out_dir), quick=quick, **options)


def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"expected a number, got {text!r}")
        return value

    return parse


#: Parsers for ``OPTIONS``: the type only (``inf`` is a number, ``nan`` is not); each ``run``
#: checks the ranges of its options.
integer = _number(int, "an integer")
number = _number(float, "a number")


def positive_int(text: str) -> int:
    """An integer >= 1 (for options whose ``run`` does not check their range itself)."""
    value = integer(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def parse_options(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs of reproduction ``name`` as keyword arguments of its ``run``.

    Keys may be kebab-case (``retrain-ratio``) or snake_case (``retrain_ratio``).

    Raises
    ------
    ValueError
        On a pair without ``=``, a key that ``name`` does not declare in ``OPTIONS``, a key
        given twice, or a value its parser refuses; the message names the key.
    """
    if name not in REPRODUCTIONS:
        raise ValueError(f"unknown reproduction {name!r}; available: {', '.join(REPRODUCTIONS)}")
    options: dict[str, Callable[[str], Any]] = getattr(
        importlib.import_module(REPRODUCTIONS[name]), "OPTIONS", {})
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        shown = key.replace("_", "-")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        if key not in options:
            known = ", ".join(k.replace("_", "-") for k in options) or "none"
            raise ValueError(f"{name} has no option {shown!r} (its options: {known})")
        if key in parsed:
            raise ValueError(f"{name}: option {shown!r} given twice")
        try:
            parsed[key] = options[key](text.strip())
        except ValueError as err:
            raise ValueError(f"{name}: {shown}: {err}") from None
    return parsed
