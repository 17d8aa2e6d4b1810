"""MOCHA paper, Figure 1: primal sub-optimality of the W-update vs estimated time.

As in the paper, Omega is fixed (``identity``: K = lambda m I) and every method minimises the
same P(W) = sum_t mean hinge_t(w_t) + (lambda/2) m |W|_F^2 from W = 0 (lambda = 1e-4):

* MOCHA: SDCA on each device for ``local-frac`` x n_t coordinate steps per round;
* CoCoA: SDCA until each device's true local gap falls by ``theta`` (capped);
* Mb-SDCA: stale-model SDCA on a mini-batch of half of each device's data, scaled by beta / b;
* Mb-SGD: stale-model hinge subgradients on half of each device's data, projected step
  1 / (lambda_min(K) h) (Pegasos).

The trajectories come from :func:`fmtl_flower.centralized.fit_mocha` (bit-identical to the
federation) and a direct Mb-SGD loop over :mod:`fmtl_flower.core.baselines`; the time axis is
the estimated-time model of :mod:`fmtl_flower.systems.timing` (eq. 30) for each network, with
the per-device steps each round actually took. The optimum P* decouples into per-task SVMs
(c = lambda m), solved to a relative duality gap of 1e-12.

Writes ``mocha-fig1.json`` with ``{"rows": [{"dataset", "method", "network", "round",
"estimated_time_s", "primal_suboptimality"}], "optimum": {dataset: P*}, "summary": [...]}``
(``summary``: estimated time each method needs to reach sub-optimality 1e-2 and 1e-3 of P*),
a CSV of the rows and a plot (one panel per network).

The methods are compared on a common horizon: on each dataset and network every curve is cut
at the estimated time of the shortest run (``config["horizon_s"][dataset][network]``; the
last round of each method that ends within it), so every method has the same time budget,
the summary's ``-`` means "not reached within it", and the plot's curves end at the same x.
(The round counts differ by method; without the cut, a method given more rounds ran several
times longer and ended lower, although it reached every target later.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import fit_mocha
from ..data import load_dataset
from .optimization import (
    NETWORKS,
    cumulative_time,
    curve_rows,
    network_curves,
    optimum,
    plot_panels,
    run_mbsgd,
    write_curves,
)

NAME = "mocha-fig1"
METHODS = ("mocha", "cocoa", "mb-sdca", "mb-sgd")
LAM = 1e-4
logger = logging.getLogger("fmtl_flower")


def trajectories(tasks, rounds: dict[str, int], seed: int) -> dict[str, dict[str, Any]]:
    """Primal per round and per-round steps of every method."""
    out = {}
    for method in ("mocha", "cocoa", "mb-sdca"):
        kwargs = {"mocha": {"local_frac": 1.0},
                  "cocoa": {"local_frac": 20.0, "theta": 0.5},
                  "mb-sdca": {"local_frac": 0.5, "beta": 10.0}}[method]
        fit = fit_mocha(tasks, lam=LAM, rounds=rounds[method], omega="identity", omega_every=0,
                        method=method, seed=seed, record_every=1, **kwargs)
        out[method] = {"primal": [h["primal"] for h in fit.history], "steps": fit.steps}
    primal, counts = run_mbsgd(tasks, LAM, rounds["mb-sgd"], 0.5, seed)
    out["mb-sgd"] = {"primal": primal, "steps": counts}
    return out


def settings(datasets: list[str] | None, quick: bool) -> tuple[list[str], dict[str, int]]:
    """The datasets (default: small, and synthetic unless ``quick``) and rounds per method of
    Figures 1 and 2."""
    datasets = list(datasets or (["small"] if quick else ["small", "synthetic"]))
    rounds = ({"mocha": 60, "cocoa": 30, "mb-sdca": 100, "mb-sgd": 100} if quick else
              {"mocha": 2000, "cocoa": 500, "mb-sdca": 5000, "mb-sgd": 5000})
    return datasets, rounds


def problem(dataset: str) -> tuple[Any, list, float]:
    """``dataset`` unsplit: (data, training tasks, P* of the identity formulation at LAM)."""
    data = load_dataset(dataset, seed=0, test_frac=0.0)
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    return data, tasks, optimum(tasks, LAM)


#: One curve of a figure: the row fields besides ``dataset`` (``method`` among them), the
#: trajectory (``primal`` per round, ``steps`` per round and device) and further keyword
#: arguments of :func:`~.optimization.network_curves`.
Curve = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]
#: ``curves(dataset, data, tasks, p_star, rounds)``: a figure's curves on one dataset.
CurvesFn = Callable[[str, Any, list, float, dict[str, int]], Iterable[Curve]]


def run_figure(out_dir: Path, name: str, plot: Callable[[Any, dict[str, Any]], None],
               quick: bool, datasets: list[str] | None, curves: CurvesFn, *,
               common_horizon: bool = False, hold: bool = False) -> dict[str, Any]:
    """Figures 1 and 2: on each dataset (:func:`settings`) its problem and P*
    (:func:`problem`), the rows and summary of every curve ``curves`` yields (each on every
    network, :func:`~.optimization.network_curves`; CoCoA's gap checks charged with the
    tasks' sizes; with ``common_horizon``, cut at the time of the shortest run:
    :func:`on_common_horizon`, ``hold`` passed on), written by
    :func:`~.optimization.write_curves`."""
    datasets, rounds = settings(datasets, quick)
    rows, optima, summary, horizon = [], {}, [], {}
    for dataset in datasets:
        data, tasks, p_star = problem(dataset)
        optima[dataset] = p_star
        found = [({"dataset": dataset, **fields}, tr,
                  {"n": data.n_train if fields["method"] == "cocoa" else None, **options})
                 for fields, tr, options in curves(dataset, data, tasks, p_star, rounds)]
        if common_horizon:
            new_rows, new_summary, horizon[dataset] = on_common_horizon(found, data.dim, p_star,
                                                                        hold=hold)
            rows.extend(new_rows)
            summary.extend(new_summary)
            continue
        for base, tr, options in found:
            new_rows, new_summary = network_curves(base, tr["primal"], tr["steps"], data.dim,
                                                   base["method"], p_star, **options)
            rows.extend(new_rows)
            summary.extend(new_summary)
    return write_curves(out_dir, name, plot, rows=rows, optima=optima, summary=summary,
                        datasets=datasets, lam=LAM, rounds=rounds, quick=quick,
                        horizon=horizon if common_horizon else None)


def on_common_horizon(curves: list[Curve], dim: int, p_star: float, *, hold: bool = False
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """The rows and summary of ``curves`` (row fields, trajectory, time options) on every
    network, each cut at that network's horizon: the estimated time of the shortest run. A
    curve keeps its rounds that end within the horizon, so every method has the same time
    budget; also returns the horizon of each network. With ``hold``, a curve whose last kept
    round ends before the horizon gets one more row at the horizon with that round's value
    (the round in progress has not finished), so a method with long rounds ends at the same x
    as the others."""
    rows, summary, horizon = [], [], {}
    for network in NETWORKS:
        times = [cumulative_time(tr["steps"], dim, base["method"], network, **options)
                 for base, tr, options in curves]
        horizon[network] = min(float(t[-1]) for t in times)
        for (base, tr, _), t in zip(curves, times, strict=True):
            end = int(np.searchsorted(t, horizon[network], side="right"))
            new_rows, new_summary = curve_rows({**base, "network": network},
                                               tr["primal"][:end], t[:end], p_star)
            if hold and t[end - 1] < horizon[network]:
                new_rows.append({**new_rows[-1], "estimated_time_s": horizon[network]})
            rows.extend(new_rows)
            summary.extend(new_summary)
    return rows, summary, horizon


def _curves(dataset: str, data: Any, tasks: list, p_star: float,
            rounds: dict[str, int]) -> Iterator[Curve]:
    """Every method's trajectory (Omega fixed, no heterogeneity); logs how far each got."""
    traj = trajectories(tasks, rounds, seed=0)
    for method, tr in traj.items():
        yield {"method": method}, tr, {}
    logger.info("%s: P* = %.6f; %s", dataset, p_star, ", ".join(
        f"{m} {(tr['primal'][-1] - p_star) / p_star:.1e} after {len(tr['primal']) - 1} "
        "rounds" for m, tr in traj.items()))


