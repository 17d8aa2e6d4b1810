"""The FSVRG family against one hostile device, and what robust mode costs honest runs.

``attacks``: the cases of ``tests/strategies/test_byzantine_fsvrg.py`` (10 tasks of
``sparse-federated``, d = 300, seed 0; task 9 hostile), each run with robust mode off and on,
and the run in which task 9's replies are lost (robust off). Prints, per case, the honest
devices' objective ``f_H(w)`` (``lam = 1/n`` of the true counts, computed from the data) of each
run and ``on / lost``; ``all-honest`` is the run where task 9 answers honestly (robust on).

``poisoned``: the same federation, task 9's device honest to the protocol but holding other
rows: its own rows with the labels flipped, or its row norms along one direction with label
-1. Every reply is true to its data, so no check of the replies can refuse it; prints
``on / lost`` (robust on).

``floor``: one JSON line. Per method (fsvrg, gd, cocoa-plus), robust on, ``on / lost`` of
(a) the floor an honest-looking device sets: task 9 truthful to every message for its own
rows with the labels flipped (``labels-flipped``) and for its rows repeated to the 200 rows
the ``n-train-200`` attack claims (``labels-flipped-200-rows``); no reply of it can be
refused; (b) each edge attack (replies inside every check, pushing one way as far as the
checks allow). ``worst_attack`` / ``floor_max`` name the largest of each. CoCoA+'s edge attack
and its labels-flipped floor also over 30 rounds (``d-w-robust-edge@30``,
``labels-flipped@30``, against the 30-round lost run).

``cost``: FSVRG's Figure 2 protocol through the strategy and its ClientApp (``fmtl reproduce
fsvrg-fig2`` runs the same algorithms Flower-free, so robust mode cannot change it):
``sparse-federated`` with K tasks (d = 20,000, seed 0), ``lam = 1/n``, R rounds of gd, cocoa-plus
and fsvrg (h = 16), robust off, on, and on with ``max-weight-share = 1``. Prints the objective
``f(w_R)`` on all the data, its relative sub-optimality against scikit-learn's optimum P*, the
pooled test error and the first round at which robust mode's recorded objective reaches the
off run's final one.

``shares``: honest CoCoA+ Flower-free (the strategy's run, bit for bit, while no reply is
refused) on ``sparse-federated`` with K tasks; per round, how many devices' shares of ``w``
robust mode's share fence would refuse (:func:`~fmtl_flower.core.fsvrg.robust.share_outliers`)
and how many the per-row fence alone would, the largest share as a fraction of its
verifiable bound ``sqrt(n_k S_k) / (lam n)``, and for how many devices a share at 0.999 of its
bound (the others honest) would be refused.

Run from the repository root:
``python benchmarks/fsvrg_byzantine.py attacks [--rounds 8]``,
``python benchmarks/fsvrg_byzantine.py poisoned [--rounds 8]``,
``python benchmarks/fsvrg_byzantine.py floor [--rounds 8]``,
``python benchmarks/fsvrg_byzantine.py cost [--tasks 30] [--rounds 20] [--methods gd,...]``,
``python benchmarks/fsvrg_byzantine.py shares [--tasks 1000] [--rounds 10]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import numpy as np
import scipy.sparse as sp

from fmtl_flower.core.fsvrg import cocoa_plus_aggregate, cocoa_plus_local_sdca
from fmtl_flower.core.fsvrg.robust import share_outliers
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import SparseTaskData, make_sparse_federated
from fmtl_flower.experiments.fsvrg_fig2 import Pooled, optimum
from tests.strategies.test_byzantine_fsvrg import (
    CASES,
    DIM,
    HOSTILE,
    TASKS,
    _direction,
    federate,
    honest_objective,
)
from tests.strategies.test_fsvrg_strategy import run

EXTRA_CASES = [("fsvrg", "gradient-pairing-floor"), ("gd", "gradient-pairing-floor"),
               ("fsvrg", "gradient-orthogonal"), ("gd", "gradient-orthogonal"),
               ("fsvrg", "n-train-200"), ("fsvrg", "n-train-200-pairing-floor"),
               ("gd", "n-train-200-pairing-floor"), ("fsvrg", "n-train-200-orthogonal"),
               ("gd", "n-train-200-orthogonal"), ("cocoa-plus", "d-w-robust-edge"),
               ("cocoa-plus", "n-train-1e9")]


def attacks(rounds: int) -> None:
    data = make_sparse_federated(num_tasks=TASKS, dim=DIM, seed=0)
    print(f"K = {TASKS}, d = {DIM}, {rounds} rounds, task 9 hostile; honest objective f_H(w)")
    print(f"{'method':12s} {'attack':22s} {'lost':>8s} {'robust off':>11s} {'robust on':>10s} "
          f"{'on/lost':>8s} {'all-honest/lost':>16s}")
    lost: dict[str, float] = {}
    honest: dict[str, float] = {}
    for method, attack in [*CASES, *EXTRA_CASES]:
        if method not in lost:
            lost[method] = honest_objective(data, federate(data, method, None, robust=False,
                                                           rounds=rounds).w)
            honest[method] = honest_objective(data, federate(data, method, "honest",
                                                             robust=True, rounds=rounds).w)
        off = honest_objective(data, federate(data, method, attack, robust=False,
                                              rounds=rounds).w)
        on = honest_objective(data, federate(data, method, attack, robust=True,
                                             rounds=rounds).w)
        print(f"{method:12s} {attack:22s} {lost[method]:8.4f} {off:11.4g} {on:10.4f} "
              f"{on / lost[method]:8.3f} {honest[method] / lost[method]:16.3f}", flush=True)


def poisoned(rounds: int) -> None:
    data = make_sparse_federated(num_tasks=TASKS, dim=DIM, seed=0)
    own = data.task(HOSTILE)
    norms = np.sqrt(np.asarray(own.X_train.multiply(own.X_train).sum(axis=1)).ravel())
    variants = {
        "labels flipped": SparseTaskData(own.X_train, -own.y_train, own.X_test, own.y_test),
        "rows along one direction": SparseTaskData(
            sp.csr_matrix(np.outer(norms, _direction(DIM))), -np.ones(norms.size),
            own.X_test, own.y_test),
    }
    print(f"K = {TASKS}, d = {DIM}, {rounds} rounds, task 9 honest to the protocol on other "
          "rows; robust on / lost")
    for method in ("fsvrg", "gd", "cocoa-plus"):
        lost = honest_objective(data, federate(data, method, None, robust=False,
                                               rounds=rounds).w)
        for name, task in variants.items():
            tasks = list(data.tasks)
            tasks[HOSTILE] = task
            other = dataclasses.replace(data, tasks=tuple(tasks))
            on = honest_objective(data, federate(other, method, "honest", robust=True,
                                                 rounds=rounds).w)
            print(f"{method:11s} {name:25s} {on / lost:8.3f}", flush=True)


EDGE_ATTACKS = {
    "fsvrg": ["gradient-pairing-floor", "gradient-orthogonal", "n-train-200",
              "n-train-200-pairing-floor", "n-train-200-orthogonal"],
    "gd": ["gradient-pairing-floor", "gradient-orthogonal", "n-train-200",
           "n-train-200-pairing-floor", "n-train-200-orthogonal"],
    "cocoa-plus": ["d-w-robust-edge"],
}
#: CoCoA+'s edge attack grows slowly: also measured over this many rounds.
COCOA_LONG_ROUNDS = 30


def _labels_flipped(data, rows: int | None = None):
    """``data`` with task 9's rows (repeated to ``rows`` if given) labelled the other way."""
    own = data.task(HOSTILE)
    X, y = own.X_train, -own.y_train
    if rows is not None:
        take = np.arange(rows) % own.n_train
        X, y = X[take], y[take]
    tasks = list(data.tasks)
    tasks[HOSTILE] = SparseTaskData(sp.csr_matrix(X), y, own.X_test, own.y_test)
    return dataclasses.replace(data, tasks=tuple(tasks))


