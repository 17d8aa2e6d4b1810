"""Barrier-free MOCHA in real time (the deployment clock, ``clock="wall"``).

In-process (fast): a grid that holds one node's replies back for a real delay shows the wall
loop applying replies as they arrive (the fast tasks apply more), with W = B M after every
reply and a valid certificate; a server killed mid-flight resumes from its checkpoint.

On a real loopback deployment (slow suite): one ``flower-superlink`` and four
``flower-supernode`` processes (private ``FLWR_HOME``, :mod:`tests.apps.loopback`), one of
them started with ``emulate-delay-s`` (it sleeps in every ``train``): the run completes with
a valid certificate, its records are stamped in wall seconds, and the fast devices applied
more replies than the slow one. Every process is stopped by PID in the teardown.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMOCHA

from ..strategies.helpers import PassThroughGrid, ServerKilled, make_problem

KNOBS = dict(lam=0.05, omega="probabilistic", formulation_options={}, concurrency=4, tau=6,
             omega_every=2, seed=3, clock="wall")
SLOW_TASK, SLOW_S = 1, 0.15


class SlowNodeGrid(PassThroughGrid):
    """The in-process grid, with the replies of ``slow_node``'s messages held back until
    ``delay_s`` real seconds after they were pushed (as a slow device would send them)."""

    def __init__(self, grid: InProcessGrid, slow_node: int, delay_s: float) -> None:
        super().__init__(grid)
        self.slow_node, self.delay_s = slow_node, delay_s
        self.release: dict[str, float] = {}

    def push_messages(self, messages):  # noqa: D102
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for message, mid in zip(messages, ids, strict=True):
            slow = message.metadata.dst_node_id == self.slow_node
            self.release[mid] = time.monotonic() + (self.delay_s if slow else 0.0)
        return ids

    def pull_messages(self, message_ids):  # noqa: D102
        now = time.monotonic()
        ready = [i for i in message_ids if self.release.get(i, 0.0) <= now]
        return self.inner.pull_messages(ready)


def _grid(problem):
    inner = InProcessGrid(make_async_mocha_client_app(problem.load), problem.num_tasks)
    slow_node = sorted(inner.get_node_ids())[SLOW_TASK]  # node i serves partition (task) i
    return SlowNodeGrid(inner, slow_node, SLOW_S)


class Checked(AsyncMOCHA):
    """Checks W = B M after every reply event; ``kill_at``: the server 'dies' at that event."""

    kill_at = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.worst = 0.0

    def _on_event(self, record, m):
        state = self.run.server.state
        self.worst = max(self.worst, float(np.abs(state.W - state.B @ state.M).max()))
        if len(self.run.records) == self.kill_at:
            raise ServerKilled(self.kill_at)
        super()._on_event(record, m)


def _applied_by_task(records):
    return Counter(r["task"] for r in records if r["status"] == APPLIED)


def test_wall_clock_applies_replies_as_they_arrive():
    """Task 1's replies come 0.15 s late: the others keep working meanwhile (no barrier),
    so they apply more replies; every record is stamped with wall seconds; W = B M after
    every reply; the certificate is valid."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    strategy = Checked(**KNOBS)
    started = time.monotonic()
    strategy.start(_grid(problem), num_rounds=4)
    elapsed = time.monotonic() - started
    records, final = strategy.run.records, strategy.results()["final"]
    assert final["replies_applied"] == 24 and final["clock"] == "wall"
    assert final["virtual_time_s"] is None and 0 < final["time_s"] <= elapsed
    assert final["gap"] >= 0 and all(r["gap"] >= 0 for r in records if r["gap"] is not None)
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and times[-1] <= final["time_s"]
    applied = _applied_by_task(records)
    fast = [applied[t] for t in range(6) if t != SLOW_TASK]
    assert min(fast) > applied[SLOW_TASK], applied
    assert strategy.worst <= 1e-12


def test_wall_clock_expires_a_device_that_never_replies():
    """Task 1's replies never come: each of its requests expires after ``pull_timeout_s``
    real seconds (theta = 1) and is sent again; the other tasks apply theirs meanwhile, and
    without task 1's loss there is no certificate (None, never a made-up gap)."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    grid = _grid(problem)
    grid.delay_s = float("inf")
    strategy = Checked(**{**KNOBS, "pull_timeout_s": 0.3})
    strategy.start(grid, num_rounds=2)
    records, final = strategy.run.records, strategy.results()["final"]
    expired = [r["task"] for r in records if r["status"] == "expired"]
    assert final["replies_applied"] == 12 and final["replies_expired"] == len(expired) >= 1
    assert set(expired) == {SLOW_TASK} and SLOW_TASK not in _applied_by_task(records)
    assert final["gap"] is None and strategy.worst <= 1e-12


def test_wall_clock_resumes_mid_flight(tmp_path):
    """The server dies mid-flight; resumed from its checkpoint it re-pushes the requests in
    flight, its clock continues, and the run completes consistent."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    grid = _grid(problem)
    killed = Checked(**KNOBS)
    killed.kill_at = 14
    killed.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        killed.start(grid, num_rounds=4)
    resumed = Checked(**KNOBS)
    resumed.enable_checkpoints(tmp_path)
    resumed.start(grid, num_rounds=4)
    final = resumed.results()["final"]
    assert resumed.resumed_from >= 1 and final["replies_applied"] == 24
    kept = killed.run.records[:6 * resumed.resumed_from]
    assert resumed.run.records[:len(kept)] == kept
    times = [r["time_s"] for r in resumed.run.records]
    assert times == sorted(times)
    assert final["gap"] >= 0 and resumed.worst <= 1e-12


