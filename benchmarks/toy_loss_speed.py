"""The price of a loss written in Python: the toy squared hinge of ``tests/core/test_toy_loss.py``
(registered with :func:`fmtl_flower.core.losses.register_loss`, so its SDCA runs the numpy
implementation) against the built-in hinge, compiled and numpy.

One MOCHA local update (:func:`fmtl_flower.core.sdca.sdca_local_update`) of ``--passes``
passes over n = ``--n`` rows of d = ``--d`` features; the best of ``--repeats`` runs each
(numba's compile or cache load excluded: one unmeasured warm-up call). Prints microseconds per
coordinate step and the ratios, then one JSON line.

    python benchmarks/toy_loss_speed.py [--n 2000 --d 20 --passes 5 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fmtl_flower.core import jit  # noqa: E402
from fmtl_flower.core.losses import register_loss  # noqa: E402
from fmtl_flower.core.sdca import sdca_local_update  # noqa: E402
from tests.core.test_toy_loss import SquaredHinge  # noqa: E402


def per_step_us(loss, mode: str, X, y, w, order, budget: int, repeats: int) -> float:
    """Best-of-``repeats`` microseconds per coordinate step of one local update."""
    n = X.shape[0]
    args = dict(budget=budget, m_tt=1.0, sigma_prime=1.0, order=order, loss=loss)
    best = np.inf
    with jit.using(mode):
        sdca_local_update(X, y, np.zeros(n), w, **args)  # warm-up: numba's load or compile
        for _ in range(repeats):
            start = time.perf_counter()
            sdca_local_update(X, y, np.zeros(n), w, **args)
            best = min(best, time.perf_counter() - start)
    return 1e6 * best / budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--d", type=int, default=20)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((opts.n, opts.d)) / np.sqrt(opts.d)
    y = np.where(rng.standard_normal(opts.n) > 0, 1.0, -1.0)
    w = np.zeros(opts.d)
    order = rng.permutation(opts.n)
    budget = opts.passes * opts.n
    toy = register_loss(SquaredHinge())
    figures = {
        "toy_numpy_us": per_step_us(toy, "numpy", X, y, w, order, budget, opts.repeats),
        "toy_under_numba_mode_us": per_step_us(toy, "numba", X, y, w, order, budget,
                                               opts.repeats),
        "hinge_numpy_us": per_step_us("hinge", "numpy", X, y, w, order, budget, opts.repeats),
        "hinge_numba_us": per_step_us("hinge", "numba", X, y, w, order, budget, opts.repeats),
    }
    figures["toy_numpy_over_hinge_numba"] = figures["toy_numpy_us"] / figures["hinge_numba_us"]
    figures["toy_numpy_over_hinge_numpy"] = figures["toy_numpy_us"] / figures["hinge_numpy_us"]
    print(f"n = {opts.n}, d = {opts.d}, {budget} steps, best of {opts.repeats}")
    for key, value in figures.items():
        print(f"  {key:28s} {value:10.4f}")
    print(json.dumps({"n": opts.n, "d": opts.d, "steps": budget, **figures}))


if __name__ == "__main__":
    main()
