"""Barrier-free MOCHA against synchronous MOCHA with its best deadline, on the virtual clock.

For ``synthetic`` (30 tasks) and ``small`` (small.mat through the registry), each
``latency-sigma`` in 0, 0.5, 1, 1.5, the time (virtual seconds) to a certified relative gap
``gap / |primal| <= 1e-3``:

* AsyncMocha (:func:`fmtl_flower.core.async_mocha.simulate_async_mocha`): every task in flight
  (``concurrency`` = m), ``tau`` unbounded (the tasks are uncoupled), the safeguard on, with
  its request timeout (a request not back by then expires, theta = 1, and the device gets
  new work) TUNED ON THE GRID below; its time with the default timeout (10 x the nominal
  request time) is reported too (``*_default_timeout_*``);
* synchronous MOCHA (:func:`~fmtl_flower.core.async_mocha.simulate_sync_mocha`) with a
  deadline TUNED ON A GRID for each dataset and sigma: ``DEADLINES`` times the median nominal
  request time, and no deadline; the best (shortest time to the target) is reported with
  its value.

Both use the same certificate (primal at the models each device last evaluated its loss on,
dual of the applied updates), the same time model (eq. (30), ``lte``, physical: one request
~ 70 ms, nearly all of it the round trip) and the same log-normal draws (task t's k-th request
and synchronous round k draw the same factor). The problem: MOCHA's objective with
``omega = identity`` (fixed, as in the paper's optimisation figures) and lambda = 1e-3,
local-frac 1. Afterwards the async run and the best synchronous run at sigma = 1 continue to a
certified relative gap of 1e-6 or ``--final-rounds`` rounds (1500), and their final dual and
certified primal are compared with P* computed independently (per-task SVMs,
:func:`fmtl_flower.experiments.optimization.optimum`, tol 1e-12): keys
``sigma_1_{async,sync}_final_{round,relative_gap,primal_error,dual_error}`` and
``sigma_1_{dual,primal}_within_1e-6_of_optimum`` (prefixed ``small_`` for small).

Printed: ONE JSON line with ``speedup_sigma_0``, ``speedup_sigma_0_5``, ``speedup_sigma_1``,
``speedup_sigma_1_5`` (synchronous time / async time on ``synthetic``), the same for ``small``
(``small_speedup_sigma_*``), every time and best deadline, ``dual_monotone`` (every run's dual
never decreases, up to 1e-13 relative rounding), ``gap_valid`` (every certified gap of every
run is >= both P(W_eval) - P* and P* - D(alpha), up to 1e-12 relative). Targets (issue 28):
>= 2x at sigma 1, at most 1.25x slower at sigma 0.

Usage: python benchmarks/async_mocha.py [--rounds 600] [--quick] [--out DIR]

``--out DIR`` also writes the line to ``DIR/async-mocha.json`` and the figure (time to the
target against latency-sigma, both protocols, both datasets) to ``DIR/async-mocha.png``;
``--replot FILE.json`` redraws the figure from such a file without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from fmtl_flower.core.async_mocha import Run, simulate_async_mocha, simulate_sync_mocha
from fmtl_flower.data import load_dataset
from fmtl_flower.experiments.optimization import optimum
from fmtl_flower.systems.timing import get_network, node_times

LAM = 1e-3
SIGMAS = (0.0, 0.5, 1.0, 1.5)
TARGET = 1e-3
FINAL = 1e-6
NETWORK = "lte"
#: Synchronous deadlines as multiples of the median nominal request time (None: no deadline).
DEADLINES = (None, 0.8, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)


def _key(sigma: float) -> str:
    return f"{sigma:g}".replace(".", "_")


def _problem(name: str) -> tuple[list, np.ndarray, float]:
    data = load_dataset(name, seed=0)
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    n = np.array([X.shape[0] for X, _ in tasks])
    seconds = node_times(n, data.dim, "mocha", NETWORK)
    comm = get_network(NETWORK).comm_time(data.dim, data.dim)
    return tasks, seconds, comm


def _monotone(run: Run) -> bool:
    duals = np.array([r["dual"] for r in run.records])
    return bool(np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max()))


def _gap_valid(run: Run, p_star: float) -> bool:
    tol = 1e-12 * abs(p_star)
    return all(r["gap"] >= max(r["primal"] - p_star, p_star - r["dual"]) - tol
               for r in run.records if r["gap"] is not None)


class Bench:
    """Runs one dataset's comparison and accumulates the checks."""

    def __init__(self, name: str, rounds: int) -> None:
        self.name, self.rounds = name, rounds
        self.tasks, self.seconds, self.comm = _problem(name)
        self.p_star = optimum(self.tasks, LAM)
        self.monotone, self.valid = True, True

    def _check(self, run: Run) -> Run:
        self.monotone &= _monotone(run)
        self.valid &= _gap_valid(run, self.p_star)
        return run

    def run_async(self, sigma: float, timeout: float | None, stop: float) -> Run:
        m = len(self.tasks)
        return self._check(simulate_async_mocha(
            self.tasks, self.seconds, lam=LAM, replies=self.rounds * m, latency_sigma=sigma,
            timeout_s=timeout, stop_relative_gap=stop))

    def run_sync(self, sigma: float, deadline: float | None, stop: float) -> Run:
        return self._check(simulate_sync_mocha(
            self.tasks, self.seconds, self.comm, lam=LAM, rounds=self.rounds, deadline=deadline,
            latency_sigma=sigma, stop_relative_gap=stop))

    def best(self, run, sigma: float) -> tuple[float, float | None]:
        """(time to TARGET, limit) of the best limit on the grid, ``run(sigma, limit, stop)``
        a protocol whose time limit (a deadline, a timeout) is ``limit`` (None: none)."""
        c = float(np.median(self.seconds))
        best = (math.inf, None)
        for factor in DEADLINES:
            limit = None if factor is None else factor * c
            t = run(sigma, limit, TARGET).time_to_gap(TARGET)
            if t is not None and t < best[0]:
                best = (t, limit)
        return best

    def compare(self, sigma: float) -> dict:
        t_default = self.run_async(sigma, None, TARGET).time_to_gap(TARGET)
        t_async, timeout = self.best(self.run_async, sigma)
        t_sync, deadline = self.best(self.run_sync, sigma)
        t_default = math.inf if t_default is None else t_default
        return {"async_s": t_async, "timeout_s": timeout, "async_default_s": t_default,
                "sync_s": t_sync, "deadline_s": deadline}

    def near_optimum(self, sigma: float, timeout: float | None,
                     deadline: float | None, rounds: int) -> dict:
        """Both protocols continued to a certified relative gap of 1e-6 or ``rounds`` rounds:
        the relative distance of their final dual and of their final certified primal
        (P(W_eval)) to the independent P*, and their final relative gap."""
        out = {}
        saved, self.rounds = self.rounds, rounds
        try:
            runs = {"async": self.run_async(sigma, timeout, FINAL),
                    "sync": self.run_sync(sigma, deadline, FINAL)}
        finally:
            self.rounds = saved
        for name, run in runs.items():
            last = run.records[-1]
            out[f"{name}_final_round"] = last["round"]
            out[f"{name}_final_relative_gap"] = last["gap"] / abs(last["primal"])
            out[f"{name}_final_primal_error"] = abs(last["primal"] - self.p_star) / abs(
                self.p_star)
            out[f"{name}_final_dual_error"] = abs(last["dual"] - self.p_star) / abs(self.p_star)
        out["dual_within_1e-6_of_optimum"] = all(
            out[f"{n}_final_dual_error"] <= FINAL for n in runs)
        out["primal_within_1e-6_of_optimum"] = all(
            out[f"{n}_final_primal_error"] <= FINAL for n in runs)
        return out