def test_checkpoint_of_the_other_clock_is_refused(tmp_path):
    from fmtl_flower.checkpoint import CheckpointError

    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    strategy = AsyncMOCHA(**KNOBS)
    strategy.enable_checkpoints(tmp_path)
    strategy.start(_grid(problem), num_rounds=1)
    virtual = AsyncMOCHA(**{**KNOBS, "clock": "virtual"})
    virtual.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="clock"):
        virtual.start(_grid(problem), num_rounds=2)


# ----------------------------------------------------------------------------- loopback
# A ClientApp process per message takes about 10 s a request here (2 shared cores); with a
# 15 s delay the slow device needs about 2.5 times as long (measured: 7, 7, 7 replies applied
# for the fast devices, 3 for the slow one; with 2 s it was 6, 6, 7 against 5).
NODES, ROUNDS, DELAY_S = 4, 6, 15.0
RUN_CONFIG = (f"strategy='async-mocha' num-tasks={NODES} dim=5 samples-per-task=30 "
              f"num-server-rounds={ROUNDS} seed=2 round-timeout=120.0 "
              f"mocha.concurrency={NODES} mocha.tau={2 * NODES} mocha.omega='identity'")


def _run_to_completion(fed, run_config: str, results) -> tuple[dict, float]:
    """Start the loopback federation ``fed``, submit ``run_config`` writing ``results``,
    wait for it to end (rc 0), stop every process it started; the results and the run's
    seconds."""
    try:
        fed.start()
        fed.wait_nodes_registered()
        sub = fed.submit(f"{run_config} results-file='{results}'", results=results)
        seconds = sub.wait(1200.0, fed.context())
        assert sub.popen.returncode == 0, fed.context()
        out = sub.read_results()
    finally:
        survivors = fed.stop()
    assert not survivors, f"processes still alive: {survivors}"
    return out, seconds


@pytest.mark.slow  # a real SuperLink and four SuperNodes: a few minutes on the 2-core machine
def test_loopback_deployment_with_a_slow_supernode(tmp_path) -> None:
    from .loopback import LoopbackFederation

    configs = [f"task-id={t}" + (f" emulate-delay-s={DELAY_S}" if t == SLOW_TASK else "")
               for t in range(NODES)]
    fed = LoopbackFederation(tmp_path, NODES, node_configs=configs)
    out, seconds = _run_to_completion(fed, RUN_CONFIG, tmp_path / "async.json")
    print(f"loopback async-mocha run: {seconds:.1f} s (flwr run), "
          f"{out['final']['time_s']:.1f} s on the wall clock of the run")
    final, records = out["final"], out["rounds"]
    assert out["engine"] == "deployment" and final["clock"] == "wall"
    assert final["replies_applied"] == ROUNDS * NODES and final["virtual_time_s"] is None
    assert final["gap"] >= 0 and final["primal"] - final["dual"] == pytest.approx(final["gap"])
    assert all(r["gap"] >= 0 for r in records if r["gap"] is not None)
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and 0 < times[-1] <= final["time_s"]
    applied = _applied_by_task(records)
    fast = [applied[t] for t in range(NODES) if t != SLOW_TASK]
    assert applied[SLOW_TASK] >= 1 and min(fast) > applied[SLOW_TASK], applied
    # the slow device's requests really took its delay: the run lasted at least its replies
    assert final["time_s"] >= applied[SLOW_TASK] * DELAY_S


PACKED_CONFIG = (f"strategy='async-mocha' num-tasks={NODES} dim=5 samples-per-task=30 "
                 f"num-server-rounds={ROUNDS} seed=2 round-timeout=120.0 tasks-per-node=2 "
                 f"mocha.concurrency={NODES} mocha.tau={2 * NODES} mocha.omega='identity'")


@pytest.mark.slow  # a real SuperLink and two SuperNodes: a few minutes on the 2-core machine
def test_loopback_deployment_on_packed_nodes(tmp_path) -> None:
    """Two SuperNodes host two tasks each (``tasks-per-node=2``), with state files: both
    tasks of a node have a request in flight at once (a one-slot packed message each; the
    SuperNode of flwr 1.42 serves them one after the other: its log alternates receive and
    send). The run completes with a valid certificate and no reset: every task kept its
    duals across the per-message ClientApp processes."""
    from .loopback import LoopbackFederation

    fed = LoopbackFederation(tmp_path, 2, state_dirs=True,
                             node_configs=["task-ids='0,1'", "task-ids='2,3'"])
    out, seconds = _run_to_completion(fed, PACKED_CONFIG, tmp_path / "packed.json")
    print(f"loopback packed async-mocha run: {seconds:.1f} s (flwr run)")
    final, records = out["final"], out["rounds"]
    assert final["clock"] == "wall" and final["replies_applied"] == ROUNDS * NODES
    assert final["gap"] >= 0 and all(r["gap"] >= 0 for r in records if r["gap"] is not None)
    assert final["replies_resets"] == 0, final
    assert _applied_by_task(records).keys() == set(range(NODES))
