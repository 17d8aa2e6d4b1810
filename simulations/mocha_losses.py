"""MOCHA with each smooth loss: rounds to a certified 1e-4 relative gap, checked by L-BFGS.

For ``small`` and ``synthetic`` and each of ``smoothed-hinge``, ``logistic``, ``squared``,
MOCHA runs as a federation (in-process engine, the apps of ``fmtl run``) with Omega fixed
(``mean``: lambda 1e-3, lambda2 1e-2), and the table reports the first round whose record
has a certified relative gap <= 1e-4, the final relative gap, the final primal against the
optimum of the same primal found by scipy's L-BFGS (:mod:`fmtl_flower.experiments.
mocha_losses`) and the test error. About 3 minutes.

Usage: python simulations/mocha_losses.py [--rounds 300] [--out mocha_losses.json]
"""

import argparse
import json
import logging

from fmtl_flower.experiments.mocha_losses import run_loss

DATASETS = ("small", "synthetic")
LOSSES = ("smoothed-hinge", "logistic", "squared")
TARGET = 1e-4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    overrides = {"mocha.omega": "mean", "mocha.lambda": "1e-3", "mocha.lambda2": "1e-2"}
    rows = []
    print("| dataset | loss | rounds to certified 1e-4 | final rel. gap | P (MOCHA) | "
          "P* (L-BFGS) | abs(P - P*) / P* | test error | passes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dataset in DATASETS:
        for loss in LOSSES:
            run = run_loss(dataset, loss, rounds=args.rounds, target=TARGET,
                           overrides=overrides)
            rows.append(run.row())
            print(f"| {dataset} | {loss} | {run.rounds_to_target} | {run.relative_gap:.2e} | "
                  f"{run.primal:.10f} | {run.reference:.10f} | {run.primal_error:.1e} | "
                  f"{run.test_error:.4f} | {'yes' if run.passes(TARGET) else 'NO'} |",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