def plot(payload: dict, path: Path) -> None:
    """Time to the target against latency-sigma: AsyncMocha (tuned and default timeout) and
    synchronous MOCHA with its best deadline, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = [p for p in ("", "small_") if f"{p}speedup_sigma_1" in payload]
    fig, axes = plt.subplots(1, len(prefixes), figsize=(5.2 * len(prefixes), 3.8), squeeze=False)
    for ax, prefix in zip(axes[0], prefixes, strict=True):
        for label, key, style in (
                ("AsyncMocha (timeout tuned)", "async_time_s", "o-"),
                ("AsyncMocha (default timeout)", "async_default_timeout_time_s", "s--"),
                ("synchronous MOCHA (best deadline)", "sync_time_s", "^-")):
            ax.plot(SIGMAS, [payload[f"{prefix}{key}_sigma_{_key(s)}"] for s in SIGMAS], style,
                    label=label)
        ax.set_title(f"{prefix.rstrip('_') or 'synthetic'}: time to relative gap {TARGET:g}")
        ax.set_xlabel("latency-sigma (log-normal factor)")
        ax.set_ylabel("virtual time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600,
                        help="cap: synchronous rounds / async applied replies per task")
    parser.add_argument("--final-rounds", type=int, default=1500,
                        help="cap of the runs continued towards a relative gap of 1e-6")
    parser.add_argument("--quick", action="store_true", help="synthetic only, no 1e-6 runs")
    parser.add_argument("--out", type=Path, help="also write async-mocha.json and .png here")
    parser.add_argument("--replot", type=Path, help="redraw the figure of a saved JSON line")
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    out: dict = {"lambda": LAM, "omega": "identity", "network": NETWORK,
                 "target_relative_gap": TARGET,
                 "sync_deadline_grid_x_median_request": [d if d is not None else "none"
                                                         for d in DEADLINES]}
    benches = [Bench("synthetic", args.rounds)] + ([] if args.quick else [
        Bench("small", args.rounds)])
    for bench in benches:
        prefix = "" if bench.name == "synthetic" else f"{bench.name}_"
        for sigma in SIGMAS:
            result = bench.compare(sigma)
            k = _key(sigma)
            out[f"{prefix}speedup_sigma_{k}"] = round(result["sync_s"] / result["async_s"], 3)
            out[f"{prefix}speedup_default_timeout_sigma_{k}"] = round(
                result["sync_s"] / result["async_default_s"], 3)
            out[f"{prefix}async_time_s_sigma_{k}"] = round(result["async_s"], 3)
            out[f"{prefix}async_best_timeout_s_sigma_{k}"] = result["timeout_s"]
            out[f"{prefix}async_default_timeout_time_s_sigma_{k}"] = round(
                result["async_default_s"], 3)
            out[f"{prefix}sync_time_s_sigma_{k}"] = round(result["sync_s"], 3)
            out[f"{prefix}sync_best_deadline_s_sigma_{k}"] = result["deadline_s"]
            if sigma == 1.0 and not args.quick:
                near = bench.near_optimum(sigma, result["timeout_s"], result["deadline_s"],
                                          args.final_rounds)
                out.update({f"{prefix}sigma_1_{k}": v for k, v in near.items()})
        out[f"{prefix}p_star"] = bench.p_star
    out["dual_monotone"] = all(b.monotone for b in benches)
    out["gap_valid"] = all(b.valid for b in benches)
    line = json.dumps(out)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "async-mocha.json").write_text(line + "\n")
        plot(out, args.out / "async-mocha.png")
    print(line)


if __name__ == "__main__":
    main()
