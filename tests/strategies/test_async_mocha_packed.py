"""AsyncMOCHA on packed nodes (several tasks per Flower node, :mod:`fmtl_flower.packing`).

The design: each task on a packed node keeps its own block of duals and its own request in
flight; :meth:`PackedGrid.push_messages` sends each request as a packed message of one slot.
So a packed run sends exactly the messages of the unpacked run, only wrapped, and its records
are the unpacked run's, bit for bit, for the same seed and virtual clock.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED, INVALID
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies.async_mocha import AsyncMOCHA
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem

KNOBS = dict(lam=0.05, omega="probabilistic", formulation_options={}, concurrency=4, tau=5,
             latency_sigma=1.0, omega_every=2, seed=3)
TASKS_PER_NODE = 3


class CheckedAsyncMOCHA(AsyncMOCHA):
    """AsyncMOCHA that checks W = B M (W = W(alpha)) after every reply event."""

    worst = 0.0

    def _on_event(self, record, m):
        state = self.run.server.state
        self.worst = max(self.worst, float(np.abs(state.W - state.B @ state.M).max()))
        super()._on_event(record, m)


def _tampered(app, tamper):
    def client(message: Message, context: Context) -> Message:
        reply = app(message, context)
        if tamper is not None and message.metadata.message_type == "train":
            tamper(message, reply)
        return reply
    return client


def _run(problem, rounds, packed: bool, tamper=None):
    m = problem.num_tasks
    app = _tampered(make_async_mocha_client_app(problem.load), tamper)
    if packed:
        app = packed_client_app(
            app, lambda context: tasks_of_node(context.node_config, TASKS_PER_NODE, m))
        grid = PackedGrid(InProcessGrid(app, -(-m // TASKS_PER_NODE)))
    else:
        grid = InProcessGrid(app, m)
    strategy = CheckedAsyncMOCHA(**KNOBS)
    strategy.start(grid, num_rounds=rounds)
    return strategy, grid


def test_packed_run_gives_the_unpacked_records():
    """Six tasks on two nodes of three: the same records, W and certificate as one task
    per node; W = B M after every reply; one physical message per request."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    packed, grid = _run(problem, 6, packed=True)
    unpacked, _ = _run(problem, 6, packed=False)
    assert packed.run.records == unpacked.run.records
    assert np.array_equal(packed.run.server.state.W, unpacked.run.server.state.W)
    assert packed.results()["final"] == unpacked.results()["final"]
    assert packed.run.server.counts[APPLIED] == 36 and packed.results()["final"]["gap"] >= 0
    assert packed.worst <= 1e-12
    requests = packed.run.server.next_id - 1
    assert grid.messages_sent == 2 + 2 + requests  # slots queries, whoami, one per request


def test_trust_boundary_stays_per_task_on_a_packed_node():
    """Task 4 (slot 1 of the second node) sends an inflated delta-b on its 3rd request: only
    that reply is rejected (theta = 1), its node's other tasks are applied as usual, and the
    run equals the unpacked run with the same hostile device."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)

    def tamper(message, reply):
        config = message.content["config"]
        if config["task-id"] == 4 and config["count"] == 3:
            d_b = from_array(reply.content["arrays"]["delta-b"])
            reply.content["arrays"]["delta-b"] = to_array(d_b * 1e6)

    packed, _ = _run(problem, 5, packed=True, tamper=tamper)
    unpacked, _ = _run(problem, 5, packed=False, tamper=tamper)
    server = packed.run.server
    invalid = [r["task"] for r in packed.run.records if r["status"] == INVALID]
    assert invalid == [4] and server.counts[APPLIED] == 30
    applied = {r["task"] for r in packed.run.records if r["status"] == APPLIED}
    assert applied == set(range(6))
    assert packed.run.records == unpacked.run.records
    assert packed.worst <= 1e-12 and np.all(np.isfinite(server.state.W))


def test_fmtl_run_async_on_packed_nodes(tmp_path):
    """`fmtl run async-mocha --set tasks-per-node=3` runs (it was refused) and gives the
    records of one task per node."""
    from fmtl_flower.cli import main

    out = {}
    for per_node in (1, 3):
        path = tmp_path / f"r{per_node}.json"
        assert main(["run", "async-mocha", "--rounds", "3", "--quiet", "--out", str(path),
                     "--set", f"tasks-per-node={per_node}", "--set", "num-tasks=6",
                     "--set", "mocha.latency-sigma=1.0", "--set", "mocha.concurrency=4"]) == 0
        out[per_node] = json.loads(path.read_text())
    assert out[3]["rounds"] == out[1]["rounds"]
    assert out[3]["final"]["replies_applied"] == 18 and out[3]["final"]["gap"] >= 0
    assert out[3]["config"]["tasks-per-node"] == 3


@pytest.mark.parametrize("where", ["push", "pull"])
def test_packed_grid_push_pull_of_an_unknown_id_or_node_drops_it(where):
    problem = make_problem(num_tasks=3, dim=5, samples_per_task=30)
    app = packed_client_app(make_async_mocha_client_app(problem.load),
                            lambda context: tasks_of_node(context.node_config, 3, 3))
    grid = PackedGrid(InProcessGrid(app, 1))
    assert len(list(grid.get_node_ids())) == 3
    if where == "push":
        from fmtl_flower.wire import message, record_dict

        assert list(grid.push_messages([message(record_dict({}), 999, "train")])) == []
    else:
        assert list(grid.pull_messages(["no-such-id"])) == []


ENGINE_CONFIG = {"strategy": "async-mocha", "dataset": "synthetic", "num-tasks": 4, "dim": 5,
                 "samples-per-task": 30, "num-server-rounds": 4, "seed": 3,
                 "mocha.omega": "probabilistic", "mocha.omega-every": 2,
                 "mocha.concurrency": 3, "mocha.tau": 4, "mocha.latency-sigma": 1.0}


def _engine_run(engine: str, tasks_per_node: int) -> dict:
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess, run_ray

    cfg = RunConfig.from_mapping({**ENGINE_CONFIG, "tasks-per-node": tasks_per_node})
    box: dict = {}
    server_app, client_app = make_server_app(cfg, on_done=box.update), make_client_app(cfg)
    nodes = -(-ENGINE_CONFIG["num-tasks"] // tasks_per_node)
    (run_inprocess if engine == "inprocess" else run_ray)(server_app, client_app, nodes)
    assert box, f"{engine}: the ServerApp finished without results"
    return box


@pytest.mark.slow  # Ray's start and shutdown: about a minute on the 2-core machine
def test_ray_engine_on_packed_nodes_gives_the_unpacked_inprocess_records():
    """Four tasks on two packed Ray nodes: the records and certificate of the in-process run
    with one task per node."""
    local, ray = _engine_run("inprocess", 1), _engine_run("ray", 2)
    assert ray["config"]["tasks-per-node"] == 2 and ray["engine"] == "ray"
    assert ray["rounds"] == local["rounds"] and len(local["rounds"]) >= 16
    assert ray["final"] == local["final"] and ray["final"]["gap"] >= 0
