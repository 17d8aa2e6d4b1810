"""OFMTL newcomers under record-level DP: test error at epsilon 8 and inf vs local-only.

    python benchmarks/ofmtl_privacy.py [--dataset synthetic] [--seeds 0 1 2] [--clip 4]
                                       [--rounds 10] [--outer 10] [--lam 0.1]

Runs ``fmtl run ofmtl`` (in-process) on ``--dataset`` (``synthetic``, ``fmtl run ofmtl``'s
default; ``small``, the ``ofmtl-arrivals --quick`` one; ``eat-voc``) with the founding tasks
of ``fmtl reproduce ofmtl-arrivals`` (10, 10, 1), no retraining
(``ofmtl.retrain-ratio=inf``: the newcomers keep their O(1)-exchange models), MOCHA
``--rounds`` rounds, ``dp.delta`` 1e-5, at ``dp.epsilon`` 8 and inf (inf: z = 0, rows still
clipped, MOCHA's separable step), and without DP; and local-only SVMs (``fmtl run local``'s
fit at the same lambda), which release nothing.

The newcomers' error: records are per-task-averaged over the present tasks and the founding
columns stay frozen without retraining, so the newcomers' mean test error is
``(m * final - k * initial) / (m - k)`` (k founding tasks, m all); each newcomer evaluates
its own model without its own noise (``docs/guides/privacy.md``). Local-only: the mean of the
same tasks' per-task test errors.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

INITIAL = {"synthetic": 10, "small": 10, "eat-voc": 1}  # as ofmtl-arrivals


def _run(args: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "fmtl_flower.cli", *args, "--quiet", "--out",
                    str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def newcomer_error(results: dict) -> tuple[float, float]:
    """(newcomers' mean test error, founding tasks' mean test error) of an OFMTL run."""
    rounds = results["rounds"]
    k, m = rounds[0]["devices"], rounds[-1]["devices"]
    first, last = rounds[0]["test_error"], rounds[-1]["test_error"]
    return (m * last - k * first) / (m - k), first


def local_error(dataset: str, seed: int, lam: float) -> float:
    """Local-only SVMs' mean test error over the newcomer tasks (tasks INITIAL[dataset] ..)."""
    from fmtl_flower.apps.common import dataset_for
    from fmtl_flower.config import RunConfig
    from fmtl_flower.core.hinge import classification_errors
    from fmtl_flower.core.svm import fit_local_svms

    cfg = RunConfig.from_mapping({"strategy": "local", "dataset": dataset, "seed": seed,
                                  "mocha.lambda": lam})
    data = dataset_for(cfg)
    W = fit_local_svms([(t.X_train, t.y_train) for t in data.tasks], float(cfg.lam),
                       seed=seed)
    rates = [classification_errors(t.X_test, t.y_test, W[:, i]) / t.X_test.shape[0]
             for i, t in enumerate(data.tasks)]
    return float(np.mean(rates[INITIAL[dataset]:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="synthetic", choices=sorted(INITIAL))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clip", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--outer", type=int, default=10)
    parser.add_argument("--lam", type=float, default=0.1, help="mocha.lambda (OFMTL's)")
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            common = ["run", "ofmtl", "--dataset", args.dataset, "--seed", str(seed),
                      "--rounds", str(args.rounds),
                      "--set", f"ofmtl.initial-tasks={INITIAL[args.dataset]}",
                      "--set", "ofmtl.retrain-ratio=inf", "--set", f"ofmtl.outer={args.outer}",
                      "--set", f"mocha.lambda={args.lam}"]
            for eps in ("8", "inf", None):
                dp = [] if eps is None else [
                    "--set", "dp.mechanism=record", "--set", f"dp.clip={args.clip}",
                    "--set", f"dp.epsilon={eps}", "--set", "dp.delta=1e-5"]
                name = "no DP" if eps is None else f"epsilon {eps}"
                res = _run(common + dp, Path(tmp) / f"{seed}-{eps}.json")
                new, founding = newcomer_error(res)
                rows.setdefault(f"OFMTL newcomers, {name}", []).append(new)
                rows.setdefault(f"OFMTL founding tasks, {name}", []).append(founding)
            rows.setdefault("local-only newcomers", []).append(
                local_error(args.dataset, seed, args.lam))
    print(f"{args.dataset}, {INITIAL[args.dataset]} founding tasks, MOCHA {args.rounds} rounds, "
          f"outer {args.outer}, lambda {args.lam:g}, clip {args.clip}, delta 1e-5, "
          f"seeds {args.seeds}")
    for name, values in rows.items():
        per_seed = ', '.join(f'{v:.4f}' for v in values)
        print(f"{name:40s} {np.mean(values):.4f}  (per seed {per_seed})")


if __name__ == "__main__":
    main()
