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

``--select validation`` (the fair protocol): every method's hyper-parameters are chosen on a
validation split of each device's TRAINING data (20 % held out per device, stratified by
class, :func:`fmtl_flower.data.digits.validation_split`), by the validation accuracy (mean
weighted by set size; ties: bottom decile, then the first in grid order); the chosen setting
is then retrained on the full training split and scored once on the test split. The grids:

* MOCHA (``mocha``): :data:`MOCHA_GRID` (formulation, lambda, lambda2, loss), each run
  ``--rounds`` rounds, the rounds chosen among :data:`ROUND_CHOICES` up to ``--rounds`` from
  the validation accuracy the run records every round;
* FedAvg: lr in :data:`FEDAVG_LRS`, rounds as for MOCHA (one run per lr);
* local models: C in :data:`LOCAL_CS`.

``mocha-identity`` is not part of it. ``--select none`` (the
default) runs the given ``--lam``, ``--loss`` and ``--rounds`` with no selection.

Usage: python benchmarks/mocha_multiclass_digits.py [--rounds 100] [--seed 0] [--lam 1e-3]
       python benchmarks/mocha_multiclass_digits.py --select validation --seed 0
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

from fmtl_flower import MOCHA, FedEM, make_fedem_client_app, make_mocha_client_app
from fmtl_flower.clients.common import default_task_id
from fmtl_flower.core.multiclass import predict_classes, with_intercept
from fmtl_flower.data import load_dataset
from fmtl_flower.data.digits import validation_split
from fmtl_flower.engine import run_inprocess
from fmtl_flower.metrics import error_summary

KEYS = ("accuracy_mean", "accuracy_mean_unweighted", "accuracy_bottom_decile")
#: ``--select validation``: MOCHA's candidate settings (omega, lambda, lambda2, loss).
MOCHA_GRID = (("probabilistic", 1e-4, None, "hinge"), ("probabilistic", 1e-3, None, "hinge"),
              ("mean", 1e-3, 1e-5, "hinge"), ("mean", 1e-3, 1e-5, "logistic"))
#: FedAvg's candidate learning rates.
FEDAVG_LRS = (0.1, 0.3, 1.0)
#: The local models' candidate inverse regularisation C (scikit-learn's).
LOCAL_CS = (0.1, 1.0, 10.0)
#: Candidate numbers of rounds (those up to ``--rounds``, and ``--rounds`` itself).
ROUND_CHOICES = (50, 100)


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
              loss: str = "hinge", lam2: float | None = None) -> dict[str, Any]:
    """Multi-class MOCHA; the per-device accuracies recomputed from W (argmax) and checked
    against the devices' reports; ``"per_round"``: each round's accuracy."""
    strategy = MOCHA(len(tasks), lam=lam, omega=omega, omega_every=10, fit_intercept=True,
                     loss=loss, seed=seed, discovery_timeout=10.0,
                     **({} if lam2 is None else {"lam2": lam2}))
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
    out["per_round"] = per_round(strategy.results()["rounds"])
    return out


