"""Barrier-free MOCHA against synchronous MOCHA with its best deadline, on the virtual clock.

For ``synthetic`` (30 tasks) and ``small`` (small.mat through the registry), each
``latency-sigma`` in 0, 0.5, 1, 1.5, the time (virtual seconds) to a certified relative gap
``gap / |primal| <= 1e-3``:

* AsyncMOCHA (:func:`fmtl_flower.core.async_mocha.simulate_async_mocha`): every task in flight
  (``concurrency`` = m), ``tau`` unbounded (the tasks are uncoupled), the safeguard on, with
  its request timeout (a request not back by then expires, theta = 1, and the device gets
  new work) TUNED ON THE GRID below; its time with the default timeout (10 x the nominal
  request time) is reported too (``*_default_timeout_*``);
* synchronous MOCHA (:func:`~fmtl_flower.core.async_mocha.simulate_sync_mocha`) with a
  deadline TUNED ON A GRID for each dataset and sigma: ``DEADLINES`` times the median nominal
  request time (0.25 to 20), and no deadline; the best (shortest time to the target) is
  reported with its value. (A run that passes the best time so far is cut there: it cannot
  win.)

Both use the same certificate (primal at the models each device last evaluated its loss on,
dual of the applied updates), the same time model (eq. (30), ``lte``, physical: one request
~ 70 ms, nearly all of it the round trip) and the same log-normal draws (task t's k-th request
and synchronous round k draw the same factor). The problem: MOCHA's objective with
``omega = identity`` (fixed, as in the paper's optimisation figures) and lambda = 1e-3,
local-frac 1. Afterwards the async run and the best synchronous run at sigma = 1 continue to a
certified relative gap of 5e-7 (so that both the certified primal and the dual are within
1e-6 of P*) or ``--final-rounds`` rounds (6000), and their final dual and certified primal
are compared with P* computed independently (per-task SVMs,
:func:`fmtl_flower.experiments.optimization.optimum`, tol 1e-12): keys
``end_rel_to_optimum_{async,sync}`` (the larger of the two relative distances),
``sigma_1_{async,sync}_final_{round,relative_gap,primal_error,dual_error}`` and
``sigma_1_{dual,primal}_within_1e-6_of_optimum`` (prefixed ``small_`` for small).

The latency model (:func:`fmtl_flower.core.async_mocha.latency_factor`): the issue's keys are
measured with ``latency-persistence`` 0 (every request's factor drawn independently; key
``latency_persistence``). ``--persistence 0.5,1`` repeats the synthetic comparison with that
share of the log-variance per device (1: a slow device is slow on every request; every
request's factor has the same law): keys ``persistence_{p}_speedup_sigma_{s}`` and their
times and limits. ``--availability F,D`` puts every device offline a fraction F of the time,
D virtual seconds per window on average (the same windows for both protocols); key
``availability``.

Printed: ONE JSON line with ``speedup_sigma_0``, ``speedup_sigma_0_5``, ``speedup_sigma_1``,
``speedup_sigma_1_5`` (synchronous time / async time on ``synthetic``), the same for ``small``
(``small_speedup_sigma_*``), every time and best deadline, ``dual_monotone`` (every run's dual
never decreases, up to 1e-13 relative rounding), ``gap_valid`` (every certified gap of every
run is >= both P(W_eval) - P* and P* - D(alpha), up to 1e-12 relative). Targets (issue 28):
>= 2x at sigma 1, at most 1.25x slower at sigma 0.

Usage: python benchmarks/async_mocha.py [--rounds 600] [--quick] [--out DIR]
[--persistence 0.5,1] [--availability F,D]

``--out DIR`` also writes the line to ``DIR/async-mocha.json`` and the figure (time to the
target against latency-sigma, both protocols, both datasets) to ``DIR/async-mocha.png``;
``--replot FILE.json`` redraws the figure from such a file without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from fmtl_flower.core.async_mocha import (
    Availability,
    Run,
    simulate_async_mocha,
    simulate_sync_mocha,
)
from fmtl_flower.data import load_dataset
from fmtl_flower.experiments.optimization import optimum
from fmtl_flower.systems.timing import get_network, node_times

LAM = 1e-3
SIGMAS = (0.0, 0.5, 1.0, 1.5)
TARGET = 1e-3
FINAL = 1e-6
#: The end runs stop at this certified relative gap: it bounds both the certified primal's and
#: the dual's distance to P*, with room for the primal's own scale (gap / P <= 5e-7).
FINAL_STOP = 5e-7
NETWORK = "lte"
#: An async run may apply this many times the synchronous cap's replies (with persistent
#: latency the fast devices apply many more than the slow ones) and is cut instead once it
#: takes ``ASYNC_CUT`` times the synchronous protocol's best time.
ASYNC_WORK, ASYNC_CUT = 50, 5.0
#: Synchronous deadlines (and async timeouts) as multiples of the median nominal request time
#: (None: none). Small ones pay off when the factor's law puts much mass far below 1 (sigma
#: 1.5), large ones when slow devices stay slow (latency-persistence 1).
DEADLINES = (None, 0.25, 0.5, 0.8, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0)


def _key(sigma: float) -> str:
    return f"{sigma:g}".replace(".", "_")


class _PastBudget(Exception):
    """An async run passed the best time so far: it cannot win the grid."""


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

    def __init__(self, name: str, rounds: int, persistence: float = 0.0,
                 availability: Availability | None = None) -> None:
        self.name, self.rounds = name, rounds
        self.clock = {"latency_persistence": persistence, "availability": availability}
        self.tasks, self.seconds, self.comm = _problem(name)
        self.p_star = optimum(self.tasks, LAM)
        self.monotone, self.valid = True, True

    def _check(self, run: Run) -> Run:
        self.monotone &= _monotone(run)
        self.valid &= _gap_valid(run, self.p_star)
        return run

    def run_async(self, sigma: float, timeout: float | None, stop: float,
                  max_time_s: float = math.inf) -> Run | None:
        """The async run (None if it passed ``max_time_s`` before ``stop``)."""
        m = len(self.tasks)  # a fast device may apply many replies: capped by time instead

        def cut(run: Run, record: dict) -> None:
            if record["time_s"] > max_time_s:
                self._check(run)  # the records so far are checked too
                raise _PastBudget

        try:
            return self._check(simulate_async_mocha(
                self.tasks, self.seconds, lam=LAM, replies=ASYNC_WORK * self.rounds * m,
                latency_sigma=sigma, timeout_s=timeout, stop_relative_gap=stop,
                on_event=cut, **self.clock))
        except _PastBudget:
            return None

    def run_sync(self, sigma: float, deadline: float | None, stop: float,
                 max_time_s: float = math.inf) -> Run:
        return self._check(simulate_sync_mocha(
            self.tasks, self.seconds, self.comm, lam=LAM, rounds=self.rounds, deadline=deadline,
            latency_sigma=sigma, stop_relative_gap=stop, max_time_s=max_time_s, **self.clock))

    def best(self, run, sigma: float, start: float = math.inf) -> tuple[float, float | None]:
        """(time to TARGET, limit) of the best limit on the grid, ``run(sigma, limit, stop,
        max_time_s)`` a protocol whose time limit (a deadline, a timeout) is ``limit`` (None:
        none), cut once it passes the best time so far (at first ``start``)."""
        c = float(np.median(self.seconds))
        best = (math.inf, None)
        for factor in DEADLINES:
            limit = None if factor is None else factor * c
            result = run(sigma, limit, TARGET, min(best[0], start))
            t = None if result is None else result.time_to_gap(TARGET)
            if t is not None and t < min(best[0], start):
                best = (t, limit)
        return best

    def compare(self, sigma: float) -> dict:
        """The best of each protocol at ``sigma``. The synchronous grid runs first; an async
        run is cut at ``ASYNC_CUT`` times the synchronous best (reported as inf: it lost)."""
        t_sync, deadline = self.best(self.run_sync, sigma)
        cut = ASYNC_CUT * t_sync
        run = self.run_async(sigma, None, TARGET, cut)
        t_default = None if run is None else run.time_to_gap(TARGET)
        t_async, timeout = self.best(self.run_async, sigma, start=cut)
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
            runs = {"async": self.run_async(sigma, timeout, FINAL_STOP),
                    "sync": self.run_sync(sigma, deadline, FINAL_STOP)}
        finally:
            self.rounds = saved
        for name, run in runs.items():
            last = run.records[-1]
            out[f"{name}_final_round"] = last["round"]
            out[f"{name}_final_relative_gap"] = last["gap"] / abs(last["primal"])
            out[f"{name}_final_primal_error"] = abs(last["primal"] - self.p_star) / abs(
                self.p_star)
            out[f"{name}_final_dual_error"] = abs(last["dual"] - self.p_star) / abs(self.p_star)
            out[f"end_rel_to_optimum_{name}"] = max(out[f"{name}_final_primal_error"],
                                                    out[f"{name}_final_dual_error"])
        out["dual_within_1e-6_of_optimum"] = all(
            out[f"{n}_final_dual_error"] <= FINAL for n in runs)
        out["primal_within_1e-6_of_optimum"] = all(
            out[f"{n}_final_primal_error"] <= FINAL for n in runs)
        return out


def _panels(payload: dict) -> list[tuple[str, str]]:
    """(title, key prefix) of each panel: each dataset under the default latency model, then
    synthetic under each other persistence."""
    out = [(f"{p.rstrip('_') or 'synthetic'}", p) for p in ("", "small_")
           if f"{p}speedup_sigma_1" in payload]
    out += [(f"synthetic, latency-persistence {p}", f"persistence_{_key(float(p))}_")
            for p in payload.get("persistence_tables", [])]
    return out


def plot(payload: dict, path: Path) -> None:
    """Time to the target against latency-sigma: AsyncMOCHA (tuned and default timeout) and
    synchronous MOCHA with its best deadline, one panel per dataset and latency model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(payload)
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, prefix) in zip(axes.flat, panels, strict=False):  # extra axes hidden
        for label, key, style in (
                ("AsyncMOCHA (timeout tuned)", "async_time_s", "o-"),
                ("AsyncMOCHA (default timeout)", "async_default_timeout_time_s", "s--"),
                ("synchronous MOCHA (best deadline)", "sync_time_s", "^-")):
            ax.plot(SIGMAS, [payload[f"{prefix}{key}_sigma_{_key(s)}"] for s in SIGMAS], style,
                    label=label)
        ax.set_title(f"{title}: time to relative gap {TARGET:g}", fontsize=9)
        ax.set_xlabel("latency-sigma (log-normal factor)")
        ax.set_ylabel("virtual time (s)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(bench: Bench, prefix: str, quick: bool, final_rounds: int) -> dict:
    """The speedup table of one bench (and, unless quick, the end runs at sigma 1)."""
    out = {}
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
        if sigma == 1.0 and not quick:
            near = bench.near_optimum(sigma, result["timeout_s"], result["deadline_s"],
                                      final_rounds)
            for key, value in near.items():
                name = f"{prefix}{key}" if key.startswith("end_") else f"{prefix}sigma_1_{key}"
                out[name] = value
        print(json.dumps({"bench": prefix or "synthetic_", "sigma": sigma, **result}),
              file=sys.stderr, flush=True)
    return out


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600,
                        help="cap: synchronous rounds (async: 50 x as many applied replies, "
                             "and 5 x the synchronous time)")
    parser.add_argument("--final-rounds", type=int, default=6000,
                        help="cap of the runs continued towards a relative gap of 5e-7")
    parser.add_argument("--quick", action="store_true", help="synthetic only, no 1e-6 runs")
    parser.add_argument("--persistence", type=_floats, default=[],
                        help="also the synthetic table under these latency-persistence values "
                             "(comma-separated, e.g. 0.5,1)")
    parser.add_argument("--availability", type=_floats, default=None,
                        help="F,D: devices offline a fraction F of the time, D seconds a "
                             "window on average (default: always online)")
    parser.add_argument("--out", type=Path, help="also write async-mocha.json and .png here")
    parser.add_argument("--replot", type=Path, help="redraw the figure of a saved JSON line")
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    availability = None if args.availability is None else Availability(*args.availability)
    out: dict = {"lambda": LAM, "omega": "identity", "network": NETWORK,
                 "target_relative_gap": TARGET, "latency_persistence": 0.0,
                 "availability": None if availability is None else {
                     "offline_fraction": availability.offline_fraction,
                     "mean_offline_s": availability.mean_offline_s},
                 "sync_deadline_grid_x_median_request": [d if d is not None else "none"
                                                         for d in DEADLINES],
                 "persistence_tables": [p for p in args.persistence if p != 0.0]}
    benches = [Bench("synthetic", args.rounds, availability=availability)] + (
        [] if args.quick else [Bench("small", args.rounds, availability=availability)])
    for bench in benches:
        prefix = "" if bench.name == "synthetic" else f"{bench.name}_"
        out.update(_table(bench, prefix, args.quick, args.final_rounds))
        out[f"{prefix}p_star"] = bench.p_star
    for p in out["persistence_tables"]:
        bench = Bench("synthetic", args.rounds, persistence=p, availability=availability)
        out.update(_table(bench, f"persistence_{_key(p)}_", True, args.final_rounds))
        benches.append(bench)
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
