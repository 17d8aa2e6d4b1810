"""Test error of MOCHA vs global and local SVMs, lambda by 5-fold CV, averaged over seeds.

The protocol of the MOCHA paper's Table 1 (75/25 per-task stratified split, lambda chosen by
5-fold cross-validation on the training split for each method separately, over the grid
1e-5 ... 10), repeated for several seeds (each seed: a new split, new folds, new coordinate
orders). MOCHA runs with ``omega=probabilistic``; its models come from
:func:`fmtl_flower.centralized.fit_mocha`, which performs the federated computation
bit for bit (tests/strategies check the parity), so the cross-validation sweep does not pay
Flower's per-message cost.

Prints a table of mean and standard error of the per-task-averaged test error per method and
dataset, and writes ``mocha_error_table.json`` / ``.csv`` to ``--out``.

Usage: python simulations/mocha_error_table.py [--datasets small eat-voc] [--seeds 5]
       [--rounds 1000] [--omega-every 100] [--out results/]
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

from fmtl_flower.centralized import evaluate_models
from fmtl_flower.data import load_dataset
from fmtl_flower.model_selection import cross_validate_lambda, make_fitter

METHODS = ("global", "local", "mtl")


def run_seed(dataset: str, seed: int, rounds: int, omega_every: int) -> dict[str, dict]:
    data = load_dataset(dataset, seed=seed, test_frac=0.25)
    train = [(t.X_train, t.y_train) for t in data.tasks]
    test = [(t.X_test, t.y_test) for t in data.tasks]
    mocha = {"rounds": rounds, "omega": "probabilistic", "omega_every": omega_every}
    out = {}
    for method in METHODS:
        extra = mocha if method == "mtl" else {}
        lam, _ = cross_validate_lambda(method, train, seed=seed, **extra)
        W = make_fitter(method, seed=seed, **extra)(train, lam)
        out[method] = {"lambda": lam, "test_error": evaluate_models(W, test)["test_error"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["small", "eat-voc"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--omega-every", type=int, default=100)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    rows, per_seed = [], []
    for dataset in args.datasets:
        errors: dict[str, list[float]] = {m: [] for m in METHODS}
        for seed in range(args.seeds):
            t = time.perf_counter()
            result = run_seed(dataset, seed, args.rounds, args.omega_every)
            for method, r in result.items():
                errors[method].append(r["test_error"])
                per_seed.append({"dataset": dataset, "seed": seed, "method": method, **r})
            print(f"{dataset} seed {seed}: " + ", ".join(
                f"{m} {r['test_error']:.4f} (lambda {r['lambda']:g})" for m, r in result.items())
                + f"  [{time.perf_counter() - t:.1f} s]", flush=True)
        for method in METHODS:
            e = np.array(errors[method])
            rows.append({"dataset": dataset, "method": method, "error_mean": float(e.mean()),
                         "error_stderr": float(e.std(ddof=1) / np.sqrt(len(e))) if len(e) > 1
                         else None, "shuffles": len(e)})
    print(f"\n{'dataset':10s} {'method':7s} {'mean error':>11s} {'std. error':>11s} seeds")
    for r in rows:
        se = "-" if r["error_stderr"] is None else f"{r['error_stderr']:.4f}"
        print(f"{r['dataset']:10s} {r['method']:7s} {r['error_mean']:11.4f} {se:>11s} "
              f"{r['shuffles']:5d}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mocha_error_table.json").write_text(json.dumps(
        {"config": vars(args), "rows": rows, "per_seed": per_seed}, indent=1))
    with open(out / "mocha_error_table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
