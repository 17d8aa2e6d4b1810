"""MOCHA paper, Table 1 protocol: prediction error of global, local and MTL models.

Per dataset and shuffle (seed): a 75/25 stratified split per task; lambda chosen for each
method separately by 5-fold cross-validation on the training split over 1e-5 ... 10; the
models refitted on the whole training split and evaluated on the test split (mean of
per-task error rates). MTL is MOCHA with ``omega=probabilistic`` (1000 rounds, an Omega-step
every 100: the reference driver's 10 x 100), fitted with :func:`fmtl_flower.centralized.fit_mocha`,
which performs the federated computation bit for bit without Flower's per-message cost.
The global and local SVMs use MOCHA's lambda scaling (:mod:`fmtl_flower.core.svm`).

Datasets: ``small``, ``eat-voc`` and ``synthetic`` always (the two files from
``$FMTL_DATA_DIR`` or ``../shared/data``), plus ``har``, ``gleam`` and ``vehicle`` when a local
copy is found; a dataset that cannot be loaded is listed under ``"skipped"`` with the reason.

Writes ``mocha-table1.json``: ``{"rows": [{"dataset", "method", "error_mean",
"error_stderr", "shuffles"}], "per_shuffle": [...], "skipped": {...}, "config": {...}}``,
the CSV of the rows, and a bar chart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import evaluate_models
from ..config import positive_int
from ..data import available_datasets, load_dataset
from ..model_selection import cross_validate_lambda, make_fitter
from .output import runs_per_dataset, write_outputs

#: ``fmtl reproduce ... --set KEY=VALUE``: rounds (default 1000) and omega_every (default 100).
OPTIONS = {"rounds": positive_int, "omega_every": positive_int}
NAME = "mocha-table1"
METHODS = ("global", "local", "mtl")
DEFAULT_DATASETS = ("small", "eat-voc", "synthetic", "har", "gleam", "vehicle")
logger = logging.getLogger("fmtl_flower")


def fit_and_score(dataset: str, seed: int, rounds: int, omega_every: int) -> dict[str, dict]:
    """One shuffle: CV per method, refit, test error. Returns ``{method: {lambda, error}}``."""
    data = load_dataset(dataset, seed=seed, test_frac=0.25)
    train = [(t.X_train, t.y_train) for t in data.tasks]
    test = [(t.X_test, t.y_test) for t in data.tasks]
    mocha = {"rounds": rounds, "omega": "probabilistic", "omega_every": omega_every}
    out = {}
    for method in METHODS:
        extra = mocha if method == "mtl" else {}
        lam, _ = cross_validate_lambda(method, train, seed=seed, **extra)
        W = make_fitter(method, seed=seed, **extra)(train, lam)
        out[method] = {"lambda": lam, "test_error": evaluate_models(W, test)["test_error"]}
    return out


def summarise(per_shuffle: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard error per (dataset, method)."""
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in per_shuffle):
        for method in METHODS:
            e = np.array([r["test_error"] for r in per_shuffle
                          if r["dataset"] == dataset and r["method"] == method])
            rows.append({"dataset": dataset, "method": method, "error_mean": float(e.mean()),
                         "error_stderr": float(e.std(ddof=1) / np.sqrt(len(e)))
                         if len(e) > 1 else None, "shuffles": int(len(e))})
    return rows


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """Grouped bars: mean test error with standard-error bars, per dataset and method."""
    rows = payload["rows"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(METHODS)
    for k, method in enumerate(METHODS):
        sel = [next(r for r in rows if r["dataset"] == d and r["method"] == method)
               for d in datasets]
        ax.bar(np.arange(len(datasets)) + (k - 1) * width, [r["error_mean"] for r in sel],
               width, yerr=[r["error_stderr"] or 0.0 for r in sel], capsize=3, label=method)
    ax.set_xticks(np.arange(len(datasets)), datasets)
    ax.set_ylabel("test error (mean of per-task errors)")
    ax.set_title(f"Global vs local vs MTL (MOCHA), {rows[0]['shuffles']} shuffles")
    ax.legend()


def run(out_dir: Path, quick: bool = False, datasets: list[str] | None = None,
        shuffles: int | None = None, rounds: int | None = None,
        omega_every: int | None = None) -> dict[str, Any]:
    """Run the protocol and write the outputs (see the module docstring)."""
    datasets = list(datasets or (["small"] if quick else DEFAULT_DATASETS))
    shuffles = shuffles or (2 if quick else 10)
    rounds = rounds or (100 if quick else 1000)
    omega_every = omega_every or (20 if quick else 100)
    unknown = [d for d in datasets if d not in available_datasets() and not d.endswith(".mat")]
    if unknown:
        raise ValueError(f"unknown datasets {unknown}; available: {available_datasets()}")
    per_shuffle, skipped = [], {}
    for dataset, seed, result, seconds in runs_per_dataset(
            datasets, shuffles, lambda ds, s: fit_and_score(ds, s, rounds, omega_every), skipped):
        for method, r in result.items():
            per_shuffle.append({"dataset": dataset, "seed": seed, "method": method, **r})
        logger.info("%s shuffle %d: %s [%.1f s]", dataset, seed, ", ".join(
            f"{m} {r['test_error']:.4f} (lambda {r['lambda']:g})"
            for m, r in result.items()), seconds)
    payload = {"rows": summarise(per_shuffle), "per_shuffle": per_shuffle, "skipped": skipped,
               "config": {"datasets": datasets, "shuffles": shuffles, "rounds": rounds,
                          "omega_every": omega_every, "quick": quick}}
    write_outputs(Path(out_dir), NAME, payload, plot)
    return payload


def format_table(payload: dict[str, Any]) -> str:
    """The rows as a text table."""
    lines = [f"{'dataset':10s} {'method':7s} {'mean error':>11s} {'std. error':>11s} shuffles"]
    for r in payload["rows"]:
        se = "-" if r["error_stderr"] is None else f"{r['error_stderr']:.4f}"
        lines.append(f"{r['dataset']:10s} {r['method']:7s} {r['error_mean']:11.4f} {se:>11s} "
                     f"{r['shuffles']:8d}")
    return "\n".join(lines)
