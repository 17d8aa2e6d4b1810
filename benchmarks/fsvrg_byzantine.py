"""The FSVRG family against one hostile device, and what robust mode costs honest runs.

``attacks``: the cases of ``tests/strategies/test_byzantine_fsvrg.py`` (10 tasks of
``sparse-federated``, d = 300, seed 0; task 9 hostile), each run with robust mode off and on,
and the run in which task 9's replies are lost (robust off). Prints, per case, the honest
devices' objective ``f_H(w)`` (``lam = 1/n`` of the true counts, computed from the data) of each
run and ``on / lost``; ``all-honest`` is the run where task 9 answers honestly (robust on).

``cost``: FSVRG's Figure 2 protocol through the strategy and its ClientApp (``fmtl reproduce
fsvrg-fig2`` runs the same algorithms Flower-free, so robust mode cannot change it):
``sparse-federated`` with K tasks (d = 20,000, seed 0), ``lam = 1/n``, R rounds of gd, cocoa-plus
and fsvrg (h = 16), robust off, on, and on with ``max-weight-share = 1``. Prints the objective
``f(w_R)`` on all the data, its relative sub-optimality against scikit-learn's optimum P*, the
pooled test error and the first round at which robust mode's recorded objective reaches the
off run's final one.

Run from the repository root:
``python benchmarks/fsvrg_byzantine.py attacks [--rounds 8]``,
``python benchmarks/fsvrg_byzantine.py cost [--tasks 30] [--rounds 20] [--methods gd,...]``.
"""

from __future__ import annotations

import argparse
import logging

from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.experiments.fsvrg_fig2 import Pooled, optimum
from tests.strategies.test_byzantine_fsvrg import (
    CASES,
    DIM,
    TASKS,
    federate,
    honest_objective,
)
from tests.strategies.test_fsvrg_strategy import run

EXTRA_CASES = [("fsvrg", "gradient-robust-edge"), ("gd", "gradient-robust-edge"),
               ("cocoa-plus", "d-w-robust-edge"), ("cocoa-plus", "n-train-1e9")]


def attacks(rounds: int) -> None:
    data = make_sparse_federated(num_tasks=TASKS, dim=DIM, seed=0)
    print(f"K = {TASKS}, d = {DIM}, {rounds} rounds, task 9 hostile; honest objective f_H(w)")
    print(f"{'method':12s} {'attack':21s} {'lost':>8s} {'robust off':>11s} {'robust on':>10s} "
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
        print(f"{method:12s} {attack:21s} {lost[method]:8.4f} {off:11.4g} {on:10.4f} "
              f"{on / lost[method]:8.3f} {honest[method] / lost[method]:16.3f}", flush=True)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", choices=("attacks", "cost"))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--methods", default="gd,cocoa-plus,fsvrg")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    if args.table == "attacks":
        attacks(args.rounds or 8)
    else:
        cost(args.tasks, args.rounds or 20, args.methods.split(","))


if __name__ == "__main__":
    main()
