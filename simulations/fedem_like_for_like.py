"""Like-for-like rows of the FedEM table (issue 18): M = 3 (the paper's), FedProx with the
authors' optimiser (momentum 0, mu and lr from ``fedem_tune.py --momentum 0 --mus ...``), and
the ``fixed`` generator.

Every run is ``fmtl_flower.experiments.fedem_table1.run_one``: a real in-process Flower
federation of 100 rounds over the 300 clients of ``fedem-synthetic``, evaluated on the test
sets. Parts (``--parts``):

* ``m3``: FedEM with M = 3 (the paper's), lr 0.3 / batch 128 (FedEM's tuned solver);
* ``fedprox-m0``: FedProx, momentum 0, ``--fedprox-lr`` / ``--fedprox-mu`` (the values the
  validation runs chose) and batch 32;
* ``cfl``: Sattler et al.'s CFL (the FedEM authors' thresholds 0.4 / 1.6) with
  ``--cfl-settings`` (JSON run-config keys: the lr and batch chosen by ``fedem_tune.py
  --methods cfl``);
* ``pfedme``: pFedMe with ``--pfedme-settings`` (likewise, ``fedem_tune.py --methods
  pfedme``);
* ``fixed``: ``generator=fixed`` (the row-offset bug of the released generator fixed) for
  Local, FedAvg, FedAvg+, clustered FL (IFCA) and FedEM (M = 3), each with the settings tuned
  on the released data (``fedem_table1.TUNED``), FedProx with the ``fedprox-m0`` settings
  (``--fixed-methods fedprox``) and FedEM with M = 4 (``fedem-m4``, part ``fixed-m4``).

Usage: python simulations/fedem_like_for_like.py [--jobs 2] [--seeds 0 1 2] [--parts ...]
       [--fedprox-lr 0.3] [--fedprox-mu 0.1] [--fixed-methods ...] [--cfl-settings JSON]
       [--pfedme-settings JSON]
       python simulations/fedem_like_for_like.py --merge a.json b.json --out c.json
       [--out results/fedem-like-for-like.json]
Prints one line per run and a JSON summary (mean and standard error over seeds) last.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from fmtl_flower.experiments.fedem_table1 import TUNED, run_one

PARTS = ("m3", "fedprox-m0", "fixed", "cfl", "pfedme")

FIXED_METHODS = ("local", "fedavg", "fedavg-ft", "clustered", "fedem", "fedprox", "fedem-m4")


def plan(parts: list[str], seeds: list[int], fedprox_lr: float, fedprox_mu: float,
         fixed_methods: tuple[str, ...] = FIXED_METHODS, cfl: dict | None = None,
         pfedme: dict | None = None) -> list[tuple[str, dict]]:
    jobs: list[tuple[str, dict]] = []
    base = {"eval-every": 1000}
    for seed in seeds:
        if "m3" in parts:
            jobs.append(("m3", {**base, "strategy": "fedem", "M": 3, "seed": seed}))
        if "fedprox-m0" in parts:
            jobs.append(("fedprox-m0", {**base, "strategy": "fedprox", "seed": seed,
                                        "momentum": 0.0, "lr": fedprox_lr,
                                        "prox-mu": fedprox_mu, "batch-size": 32}))
        for part, extra in (("cfl", cfl), ("pfedme", pfedme)):
            if part in parts:
                jobs.append((part, {**base, **(extra or {}), "strategy": part, "seed": seed}))
        if "fixed" in parts:
            for method in fixed_methods:
                if method == "fedprox":  # the authors' optimiser, as the fedprox-m0 part
                    extra = {"strategy": "fedprox", "momentum": 0.0, "lr": fedprox_lr,
                             "prox-mu": fedprox_mu, "batch-size": 32}
                elif method == "fedem-m4":  # the variant chosen on validation
                    extra = {**TUNED["fedem"], "strategy": "fedem", "M": 4}
                else:
                    extra = {**TUNED[method], "strategy": method,
                             **({"M": 3} if method == "fedem" else {})}
                part = "fixed-m4" if method == "fedem-m4" else "fixed"
                jobs.append((part, {**base, **extra, "seed": seed, "generator": "fixed"}))
    return jobs


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and standard error (sd / sqrt(seeds)) over seeds per (part, method)."""
    summary = []
    for part in dict.fromkeys(r["part"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["part"] == part):
            sel = [r for r in rows if r["part"] == part and r["method"] == method]
            entry = {"part": part, "method": method, "seeds": len(sel)}
            for key in ("accuracy_mean", "accuracy_bottom_decile"):
                v = np.array([r[key] for r in sel], dtype=float)
                entry[key] = float(v.mean())
                entry[f"{key}_se"] = (float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1
                                      else None)
            summary.append(entry)
    return summary


def merge(paths: list[str], out: str) -> None:
    """One payload from several runs' JSON files (rows concatenated, a (part, method, seed)
    seen twice is an error), the summary recomputed."""
    rows, seen = [], set()
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            key = (row["part"], row["method"], row["seed"])
            if key in seen:
                raise ValueError(f"{path}: {key} is already in an earlier file")
            seen.add(key)
            rows.append(row)
    rows.sort(key=lambda r: (r["part"], r["method"], r["seed"]))
    payload = {"rows": rows, "summary": summarise(rows), "merged_from": len(paths)}
    Path(out).write_text(json.dumps(payload, indent=1))
    print(json.dumps({"summary": payload["summary"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--fedprox-lr", type=float, default=0.3)
    parser.add_argument("--fedprox-mu", type=float, default=0.1)
    parser.add_argument("--fixed-methods", nargs="+", choices=FIXED_METHODS,
                        default=list(FIXED_METHODS))
    parser.add_argument("--cfl-settings", type=json.loads, default={},
                        help="JSON run-config keys of the cfl part")
    parser.add_argument("--pfedme-settings", type=json.loads, default={},
                        help="JSON run-config keys of the pfedme part")
    parser.add_argument("--out", default="results/fedem-like-for-like.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' files into --out (no run)")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    jobs = plan(args.parts, args.seeds, args.fedprox_lr, args.fedprox_mu,
                tuple(args.fixed_methods), args.cfl_settings, args.pfedme_settings)
    started = time.perf_counter()
    rows = []
    partial = Path(args.out).with_suffix(".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for (part, settings), result in zip(jobs, pool.map(run_one, [s for _, s in jobs]),
                                            strict=True):
            row = {"part": part, "method": settings["strategy"], "seed": settings["seed"],
                   "settings": settings, **result}
            rows.append(row)
            with partial.open("a") as out:  # every finished run kept, should a later one fail
                out.write(json.dumps(row) + "\n")
            print(f"{part:10s} {row['method']:9s} seed {row['seed']}: accuracy "
                  f"{row['accuracy_mean']:.4f} / bottom decile "
                  f"{row['accuracy_bottom_decile']:.4f} [{row['wall_time_s']:.0f} s]",
                  flush=True)
    summary = summarise(rows)
    payload = {"rows": rows, "summary": summary, "wall_time_s": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
