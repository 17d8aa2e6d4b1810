"""MOCHA paper, Figure 3: fault tolerance as devices drop out.

MOCHA with every device dropping out of each round with probability p (it does no work and
sends nothing; Assumption 2), for p in {0, 0.1, 0.3, 0.5}, and a run in which one device
never sends (p = 0 for the others). Two settings, as in the paper: the W-update with Omega
fixed (``identity``; sub-optimality against P*, the sum of the per-task SVM optima) and the
full method (``probabilistic``, an Omega-step every 100 rounds; sub-optimality against the
final primal of the p = 0 run, since the objective moves with Omega). A dropped device does
not hold the round up; the time axis is eq. (30) with reference communication costs.

Writes ``mocha-fig3.json`` with rows ``{"dataset", "method" ("mocha" | "mocha-full"),
"network", "drop_prob" (a number, or "never" for the silent device), "round",
"estimated_time_s", "primal_suboptimality"}``, ``optimum``, ``summary`` and a plot (lte).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import fit_mocha
from ..data import load_dataset
from ..systems.heterogeneity import drop_mask
from .mocha_fig1 import LAM
from .optimization import network_curves, optimum, plot_panels, write_curves

NAME = "mocha-fig3"
DROPS = (0.0, 0.1, 0.3, 0.5, "never")
logger = logging.getLogger("fmtl_flower")


def per_task(p: float | str, m: int) -> np.ndarray:
    """Per-device drop probabilities: p for every device, or device 0 never sending."""
    if p == "never":
        return np.eye(1, m)[0]
    return np.full(m, float(p))


def run(out_dir: Path, quick: bool = False, datasets: list[str] | None = None,
        shuffles: int | None = None) -> dict[str, Any]:
    """Run the experiment and write the outputs (see the module docstring)."""
    datasets = list(datasets or ["small"])
    rounds = 60 if quick else 2000
    rows, optima, summary = [], {}, []
    for dataset in datasets:
        data = load_dataset(dataset, seed=0, test_frac=0.0)
        tasks = [(t.X_train, t.y_train) for t in data.tasks]
        m = len(tasks)
        optima[dataset] = {"mocha": optimum(tasks, LAM)}
        for method, omega, omega_every in (("mocha", "identity", 0),
                                           ("mocha-full", "probabilistic", 100)):
            fits = {}
            for p in DROPS:
                fits[p] = fit_mocha(tasks, lam=LAM, rounds=rounds, omega=omega,
                                    omega_every=omega_every, seed=0, record_every=1,
                                    drop_prob=per_task(p, m))
            if method == "mocha-full":
                optima[dataset][method] = fits[0.0].history[-1]["primal"]
            p_star = optima[dataset][method]
            for p, fit in fits.items():
                masks = [~drop_mask(m, per_task(p, m), seed=0, server_round=r)
                         for r in range(1, rounds + 1)]
                primal = [h["primal"] for h in fit.history]
                new_rows, new_summary = network_curves(
                    {"dataset": dataset, "method": method, "drop_prob": p}, primal, fit.steps,
                    data.dim, "mocha", p_star, participating=masks)
                rows.extend(new_rows)
                summary.extend(new_summary)
                logger.info("%s %s drop %s: final (P - P*)/P* = %.2e", dataset, method, p,
                            (primal[-1] - p_star) / p_star)
    return write_curves(out_dir, NAME, plot, rows=rows, optima=optima, summary=summary,
                        datasets=datasets, lam=LAM, rounds=rounds, quick=quick)


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """lte: W-update (left) and full method (right), one curve per drop probability."""
    plot_panels(fig, payload,
                [(f", lte: {'W-update' if m == 'mocha' else 'full method'}",
                  {"method": m, "network": "lte"}) for m in ("mocha", "mocha-full")],
                [("one device never sends" if p == "never" else f"p = {p}", {"drop_prob": p})
                 for p in DROPS], ylabel="relative primal sub-optimality")


def format_table(payload: dict[str, Any]) -> str:
    """Final relative sub-optimality (lte) per setting and drop probability."""
    lines = [f"{'dataset':10s} {'method':10s} {'drop':>6s} {'final (P-P*)/P*':>16s} "
             f"{'time to 1e-3':>13s}"]
    for s in payload["summary"]:
        if s["network"] != "lte" or s["target"] != 1e-3:
            continue
        last = [r for r in payload["rows"] if r["dataset"] == s["dataset"]
                and r["method"] == s["method"] and r["network"] == "lte"
                and r["drop_prob"] == s["drop_prob"]][-1]
        t = "-" if s["time_s"] is None else f"{s['time_s']:.4g}"
        lines.append(f"{s['dataset']:10s} {s['method']:10s} {s['drop_prob']!s:>6s} "
                     f"{last['primal_suboptimality']:16.3e} {t:>13s}")
    return "\n".join(lines)
