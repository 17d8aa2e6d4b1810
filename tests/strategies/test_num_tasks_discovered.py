"""``num_tasks`` learned from the federation (issue 27, item 5): Flower sizes a run by its
SuperNodes; a run config without ``num-tasks`` but with ``min-available-nodes`` takes the
tasks of the nodes online, and ``discover_num_tasks`` does it for a user's ServerApp."""

from __future__ import annotations

import json
import logging

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fmtl_flower import MOCHA, discover_num_tasks, make_mocha_client_app
from fmtl_flower.apps.client_app import app as client_app
from fmtl_flower.apps.server_app import app as server_app
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.strategies.discovery import DiscoveryError

from .helpers import make_problem


def test_the_app_takes_the_tasks_of_the_supernodes_online(tmp_path):
    """Three SuperNodes of the synthetic dataset (more tasks by default), num-tasks unset:
    the run used to wait for the dataset's every task and fail; it now runs three."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = tmp_path / "r.json"
    run_config = {"strategy": "mocha", "dataset": "synthetic", "dim": 4,
                  "samples-per-task": 20, "num-server-rounds": 2, "round-timeout": 5.0,
                  "min-available-nodes": 3, "results-file": str(out)}
    run_inprocess(server_app, client_app, 3, run_config=run_config)
    final = json.loads(out.read_text())["final"]
    assert final["complete"] is True and final["tasks_never_replied"] == []
    assert final["gap"] is not None


def test_discover_num_tasks_counts_the_distinct_task_ids_online():
    problem = make_problem(num_tasks=5)
    grid = InProcessGrid(make_mocha_client_app(problem.load), 5)
    assert discover_num_tasks(grid, min_available_nodes=5, timeout=5.0) == 5
    strategy = MOCHA(discover_num_tasks(grid, 5, timeout=5.0), lam=0.1)
    strategy.start(grid=grid, num_rounds=1, timeout=10.0)
    assert strategy.results()["final"]["complete"] is True


def test_a_node_cannot_make_the_federation_larger_than_the_nodes_online():
    problem = make_problem(num_tasks=3)
    app = make_mocha_client_app(problem.load)

    def client(message: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 3:  # claims a huge task id
            return Message(RecordDict({"info": ConfigRecord(
                {"task-id": 999_999, "n-train": 10, "dim": problem.dim})}), reply_to=message)
        return app(message, context)

    grid = InProcessGrid(client, 4)
    assert discover_num_tasks(grid, 4, timeout=5.0) == 4


def test_no_task_id_at_all_is_a_discovery_error_with_the_reasons():
    def client(message: Message, context: Context) -> Message:
        raise KeyError("task-id")

    with pytest.raises(DiscoveryError, match=r"KeyError: 'task-id'"):
        discover_num_tasks(InProcessGrid(client, 2), 2, timeout=5.0)

