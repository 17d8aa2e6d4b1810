"""Tune the FedEM family's local solver on a validation split (the test sets are never used).

Each client of ``fedem-synthetic`` (released generator) keeps 80 % of its training set for
training and evaluates on the other 20 % (a fixed, per-client random split); every method of
the poster's Table 1 is run, as a real in-process Flower federation of 100 rounds with seed 0,
over the grid lr x batch size below (one local epoch, momentum 0.9, weight decay 5e-4, as the
authors' scripts), and for ``fedem`` / ``clustered`` over the number of components M
(``--components``, default 3), and for ``fedprox`` over its mu (``--mus``, default 0.1).
``--momentum`` sets the momentum of every run (0.9; the authors' FedProx uses 0); for
``pfedme`` ``--pfedme-lrs`` is the grid of its inner learning rate, and ``--set KEY=VALUE``
fixes any other run-config key for every run (e.g. ``pfedme-lambda=15``, FedEM's keys with
or without ``fedem.``). The best
setting per method (highest weighted validation
accuracy) is what ``fmtl_flower.experiments.fedem_table1.TUNED`` and the run-config
defaults (FedEM's) hold.

Usage: python simulations/fedem_tune.py [--jobs 2] [--rounds 100] [--methods ...] [--lrs ...]
       [--batches ...] [--components ...] [--mus ...] [--momentum 0.9]
       [--out results/fedem-tune.json]
Prints one JSON line last: {"best": {method: {"lr", "batch-size", "M", "prox-mu", "momentum",
"validation_accuracy"}}}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

METHODS = ("local", "fedavg", "fedprox", "fedavg-ft", "clustered", "fedem")
#: Also tunable: Sattler et al.'s CFL and pFedMe (``--methods cfl pfedme``).
EXTRA_METHODS = ("cfl", "pfedme")
LRS = (0.03, 0.1, 0.3)
BATCHES = (32, 128)


def validation_run(job: tuple[str, float, int, int, int, float, float, float,
                                tuple[tuple[str, str], ...]]) -> dict:
    """One federation on the 80/20 split of every client's training set."""
    import flwr.common.logger  # noqa: F401

    from fmtl_flower.apps.common import dataset_for, make_server_app
    from fmtl_flower.clients.fedem import make_fedem_client_app
    from fmtl_flower.clients.mocha import default_task_id
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess
    from fmtl_flower.experiments.fedem_table1 import run_config_of

    logging.getLogger("flwr").setLevel(logging.ERROR)
    method, lr, batch, components, rounds, mu, momentum, personal_lr, extra = job
    cfg = RunConfig.from_mapping(run_config_of({  # --set keys with or without "fedem."
        "strategy": method, "dataset": "fedem-synthetic", "fedem.lr": lr,
        "fedem.batch-size": batch, "fedem.M": components, "num-server-rounds": rounds,
        "eval-every": 1000, "fedem.prox-mu": mu, "fedem.momentum": momentum,
        "fedem.pfedme-lr": personal_lr, **dict(extra)}))
    data = dataset_for(cfg)

    def load(context):
        t = default_task_id(context)
        task = data.task(t)
        order = np.random.default_rng([12345, t, 99]).permutation(task.n_train)
        cut = max(1, int(0.8 * task.n_train))
        tr, va = order[:cut], order[cut:]
        return task.X_train[tr], task.y_train[tr], task.X_train[va], task.y_train[va]

    box: dict = {}
    started = time.perf_counter()
    run_inprocess(make_server_app(cfg, on_done=box.update), make_fedem_client_app(load),
                  data.num_tasks)
    final = box["final"]
    return {"method": method, "lr": lr, "batch-size": batch, "M": components,
            "prox-mu": mu, "momentum": momentum,
            **({"pfedme-lr": personal_lr} if method == "pfedme" else {}), **dict(extra),
            "validation_accuracy": final["accuracy_mean"],
            "validation_bottom_decile": final["accuracy_bottom_decile"],
            "wall_time_s": time.perf_counter() - started}


def personal(row: dict) -> str:
    """pFedMe's inner learning rate for the progress line (empty for the other methods)."""
    return f" personal lr {row['pfedme-lr']:g}" if "pfedme-lr" in row else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--components", nargs="+", type=int, default=[3],
                        help="M values tried for fedem and clustered")
    parser.add_argument("--mus", nargs="+", type=float, default=[0.1],
                        help="FedProx mu values tried (fedprox only)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--pfedme-lrs", nargs="+", type=float, default=[0.05],
                        help="pFedMe inner learning rates tried (pfedme only)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-config keys fixed for every run")
    parser.add_argument("--out", default="results/fedem-tune.json")
    args = parser.parse_args()
    extra = tuple(tuple(item.split("=", 1)) for item in args.set)
    jobs = [(m, lr, b, k, args.rounds, mu, args.momentum, plr, extra)
            for m, lr, b in itertools.product(args.methods, args.lrs, args.batches)
            for k in (args.components if m in ("fedem", "clustered") else [3])
            for mu in (args.mus if m == "fedprox" else [0.1])
            for plr in (args.pfedme_lrs if m == "pfedme" else [0.05])]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = []
        for r in pool.map(validation_run, jobs):
            results.append(r)
            print(f"{r['method']:10s} lr {r['lr']:<5g} batch {r['batch-size']:4d} M {r['M']} "
                  f"mu {r['prox-mu']:g} momentum {r['momentum']:g}"
                  f"{personal(r)}: "
                  f"validation "
                  f"accuracy {r['validation_accuracy']:.4f} / bottom decile "
                  f"{r['validation_bottom_decile']:.4f} [{r['wall_time_s']:.0f} s]", flush=True)
    best = {}
    for method in args.methods:
        top = max((r for r in results if r["method"] == method),
                  key=lambda r: r["validation_accuracy"])
        best[method] = {k: top[k] for k in ("lr", "batch-size", "M", "prox-mu", "momentum",
                                            "pfedme-lr", "validation_accuracy") if k in top}
    payload = {"best": best, "runs": results, "rounds": args.rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(json.dumps({"best": best}))


if __name__ == "__main__":
    main()
