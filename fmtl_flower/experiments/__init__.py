"""Reproductions of the papers' tables and figures (``fmtl reproduce NAME``).

Each module has ``run(out_dir, quick=False, **options) -> dict`` that writes
``out_dir/NAME.json`` (``{"rows": [...], ...}``), ``NAME.csv`` and, when matplotlib is
installed, ``NAME.png``; ``quick=True`` runs a reduced version in under a minute (tests).
A module may also declare ``OPTIONS``, ``{name: parser}``: the further keyword arguments of
its ``run`` that ``fmtl reproduce NAME --set KEY=VALUE`` may set (:func:`parse_options`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config import split_set_option
from ..core import jit

REPRODUCTIONS = {
    "mocha-table1": "fmtl_flower.experiments.mocha_table1",
    "mocha-fig1": "fmtl_flower.experiments.mocha_fig1",
    "mocha-fig2": "fmtl_flower.experiments.mocha_fig2",
    "mocha-fig3": "fmtl_flower.experiments.mocha_fig3",
    "fedem-table1": "fmtl_flower.experiments.fedem_table1",
    "fedem-images": "fmtl_flower.experiments.fedem_images",
    "ofmtl-arrivals": "fmtl_flower.experiments.ofmtl_arrivals",
    "fsvrg-fig2": "fmtl_flower.experiments.fsvrg_fig2",
}


def module_of(name: str) -> ModuleType:
    """The module of reproduction ``name``; a ValueError listing the names if unknown."""
    if name not in REPRODUCTIONS:
        raise ValueError(f"unknown reproduction {name!r}; available: {', '.join(REPRODUCTIONS)}")
    return importlib.import_module(REPRODUCTIONS[name])


def reproduce(name: str, out_dir: str | Path, quick: bool = False, **options: Any) -> dict:
    """Run reproduction ``name`` and write its files to ``out_dir``; return its JSON dict.

    A reproduction is a simulation (:func:`fmtl_flower.core.jit.simulation`): the local
    solvers run compiled at every size when numba is installed, as when the committed results
    were made, unless ``FMTL_KERNELS`` says otherwise (the default ``auto`` would run small
    calls with numpy, equal only up to rounding). The choice is also exported to
    ``FMTL_KERNELS`` for the block, for the processes started from here."""
    module = module_of(name)
    saved = os.environ.get(jit.KERNELS_ENV)
    with jit.simulation() as (choice, _):
        os.environ[jit.KERNELS_ENV] = choice
        try:
            return module.run(Path(out_dir), quick=quick, **options)
        finally:
            if saved is None:
                os.environ.pop(jit.KERNELS_ENV, None)
            else:
                os.environ[jit.KERNELS_ENV] = saved


def parse_options(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs of reproduction ``name`` as keyword arguments of its ``run``.

    Keys may be kebab-case (``retrain-ratio``) or snake_case (``retrain_ratio``). A module's
    ``OPTIONS`` maps each key (snake_case) to a parser ``(key, text) -> value`` in the style of
    :mod:`fmtl_flower.config` (``as_int``, ``as_float``, ...); ranges the parser does not check
    are left to ``run``.

    Raises
    ------
    ValueError
        On a pair without ``=``, a key that ``name`` does not declare in ``OPTIONS``, a key
        given twice, or a value its parser refuses; the message names the key.
    """
    options: dict[str, Callable[[str, str], Any]] = getattr(module_of(name), "OPTIONS", {})
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, text = split_set_option(pair)
        key = key.replace("-", "_")
        shown = key.replace("_", "-")
        if key not in options:
            known = ", ".join(k.replace("_", "-") for k in options) or "none"
            raise ValueError(f"{name} has no option {shown!r} (its options: {known})")
        if key in parsed:
            raise ValueError(f"{name}: option {shown!r} given twice")
        try:
            parsed[key] = options[key](shown, text)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    return parsed
