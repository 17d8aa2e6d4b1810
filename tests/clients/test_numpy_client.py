"""NumPyClient devices (``ClientApp(client_fn=...)``) against the Message-API strategies:
federations equal to the native ones, the legacy layout on the wire, mixed federations."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.client import ClientApp

from fmtl_flower import MOCHA, FedEM, FedEMNumPyClient, LegacyGrid, MOCHANumPyClient
from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.mocha import STATE_ARRAYS, default_task_id, make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.legacy import to_legacy, wrap_grid

from ..strategies.helpers import make_problem

TIMING = {"wall_time_s", "e_step_s", "train_s", "server_time_s", "round_time_s"}


@pytest.fixture(autouse=True)
def quiet_flower() -> Iterator[None]:
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def comparable(results: dict[str, Any]) -> dict[str, Any]:
    """Results without the measured times (they differ between any two runs)."""
    def strip(record: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if k not in TIMING and not k.endswith("_s")}
    return {"rounds": [strip(r) for r in results["rounds"]], "final": strip(results["final"])}


class Recorder:
    """Wraps a ClientApp and records the message types it received."""

    def __init__(self, app: Any) -> None:
        self.app, self.types = app, []

    def __call__(self, message: Message, context: Context) -> Message:
        self.types.append(message.metadata.message_type)
        return self.app(message, context)


def mocha_federation(app: Any, client_api: str | None, num_tasks: int = 5,
                     discovery_timeout: float = 30.0) -> tuple[MOCHA, InProcessGrid, Any]:
    grid = InProcessGrid(app, num_tasks)
    wrapped = grid if client_api is None else LegacyGrid(grid, client_api)
    strategy = MOCHA(num_tasks=num_tasks, lam=0.1, omega_every=2, seed=1, eval_every=1,
                     discovery_timeout=discovery_timeout)
    strategy.start(grid=wrapped, num_rounds=5, timeout=30.0)
    return strategy, grid, wrapped


@pytest.mark.parametrize("client_api", ["numpyclient", "auto"])
def test_mocha_numpyclient_federation_equals_the_native_one(client_api):
    problem = make_problem(num_tasks=5)

    def client_fn(context: Context):
        t = default_task_id(context)
        return MOCHANumPyClient(context, problem.Xs[t], problem.ys[t], problem.Xt[t],
                                problem.yt[t]).to_client()

    native, native_grid, _ = mocha_federation(make_mocha_client_app(problem.load), None)
    legacy_app = Recorder(ClientApp(client_fn=client_fn))
    legacy, legacy_grid, wrapped = mocha_federation(legacy_app, client_api)

    assert comparable(legacy.results()) == comparable(native.results())
    assert legacy.results()["final"]["complete"] and legacy.results()["final"]["gap"] >= 0
    # the devices were reached through the legacy layout, not the native one
    assert "get_properties" in legacy_app.types and "train" in legacy_app.types
    if client_api == "auto":
        assert wrapped.legacy_nodes == set(legacy_grid.contexts)
    # the dual state sits in context.state under the native client's records, bit for bit
    for node in native_grid.contexts:
        ours = legacy_grid.contexts[node].state[STATE_ARRAYS]["duals"].numpy()
        theirs = native_grid.contexts[node].state[STATE_ARRAYS]["duals"].numpy()
        np.testing.assert_array_equal(ours, theirs)


def fedem_data(num_tasks: int = 6, dim: int = 4, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(2, dim)) * 3
    data = []
    for t in range(num_tasks):
        parts = []
        for n in (40 + 10 * t, 60):
            X = rng.uniform(-1, 1, size=(n, dim))
            z = rng.random(n) < (t + 1) / (num_tasks + 1)
            parts += [X, np.where(z, X @ theta[0] > 0, X @ theta[1] > 0).astype(float)]
        data.append(tuple(parts))
    return data


@pytest.mark.parametrize("method", ["fedem", "fedavg"])
def test_fedem_numpyclient_federation_equals_the_native_one(method):
    data = fedem_data()

    def client_fn(context: Context):
        return FedEMNumPyClient(context, *data[default_task_id(context)]).to_client()

    def run(app: Any, client_api: str) -> dict[str, Any]:
        grid = InProcessGrid(app, len(data))
        strategy = FedEM(len(data), method=method, num_components=2, lr=0.5, batch_size=16,
                         fraction=0.5, seed=3, unseen_tasks=[5], discovery_timeout=5.0)
        strategy.start(grid=wrap_grid(grid, client_api), num_rounds=4, timeout=30.0)
        return strategy.results()

    native = run(make_fedem_client_app(lambda ctx: data[default_task_id(ctx)]), "message")
    legacy_app = Recorder(ClientApp(client_fn=client_fn))
    legacy = run(legacy_app, "numpyclient")
    assert comparable(legacy) == comparable(native)
    assert native["final"]["accuracy_mean"] is not None
    assert {"get_properties", "train", "evaluate"} <= set(legacy_app.types)


def test_mixed_federation_auto_serves_both_kinds():
    problem = make_problem(num_tasks=4)
    native_app = make_mocha_client_app(problem.load)

    def client_fn(context: Context):
        t = default_task_id(context)
        return MOCHANumPyClient(context, problem.Xs[t], problem.ys[t], problem.Xt[t],
                                problem.yt[t]).to_client()

    legacy_app = ClientApp(client_fn=client_fn)

    def mixed(message: Message, context: Context) -> Message:  # even tasks NumPyClients
        app = legacy_app if default_task_id(context) % 2 == 0 else native_app
        return app(message, context)

    native, _, _ = mocha_federation(native_app, None, num_tasks=4)
    both, grid, wrapped = mocha_federation(mixed, "auto", num_tasks=4)
    assert comparable(both.results()) == comparable(native.results())
    assert wrapped.legacy_nodes == {n for n, c in grid.contexts.items()
                                    if c.node_config["partition-id"] % 2 == 0}
    assert wrapped.native_nodes == set(grid.contexts) - wrapped.legacy_nodes


def test_a_numpyclient_federation_just_works_with_the_plain_grid():
    """Issue 27, item 5: ``start(grid)`` without LegacyGrid failed discovery with "Invalid
    message type: query.whoami"; the strategy now finds the NumPyClient devices itself."""
    problem = make_problem(num_tasks=3)

    def client_fn(context: Context):
        t = default_task_id(context)
        return MOCHANumPyClient(context, problem.Xs[t], problem.ys[t], problem.Xt[t],
                                problem.yt[t]).to_client()

    native, _, _ = mocha_federation(make_mocha_client_app(problem.load), None, num_tasks=3)
    legacy_app = Recorder(ClientApp(client_fn=client_fn))
    legacy, _, _ = mocha_federation(legacy_app, None, num_tasks=3, discovery_timeout=5.0)
    assert comparable(legacy.results()) == comparable(native.results())
    assert {"get_properties", "train"} <= set(legacy_app.types)


