"""Privacy-utility of client-level DP (``dp.mechanism=central``) for the FSVRG family on
``sparse-federated``: the objective and test error at epsilon in {1, 2, 4, 8, inf}
(delta 1e-5) over seeds, next to the run without DP and w = 0 (f = log 2: what a run that
releases nothing keeps).

Each run is ``fmtl run METHOD --dataset sparse-federated --set num-tasks=K --rounds R
--seed S --set dp.mechanism=central --set dp.clip=C --set dp.epsilon=EPS`` (plus
``--set KEY=VALUE`` extras); this script runs the grid and prints the table.

Usage: python simulations/fsvrg_privacy.py [--method dane] [--tasks 1000] [--rounds 4]
       [--seeds 0,1,2] [--epsilons 1,2,4,8,inf] [--clip 0.5] [--set KEY=VALUE ...]
       [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from fmtl_flower.cli import main as fmtl


def run_one(method: str, tasks: int, rounds: int, seed: int, epsilon: str | None,
            clip: float, extra: list[str], out: Path) -> dict:
    """One ``fmtl run``; its final record (``epsilon`` None: no DP)."""
    name = f"{method}-K{tasks}-R{rounds}-s{seed}-eps{epsilon or 'off'}.json"
    path = out / name
    if not path.exists():
        argv = ["run", method, "--dataset", "sparse-federated", "--rounds", str(rounds),
                "--seed", str(seed), "--quiet", "--out", str(path),
                "--set", f"num-tasks={tasks}"]
        if epsilon is not None:
            argv += ["--set", "dp.mechanism=central", "--set", f"dp.clip={clip}",
                     "--set", f"dp.epsilon={epsilon}"]
        for item in extra:
            argv += ["--set", item]
        started = time.perf_counter()
        fmtl(argv)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return json.loads(path.read_text())["final"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="dane")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epsilons", default="1,2,4,8,inf")
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--set", dest="extra", action="append", default=[])
    parser.add_argument("--out", default="/tmp/fsvrg-privacy")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [("no DP", None)] + [(f"eps = {e}", e) for e in args.epsilons.split(",")]
    print(f"| {args.method}, K = {args.tasks}, {args.rounds} rounds, clip {args.clip:g} "
          "| epsilon (final) | objective | test error | noise multiplier |")
    print("|---|---|---|---|---|")
    for label, eps in rows:
        finals = [run_one(args.method, args.tasks, args.rounds, s, eps, args.clip,
                          args.extra, out) for s in seeds]
        obj = np.array([f["objective"] for f in finals], dtype=float)
        err = np.array([f["test_error"] for f in finals], dtype=float)
        eps_final = [f.get("epsilon") for f in finals]
        z = [f.get("dp_noise_multiplier") for f in finals]
        shown = "-" if eps is None else (
            "inf" if math.isinf(max(eps_final)) else f"{max(eps_final):.3f}")
        print(f"| {label} | {shown} | {obj.mean():.4f} +- {obj.std():.4f} | "
              f"{err.mean():.4f} +- {err.std():.4f} | "
              f"{'-' if z[0] is None else f'{np.mean(z):.3f}'} |", flush=True)
    print(f"(w = 0: objective log 2 = {math.log(2):.4f}; seeds {args.seeds}; "
          f"delta 1e-5; mean +- std over seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
