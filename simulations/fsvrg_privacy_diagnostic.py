"""Where private fsvrg's utility goes (a diagnostic, not a private run: the runs with one
release's noise switched off have no valid epsilon): ``sparse-federated`` K = 1000, seed 0,
4 rounds, C = 1, ``stats_clip`` 20, z = 1.913 (what epsilon 8 over 9 releases costs), with
the setup release's noise and the rounds' noise on or off in turn. Prints the objective
by round for each. About 2 minutes a run on 2 cores.

Usage: python simulations/fsvrg_privacy_diagnostic.py
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.privacy import enable_client_dp

Z = 1.913
TASKS = 1000


def run(data: SparseFederatedDataset, stats_z: float, rounds_z: float) -> list[float]:
    """The objective by round of fsvrg under DP with noise multiplier ``stats_z`` on the
    statistics' release and ``rounds_z`` on the rounds' releases."""
    strategy = enable_client_dp(FSVRG(TASKS, method="fsvrg", discovery_timeout=30.0),
                                mechanism="central", clip=1.0, noise_multiplier=rounds_z)
    privacy = strategy.privacy
    release = privacy.feature_stats

    def stats_release(*args: Any, **kwargs: Any) -> Any:  # its own noise multiplier
        privacy.noise_multiplier = stats_z
        try:
            return release(*args, **kwargs)
        finally:
            privacy.noise_multiplier = rounds_z

    privacy.feature_stats = stats_release
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=4, timeout=600.0)

    run_inprocess(server, app, TASKS)
    return [round(r["objective"], 4) for r in strategy.results()["rounds"]]


def main() -> None:
    data = make_sparse_federated(num_tasks=TASKS, seed=0)
    for stats_z, rounds_z in [(0.0, 0.0), (Z, 0.0), (0.0, Z), (Z, Z)]:
        print(f"stats z={stats_z} rounds z={rounds_z}: objective by round "
              f"{run(data, stats_z, rounds_z)}", flush=True)


if __name__ == "__main__":
    main()