def test_native_devices_do_not_understand_the_legacy_layout():
    """With the wrong translation nothing trains: the option matters."""
    problem = make_problem(num_tasks=3)
    with pytest.raises(RuntimeError, match="task"):
        mocha_federation(make_mocha_client_app(problem.load), "numpyclient", num_tasks=3,
                         discovery_timeout=0.5)


def test_auto_keeps_a_native_devices_own_failure_and_survives_undecodable_replies():
    """A native device whose whoami fails for its own reason is not asked in the legacy
    layout (its reason would be lost for "Invalid message type: get_properties"); a reply
    in the legacy layout that cannot be decoded is an error reply, not an exception."""
    from flwr.app import ConfigRecord, RecordDict

    from fmtl_flower.strategies.discovery import DiscoveryError

    problem = make_problem(num_tasks=3)
    app = make_mocha_client_app(problem.load)

    def client(message: Message, context: Context) -> Message:
        if default_task_id(context) == 0:
            raise ValueError("this device's own reason")
        if default_task_id(context) == 1:  # a garbled legacy-layout reply
            return Message(RecordDict({"getpropertiesres.properties": ConfigRecord({}),
                                       "fitres.metrics": ConfigRecord({}),
                                       "fitres.parameters": ConfigRecord({"a": 1})}),
                           reply_to=message)
        return app(message, context)

    with pytest.raises(DiscoveryError) as caught:
        mocha_federation(client, None, num_tasks=3, discovery_timeout=1.0)
    reasons = set(caught.value.reasons.values())
    assert "ValueError: this device's own reason" in reasons
    assert any(r.startswith("reply in the legacy layout not decodable") for r in reasons)