def floor(rounds: int) -> None:
    data = make_sparse_federated(num_tasks=TASKS, dim=DIM, seed=0)
    out: dict = {"tasks": TASKS, "dim": DIM, "seed": 0, "rounds": rounds, "hostile": HOSTILE,
                 "ratio": "honest objective robust on / task 9's replies lost", "methods": {}}

    def ratio(method: str, federation, attack: str, n_rounds: int) -> float:
        lost = honest_objective(data, federate(data, method, None, robust=False,
                                               rounds=n_rounds).w)
        on = honest_objective(data, federate(federation, method, attack, robust=True,
                                             rounds=n_rounds).w)
        return round(on / lost, 4)

    for method, attacks_of in EDGE_ATTACKS.items():
        floors = {"labels-flipped": ratio(method, _labels_flipped(data), "honest", rounds),
                  "labels-flipped-200-rows": ratio(method, _labels_flipped(data, 200),
                                                   "honest", rounds)}
        edge = {a: ratio(method, data, a, rounds) for a in attacks_of}
        if method == "cocoa-plus":
            edge[f"d-w-robust-edge@{COCOA_LONG_ROUNDS}"] = ratio(
                method, data, "d-w-robust-edge", COCOA_LONG_ROUNDS)
            floors[f"labels-flipped@{COCOA_LONG_ROUNDS}"] = ratio(
                method, _labels_flipped(data), "honest", COCOA_LONG_ROUNDS)
        worst = max(edge, key=edge.get)
        highest = max(floors, key=floors.get)
        out["methods"][method] = {"floor": floors, "attacks": edge,
                                  "worst_attack": [worst, edge[worst]],
                                  "floor_max": [highest, floors[highest]]}
    print(json.dumps(out), flush=True)


