"""The server's trust boundary: defects of issue 15 (items 1, 3, 5b, 9), one test each.

Each test drives a small MOCHA federation on a :class:`~tests.strategies.hostile.HostileGrid`
and checks the run finishes with the state of the run where the hostile reply was lost.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import FIRST_NODE_ID, InProcessGrid
from fmtl_flower.strategies.base import NoValidReplies
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.wire import from_array, to_array

from .helpers import Problem, make_problem
from .hostile import HostileGrid, Tamper, untouched

RUN = {"omega": "probabilistic", "omega_every": 2, "lam": 1e-2, "seed": 1}
ROUNDS = 5
BAD_ROUND = 3
BAD_TASK = 1
BAD_NODE = FIRST_NODE_ID + BAD_TASK


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem(num_tasks=6, dim=5, samples_per_task=30, seed=0)


def run_mocha(problem: Problem, tamper: Tamper = untouched, *, rounds: int = ROUNDS,
              reverse: bool = False, num_nodes: int | None = None,
              node_configs: list[dict[str, Any]] | None = None, client: Any = None,
              before_round: Any = None, **kwargs: Any) -> MOCHA:
    app = client or make_mocha_client_app(problem.load)
    strategy = MOCHA(problem.num_tasks, discovery_timeout=5.0, **{**RUN, **kwargs})
    grid = HostileGrid(app, num_nodes or problem.num_tasks, node_configs=node_configs)
    grid.tamper, grid.reverse = tamper, reverse
    if before_round is not None:
        configure = strategy.configure_train

        def configure_train(server_round, arrays, config, grid_):  # noqa: ANN001
            before_round(server_round, grid)
            return configure(server_round, arrays, config, grid_)

        strategy.configure_train = configure_train  # type: ignore[method-assign]
    strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)
    return strategy


def is_bad(message: Message, node: int = BAD_NODE, server_round: int = BAD_ROUND) -> bool:
    return (message.metadata.dst_node_id == node
            and message.metadata.message_type == MessageType.TRAIN
            and int(message.content["config"]["server-round"]) == server_round)


def replace_with(make: Any) -> Tamper:
    """The bad train reply replaced by ``make(message, reply)``."""
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is not None and is_bad(message):
            return [make(message, reply)]
        return untouched(message, reply)
    return tamper


def lose(message: Message, reply: Message | None) -> list[Message]:
    return [] if reply is None or is_bad(message) else [reply]


@pytest.fixture(scope="module")
def lost_run(problem) -> MOCHA:
    return run_mocha(problem, lose)


def with_arrays(reply: Message, message: Message, arrays: Any) -> Message:
    return Message(RecordDict({"arrays": arrays, "metrics": reply.content["metrics"]}),
                   reply_to=message)


def raw_array(stype: str = "numpy.ndarray", dtype: str = "float64", shape: tuple = (5,),
              data: bytes = b"") -> Array:
    return Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)


DECODING = {  # issue 15: each escaped MOCHA's reply parser and killed the ServerApp
    "torch-raw-stype": lambda m, r: with_arrays(r, m, ArrayRecord(
        {"delta-b": raw_array("torch.raw", data=b"\0" * 40)})),
    "object-dtype": lambda m, r: with_arrays(r, m, ArrayRecord(
        {"delta-b": raw_array(dtype="object", data=b"\0" * 40)})),
    "truncated-bytes": lambda m, r: with_arrays(r, m, ArrayRecord(
        {"delta-b": Array(dtype="float64", shape=(5,), stype="numpy.ndarray",
                          data=to_array(np.zeros(5)).data[:-7])})),
    "arrays-as-metricrecord": lambda m, r: with_arrays(r, m, MetricRecord({"delta-b": 1.0})),
    "arrays-as-configrecord": lambda m, r: with_arrays(r, m, ConfigRecord({"delta-b": "x"})),
}


@pytest.mark.parametrize("kind", list(DECODING))
def test_undecodable_reply_is_rejected_not_fatal(problem, lost_run, caplog, kind):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = run_mocha(problem, replace_with(DECODING[kind]))
    assert any(f"round {BAD_ROUND}: reply of task {BAD_TASK} (node {BAD_NODE}) rejected" in
               r.getMessage() for r in caplog.records), caplog.text
    assert np.array_equal(strategy.state.W, lost_run.state.W)
    assert np.array_equal(strategy.state.B, lost_run.state.B)
    assert strategy.results()["final"]["complete"]


def test_second_reply_for_a_task_is_rejected_and_the_first_kept(problem, caplog):
    clean = run_mocha(problem)

    def forged_second(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or not is_bad(message):
            return untouched(message, reply)
        forged = with_arrays(reply, message, ArrayRecord({"delta-b": to_array(np.full(5, .01))}))
        return [reply, forged]

    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = run_mocha(problem, forged_second)
    assert f"second reply for task {BAD_TASK} (node {BAD_NODE}) rejected" in caplog.text
    assert np.array_equal(strategy.state.W, clean.state.W)
    assert np.array_equal(strategy.state.B, clean.state.B)


def test_wrong_message_type_is_rejected(problem, lost_run):
    def evaluate_typed(message: Message, reply: Message) -> Message:
        out = Message(reply.content, reply_to=message)
        out.metadata.__dict__["_message_type"] = MessageType.EVALUATE
        return out

    strategy = run_mocha(problem, replace_with(evaluate_typed))
    assert np.array_equal(strategy.state.W, lost_run.state.W)


def test_error_reply_names_the_task_and_its_real_node(problem, caplog):
    """A SuperNode that dies: the SuperLink answers for it (source: the SuperLink's id)."""
    def superlink_error(message: Message, reply: Message) -> Message:
        out = Message(Error(code=0, reason="SuperNode unreachable"), reply_to=message)
        out.metadata.__dict__["_src_node_id"] = 1
        return out

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_mocha(problem, replace_with(superlink_error))
    lines = [r.getMessage() for r in caplog.records if f"round {BAD_ROUND}" in r.getMessage()]
    assert any(f"task {BAD_TASK}: node {BAD_NODE} failed: SuperNode unreachable" in line
               for line in lines), lines
    assert not any("no reply from" in line for line in lines), lines
    assert not any("node 1 " in line for line in lines), lines


def test_metrics_are_summed_in_task_order_not_arrival_order():
    """Issue 15: two identical runs differed by 1 ulp. Here the second run's replies arrive
    in reverse task order (on the old code a record of this run differs)."""
    base = make_problem(num_tasks=24, dim=5, samples_per_task=60, seed=0)
    sizes = [3 + (7 * t) % 17 for t in range(24)]  # test sets of 3..15 samples
    problem = Problem(base.Xs, base.ys, [X[:k] for X, k in zip(base.Xt, sizes, strict=True)],
                      [y[:k] for y, k in zip(base.yt, sizes, strict=True)])
    forward = run_mocha(problem, rounds=4).results()["rounds"]
    backward = run_mocha(problem, rounds=4, reverse=True).results()["rounds"]
    keys = ("test_error", "test_error_pooled", "accuracy_mean_unweighted",
            "accuracy_bottom_decile", "primal", "dual", "gap")
    assert [[r[k] for k in keys] for r in forward] == [[r[k] for k in keys] for r in backward]


# ------------------------------------------------------------------------------ discovery
def rogue_client(problem: Problem, rogue: int, info: dict[str, Any]) -> Any:
    app = make_mocha_client_app(problem.load)

    def client(msg: Message, context: Context) -> Message:
        if context.node_id == rogue:
            if "whoami" not in msg.metadata.message_type:
                raise RuntimeError("the rogue node gets no work")
            return Message(RecordDict({"info": ConfigRecord(info)}), reply_to=msg)
        return app(msg, context)

    return client


@pytest.mark.parametrize("dim", [4, 2**40])
def test_one_node_cannot_fix_dim(problem, caplog, dim):
    """The rogue node answers whoami first (lowest node id) and claims task 0."""
    rogue = FIRST_NODE_ID
    configs = [{"task-id": 0}] + [{"task-id": t} for t in range(problem.num_tasks)]
    info = {"task-id": 0, "n-train": 30, "n-test": 0, "dim": dim}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = run_mocha(problem, num_nodes=problem.num_tasks + 1, node_configs=configs,
                             client=rogue_client(problem, rogue, info))
    reference = run_mocha(problem)
    assert strategy.directory.dim == problem.dim
    assert rogue not in strategy.node_to_task
    assert sorted(strategy.task_to_node) == list(range(problem.num_tasks))
    assert np.array_equal(strategy.state.W, reference.state.W)
    lines = [r.getMessage() for r in caplog.records if f"node {rogue}" in r.getMessage()]
    assert len(lines) == 1 and "excluded" in lines[0], lines


def test_min_replies_above_the_number_of_tasks_is_a_configuration_error():
    with pytest.raises(ValueError, match="min-replies"):
        MOCHA(4, min_replies=5)
    MOCHA(4, min_replies=4)


def test_resets_and_rejoins_are_logged_with_their_reason(problem, caplog):
    task = 3
    old, new = FIRST_NODE_ID + task, FIRST_NODE_ID + 10

    def before_round(server_round: int, grid: InProcessGrid) -> None:
        if server_round == 2:
            grid.offline.add(old)
        if server_round == 3:
            grid.contexts[new] = Context(run_id=1, node_id=new, node_config={"task-id": task},
                                         state=RecordDict(), run_config={})

    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy = run_mocha(problem, before_round=before_round)
    assert strategy.task_to_node[task] == new
    text = caplog.text
    assert f"task {task} rejoined on node {new} (its node {old} went offline)" in text
    assert f"round 3: task {task} reset (b_t = 0)" in text


# ------------------------------------------------------------------------------ bounds
def shifted_delta(value: float) -> Any:
    def make(message: Message, reply: Message) -> Message:
        delta = np.array(from_array(reply.content["arrays"]["delta-b"]))
        delta[0] += value
        return with_arrays(reply, message, ArrayRecord({"delta-b": to_array(delta)}))
    return make


@pytest.mark.parametrize("value", [1e150, 1.7e308, 1e200])
def test_delta_b_no_feasible_step_can_send_is_rejected(problem, lost_run, caplog, value):
    """Issue 15: 1e150 was accepted (gap 1e302), 1.7e308 overflowed W for good, 1e200 made
    the next Omega-step raise. Round 3 is followed by an Omega-step (omega_every 2: round 4)."""
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = run_mocha(problem, replace_with(shifted_delta(value)))
    assert "|delta-b|" in caplog.text and "above its bound" in caplog.text
    assert np.array_equal(strategy.state.W, lost_run.state.W)
    assert np.array_equal(strategy.state.B, lost_run.state.B)
    final = strategy.results()["final"]
    assert final["complete"] and 0 <= final["gap"] < 1


def test_whoami_reports_the_largest_row_norm(problem):
    strategy = run_mocha(problem, rounds=1)
    expected = [np.linalg.norm(X, axis=1).max() for X in problem.Xs]
    np.testing.assert_allclose(strategy.directory.row_norm, expected, rtol=1e-15)


def test_without_a_row_norm_the_run_config_bound_is_used(problem):
    """A device that reports no max-row-norm: its updates cannot be bounded and are rejected
    (with every device so, the run stops: no valid reply), unless the run configures
    max-row-norm (here the true bound: the same run as usual)."""
    app = make_mocha_client_app(problem.load)

    def client(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        if "whoami" in msg.metadata.message_type:
            info = dict(reply.content["info"])
            del info["max-row-norm"]
            return Message(RecordDict({"info": ConfigRecord(info)}), reply_to=msg)
        return reply

    with pytest.raises(NoValidReplies, match="no max-row-norm"):  # every reply rejected
        run_mocha(problem, client=client)
    largest = max(float(np.linalg.norm(X, axis=1).max()) for X in problem.Xs)
    configured = run_mocha(problem, client=client, max_row_norm=largest)
    assert np.array_equal(configured.state.W, run_mocha(problem).state.W)


def test_a_failing_vectorised_check_rejects_its_replies_not_the_run(problem, caplog,
                                                                     monkeypatch):
    """Issue 17: the one-task replies' bounds run once per round over all of them
    (``check_rows``); anything that check raises rejects that round's replies, inside the
    trust boundary, and the run goes on."""
    check = MOCHA._check_rows

    def failing(self, rows, with_delta):  # noqa: ANN001
        if self.records and len(self.records) == BAD_ROUND:
            raise FloatingPointError("boom")
        return check(self, rows, with_delta)

    monkeypatch.setattr(MOCHA, "_check_rows", failing)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = run_mocha(problem)
    assert "rejected: FloatingPointError: boom" in caplog.text
    rounds = strategy.results()["rounds"]
    assert rounds[BAD_ROUND]["num_replies"] == 0 and not rounds[BAD_ROUND]["counted"]
    assert all(r["num_replies"] == problem.num_tasks for r in rounds[1:] if r["round"]
               != BAD_ROUND)


def test_a_huge_error_reason_is_cut_before_it_is_kept_or_logged(problem, caplog):
    """A hostile node's error reply of 1 MB fills neither the log nor the round's reasons."""
    from fmtl_flower.strategies.discovery import MAX_REASON_CHARS

    def hostile_error(message: Message, reply: Message) -> Message:
        return Message(Error(code=0, reason="x" * 1_000_000), reply_to=message)

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_mocha(problem, replace_with(hostile_error))
    lines = [r.getMessage() for r in caplog.records]
    assert any("x" * 100 in line for line in lines)  # the reason is logged, cut
    assert max(map(len, lines)) < MAX_REASON_CHARS + 1000, max(map(len, lines))
