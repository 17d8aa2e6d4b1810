"""Nanoseconds per local step of each baseline's solver vs MOCHA's SDCA kernel (ratios).

One pass over n samples from alpha = 0 (best of ``--repeats``), at d = 9 and d = 100:
MOCHA (``sdca_local_update``), CoCoA (the same steps plus its local-gap checks, one per
pass), Mb-SDCA (stale-model steps) and Mb-SGD (subgradient sums). Call overhead included.
Last line: JSON ``{d: {method: {"ns_per_step", "ratio_to_mocha"}}}``.

Usage: python benchmarks/local_steps.py [--n 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fmtl_flower.core.baselines import (
    cocoa_local_update,
    mbsdca_local_update,
    mbsgd_local_gradient,
)
from fmtl_flower.core.sdca import sdca_local_update


def best_time(call, repeats: int) -> float:
    call()
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    out = {}
    for d in (9, 100):
        times = bench_dim(d, args.n, args.repeats)
        out[str(d)] = {k: {"ns_per_step": v, "ratio_to_mocha": v / times["mocha"]}
                       for k, v in times.items()}
        print(f"d={d:3d}: " + " | ".join(f"{k} {v:6.1f} ns ({v / times['mocha']:.2f}x)"
                                         for k, v in times.items()))
    print(json.dumps(out))


def bench_dim(d: int, n_samples: int, repeats: int) -> dict[str, float]:
    """ns per step of every method at dimension d."""
    rng = np.random.default_rng(d)
    X = rng.normal(size=(n_samples, d))
    y = np.sign(X @ rng.normal(size=d) + 0.3 * rng.normal(size=n_samples))
    alpha, w, order = np.zeros(n_samples), np.zeros(d), rng.permutation(n_samples)
    sq = np.einsum("ij,ij->i", X, X)
    kw = {"m_tt": 1e4 / 29, "order": order, "sqnorm": sq}
    calls = {
        "mocha": lambda: sdca_local_update(X, y, alpha, w, budget=n_samples,
                                           sigma_prime=1.0, **kw),
        "cocoa": lambda: cocoa_local_update(X, y, alpha, w, sigma_prime=1.0, theta=1e-12,
                                            max_steps=n_samples, **kw),
        "mb-sdca": lambda: mbsdca_local_update(X, y, alpha, w, budget=n_samples, **kw),
        "mb-sgd": lambda: mbsgd_local_gradient(X, y, w, budget=n_samples, order=order),
    }
    return {k: best_time(c, repeats) / n_samples * 1e9 for k, c in calls.items()}


if __name__ == "__main__":
    main()