def test_get_parameters_returns_the_model_received_last():
    problem = make_problem(num_tasks=3)
    clients = {}

    def client_fn(context: Context):
        t = default_task_id(context)
        clients[t] = MOCHANumPyClient(context, problem.Xs[t], problem.ys[t])
        return clients[t].to_client()

    strategy, _, _ = mocha_federation(ClientApp(client_fn=client_fn), "numpyclient",
                                      num_tasks=3)
    W = strategy.state.W  # (d, m): the server's models after the last round
    for t, client in clients.items():
        (w,) = client.get_parameters({})
        np.testing.assert_array_equal(w, W[:, t])


def test_messages_without_a_legacy_form_are_refused_by_name():
    grid = InProcessGrid(lambda m, c: m, 1)
    from flwr.app import ConfigRecord, RecordDict

    message = grid.create_message(RecordDict({"config": ConfigRecord({"xs": [1, 2]})}),
                                  "train", 1001, "1")
    with pytest.raises(ValueError, match="'xs'"):
        to_legacy(message)
    message = grid.create_message(RecordDict({"config": ConfigRecord({})}),
                                  "train.newcomer", 1001, "1")
    with pytest.raises(ValueError, match="train.newcomer"):
        to_legacy(message)
    with pytest.raises(ValueError, match="client_api"):
        LegacyGrid(grid, "grpc")


@pytest.mark.parametrize("client_api", ["numpyclient", "auto"])
def test_replies_are_tied_to_the_strategys_messages(client_api):
    """Through LegacyGrid a reply names the message the strategy made (not its legacy copy)
    and carries its message type, also an error reply: strategies match replies so."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from fmtl_flower.wire import to_array

    problem = make_problem(num_tasks=3)

    def client_fn(context: Context):
        t = default_task_id(context)
        return MOCHANumPyClient(context, problem.Xs[t], problem.ys[t]).to_client()

    grid = InProcessGrid(ClientApp(client_fn=client_fn), 3)
    wrapped = LegacyGrid(grid, client_api)
    nodes = list(grid.get_node_ids())
    whoami = [grid.create_message(RecordDict({"config": ConfigRecord({})}), "query.whoami",
                                  n, "0") for n in nodes]
    replies = list(wrapped.send_and_receive(whoami, timeout=10.0))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == \
        sorted(m.metadata.message_id for m in whoami)
    assert all(m.metadata.message_id for m in whoami)
    assert {r.metadata.message_type for r in replies} == {"query.whoami"}
    assert all(not r.has_error() and "info" in r.content for r in replies)
    # a train message the device rejects (no w): an error reply, tied and typed
    bad = [grid.create_message(RecordDict({"config": ConfigRecord({"task-id": 0}),
                                           "arrays": ArrayRecord({"v": to_array(np.zeros(2))})}),
                               "train", nodes[0], "1")]
    (error,) = list(wrapped.send_and_receive(bad, timeout=10.0))
    assert error.has_error() and error.metadata.message_type == "train"
    assert error.metadata.reply_to_message_id == bad[0].metadata.message_id != ""


def test_the_app_counts_numpyclient_devices_when_num_tasks_is_unset(tmp_path):
    """The project's ServerApp with ``num-tasks`` unset and ``min-available-nodes`` set counts
    the tasks online before ``start`` wraps the grid: NumPyClient devices must answer that
    count too (they failed it with "Invalid message type: query.whoami")."""
    import json

    from fmtl_flower.apps.server_app import app as server_app
    from fmtl_flower.engine import run_inprocess

    problem = make_problem(num_tasks=3)

    def client_fn(context: Context):
        t = default_task_id(context)
        return MOCHANumPyClient(context, problem.Xs[t], problem.ys[t], problem.Xt[t],
                                problem.yt[t]).to_client()

    out = tmp_path / "r.json"
    run_inprocess(server_app, ClientApp(client_fn=client_fn), 3, run_config={
        "strategy": "mocha", "num-server-rounds": 2, "round-timeout": 5.0,
        "min-available-nodes": 3, "results-file": str(out)})
    final = json.loads(out.read_text())["final"]
    assert final["complete"] is True and final["gap"] is not None
