"""Nanoseconds per SDCA coordinate step: compiled kernel vs a plain-numpy loop vs a bandwidth model.

For d in {9, 100, 561} (small.mat, a mid size, HAR) the script times one pass of MOCHA's local
solver over n random samples (alpha = 0, w = 0, so nearly every step updates the model) and
compares with

* the same steps written as a plain numpy per-sample loop (one dot, one axpy per step);
* an estimate from the bytes a step moves: the sample row x_i (8d bytes) is read from the
  cache level the data matrix lives in (its size decides which) and the local model v (8d
  bytes) from L1 by the dot; a step that changes alpha (fraction f) also runs the axpy, which
  reads x_i again and reads and writes v, all in L1:
  t_est = 8d / BW(X level) + (8d + 24 d f) / BW(L1), with both bandwidths measured here by a
  compiled (SIMD) streaming read of an array of the same size.

Prints one JSON line last: {"d": {..., "ns_per_step", "numpy_ns_per_step", "speedup_vs_numpy",
"estimate_ns_per_step", "ratio_to_estimate"}}.

Usage: python benchmarks/sdca_step.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np

from fmtl_flower.core.sdca import _sdca_kernel


@numba.njit(cache=True, fastmath=True)
def _stream_sum(a, repeats):  # pragma: no cover - compiled
    total = 0.0
    for _ in range(repeats):
        for i in range(a.shape[0]):
            total += a[i]
    return total


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of a compiled sequential read over ``num_bytes`` (best of 5)."""
    a = np.random.default_rng(0).random(max(num_bytes // 8, 64))
    inner = max(1, int(2e8 // a.nbytes))
    _stream_sum(a, 1)
    best = np.inf
    for _ in range(max(5, repeats)):
        t = time.perf_counter()
        _stream_sum(a, inner)
        best = min(best, time.perf_counter() - t)
    return a.nbytes * inner / best


def numpy_steps(X, y, alpha, w, order, scale):
    """The same coordinate steps as the kernel, one numpy dot and one axpy per step."""
    n = X.shape[0]
    d_alpha = np.zeros(n)
    v = w.copy()
    sqnorm = np.einsum("ij,ij->i", X, X)
    for i in order:
        x = X[i]
        a_old = y[i] * (alpha[i] + d_alpha[i])
        a_new = min(1.0, max(0.0, a_old + (1.0 - y[i] * np.dot(x, v)) / (scale * sqnorm[i] / n)))
        if a_new != a_old:
            delta = y[i] * (a_new - a_old)
            d_alpha[i] += delta
            v += (scale * delta / n) * x
    return d_alpha


def bench_dim(d: int, n: int, repeats: int) -> dict:
    rng = np.random.default_rng(d)
    X = rng.normal(size=(n, d))
    y = np.sign(X @ rng.normal(size=d) + 0.3 * rng.normal(size=n))
    alpha, w = np.zeros(n), np.zeros(d)
    sqnorm = np.einsum("ij,ij->i", X, X)
    order = rng.permutation(n)
    scale = 1e-4 ** -1 / 29  # m_tt of small.mat's identity start (sigma' = 1)
    d_alpha, v = np.zeros(n), w.copy()
    _sdca_kernel(X, y, alpha, sqnorm, w, order, n, scale, d_alpha, v, 0)
    updates = int(np.count_nonzero(d_alpha))
    best = np.inf
    for _ in range(repeats):
        d_alpha[:] = 0.0
        v[:] = w
        t = time.perf_counter()
        _sdca_kernel(X, y, alpha, sqnorm, w, order, n, scale, d_alpha, v, 0)
        best = min(best, time.perf_counter() - t)
    ns = best / n * 1e9
    m = min(n, 2000)
    t = time.perf_counter()
    numpy_steps(X[:m], y[:m], alpha[:m], w, order[order < m], scale)
    numpy_ns = (time.perf_counter() - t) / m * 1e9
    bw_x = read_bandwidth(X.nbytes, repeats)
    bw_l1 = read_bandwidth(16 * 1024, repeats)
    f = updates / n
    estimate = (8 * d / bw_x + (8 * d + 24 * d * f) / bw_l1) * 1e9
    return {"n": n, "data_bytes": X.nbytes, "update_fraction": updates / n,
            "ns_per_step": ns, "numpy_ns_per_step": numpy_ns, "speedup_vs_numpy": numpy_ns / ns,
            "bw_data_level_GBps": bw_x / 1e9, "bw_l1_GBps": bw_l1 / 1e9,
            "estimate_ns_per_step": estimate, "ratio_to_estimate": ns / estimate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {}
    # small.mat pooled; a mid size; one HAR subject (7352 samples / 30 subjects ~ 250-400)
    for d, n in ((9, 1464), (100, 2000), (561, 400)):
        r = bench_dim(d, n, args.repeats)
        results[str(d)] = r
        print(f"d={d:4d} n={n:5d} ({r['data_bytes'] / 1e6:6.2f} MB): "
              f"{r['ns_per_step']:8.1f} ns/step | numpy loop {r['numpy_ns_per_step']:9.1f} ns "
              f"({r['speedup_vs_numpy']:6.1f}x) | estimate {r['estimate_ns_per_step']:7.1f} ns "
              f"(ratio {r['ratio_to_estimate']:.2f}; BW data {r['bw_data_level_GBps']:.1f} GB/s, "
              f"L1 {r['bw_l1_GBps']:.1f} GB/s) | updates {r['update_fraction']:.0%}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
