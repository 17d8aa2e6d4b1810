"""MOCHA's and Mb-SGD's reply bounds that need R_t (``loss-mean`` <= 1 + R_t |w_t|, |delta-b| or
|grad|, and a task without R_t) are one check for one-task replies and a stacked reply's rows
(:meth:`fmtl_flower.strategies.linear_tasks.LinearTasks._bound_rows`): a packed run and an
unpacked one reject the same replies for the same reasons, the final ``evaluate`` round's too;
so do their checks of ``test-n`` against the discovery limit ``max_n``.
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict

from fmtl_flower import MOCHA, MbSGD, make_mbsgd_client_app, make_mocha_client_app
from fmtl_flower.clients.packed_mbsgd import PackedMbSGD
from fmtl_flower.clients.packed_mocha import PackedMOCHA
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem

TASKS, DIM, ROUNDS = 5, 4, 3
UNBOUNDED = 1  # the task whose device reports no max-row-norm
HOSTILE = 2  # the task whose test-n is above the discovery limit (with hostile=True)
BIG = 2_000_000_000  # > the default max_n



@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=40, seed=5)


def run(problem, family: str, per_node: int, caplog, hostile: bool = False
        ) -> tuple[object, list[tuple[str, str]]]:
    """A run where task ``UNBOUNDED`` has no R_t (as if its device reported no
    max-row-norm at discovery), or with ``hostile`` task ``HOSTILE`` reports test-n ``BIG``,
    its tasks ``per_node`` to a node (1: unpacked); the rejections of that task's replies as
    (exchange, reason)."""
    task = HOSTILE if hostile else UNBOUNDED
    if family == "mocha":
        strategy = MOCHA(TASKS, lam=0.05, omega="mean", lam2=0.5, omega_every=0,
                         discovery_timeout=5.0)
        app = make_mocha_client_app(problem.load)
        handler = PackedMOCHA(app.mocha_client)
    else:
        strategy = MbSGD(TASKS, lam=0.05, discovery_timeout=5.0)
        app = make_mbsgd_client_app(problem.load)
        handler = PackedMbSGD(app.mbsgd_client)
    if hostile:
        handler = hostile_handler(handler)
    if per_node == 1:
        grid = InProcessGrid(hostile_app(app) if hostile else app, TASKS)
    else:
        packed = packed_client_app(
            app, lambda ctx: tasks_of_node(ctx.node_config, per_node, TASKS),
            {handler.protocol: handler}, {"query.whoami": handler.whoami})
        grid = PackedGrid(InProcessGrid(packed, math.ceil(TASKS / per_node)),
                          query_timeout=5.0)
    configure = strategy.configure_train

    def configure_train(server_round, arrays, config, grid_):  # noqa: ANN001
        messages = configure(server_round, arrays, config, grid_)  # discovery: round 1
        if not hostile:
            strategy.directory.row_norm[UNBOUNDED] = np.nan  # as if not reported
        return messages

    strategy.configure_train = configure_train  # type: ignore[method-assign]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, num_rounds=ROUNDS, timeout=30.0)
    rejected = re.compile(rf"(round \d+): reply of task {task} \(node \d+\) rejected: (.*)")
    found = [rejected.search(r.getMessage()) for r in caplog.records]
    return strategy, [m.groups() for m in found if m]


def hostile_app(app):  # noqa: ANN001, ANN201
    """``app`` whose task ``HOSTILE`` reports test-n ``BIG`` (when it reports test-n)."""
    def client(message: Message, context):  # noqa: ANN001, ANN202
        reply = app(message, context)
        content = reply.content
        if "metrics" in content and "test-n" in content["metrics"] \
                and int(content["metrics"]["task-id"]) == HOSTILE:
            metrics = dict(content["metrics"])
            metrics["test-n"] = BIG
            return Message(RecordDict({**dict(content.items()),
                                       "metrics": MetricRecord(metrics)}), reply_to=message)
        return reply
    return client


def hostile_handler(handler):  # noqa: ANN001, ANN201
    """The packed ``handler`` whose row of task ``HOSTILE`` reports test-n ``BIG``."""
    class Hostile(type(handler)):
        def __call__(self, message, context, slot_tasks):  # noqa: ANN001, ANN204
            content, slots, errors = super().__call__(message, context, slot_tasks)
            arrays = content["arrays"]
            if "test-n" in arrays:
                count = np.array(from_array(arrays["test-n"]))
                count[from_array(arrays["task-id"]) == HOSTILE] = BIG
                arrays["test-n"] = to_array(count)
            return content, slots, errors

    out = Hostile.__new__(Hostile)
    out.__dict__.update(handler.__dict__)
    return out


@pytest.mark.parametrize("family", ["mocha", "mbsgd"])
def test_a_task_without_row_norm_is_rejected_alike_packed_or_not(problem, caplog, family):
    """Every reply of a task without R_t is rejected, the final evaluate round's too (its
    loss-mean enters the final record and cannot be bounded), with the same reason whether
    its node is packed or not. Before, a packed node's final reply was rejected and a
    one-task node's accepted, and the two paths worded the reason differently."""
    unpacked, reasons = run(problem, family, 1, caplog)
    packed, packed_reasons = run(problem, family, 2, caplog)
    assert packed_reasons == reasons
    # every train round's reply and the final evaluate round's
    assert len(reasons) == ROUNDS + 1, reasons
    assert {r for _, r in reasons} == {
        "its device reported no max-row-norm at discovery and the run configures none "
        "(max-row-norm): its replies cannot be bounded"}
    for strategy in (unpacked, packed):
        final = strategy.records[-1]
        assert UNBOUNDED in final["tasks_missing"] and final["primal"] is None
    assert {k: v for k, v in unpacked.records[-1].items() if not k.endswith("_s")} \
        == {k: v for k, v in packed.records[-1].items() if not k.endswith("_s")}


@pytest.mark.parametrize("family", ["mocha", "mbsgd"])
def test_test_n_above_the_limit_is_rejected_alike_packed_or_not(problem, caplog, family):
    """A test-n above the discovery limit max_n is rejected on a packed node as on a
    one-task node, with the same reason. Before, a stacked reply's row was accepted (the
    final record's test error came out near 0)."""
    unpacked, reasons = run(problem, family, 1, caplog, hostile=True)
    packed, packed_reasons = run(problem, family, 2, caplog, hostile=True)
    assert packed_reasons == reasons
    assert reasons and reasons[-1] == (f"round {ROUNDS}",
                                       f"test-n {BIG} above the limit 1000000000")
    for strategy in (unpacked, packed):
        assert HOSTILE in strategy.records[-1]["tasks_missing"]


@pytest.mark.parametrize("n_train", [[10, 10, 10**6, 10**6], [50, 60, 10**9, 10**9]])
def test_budget_sizes_survive_a_fence_beyond_int64(n_train):
    # robust mode caps the n-train that budgets are computed from by a log-scale fence of the
    # federation's sizes; evenly split sizes (or two claims of 1e9 among four) put that fence
    # near 1e22, which once overflowed an int64 while the round's messages were built
    from fmtl_flower import MOCHA, MbSGD

    for strategy in (MOCHA(4), MbSGD(4)):
        strategy.directory.n_train[:] = n_train
        sizes = strategy._budget_sizes(np.arange(4))
        assert sizes.tolist() == n_train and sizes.dtype == strategy.directory.n_train.dtype
