"""Barrier-free MOCHA's device state files (``client-state-dir``).

A deployment's device loses ``context.state`` when its SuperNode restarts or when a resumed
server starts a new Flower run; with a state file it continues from its alpha, so the run
goes on bit for bit with no reset. A state file written by another run (another
``run-token``) is never adopted: it is reset, and the reset is logged.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.checkpoint import read_state_file, write_state_file
from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMOCHA

from ..strategies.helpers import ServerKilled, make_problem

KNOBS = dict(lam=0.05, omega="probabilistic", formulation_options={}, concurrency=4, tau=5,
             latency_sigma=1.0, omega_every=2, seed=3)
M = 6


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=M, dim=5, samples_per_task=30)


def _restarting(app, restart_at):
    """The app, whose node 'restarts' (a new, empty ``context.state``) before each train
    message ``(task-id, count)`` in ``restart_at``."""
    def client(message: Message, context: Context) -> Message:
        config = message.content["config"] if "config" in message.content else {}
        if message.metadata.message_type == "train" \
                and (config.get("task-id"), config.get("count")) in restart_at:
            for name in list(context.state.keys()):
                del context.state[name]
        return app(message, context)
    return client


def _run(problem, rounds, state_dir=None, restart_at=(), ckpt=None, strategy_cls=AsyncMOCHA,
         grid=None):
    if grid is None:
        app = make_async_mocha_client_app(problem.load, state_dir=state_dir)
        grid = InProcessGrid(_restarting(app, set(restart_at)), M)
    strategy = strategy_cls(**KNOBS)
    if ckpt is not None:
        strategy.enable_checkpoints(ckpt)
    strategy.start(grid, num_rounds=rounds)
    return strategy


def _consistent(strategy):
    state = strategy.run.server.state
    assert np.abs(state.W - state.B @ state.M).max() <= 1e-12
    assert all(r["gap"] >= 0 for r in strategy.run.records if r["gap"] is not None)


RESTARTS = [(2, 4), (0, 2), (5, 7), (3, 5)]


def test_device_restart_keeps_its_alpha_with_a_state_file(problem, tmp_path):
    """Four devices restart mid-run (their context.state emptied): with state files the run
    equals the uninterrupted one bit for bit (no reset, same certificate); without them each
    restart is a reset (the restart does hit the protocol)."""
    whole = _run(problem, 8)
    kept = _run(problem, 8, tmp_path / "state", RESTARTS)
    assert kept.run.records == whole.run.records
    assert np.array_equal(kept.run.server.state.W, whole.run.server.state.W)
    final = kept.results()["final"]
    assert final["replies_resets"] == 0 and final["gap"] == whole.results()["final"]["gap"]
    assert sorted(p.name for p in (tmp_path / "state").glob("*.npz")) == [
        f"async-mocha-task-{t}.npz" for t in range(M)]
    _consistent(kept)
    lost = _run(problem, 8, None, RESTARTS)
    assert lost.results()["final"]["replies_resets"] >= len(RESTARTS)
    _consistent(lost)


def _killed_at(record_count):
    class Killed(AsyncMOCHA):
        def _on_event(self, record, m):
            if len(self.run.records) == record_count:
                raise ServerKilled(record_count)
            super()._on_event(record, m)
    return Killed


def _fresh_grid(problem, state_dir):
    """A new Flower run's devices: empty contexts, the same state directory."""
    return InProcessGrid(make_async_mocha_client_app(problem.load, state_dir=state_dir), M)


def test_resumed_server_and_new_device_contexts_continue_bit_for_bit(problem, tmp_path):
    """The server dies mid-flight and is resumed from its checkpoint in a new Flower run
    (every device's context.state is new): the devices read their state files (the same
    run-token, kept in the checkpoint) and the run equals the uninterrupted one."""
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    whole = _run(problem, 6)
    with pytest.raises(ServerKilled):
        _run(problem, 6, state, ckpt=ckpt, strategy_cls=_killed_at(20))
    resumed = _run(problem, 6, ckpt=ckpt, grid=_fresh_grid(problem, state))
    assert resumed.resumed_from > 0
    assert resumed.run.records == whole.run.records
    assert resumed.results()["final"]["replies_resets"] == 0
    _consistent(resumed)


def test_state_file_of_another_run_is_reset_and_logged(problem, tmp_path, caplog):
    """The same resume, but the state files were written by another run (another
    run-token; the same request ids, as two runs of the same settings give): none is
    adopted, each is logged, and the server resets the tasks; the run completes with
    W = B M and every certified gap >= 0."""
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    with pytest.raises(ServerKilled):
        _run(problem, 6, state, ckpt=ckpt, strategy_cls=_killed_at(20))
    for path in state.glob("*.npz"):
        arrays, meta = read_state_file(path)
        meta.pop("format", None)
        write_state_file(path, arrays, {**meta, "run": "0123456789abcdef.0123456789abcdef"})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        resumed = _run(problem, 6, ckpt=ckpt, grid=_fresh_grid(problem, state))
    foreign = [r for r in caplog.records if "written by another run" in r.getMessage()]
    assert len({r.getMessage() for r in foreign}) == M  # one line per task, naming it
    final = resumed.results()["final"]
    assert final["replies_resets"] >= 1 and final["replies_applied"] == 6 * M
    _consistent(resumed)
    assert resumed.run.server.counts[APPLIED] == 6 * M
