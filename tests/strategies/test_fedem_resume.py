"""FedEM: a server killed mid-run and resumed from its checkpoint (a new Flower run: empty
``context.state``, devices reading their state files) ends bit for bit where an uninterrupted
run ends; devices whose state is too new or lost start afresh instead of mixing rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fedem import FedEM

from .helpers import ServerKilled, killed_in
from .test_fedem_strategy import mixture_problem

ROUNDS = 6
SETTINGS = {"num_components": 2, "lr": 0.5, "batch_size": 32, "seed": 5, "fraction": 0.5,
            "eval_every": 2, "discovery_timeout": 5.0}




@pytest.fixture(scope="module")
def problem():
    return mixture_problem(num_tasks=8, seed=1)


def _run(problem, strategy: FedEM, state_dir: Path | None):
    app = make_fedem_client_app(lambda ctx: problem[default_task_id(ctx)],
                                state_dir=None if state_dir is None else str(state_dir))
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=ROUNDS, timeout=60.0)

    return run_inprocess(server, app, len(problem))


@pytest.fixture(scope="module")
def uninterrupted(problem):
    strategy = FedEM(len(problem), **SETTINGS)
    _run(problem, strategy, None)
    return strategy


@pytest.mark.parametrize("method", ["fedem", "local"])
@pytest.mark.parametrize("kill_round", [1, 4])
def test_resume_after_server_kill_is_bit_identical(problem, uninterrupted, tmp_path,
                                                   kill_round, method):
    settings = {**SETTINGS, "method": method}
    plain = uninterrupted
    if method != "fedem":
        plain = FedEM(len(problem), **settings)
        _run(problem, plain, None)
    first = killed_in(FedEM, kill_round)(len(problem), **settings)
    first.enable_checkpoints(tmp_path / "ckpt")
    with pytest.raises(ServerKilled):
        _run(problem, first, tmp_path / "devices")
    resumed = FedEM(len(problem), **settings)
    resumed.enable_checkpoints(tmp_path / "ckpt")
    _run(problem, resumed, tmp_path / "devices")
    assert resumed.resumed_from == kill_round - 1
    np.testing.assert_array_equal(resumed.components, plain.components)
    assert _untimed(resumed) == _untimed(plain)  # every record, timings aside


def _untimed(strategy: FedEM) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")}
            for r in strategy.results()["rounds"]]


def test_devices_without_state_files_restart_from_uniform_pi(problem, uninterrupted, tmp_path):
    """No client-state-dir: the resumed run's devices have no memory of pi and momentum; the
    run still completes (different numbers, nothing mixed)."""
    first = killed_in(FedEM, 4)(len(problem), **SETTINGS)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        _run(problem, first, None)
    resumed = FedEM(len(problem), **SETTINGS)
    resumed.enable_checkpoints(tmp_path)
    _run(problem, resumed, None)
    assert resumed.results()["final"]["complete"]
    assert not np.array_equal(resumed.components, uninterrupted.components)
