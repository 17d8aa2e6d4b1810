"""Barrier-free MOCHA on coupled tasks: the staleness bound tau and the sigma' rule.

On ``synthetic`` (30 tasks) with the fixed ``mean`` regulariser (lambda = 1e-3, lambda2 =
1e-2: every pair of tasks coupled), the virtual time to a certified relative gap of 1e-2 of
AsyncMOCHA (every task in flight, default timeout) for tau = m, 2m, 4m and sigma' rule
``stale-safe`` (:func:`fmtl_flower.core.async_mocha.async_sigma_prime`) or ``synchronous``
(Lemma 9's, kept safe by the per-reply safeguard alone), against synchronous MOCHA with its
best deadline on the grid of ``benchmarks/async_mocha.py``; latency-sigma 0 and 1, the
per-request latency model. Every run's dual is checked monotone.

Usage: python benchmarks/async_mocha_steps.py   (prints one JSON line)
"""

from __future__ import annotations

import json
import math

import numpy as np
from async_mocha import DEADLINES, LAM, _problem

from fmtl_flower.core.async_mocha import simulate_async_mocha, simulate_sync_mocha

TARGET = 1e-2
OPTIONS = {"omega": "mean", "formulation_options": {"lam2": 1e-2}}
ROUNDS = 300


def _monotone(run) -> bool:
    duals = np.array([r["dual"] for r in run.records])
    return bool(np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max()))


def main() -> None:
    tasks, seconds, comm = _problem("synthetic")
    m, c = len(tasks), float(np.median(seconds))
    out: dict = {"dataset": "synthetic", "omega": "mean", "lambda": LAM, "lambda2": 1e-2,
                 "target_relative_gap": TARGET}
    monotone = True
    for sigma in (0.0, 1.0):
        k = f"{sigma:g}".replace(".", "_")
        best = (math.inf, None)
        for factor in DEADLINES:
            deadline = None if factor is None else factor * c
            run = simulate_sync_mocha(tasks, seconds, comm, lam=LAM, rounds=ROUNDS,
                                      deadline=deadline, latency_sigma=sigma,
                                      stop_relative_gap=TARGET, max_time_s=best[0], **OPTIONS)
            t = run.time_to_gap(TARGET)
            if t is not None and t < best[0]:
                best = (t, deadline)
        out[f"sync_time_s_sigma_{k}"], out[f"sync_best_deadline_s_sigma_{k}"] = best
        for tau in (m, 2 * m, 4 * m):
            for rule in ("stale-safe", "synchronous"):
                run = simulate_async_mocha(tasks, seconds, lam=LAM, replies=ROUNDS * m,
                                           latency_sigma=sigma, tau=tau, sigma_prime_rule=rule,
                                           stop_relative_gap=TARGET, **OPTIONS)
                monotone &= _monotone(run)
                t = run.time_to_gap(TARGET)
                name = f"tau_{tau // m}m_{rule}_sigma_{k}"
                out[f"async_time_s_{name}"] = None if t is None else round(t, 3)
                out[f"speedup_{name}"] = None if t is None else round(best[0] / t, 3)
                out[f"sigma_prime_mean_{name}"] = round(float(np.mean(run.server.sigma_prime)),
                                                        4)
    out["dual_monotone"] = monotone
    print(json.dumps(out))


if __name__ == "__main__":
    main()
