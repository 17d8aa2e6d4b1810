"""How many Newton passes the logistic loss's SDCA coordinate step takes: the count behind
``Loss.step_flops`` for ``logistic`` (``core/losses.py``: 8 + 9 + 23 + 14.6 x 48 = 741).

Runs four 20-round MOCHA federations with the logistic loss (two problems, the mean Omega
and the default one) on the numpy kernels, records
every (a_old, z, q) a device's coordinate step asks for, and replays each through a counting
copy of the safeguarded Newton loop of ``fmtl_flower.core.losses`` (its bracket, Newton step
and bisection fallback, the same stopping rules). Prints, per run, the steps replayed and
the mean, median, 99th percentile and largest number of passes (about 30 s).

Usage: python benchmarks/logistic_newton_passes.py
"""

from __future__ import annotations

import logging

import numpy as np

from fmtl_flower.core import jit, losses
from tests.strategies.helpers import make_problem, run_federation

RUNS = [dict(num_tasks=5, dim=10, samples_per_task=60, seed=1),
        dict(num_tasks=8, dim=20, samples_per_task=100, seed=2)]


def newton_passes(a_old: float, z: float, q: float) -> int:
    """The passes of the logistic step's loop for one coordinate step (q > 0)."""
    sigmoid = losses._sigmoid.py_func
    lo, hi = -z - q * (1.0 - a_old), -z + q * a_old
    u = min(max(-z, lo), hi)
    passes = 0
    for _ in range(losses.NEWTON_STEPS):
        if hi - lo <= 1e-15 * (1.0 + abs(u)):
            break
        passes += 1
        s = sigmoid(u)
        g = -u - z - q * (s - a_old)
        if g == 0.0:
            break
        if g > 0.0:
            lo = u
        else:
            hi = u
        nxt = u + g / (1.0 + q * s * (1.0 - s))
        if nxt <= lo or nxt >= hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - u) <= 1e-15 * (1.0 + abs(u)):
            break
        u = nxt
    return passes


def main() -> None:
    calls: list[tuple[float, float, float]] = []
    loss_class = type(losses.LOSSES["logistic"])
    step = loss_class.sdca_step

    def recording_step(self, a_old, z, q):
        calls.append((a_old, z, q))
        return step(self, a_old, z, q)

    loss_class.sdca_step = recording_step
    logging.getLogger("flwr").setLevel(logging.WARNING)
    try:
        for cfg in RUNS:
            for omega in ("mean", "default"):
                calls.clear()
                options = {"omega": "mean", "lam2": 0.1} if omega == "mean" else {}
                with jit.using("numpy"):
                    run_federation(make_problem(**cfg), 20, loss="logistic", **options)
                passes = np.array([newton_passes(*c) for c in calls if c[2] > 0])
                print(f"{cfg} omega={omega}: {passes.size} steps, mean passes "
                      f"{passes.mean():.3f}, median {np.median(passes):.0f}, p99 "
                      f"{np.percentile(passes, 99):.0f}, max {passes.max()}")
    finally:
        loss_class.sdca_step = step


if __name__ == "__main__":
    main()
