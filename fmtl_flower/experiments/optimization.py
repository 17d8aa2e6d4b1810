"""Shared pieces of the optimisation figures (``mocha-fig1``, ``-fig2``, ``-fig3``).

Every figure follows one W-update (or the full method) from W = 0 and plots the relative
primal sub-optimality (P - P*) / P* against the estimated time of eq. (30)
(:mod:`fmtl_flower.systems.timing`): each round lasts as long as its slowest device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core.baselines import (
    mbsgd_local_gradient,
    mbsgd_radius,
    mbsgd_server_step,
    mbsgd_step_size,
)
from ..core.hinge import mean_hinge_loss
from ..core.rng import coordinate_order
from ..core.svm import fit_linear_svm
from ..systems.heterogeneity import local_budgets
from ..systems.timing import round_time
from .output import write_outputs

NETWORKS = ("wifi", "lte", "3g")
TARGETS = (1e-2, 1e-3)


def optimum(tasks: list[tuple[np.ndarray, np.ndarray]], lam: float) -> float:
    """P* of the decoupled problem (Omega = m I): sum of per-task SVM optima, c = lam m."""
    c = lam * len(tasks)
    total = 0.0
    for X, y in tasks:
        w, _ = fit_linear_svm(X, y, c, tol=1e-12, max_epochs=200000, check_every=20)
        total += mean_hinge_loss(X, y, w) + 0.5 * c * float(w @ w)
    return total


def run_mbsgd(tasks, lam: float, rounds: int, frac: float,
              seed: int) -> tuple[list[float], list[np.ndarray]]:
    """Mb-SGD from W = 0: primal after each round and the per-task sample counts."""
    m, d = len(tasks), tasks[0][0].shape[1]
    n = np.array([X.shape[0] for X, _ in tasks])
    K = lam * m * np.eye(m)
    radius = mbsgd_radius(K)
    beta = 1.0 / (lam * m)
    W = np.zeros((d, m))
    primal, counts_per_round = [primal_value(W, tasks, lam)], []
    for r in range(1, rounds + 1):
        budgets = local_budgets(n, local_frac=frac, seed=seed, server_round=r)
        G, counts = np.zeros((d, m)), np.zeros(m, dtype=np.int64)
        for t, (X, y) in enumerate(tasks):
            G[:, t], counts[t] = mbsgd_local_gradient(
                X, y, W[:, t].copy(), budget=int(min(budgets[t], n[t])),
                order=coordinate_order(seed, t, r, int(n[t])))
        W = mbsgd_server_step(W, G, K, counts=counts,
                              step=mbsgd_step_size(r, beta=beta), radius=radius)
        primal.append(primal_value(W, tasks, lam))
        counts_per_round.append(counts)
    return primal, counts_per_round


def primal_value(W: np.ndarray, tasks, lam: float) -> float:
    """P(W) with Omega = m I."""
    m = len(tasks)
    loss = sum(mean_hinge_loss(X, y, W[:, t]) for t, (X, y) in enumerate(tasks))
    return float(loss + 0.5 * lam * m * np.sum(W * W))


def curve_rows(base: dict[str, Any], primal: Sequence[float], times: np.ndarray, p_star: float,
               points: int = 200) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of one curve (about ``points`` of them) and the time to reach each target."""
    sub = (np.asarray(primal) - p_star) / p_star
    keep = np.unique(np.linspace(0, len(sub) - 1, points).astype(int))
    rows = [{**base, "round": int(k), "estimated_time_s": float(times[k]),
             "primal_suboptimality": float(sub[k])} for k in keep]
    summary = []
    for target in TARGETS:
        hit = np.flatnonzero(sub <= target)
        summary.append({**base, "target": target,
                        "time_s": float(times[hit[0]]) if len(hit) else None,
                        "rounds": int(hit[0]) if len(hit) else None})
    return rows, summary


def write_curves(out_dir: Path, name: str, plot: Callable[[Any, dict[str, Any]], None], *,
                 rows: list, optima: dict, summary: list, datasets: list[str], lam: float,
                 rounds: Any, quick: bool, horizon: dict | None = None) -> dict[str, Any]:
    """The payload of a sub-optimality-vs-time figure (rows, optima, summary, config), written
    with :func:`~fmtl_flower.experiments.output.write_outputs`; returned. ``horizon`` (when
    the curves were cut at a common time) is kept as ``config["horizon_s"]``."""
    payload = {"rows": rows, "optimum": optima, "summary": summary,
               "config": {"datasets": datasets, "lambda": lam, "rounds": rounds,
                          "time_model": "reference", "quick": quick}}
    if horizon is not None:
        payload["config"]["horizon_s"] = horizon
    write_outputs(Path(out_dir), name, payload, plot)
    return payload


def plot_panels(fig: Any, payload: dict[str, Any], panels: Sequence[tuple[str, dict]],
                curves: Sequence[tuple[str, dict]], ylabel: str = "(P - P*) / P*") -> None:
    """Relative primal sub-optimality vs estimated time of the first dataset, log scale: one
    panel per ``(title, match)`` of ``panels``, one curve per ``(label, match)`` of
    ``curves``, each showing the rows whose fields equal its ``match``."""
    dataset = payload["config"]["datasets"][0]
    for i, (title, in_panel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for label, in_curve in curves:
            match = {**in_panel, **in_curve}
            pts = [r for r in payload["rows"] if r["dataset"] == dataset
                   and all(r[k] == v for k, v in match.items())
                   and r["primal_suboptimality"] > 0]
            ax.semilogy([r["estimated_time_s"] for r in pts],
                        [r["primal_suboptimality"] for r in pts], label=label)
        ax.set_title(f"{dataset}{title}")
        ax.set_xlabel("estimated time (s)")
        if i == 0:
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)


def cumulative_time(steps_per_round: Sequence[np.ndarray], dim: int, method: str,
                    network: str, *, n: np.ndarray | None = None,
                    clock_rate: np.ndarray | Sequence[np.ndarray] | float = 1.0e9,
                    participating: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """Estimated time after each round (0 before the first), reference cost units.

    ``clock_rate`` may give one array of per-device rates per round (systems
    heterogeneity); ``participating`` one boolean mask per round (drop-outs: a device that
    sends nothing does not hold the round up).
    """
    times = [0.0]
    for r, steps in enumerate(steps_per_round):
        rate = clock_rate[r] if isinstance(clock_rate, list | tuple) else clock_rate
        mask = None if participating is None else participating[r]
        times.append(round_time(steps, dim, method, network, model="reference", n=n,
                                clock_rate=rate, participating=mask))
    return np.cumsum(times)


def network_curves(base: dict[str, Any], primal: Sequence[float],
                   steps_per_round: Sequence[np.ndarray], dim: int, method: str, p_star: float,
                   **time_options: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`curve_rows` of one trajectory on every network of :data:`NETWORKS`.

    ``time_options`` go to :func:`cumulative_time` (``n``, ``clock_rate``, ``participating``).
    """
    rows, summary = [], []
    for network in NETWORKS:
        times = cumulative_time(steps_per_round, dim, method, network, **time_options)
        new_rows, new_summary = curve_rows({**base, "network": network}, primal, times, p_star)
        rows.extend(new_rows)
        summary.extend(new_summary)
    return rows, summary
