"""Reproductions of the papers' tables and figures (``fmtl reproduce NAME``).

Each module has ``run(out_dir, quick=False, **options) -> dict`` that writes
``out_dir/NAME.json`` (``{"rows": [...], ...}``), ``NAME.csv`` and, when matplotlib is
installed, ``NAME.png``; ``quick=True`` runs a reduced version in under a minute (tests).
"""

from __future__ import annotations

import importlib
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
