"""MOCHA paper, Figure 2: optimisation under low and high systems heterogeneity.

Devices differ in speed. In each round, device t can run ``f_t n_min`` coordinate steps in
the time a full-speed device runs ``n_min``, with f_t drawn from U(0.9, 1) (``low``) or
U(0.1, 1) (``high``) every round (MOCHA's appendix E.3). MOCHA adapts: device t does exactly
its budget ``f_t n_min`` (``sys-het``), so no device holds the round up. CoCoA, Mb-SDCA and
Mb-SGD do the same work as without heterogeneity, and a slow device takes 1 / f_t times as
long for it: here every device's clock rate is ``f_t`` times the nominal one, and a round
lasts as long as its slowest device (eq. 30, reference communication costs).

Otherwise as :mod:`.mocha_fig1` (Omega fixed, lambda = 1e-4, P* from per-task SVMs). Writes
``mocha-fig2.json`` with rows ``{"dataset", "method", "network", "sys_het", "round",
"estimated_time_s", "primal_suboptimality"}``, ``optimum``, ``summary`` (time to 1e-2 and
1e-3), a CSV and a plot (lte, one panel per level).

The methods are compared on a common horizon, as in :mod:`.mocha_fig1`: on each dataset and
network every curve of both levels is cut at the estimated time of the shortest run
(``config["horizon_s"][dataset][network]``; the last round of each curve that ends within
it), so every method has the same time budget at both levels and the summary's ``-`` means
"not reached within it". A curve whose last round ends before the horizon is held at that
round's value up to it (one more row at the horizon, the same ``round``): under high
heterogeneity a CoCoA round is long, and the curves of a panel must end at the same x. (The
round counts differ by method, 2000 / 500 / 5000 / 5000; without the cut CoCoA ran up to
250x longer than MOCHA and ended lowest, although it reached every target later.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import fit_mocha
from ..systems.heterogeneity import local_budgets
from ..systems.timing import DEFAULT_CLOCK_RATE
from .mocha_fig1 import LAM, METHODS, Curve, run_figure, trajectories
from .mocha_fig1 import format_table as _format_table
from .optimization import plot_panels

NAME = "mocha-fig2"
LEVELS = ("low", "high")
logger = logging.getLogger("fmtl_flower")


def speed_factors(n: np.ndarray, level: str, rounds: int, seed: int) -> list[np.ndarray]:
    """f_t per round: the sys-het budget as a fraction of n_min (the same draw MOCHA uses)."""
    n_min = float(n.min())
    return [local_budgets(n, sys_het=level, seed=seed, server_round=r) / n_min
            for r in range(1, rounds + 1)]


def _curves(dataset: str, data: Any, tasks: list, p_star: float,
            rounds: dict[str, int]) -> Iterator[Curve]:
    """At each level: MOCHA with its budgets, the others' work at the devices' speeds."""
    others = trajectories(tasks, rounds, seed=0)
    for level in LEVELS:
        mocha = fit_mocha(tasks, lam=LAM, rounds=rounds["mocha"], omega="identity",
                          omega_every=0, sys_het=level, seed=0, record_every=1)
        traj = {**others, "mocha": {"primal": [h["primal"] for h in mocha.history],
                                    "steps": mocha.steps}}
        for method, tr in traj.items():
            factors = speed_factors(data.n_train, level, len(tr["steps"]), seed=0)
            yield ({"method": method, "sys_het": level}, tr,
                   {"clock_rate": [DEFAULT_CLOCK_RATE * f for f in factors]})
    logger.info("%s: P* = %.6f", dataset, p_star)


def run(out_dir: Path, quick: bool = False, datasets: list[str] | None = None,
        shuffles: int | None = None) -> dict[str, Any]:
    """Run the experiment and write the outputs (see the module docstring)."""
    return run_figure(out_dir, NAME, plot, quick, datasets, _curves, common_horizon=True,
                      hold=True)


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """lte: one panel per heterogeneity level, the x axis ending at the common horizon (every
    curve cut there)."""
    plot_panels(fig, payload, [(f", lte: {level} heterogeneity", {"network": "lte",
                                                                   "sys_het": level})
                               for level in LEVELS],
                [(method, {"method": method}) for method in METHODS])
    horizon = payload["config"].get("horizon_s", {}).get(payload["config"]["datasets"][0], {})
    if "lte" in horizon:
        for ax in fig.axes:
            ax.set_xlim(0.0, horizon["lte"])
        fig.suptitle("every method over the same time budget: the shortest run's", fontsize=9)


def format_table(payload: dict[str, Any]) -> str:
    """Time to the targets per level (as :func:`.mocha_fig1.format_table`)."""
    parts = []
    for level in LEVELS:
        sub = {"summary": [s for s in payload["summary"] if s["sys_het"] == level]}
        parts.append(f"sys-het={level}\n" + _format_table(sub))
    return "\n".join(parts)