def per_round(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Round -> the accuracies of the rounds whose record has them."""
    return {int(r["round"]): {k: float(r[k]) for k in KEYS} for r in records
            if r.get("accuracy_mean") is not None}


def run_fedavg(tasks: list[Any], rounds: int, seed: int, lr: float = 0.3) -> dict[str, Any]:
    """FedAvg with a global softmax; ``"per_round"``: each evaluated round's accuracy."""
    strategy = FedEM(len(tasks), method="fedavg", model="softmax", lr=lr, batch_size=32,
                     local_epochs=1, seed=seed, discovery_timeout=10.0)
    federate(strategy, make_fedem_client_app(loader(tasks)), len(tasks), rounds)
    results = strategy.results()
    out: dict[str, Any] = {k: float(results["final"][k]) for k in KEYS}
    out["per_round"] = per_round(results["rounds"])
    return out


def run_local(tasks: list[Any], kind: str, seed: int, C: float = 1.0) -> dict[str, float]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import LinearSVC

    errors = []
    for t in tasks:
        if np.unique(t.y_train).size == 1:
            predicted = np.full(t.y_test.size, t.y_train[0])
        else:
            model = LogisticRegression(C=C, max_iter=2000) if kind == "logreg" \
                else LinearSVC(C=C, random_state=seed)
            predicted = model.fit(t.X_train, t.y_train).predict(t.X_test)
        errors.append(int(np.count_nonzero(predicted != t.y_test)))
    return summary(errors, [t.y_test.size for t in tasks])


def score(row: dict[str, float]) -> tuple[float, float]:
    """Validation ranking: accuracy mean (test-set-size weighted), then bottom decile."""
    return row["accuracy_mean"], row["accuracy_bottom_decile"]


def best(candidates: list[tuple[dict[str, Any], dict[str, float]]]) -> dict[str, Any]:
    """The setting of the best-scored candidate (the first on ties), with its validation
    scores under ``"validation"``."""
    top = max(range(len(candidates)), key=lambda i: (score(candidates[i][1]), -i))
    setting, row = candidates[top]
    return {**setting, "validation": {k: row[k] for k in KEYS}}


def round_choices(max_rounds: int) -> list[int]:
    return sorted({r for r in ROUND_CHOICES if r < max_rounds} | {max_rounds})


def by_rounds(setting: dict[str, Any], run: dict[str, Any], max_rounds: int
              ) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """One candidate per round count of :func:`round_choices`, read from one run's
    per-round records."""
    return [({**setting, "rounds": r}, run["per_round"][r]) for r in round_choices(max_rounds)]


def select_mocha(fit: list[Any], rounds: int, seed: int) -> dict[str, Any]:
    candidates = []
    for omega, lam, lam2, loss in MOCHA_GRID:
        run = run_mocha(fit, rounds, seed, omega, lam, loss, lam2)
        candidates += by_rounds({"omega": omega, "lam": lam, "lam2": lam2, "loss": loss},
                                run, rounds)
    return best(candidates)


def select_fedavg(fit: list[Any], rounds: int, seed: int) -> dict[str, Any]:
    candidates = []
    for lr in FEDAVG_LRS:
        candidates += by_rounds({"lr": lr}, run_fedavg(fit, rounds, seed, lr), rounds)
    return best(candidates)


def select_local(fit: list[Any], kind: str, seed: int) -> dict[str, Any]:
    return best([({"C": C}, run_local(fit, kind, seed, C)) for C in LOCAL_CS])


def selected_runs(tasks: list[Any], rounds: int, seed: int, chosen: dict[str, Any]
                  ) -> dict[str, Callable[[], dict[str, Any]]]:
    """``--select validation``: per method, pick on the validation split (the choice lands
    in ``chosen``), then retrain on the full training split and score on the test split."""
    fit = list(validation_split(load_tasks_dataset(tasks), 0.2, seed).tasks)

    def mocha() -> dict[str, Any]:
        c = chosen["mocha"] = select_mocha(fit, rounds, seed)
        return run_mocha(tasks, c["rounds"], seed, c["omega"], c["lam"], c["loss"], c["lam2"])

    def fedavg() -> dict[str, Any]:
        c = chosen["fedavg"] = select_fedavg(fit, rounds, seed)
        return run_fedavg(tasks, c["rounds"], seed, c["lr"])

    def local(kind: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            c = chosen[f"local-{kind}"] = select_local(fit, kind, seed)
            return run_local(tasks, kind, seed, c["C"])
        return run

    return {"mocha": mocha, "fedavg": fedavg, "local-logreg": local("logreg"),
            "local-svm": local("svm")}


def load_tasks_dataset(tasks: list[Any]) -> Any:
    from fmtl_flower.data.dataset import MultiTaskDataset

    return MultiTaskDataset(name="digits-dirichlet", tasks=tuple(tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--lam", type=float, default=1e-3, help="MOCHA's lambda")
    parser.add_argument("--loss", default="hinge", help="MOCHA's loss (mocha.loss)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the methods to run (default: all of "
                             "those of the --select mode)")
    parser.add_argument("--select", choices=("none", "validation"), default="none",
                        help="validation: hyper-parameters picked on 20%% of each device's "
                             "training data, then retrained and scored once on the test split")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    tasks = list(load_dataset("digits-dirichlet", num_tasks=args.tasks, seed=args.seed).tasks)
    rows: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    if args.select == "validation":
        runs = selected_runs(tasks, args.rounds, args.seed, chosen)
    else:
        runs = {"mocha": lambda: run_mocha(tasks, args.rounds, args.seed, "probabilistic",
                                       args.lam, args.loss),
            "mocha-identity": lambda: run_mocha(tasks, args.rounds, args.seed, "identity",
                                                args.lam, args.loss),
            "fedavg": lambda: run_fedavg(tasks, args.rounds, args.seed),
            "local-logreg": lambda: run_local(tasks, "logreg", args.seed),
            "local-svm": lambda: run_local(tasks, "svm", args.seed)}
    methods = args.methods.split(",") if args.methods else list(runs)
    unknown = sorted(set(methods) - set(runs))
    if unknown:
        parser.error(f"unknown methods {unknown} (with --select {args.select}); choose from "
                     f"{sorted(runs)}")
    for name, run in ((n, runs[n]) for n in methods):
        start = time.perf_counter()
        rows[name] = run()
        rows[name].pop("per_round", None)
        rows[name]["seconds"] = round(time.perf_counter() - start, 1)
        if name in chosen:
            rows[name]["chosen"] = chosen[name]
    if args.select == "validation":
        print(f"digits-dirichlet: {args.tasks} devices, Dirichlet(0.5) label skew, seed "
              f"{args.seed}, settings chosen on 20% of each device's training data (up to "
              f"{args.rounds} rounds), retrained on it all, scored on the test split")
    else:
        print(f"digits-dirichlet: {args.tasks} devices, Dirichlet(0.5) label skew, seed "
              f"{args.seed}, {args.rounds} rounds, MOCHA lambda {args.lam:g}, loss {args.loss}")
    print(f"| {'method':16s} | acc. mean | unweighted | bottom 10% |")
    print(f"| {'-' * 16} | --------- | ---------- | ---------- |")
    for name, row in rows.items():
        print(f"| {name:16s} | {row['accuracy_mean']:9.4f} | "
              f"{row['accuracy_mean_unweighted']:10.4f} | {row['accuracy_bottom_decile']:10.4f} |"
              + (f" chosen {row['chosen']}" if "chosen" in row else ""))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
