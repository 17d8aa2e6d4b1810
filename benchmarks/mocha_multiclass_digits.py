"""Multi-class MOCHA on scikit-learn's digits split among devices by label skew, against
FedAvg's one global softmax model and local-only training.

Data: ``"digits-dirichlet"`` (:mod:`fmtl_flower.data.digits`): 1,797 8 x 8 digits (64
features in [0, 1], 10 classes, bundled with scikit-learn), divided among 10 devices by
Dirichlet(0.5) label skew, each device's samples split 75/25 into train and test. Every
method sees the same split and is scored on the same per-device test sets.

Methods (each a real Flower federation on the in-process engine, except local):

* ``mocha``: multi-class MOCHA (one-vs-rest over the 10 classes with ONE learned Omega, a
  penalised intercept, :mod:`fmtl_flower.core.multiclass`), devices built with
  ``labels="auto"``; ``mocha-identity``: the same with Omega = I (no task relationship: the
  tasks' one-vs-rest SVMs trained independently, through the same federation);
* ``fedavg``: the FedEM family's FedAvg with a global softmax model (``model="softmax"``,
  ``num_classes`` learned from the devices at discovery);
* ``local-logreg`` / ``local-svm``: per device, scikit-learn's LogisticRegression /
  LinearSVC (one-vs-rest) on its own training data only (a device holding one class
  predicts it).

Printed: per method the mean per-device test accuracy (test-set-size weighted, the FedEM
authors' number), its unweighted mean, and the bottom-decile device accuracy
(:func:`fmtl_flower.metrics.error_summary`), then one JSON line.

Usage: python benchmarks/mocha_multiclass_digits.py [--rounds 100] [--seed 0] [--lam 1e-3]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower import FedEM, Mocha, make_fedem_client_app, make_mocha_client_app
from fmtl_flower.clients.common import default_task_id
from fmtl_flower.core.multiclass import predict_classes, with_intercept
from fmtl_flower.data import load_dataset
from fmtl_flower.engine import run_inprocess
from fmtl_flower.metrics import error_summary

KEYS = ("accuracy_mean", "accuracy_mean_unweighted", "accuracy_bottom_decile")


def federate(strategy: Any, client: Any, num_tasks: int, rounds: int) -> Any:
    """Run ``strategy`` against ``num_tasks`` in-process nodes of ``client``."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=600.0)

    run_inprocess(server_app, client, num_tasks)
    return strategy


def loader(tasks: list[Any]) -> Callable[[Context], tuple[np.ndarray, ...]]:
    def load(context: Context) -> tuple[np.ndarray, ...]:
        t = tasks[default_task_id(context)]
        return t.X_train, t.y_train, t.X_test, t.y_test
    return load


def summary(errors: list[int], counts: list[int]) -> dict[str, float]:
    out = error_summary(np.array(errors), np.array(counts))
    return {k: float(out[k]) for k in KEYS}


def run_mocha(tasks: list[Any], rounds: int, seed: int, omega: str, lam: float,
              loss: str = "hinge") -> dict[str, float]:
    """Multi-class MOCHA; the per-device accuracies recomputed from W (argmax) and checked
    against the devices' reports."""
    strategy = Mocha(len(tasks), lam=lam, omega=omega, omega_every=10, fit_intercept=True,
                     loss=loss, seed=seed, discovery_timeout=10.0)
    federate(strategy, make_mocha_client_app(loader(tasks), labels="auto"), len(tasks), rounds)
    classes = np.array(strategy.lifting.classes, dtype=np.float64)
    W = strategy.state.W
    errors = [int(np.count_nonzero(classes[predict_classes(
        with_intercept(t.X_test, 1.0), W[:, i], len(classes))] != t.y_test))
        for i, t in enumerate(tasks)]
    out = summary(errors, [t.y_test.size for t in tasks])
    final = strategy.results()["final"]
    assert abs(final["accuracy_mean"] - out["accuracy_mean"]) < 1e-12, "devices disagree"
    out["gap"] = float(final["gap"])
    return out


def run_fedavg(tasks: list[Any], rounds: int, seed: int) -> dict[str, float]:
    strategy = FedEM(len(tasks), method="fedavg", model="softmax", lr=0.3, batch_size=32,
                     local_epochs=1, seed=seed, discovery_timeout=10.0)
    federate(strategy, make_fedem_client_app(loader(tasks)), len(tasks), rounds)
    final = strategy.results()["final"]
    return {k: float(final[k]) for k in KEYS}


def run_local(tasks: list[Any], kind: str, seed: int) -> dict[str, float]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import LinearSVC

    errors = []
    for t in tasks:
        if np.unique(t.y_train).size == 1:
            predicted = np.full(t.y_test.size, t.y_train[0])
        else:
            model = LogisticRegression(max_iter=2000) if kind == "logreg" \
                else LinearSVC(random_state=seed)
            predicted = model.fit(t.X_train, t.y_train).predict(t.X_test)
        errors.append(int(np.count_nonzero(predicted != t.y_test)))
    return summary(errors, [t.y_test.size for t in tasks])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--lam", type=float, default=1e-3, help="MOCHA's lambda")
    parser.add_argument("--loss", default="hinge", help="MOCHA's loss (mocha.loss)")
    parser.add_argument("--methods", default="mocha,mocha-identity,fedavg,local-logreg,local-svm",
                        help="comma-separated subset of the methods to run")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    tasks = list(load_dataset("digits-dirichlet", num_tasks=args.tasks, seed=args.seed).tasks)
    rows: dict[str, dict[str, float]] = {}
    runs = {"mocha": lambda: run_mocha(tasks, args.rounds, args.seed, "probabilistic",
                                       args.lam, args.loss),
            "mocha-identity": lambda: run_mocha(tasks, args.rounds, args.seed, "identity",
                                                args.lam, args.loss),
            "fedavg": lambda: run_fedavg(tasks, args.rounds, args.seed),
            "local-logreg": lambda: run_local(tasks, "logreg", args.seed),
            "local-svm": lambda: run_local(tasks, "svm", args.seed)}
    chosen = args.methods.split(",")
    unknown = sorted(set(chosen) - set(runs))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {sorted(runs)}")
    for name, run in ((n, runs[n]) for n in chosen):
        start = time.perf_counter()
        rows[name] = run()
        rows[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"digits-dirichlet: {args.tasks} devices, Dirichlet(0.5) label skew, seed "
          f"{args.seed}, {args.rounds} rounds, MOCHA lambda {args.lam:g}, loss {args.loss}")
    print(f"| {'method':16s} | acc. mean | unweighted | bottom 10% |")
    print(f"| {'-' * 16} | --------- | ---------- | ---------- |")
    for name, row in rows.items():
        print(f"| {name:16s} | {row['accuracy_mean']:9.4f} | "
              f"{row['accuracy_mean_unweighted']:10.4f} | {row['accuracy_bottom_decile']:10.4f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