def cost(num_tasks: int, rounds: int, methods: list[str]) -> None:
    data = make_sparse_federated(num_tasks=num_tasks, seed=0)
    pooled = Pooled(data)
    lam = 1.0 / pooled.n
    p_star, _ = optimum(pooled, lam)
    print(f"K = {num_tasks}, d = {data.dim}, n = {pooled.n}, {rounds} rounds, P* = {p_star:.6f}")
    print(f"{'method':11s} {'mode':22s} {'f(w_R)':>9s} {'(f - P*)/P*':>12s} {'test err':>9s} "
          f"{'reaches off at':>15s}")
    modes = {"robust off": {"robust": False}, "robust on": {"robust": True},
             "on, max-weight-share 1": {"robust": True, "max_weight_share": 1.0}}
    for method in methods:
        final_off = None
        for mode, kwargs in modes.items():
            strategy = run(data, rounds, method=method, **kwargs)
            recorded = [r["objective"] for r in strategy.results()["rounds"]]
            if final_off is None:
                final_off = recorded[-1]
            reach = next((k for k, v in enumerate(recorded)
                          if v is not None and v <= final_off), None)
            f = pooled.objective(strategy.w, lam)
            print(f"{method:11s} {mode:22s} {f:9.6f} {(f - p_star) / p_star:12.3e} "
                  f"{pooled.test_error(strategy.w):9.4f} "
                  f"{'-' if reach is None else reach:>15}", flush=True)


def shares(num_tasks: int, rounds: int) -> None:
    data = make_sparse_federated(num_tasks=num_tasks, dim=DIM if num_tasks == TASKS else 20_000,
                                 seed=0)
    tasks = list(data.tasks)
    n = int(sum(t.n_train for t in tasks))
    lam = 1.0 / n
    rows = np.array([t.n_train for t in tasks], dtype=np.float64)
    bounds = np.sqrt(rows * np.array([float(t.X_train.multiply(t.X_train).sum())
                                      for t in tasks])) / (lam * n)
    alphas = [np.zeros(t.n_train) for t in tasks]
    share = [np.zeros(data.dim) for _ in tasks]
    w = np.zeros(data.dim)
    print(f"K = {num_tasks}, d = {data.dim}, n = {n}, honest CoCoA+ (lambda = 1/n)")
    print(f"{'round':>5s} {'refused':>8s} {'fence alone':>12s} {'largest |v_k| / bound':>22s} "
          f"{'at its bound: refused':>22s}")
    total = alone = bound_refused = 0
    for r in range(1, rounds + 1):
        d_w_sum = np.zeros(data.dim)
        for k, t in enumerate(tasks):
            d_alpha, d_w = cocoa_plus_local_sdca(
                t.X_train, t.y_train, alphas[k], w, lam=lam, n=n, sigma_prime=len(tasks),
                order=coordinate_order(0, k, r, t.n_train))
            alphas[k] = alphas[k] + d_alpha
            share[k] = share[k] + d_w
            d_w_sum += d_w
        w = cocoa_plus_aggregate(w, d_w_sum)
        sizes = np.array([np.linalg.norm(v) for v in share])
        outlier, fence = share_outliers(sizes, rows, bounds)
        over = int((sizes / rows > fence).sum())
        total, alone = total + int(outlier.sum()), alone + over
        at_bound = sum(bool(share_outliers(np.where(np.arange(len(tasks)) == k,
                                                    0.999 * bounds, sizes), rows, bounds)[0][k])
                       for k in range(len(tasks)))
        bound_refused += at_bound
        print(f"{r:5d} {int(outlier.sum()):8d} {over:12d} {float((sizes / bounds).max()):22.4f} "
              f"{at_bound:22d}", flush=True)
    print(f"total: {total} refused of {rounds * num_tasks} (the per-row fence alone: {alone}); "
          f"a share at its bound refused in {bound_refused}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", choices=("attacks", "poisoned", "floor", "cost", "shares"))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--methods", default="gd,cocoa-plus,fsvrg")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    if args.table == "attacks":
        attacks(args.rounds or 8)
    elif args.table == "poisoned":
        poisoned(args.rounds or 8)
    elif args.table == "floor":
        floor(args.rounds or 8)
    elif args.table == "cost":
        cost(args.tasks, args.rounds or 20, args.methods.split(","))
    else:
        shares(args.tasks, args.rounds or 10)


if __name__ == "__main__":
    main()
