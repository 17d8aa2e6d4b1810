"""OFMTL checkpoints after every event; a server killed in the middle of a newcomer's protocol
resumes after the last completed event, serves that newcomer again from its first step, and
ends with the W and Sigma of an uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.checkpoint import CheckpointError, read_checkpoint
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.ofmtl import OFMTL

from .helpers import Killed, KilledOFMTL, make_problem

SETTINGS = {"initial_tasks": 2, "lam": 0.05, "mocha_rounds": 20, "inner": 10,
            "discovery_timeout": 5.0, "arrival_timeout": 2.0}



@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=6, dim=4, samples_per_task=40, seed=7)


def _run(problem, strategy: OFMTL):
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, make_ofmtl_client_app(problem.load), problem.num_tasks)


def test_resume_mid_newcomer_ends_like_an_uninterrupted_run(problem, tmp_path):
    plain = OFMTL(problem.num_tasks, **SETTINGS)
    _run(problem, plain)
    first = KilledOFMTL(problem.num_tasks, task=4, step=5, **SETTINGS)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(Killed):
        _run(problem, first)
    events_done = len(first.records)
    assert read_checkpoint(tmp_path).server_round == events_done
    resumed = OFMTL(problem.num_tasks, **SETTINGS)
    resumed.enable_checkpoints(tmp_path)
    _run(problem, resumed)
    assert resumed.resumed_from == events_done
    np.testing.assert_array_equal(resumed.W, plain.W)
    np.testing.assert_array_equal(resumed.Sigma, plain.Sigma)
    keys = ("event", "devices", "test_error", "cumulative_floats", "retrainings")
    assert [{k: r[k] for k in keys} for r in resumed.records] == \
        [{k: r[k] for k in keys} for r in plain.records]


def test_checkpoint_of_other_settings_is_refused(problem, tmp_path):
    first = OFMTL(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(tmp_path)
    _run(problem, first)
    other = OFMTL(problem.num_tasks, **{**SETTINGS, "inner": 11})
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError):
        _run(problem, other)
