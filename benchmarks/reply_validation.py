"""Cost of the server's reply checks (issue 15): MOCHA's reply parser with and without the
bounds a feasible dual step guarantees (``|delta-b|`` against the task's max-row-norm, the
hinge-loss bound), per reply, for several d.

Each figure is the minimum over ``--trials`` of the mean time of ``--repeats`` parses of one
valid train reply (decode, type and shape checks, the bounds). Prints one line per d and one
JSON line; the ratio is the checked parse over the parse without the bounds.

    python benchmarks/reply_validation.py [--repeats 3000] [--trials 9]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fmtl_flower.core.mocha_factored import make_server_state
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.wire import to_array


def measure(d: int, repeats: int, trials: int, m: int = 50) -> dict[str, float]:
    strategy = MOCHA(m, omega="identity")
    strategy.state = make_server_state(d, m, "identity", lam=0.1, path="dense")
    strategy.directory.n_train[:] = 100
    strategy.directory.row_norm[:] = 10.0
    strategy._budgets = np.full(m, 100)
    strategy._w_norm = np.ones(m)
    message = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=5,
                      message_type="train")
    delta = np.random.default_rng(0).normal(size=d) * 1e-3
    reply = Message(RecordDict({
        "arrays": ArrayRecord({"delta-b": to_array(delta)}),
        "metrics": MetricRecord({"task-id": 3, "round": 2, "n-train": 100, "state-ok": 1,
                                 "loss-mean": 0.5, "dual-mean": 0.1, "steps": 100})}),
        reply_to=message)

    def mean_parse() -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            strategy._parse_reply(reply, 3, 2, True)
        return (time.perf_counter() - started) / repeats

    checked, unchecked = [], []
    for _ in range(trials):  # interleaved: the machine's load affects both alike
        checked.append(mean_parse())
        strategy._check_delta = lambda task, delta: None  # type: ignore[method-assign]
        strategy.max_row_norm = float("nan")  # NaN bound: the loss bound is skipped
        unchecked.append(mean_parse())
        del strategy._check_delta
        strategy.max_row_norm = None
    return {"d": d, "checked_us": min(checked) * 1e6, "unchecked_us": min(unchecked) * 1e6,
            "ratio": min(checked) / min(unchecked)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3000)
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args()
    InProcessGrid(lambda message, context: message, 1)  # sets Flower's run identity
    rows = [measure(d, args.repeats, args.trials) for d in (100, 1000, 10_000)]
    for row in rows:
        print(f"d={row['d']:>6}: parse {row['unchecked_us']:7.1f} us, with the bounds "
              f"{row['checked_us']:7.1f} us, ratio {row['ratio']:.2f}")
    print(json.dumps({"benchmark": "reply_validation", "rows": rows}))


if __name__ == "__main__":
    main()
