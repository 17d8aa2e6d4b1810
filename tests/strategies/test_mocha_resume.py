"""MOCHA checkpoints, resume after a server kill, device state files, and fault handling."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.checkpoint import CheckpointError, read_checkpoint
from fmtl_flower.clients.mocha import STATE_META, make_mocha_client_app
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import (
    Run,
    ServerKilled,
    assert_b_consistent,
    fault_at,
    is_train,
    killed_in,
    make_problem,
    msg_round,
    run_federation,
)

ROUNDS = 8
SETTINGS = {"lam": 0.05, "omega": "probabilistic", "omega_every": 2, "seed": 3,
            "local_frac": 0.5, "discovery_timeout": 5.0}




@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=5, dim=4, samples_per_task=40, seed=11)


@pytest.fixture(scope="module")
def uninterrupted(problem):
    return run_federation(problem, ROUNDS, **SETTINGS)


def _run(problem, strategy: MOCHA, device_dir: Path | None, rounds: int = ROUNDS):
    """One Flower run (fresh contexts: empty ``context.state``, as after a server restart)."""
    app = make_mocha_client_app(problem.load)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    run_config = {} if device_dir is None else {"client-state-dir": str(device_dir)}
    return run_inprocess(server_app, app, problem.num_tasks, run_config=run_config)


def _killed_then_resumed(problem, tmp_path: Path, kill_round: int, every: int):
    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    first = killed_in(MOCHA, kill_round)(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(ckpt, every=every)
    with pytest.raises(ServerKilled):
        _run(problem, first, devices)
    second = MOCHA(problem.num_tasks, **SETTINGS)
    second.enable_checkpoints(ckpt, every=every)
    grid = _run(problem, second, devices)
    return second, grid


@pytest.mark.parametrize(("kill_round", "every"), [(1, 1), (4, 1), (5, 2), (4, 2), (ROUNDS, 3)])
def test_resume_after_server_kill_is_bit_identical(problem, uninterrupted, tmp_path, kill_round,
                                                    every):
    resumed, _ = _killed_then_resumed(problem, tmp_path, kill_round, every)
    expected_from = (kill_round - 1) // every * every
    assert resumed.resumed_from == expected_from
    np.testing.assert_array_equal(resumed.state.W, uninterrupted.strategy.state.W)
    np.testing.assert_array_equal(resumed.state.B, uninterrupted.strategy.state.B)
    got, want = resumed.results(), uninterrupted.strategy.results()
    for a, b in zip(got["rounds"], want["rounds"], strict=True):
        for key in ("round", "primal", "dual", "gap", "test_error", "num_replies", "num_resets"):
            assert a.get(key) == b.get(key), (key, a["round"])
    assert got["final"]["complete"] and got["final"]["num_resets"] == 0


def test_lost_device_state_file_resets_only_that_task(problem, uninterrupted, tmp_path):
    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    first = killed_in(MOCHA, 5)(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(ckpt)
    with pytest.raises(ServerKilled):
        _run(problem, first, devices)
    (devices / "mocha-task-2.npz").unlink()  # that device lost its storage
    second = MOCHA(problem.num_tasks, **SETTINGS)
    second.enable_checkpoints(ckpt)
    grid = _run(problem, second, devices)
    rounds = second.results()["rounds"]
    assert rounds[5]["num_resets"] == 1 and sum(r.get("num_resets") or 0 for r in rounds) == 1
    # the other tasks' duals continued: B and the devices agree for every task
    assert_b_consistent(Run(second, grid, problem))
    assert not np.array_equal(second.state.B, uninterrupted.strategy.state.B)


def test_device_state_newer_than_checkpoint_is_reset_not_mixed(problem, tmp_path):
    """Checkpoint every 3 rounds, killed in round 6 before the checkpoint: devices committed
    round 4 and 5, which the checkpoint (round 3) lacks; none may be mixed into B."""
    resumed, grid = _killed_then_resumed(problem, tmp_path, kill_round=6, every=3)
    assert resumed.resumed_from == 3
    assert_b_consistent(Run(resumed, grid, problem))


def test_checkpoint_from_other_settings_is_refused(problem, tmp_path):
    first = MOCHA(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(tmp_path)
    _run(problem, first, None, rounds=2)
    other = MOCHA(problem.num_tasks, **{**SETTINGS, "lam": 0.1})
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="lam"):
        _run(problem, other, None, rounds=3)


def test_checkpoints_are_atomic_files_without_pickle(problem, tmp_path):
    strategy = MOCHA(problem.num_tasks, **SETTINGS)
    strategy.enable_checkpoints(tmp_path, every=2)
    _run(problem, strategy, None, rounds=5)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["round-000004.npz", "round-000005.npz"]  # the newest two, no temp files
    checkpoint = read_checkpoint(tmp_path)
    assert checkpoint.server_round == 5
    np.testing.assert_array_equal(checkpoint.arrays["state.W"], strategy.state.W)
    with np.load(tmp_path / "round-000005.npz", allow_pickle=False) as data:
        assert all(data[k].dtype != object for k in data.files)


def test_resume_after_the_last_round_sends_nothing(problem, uninterrupted, tmp_path):
    first = MOCHA(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(tmp_path / "ckpt")
    _run(problem, first, tmp_path / "dev")
    again = MOCHA(problem.num_tasks, **SETTINGS)
    again.enable_checkpoints(tmp_path / "ckpt")
    grid = _run(problem, again, tmp_path / "dev")
    assert again.resumed_from == ROUNDS
    assert all(STATE_META not in c.state for c in grid.contexts.values())  # no message sent
    np.testing.assert_array_equal(again.state.W, uninterrupted.strategy.state.W)
    assert again.results()["final"]["gap"] == uninterrupted.final["gap"]


# ------------------------------------------------------------------------------ faults
def test_round_below_min_replies_changes_nothing(problem):
    silent = {1001, 1002, 1003, 1004}  # nodes of 4 of the 5 tasks fail in round 3

    def wrap(app):
        def client(msg: Message, context: Context) -> Message:
            if is_train(msg) and msg_round(msg) == 3 and context.node_id in silent:
                raise RuntimeError("injected crash")
            return app(msg, context)
        return client

    run = run_federation(problem, 5, wrap=wrap, min_replies=2, **SETTINGS)
    trace = run.strategy.trace[3]
    np.testing.assert_array_equal(trace["B_before"], trace["B_after"])
    np.testing.assert_array_equal(trace["last_before"], trace["last_after"])
    assert run.rounds[3]["counted"] is False and run.rounds[4]["counted"] is True
    assert_b_consistent(run)


def test_failing_node_is_excluded_probed_and_readmitted(problem, caplog):
    node = 1003  # task of the fourth node
    bad_rounds = set(range(2, 9))
    caplog.set_level(logging.INFO, logger="flwr")
    run = run_federation(problem, 14, wrap=fault_at("raise-before", node, bad_rounds),
                         max_failures=2, probe_every=3, **SETTINGS)
    task = run.strategy.node_to_task[node]
    health = run.strategy.results()["health"]
    events = health["health_events"]
    # failures in rounds 2 and 3 -> excluded after round 3; probes in rounds 6 and 9;
    # round 6 fails, round 9 answers -> readmitted
    assert [(e["event"], e["round"]) for e in events] == [("excluded", 3), ("readmitted", 9)]
    assert health["missed_rounds"][str(task)] == [2, 3, 4, 5, 6, 7, 8]
    assert health["task_nodes"][str(task)] == node
    assert health["tasks_excluded"] == []
    assert [r["round"] for r in run.rounds if task in (r.get("tasks_excluded") or [])] == \
        [3, 4, 5, 6, 7, 8]
    assert "excluded after 2 consecutive failed rounds" in caplog.text
    assert_b_consistent(run)


# ------------------------------------------------------------------------------ server paths
@pytest.mark.parametrize("omega", ["probabilistic", "identity", "mean", "clustered"])
def test_factored_server_path_gives_the_dense_numbers(problem, omega):
    options = {**SETTINGS, "omega": omega}
    if omega == "mean":
        options["lam2"] = 0.1
    if omega == "clustered":
        options.update(eta=0.5, clusters=2)
    dense = run_federation(problem, 6, server_path="dense", **options)
    factored = run_federation(problem, 6, server_path="factored", **options)
    np.testing.assert_allclose(factored.strategy.state.W, dense.strategy.state.W, rtol=1e-9,
                               atol=1e-12)
    for a, b in zip(factored.rounds, dense.rounds, strict=True):
        for key in ("primal", "dual", "gap"):
            if a[key] is None:
                assert b[key] is None
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (key, a["round"])


def test_factored_server_resumes_bit_for_bit(problem, tmp_path):
    options = {**SETTINGS, "server_path": "factored"}
    plain = MOCHA(problem.num_tasks, **options)
    _run(problem, plain, None)
    first = killed_in(MOCHA, 5)(problem.num_tasks, **options)
    first.enable_checkpoints(tmp_path / "ckpt", every=2)
    with pytest.raises(ServerKilled):
        _run(problem, first, tmp_path / "dev")
    resumed = MOCHA(problem.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path / "ckpt", every=2)
    _run(problem, resumed, tmp_path / "dev")
    assert resumed.resumed_from == 4
    np.testing.assert_array_equal(resumed.state.W, plain.state.W)


def test_mbsgd_resumes_bit_for_bit(problem, tmp_path):
    from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
    from fmtl_flower.strategies.mbsgd import MbSGD

    options = {"lam": 0.05, "omega": "probabilistic", "omega_every": 2, "seed": 3,
               "discovery_timeout": 5.0}

    def run(strategy):
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            strategy.start(grid=grid, num_rounds=ROUNDS, timeout=60.0)

        run_inprocess(server_app, make_mbsgd_client_app(problem.load), problem.num_tasks)

    plain = MbSGD(problem.num_tasks, **options)
    run(plain)
    first = killed_in(MbSGD, 5)(problem.num_tasks, **options)
    first.enable_checkpoints(tmp_path, every=2)
    with pytest.raises(ServerKilled):
        run(first)
    resumed = MbSGD(problem.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path, every=2)
    run(resumed)
    assert resumed.resumed_from == 4
    np.testing.assert_array_equal(resumed.W, plain.W)
    assert [r["primal"] for r in resumed.results()["rounds"]] == \
        [r["primal"] for r in plain.results()["rounds"]]
