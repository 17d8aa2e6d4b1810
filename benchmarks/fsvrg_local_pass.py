"""Milliseconds per FSVRG local pass: the numba CSR kernel vs a scipy-per-row loop.

One node of the default ``sparse-federated`` data (K = 1000 nodes, d = 20,000, binary bag of
words, ~ 12 nonzeros per row): the node whose training set is closest to ``--n`` rows. The
pass is Algorithm 4's (``fsvrg_local_pass``: one permutation of the node's rows, step h/n_k,
S_k from the federation's counts, the full gradient at w_t = the global gradient at a
non-trivial point). The baseline, ``fsvrg_local_pass_reference``, is the same update as a
straightforward loop over ``X.getrow(i)`` with a dense numpy update of the iterate per step.
Both start from the same w_t and visit the same permutation; their results are compared.

Times are the best of ``--repeats`` calls (compilation excluded), wrapper and validation
included. Prints one JSON line: {"n_k", "d", "nnz_per_row", "numba_ms", "scipy_rows_ms",
"speedup", "max_abs_diff"}.

Usage: python benchmarks/fsvrg_local_pass.py [--n 1000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fmtl_flower.core.fsvrg import (
    combine_feature_counts,
    fsvrg_local_pass,
    fsvrg_local_pass_reference,
    global_gradient,
    local_loss_grad_sums,
    node_feature_counts,
)
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import make_sparse_federated


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
    parser.add_argument("--n", type=int, default=1000, help="target n_k of the node")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    ds = make_sparse_federated(1000, seed=0)
    k = int(np.argmin(np.abs(ds.n_train - args.n)))
    node = ds.task(k)
    X, y = node.X_train, node.y_train
    n_k, d = X.shape
    stats = combine_feature_counts(node_feature_counts(t.X_train) for t in ds.tasks)
    s = stats.node_scaling(*node_feature_counts(X))
    lam = 1.0 / stats.n
    w_t = np.random.default_rng(0).normal(scale=0.1, size=d)
    grad_sum = sum(local_loss_grad_sums(t.X_train, t.y_train, w_t)[1] for t in ds.tasks)
    g = global_gradient(w_t, grad_sum, stats.n, lam)
    order = coordinate_order(0, k, 1, n_k)
    h = 16.0

    def fast():
        return fsvrg_local_pass(X, y, w_t, g, lam=lam, h=h, s=s, order=order)

    def slow():
        return fsvrg_local_pass_reference(X, y, w_t, g, lam=lam, h=h, s=s, order=order)

    diff = float(np.max(np.abs(fast() - slow())))
    t_fast = best_time(fast, args.repeats)
    t_slow = best_time(slow, max(1, args.repeats // 3))
    print(f"node {k}: n_k = {n_k}, d = {d}, {X.nnz / n_k:.1f} nonzeros per row")
    print(f"numba pass {1e3 * t_fast:.3f} ms, scipy-per-row loop {1e3 * t_slow:.1f} ms")
    print(json.dumps({
        "n_k": int(n_k),
        "d": int(d),
        "nnz_per_row": round(X.nnz / n_k, 2),
        "numba_ms": round(1e3 * t_fast, 4),
        "scipy_rows_ms": round(1e3 * t_slow, 2),
        "speedup": round(t_slow / t_fast, 1),
        "max_abs_diff": diff,
    }))


if __name__ == "__main__":
    main()