def run(out_dir: Path, quick: bool = False, datasets: list[str] | None = None,
        shuffles: int | None = None) -> dict[str, Any]:
    """Run the experiment and write the outputs (see the module docstring)."""
    return run_figure(out_dir, NAME, plot, quick, datasets, _curves, common_horizon=True)


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """One panel per network: relative primal sub-optimality vs estimated time, log scale,
    the x axis ending at the common horizon (every curve cut there)."""
    plot_panels(fig, payload, [(f": {network}", {"network": network}) for network in NETWORKS],
                [(method, {"method": method}) for method in METHODS])
    horizon = payload["config"].get("horizon_s", {}).get(payload["config"]["datasets"][0], {})
    for ax, network in zip(fig.axes, NETWORKS, strict=True):
        if network in horizon:
            ax.set_xlim(0.0, horizon[network])
    if horizon:
        fig.suptitle("every method over the same time budget: the shortest run's", fontsize=9)


def format_table(payload: dict[str, Any]) -> str:
    """Estimated time to reach relative sub-optimality 1e-2 / 1e-3, per method and network."""
    lines = [f"{'dataset':10s} {'network':7s} {'target':>7s} "
             + " ".join(f"{m:>10s}" for m in METHODS)]
    keys = dict.fromkeys((s["dataset"], s["network"], s["target"]) for s in payload["summary"])
    for dataset, network, target in keys:
        cells = []
        for method in METHODS:
            s = next(s for s in payload["summary"] if (s["dataset"], s["network"], s["target"],
                                                        s["method"]) == (dataset, network,
                                                                         target, method))
            cells.append(f"{s['time_s']:10.4g}" if s["time_s"] is not None else f"{'-':>10s}")
        lines.append(f"{dataset:10s} {network:7s} {target:7.0e} " + " ".join(cells))
    return "\n".join(lines)
