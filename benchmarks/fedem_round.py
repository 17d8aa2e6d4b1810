"""Seconds per FedEM round over the 300 clients of fedem-synthetic, in-process, and where they go.

Runs FedEM (the run-config defaults: M = 3 logistic components, one local epoch, batch 128)
as a real Flower federation on the in-process engine for a few rounds without evaluation, and
splits each round's wall time into

* ``estep_s``: the devices' E-step (component losses, responsibilities, pi), summed;
* ``train_s``: the devices' local SGD over the M components, summed;
* ``aggregate_s``: the server's validation-free aggregation of the components;
* ``other_s``: the rest: Flower messages, serialisation, reply validation, data access.

On one machine the devices run one after another, so the parts add up to the round's time.
Prints one JSON line last: {"clients", "rounds", "round_s", "estep_s", "train_s",
"aggregate_s", "other_s", "per_client_ms"} (medians over the rounds after the first).

Usage: python benchmarks/fedem_round.py [--rounds 4] [--threads 1] [--num-tasks 300]
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    parser.add_argument("--num-tasks", type=int, default=300)
    args = parser.parse_args()

    import flwr.common.logger  # noqa: F401
    from threadpoolctl import threadpool_limits

    from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cfg = RunConfig.from_mapping({"strategy": "fedem", "dataset": "fedem-synthetic",
                                  "num-tasks": args.num_tasks,
                                  "num-server-rounds": args.rounds, "eval-every": 10**6})
    data = dataset_for(cfg)
    records: list[dict] = []
    with threadpool_limits(args.threads):
        # the final round always evaluates: time the training rounds only
        server = make_server_app(cfg, on_round=records.append)
        run_inprocess(server, make_client_app(cfg), data.num_tasks)
    train_rounds = records[1:-1] or records[:-1] or records
    parts = {k: float(np.median([r[k] for r in train_rounds]))
             for k in ("client_estep_s", "client_train_s", "aggregate_s")}
    # wall_time_s of a non-evaluated round covers configure, messages and aggregation
    round_s = float(np.median([r["wall_time_s"] for r in train_rounds]))
    out = {"clients": data.num_tasks, "rounds": len(train_rounds), "round_s": round_s,
           "estep_s": parts["client_estep_s"], "train_s": parts["client_train_s"],
           "aggregate_s": parts["aggregate_s"],
           "other_s": round_s - sum(parts.values()),
           "per_client_ms": 1e3 * round_s / data.num_tasks}
    for key in ("estep_s", "train_s", "aggregate_s", "other_s"):
        print(f"{key:12s} {out[key]:8.3f} s  ({100 * out[key] / round_s:5.1f} %)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
