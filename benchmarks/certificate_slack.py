"""How far honest devices stay from failing the certificate's check.

The server rejects a (loss, dual) pair whose Fenchel-Young slack
``loss - dual + coupling`` is below ``-PAIR_SLACK (|loss| + |dual| + |coupling|)``
(:mod:`fmtl_flower.core.certificate`). Honest pairs have a slack >= 0 in exact arithmetic and
near 0 at the optimum, so rounding can make it slightly negative. This runs honest federations
to near their optimum and prints the smallest relative slack any pair had, against the
tolerance:

* MOCHA on small.mat, the run of docs/results.md's first table (``omega=identity``,
  ``local-frac=1.0``, ``lambda=1e-4``, no test split, ``--rounds`` rounds, default 1000);
* CoCoA+ on the sparse federated data (10 nodes, d = 300, ``lambda = 1/n``, 200 rounds).

Usage: python benchmarks/certificate_slack.py [--rounds 1000] [--data small]
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np

from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
from fmtl_flower.config import RunConfig
from fmtl_flower.core.certificate import PAIR_SLACK
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies import fsvrg as fsvrg_module
from fmtl_flower.strategies import mocha as mocha_module


def relative_slack(loss: Any, dual: Any, coupling: Any) -> float:
    """The smallest ``(loss - dual + coupling) / (|loss| + |dual| + |coupling|)``."""
    loss, dual, coupling = (np.atleast_1d(np.asarray(v, dtype=np.float64))
                            for v in (loss, dual, coupling))
    scale = np.abs(loss) + np.abs(dual) + np.abs(coupling)
    return float(np.min((loss - dual + coupling) / np.where(scale > 0, scale, 1.0)))


def honest_run(values: dict[str, Any], module: Any, name: str) -> tuple[dict, float]:
    """Run ``values`` in-process with ``module.name`` (the pair check) wrapped to record the
    smallest relative slack it saw; (final record, that slack)."""
    check = getattr(module, name)
    smallest = [np.inf]

    def spy(loss: Any, dual: Any, *args: Any) -> Any:
        coupling = args[-1]
        smallest[0] = min(smallest[0], relative_slack(loss, dual, coupling))
        return check(loss, dual, *args)

    setattr(module, name, spy)
    try:
        cfg = RunConfig.from_mapping(values)
        box: dict = {}
        run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                      dataset_for(cfg).num_tasks)
    finally:
        setattr(module, name, check)
    return box["final"], smallest[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--data", default="small")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    final, slack = honest_run(
        {"strategy": "mocha", "dataset": args.data, "num-server-rounds": args.rounds,
         "mocha.omega": "identity", "mocha.lambda": 1e-4, "mocha.local-frac": 1.0,
         "test-frac": 0.0, "eval-every": 100}, mocha_module, "hinge_pair_problems")
    print(f"MOCHA {args.data}, {args.rounds} rounds: relative gap "
          f"{final['gap'] / final['primal']:.3g}, certificate rejections "
          f"{final['certificate_rejections_total']}, smallest relative slack {slack:.3g} "
          f"(tolerance {-PAIR_SLACK:.0e})")
    final, slack = honest_run(
        {"strategy": "cocoa-plus", "dataset": "sparse-federated", "num-tasks": 10, "dim": 300,
         "num-server-rounds": 200, "eval-every": 50},
        fsvrg_module, "logistic_pair_problem")
    print(f"CoCoA+ sparse-federated, 200 rounds: gap {final['gap']:.3g}, certificate "
          f"rejections {final['certificate_rejections_total']}, smallest relative slack "
          f"{slack:.3g} (tolerance {-PAIR_SLACK:.0e})")


if __name__ == "__main__":
    main()
