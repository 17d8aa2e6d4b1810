"""FSVRG family: a server killed mid-run and resumed from its checkpoint ends bit for bit where
an uninterrupted run ends (the nodes keep no state, except CoCoA+'s duals, which the commit
protocol reconciles)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.checkpoint import CheckpointError
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fsvrg import FSVRG

from .helpers import ServerKilled, killed_in

ROUNDS = 6
METHODS = {"fsvrg": {}, "fsvrg-naive": {"h": 0.05}, "gd": {}, "dane": {}, "cocoa-plus": {}}




@pytest.fixture(scope="module")
def data():
    return make_sparse_federated(num_tasks=8, dim=500, seed=1)


def _run(data, strategy: FSVRG, state_dir=None):
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays(),
                                state_dir=None if state_dir is None else str(state_dir))
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=ROUNDS, timeout=60.0)

    return run_inprocess(server_app, app, data.num_tasks)


def test_cocoa_plus_nodes_without_state_files_reset_cleanly(data, tmp_path):
    """A new run without device state files: every CoCoA+ node restarts from alpha = 0 and the
    server removes the tasks' shares of w (gap withheld for that record, >= 0 afterwards)."""
    options = {"method": "cocoa-plus", "seed": 2, "discovery_timeout": 5.0}
    first = killed_in(FSVRG, 4)(data.num_tasks, **options)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        _run(data, first)
    resumed = FSVRG(data.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path)
    _run(data, resumed)
    rounds = resumed.results()["rounds"]
    assert rounds[4]["num_resets"] == data.num_tasks and rounds[3]["gap"] is None
    assert all(r["gap"] >= 0 for r in rounds[4:])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_resume_after_server_kill_is_bit_identical(data, tmp_path, method):
    options = {"method": method, "seed": 2, "discovery_timeout": 5.0, **METHODS[method]}
    plain = FSVRG(data.num_tasks, **options)
    _run(data, plain)
    first = killed_in(FSVRG, 4)(data.num_tasks, **options)
    first.enable_checkpoints(tmp_path / "ckpt", every=2)  # CoCoA+ nodes go back to round 2
    with pytest.raises(ServerKilled):
        _run(data, first, tmp_path / "devices")
    resumed = FSVRG(data.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path / "ckpt", every=2)
    _run(data, resumed, tmp_path / "devices")
    assert resumed.resumed_from == 2
    np.testing.assert_array_equal(resumed.w, plain.w)
    got, want = resumed.results(), plain.results()
    assert [r["objective"] for r in got["rounds"]] == [r["objective"] for r in want["rounds"]]
    assert [r["exchanges"] for r in got["rounds"]] == [r["exchanges"] for r in want["rounds"]]


def test_checkpoint_of_another_method_is_refused(data, tmp_path):
    first = FSVRG(data.num_tasks, method="gd", discovery_timeout=5.0)
    first.enable_checkpoints(tmp_path)
    _run(data, first)
    other = FSVRG(data.num_tasks, method="fsvrg", discovery_timeout=5.0)
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="method"):
        _run(data, other)
