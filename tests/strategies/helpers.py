"""Small MOCHA federations run in-process, fault injection, and state checks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.centralized import MOCHAFit, fit_mocha
from fmtl_flower.clients.mocha import (
    STATE_ARRAYS,
    STATE_META,
    default_task_id,
    make_mocha_client_app,
)
from fmtl_flower.data import make_synthetic_tasks
from fmtl_flower.engine import GridWrapper, InProcessGrid, run_inprocess
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.ofmtl import OFMTL
from fmtl_flower.wire import from_array, to_array

ClientCallable = Callable[[Message, Context], Message]


@dataclass(frozen=True)
class Problem:
    """Per-task train and test arrays, indexed by task id."""

    Xs: list[np.ndarray]
    ys: list[np.ndarray]
    Xt: list[np.ndarray]
    yt: list[np.ndarray]

    @property
    def num_tasks(self) -> int:
        return len(self.Xs)

    @property
    def dim(self) -> int:
        return self.Xs[0].shape[1]

    def train(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return list(zip(self.Xs, self.ys, strict=True))

    def test(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return list(zip(self.Xt, self.yt, strict=True))

    def load(self, context: Context) -> tuple[np.ndarray, ...]:
        """The ClientApp's ``load_data``: the data of the node's task id."""
        t = default_task_id(context)
        return self.Xs[t], self.ys[t], self.Xt[t], self.yt[t]


class PassThroughGrid(GridWrapper):
    """A grid in front of ``inner`` that forwards every call to it: a test's grid overrides
    only what it changes (when replies come back, which ones, how many times)."""

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def send_and_receive(self, messages: Iterable[Message], *,  # noqa: D102
                         timeout: float | None = None) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.inner.pull_messages(message_ids)


def make_problem(num_tasks: int = 6, dim: int = 5, samples_per_task: int = 30,
                 seed: int = 0) -> Problem:
    """Clustered synthetic tasks; the last quarter of each task's samples is its test set."""
    Xs, ys = make_synthetic_tasks(num_tasks=num_tasks, dim=dim,
                                  samples_per_task=samples_per_task, seed=seed)
    cut = [len(y) - len(y) // 4 for y in ys]
    return Problem([X[:c] for X, c in zip(Xs, cut, strict=True)],
                   [y[:c] for y, c in zip(ys, cut, strict=True)],
                   [X[c:] for X, c in zip(Xs, cut, strict=True)],
                   [y[c:] for y, c in zip(ys, cut, strict=True)])


class TracingMOCHA(MOCHA):
    """MOCHA that keeps B and last-accepted rounds before and after every train round.

    ``before_round(server_round, grid)``, when given, runs at the start of every train round
    (before discovery): tests use it to change the grid's nodes mid-run.
    """

    def __init__(self, *args: Any,
                 before_round: Callable[[int, InProcessGrid], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace: dict[int, dict[str, np.ndarray]] = {}
        self.before_round = before_round

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: Any,
                        grid: Grid) -> Iterable[Message]:
        if self.before_round is not None:
            inner = getattr(grid, "inner", grid)  # start() serves it through LegacyGrid
            assert isinstance(inner, InProcessGrid)
            self.before_round(server_round, inner)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        assert self.state is not None
        before_B, before_last = self.state.B.copy(), self.last_accepted.copy()
        out = super().aggregate_train(server_round, replies)
        self.trace[server_round] = {
            "B_before": before_B, "B_after": self.state.B.copy(),
            "last_before": before_last, "last_after": self.last_accepted.copy(),
        }
        return out


@dataclass
class Run:
    """A finished federation: the strategy, the grid (nodes' contexts) and the ClientApp."""

    strategy: TracingMOCHA
    grid: InProcessGrid
    problem: Problem
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final(self) -> dict[str, Any]:
        return self.strategy.results()["final"]


def run_federation(problem: Problem, num_rounds: int, *,
                   wrap: Callable[[ClientCallable], ClientCallable] | None = None,
                   timeout: float = 60.0, num_nodes: int | None = None,
                   node_configs: list[Mapping[str, Any]] | None = None,
                   num_tasks: int | None = None, discovery_timeout: float = 5.0,
                   **strategy_kwargs: Any) -> Run:
    """Run a fresh MOCHA ClientApp (wrapped by ``wrap``) and a ServerApp in-process."""
    app = make_mocha_client_app(problem.load)  # fresh: the app caches data per node
    client = wrap(app) if wrap is not None else app
    min_tasks = strategy_kwargs.pop("min_tasks", None)
    strategy = TracingMOCHA(num_tasks or problem.num_tasks,
                            discovery_timeout=discovery_timeout, **strategy_kwargs)
    if min_tasks is not None:
        strategy.min_tasks = min_tasks
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=num_rounds, timeout=timeout)

    grid = run_inprocess(server_app, client, num_nodes or problem.num_tasks,
                         node_configs=node_configs)
    return Run(strategy, grid, problem, strategy.results()["rounds"])


def run_centralized(problem: Problem, num_rounds: int, **kwargs: Any) -> MOCHAFit:
    return fit_mocha(problem.train(), rounds=num_rounds, record_every=1, test=problem.test(),
                     **kwargs)


# ------------------------------------------------------------------------------ device state
def node_of(run: Run, task: int) -> int:
    return run.strategy.task_to_node[task]


def device_alpha(run: Run, task: int) -> np.ndarray:
    """The alpha the device of ``task`` has committed, as the server sees it.

    Row 0 of the stored duals, plus row 1 if the pending round is the one the server accepted.
    """
    context = run.grid.contexts[node_of(run, task)]
    duals = from_array(context.state[STATE_ARRAYS]["duals"])
    meta = context.state[STATE_META]
    alpha = np.array(duals[0])
    if int(meta["pending-round"]) == int(run.strategy.last_accepted[task]):
        alpha = alpha + duals[1]
    return alpha


def assert_b_consistent(run: Run, atol: float = 1e-12) -> None:
    """Server B[:, t] == X_t^T alpha_t / n_t for every task, and W == B Sigma / lambda."""
    state = run.strategy.state
    assert state is not None
    for t in range(run.problem.num_tasks):
        X = run.problem.Xs[t]
        expected = X.T @ device_alpha(run, t) / X.shape[0]
        np.testing.assert_allclose(state.B[:, t], expected, rtol=0, atol=atol,
                                   err_msg=f"task {t}: B and the device's alpha drifted apart")
    np.testing.assert_allclose(state.W, state.B @ state.M, rtol=1e-12,
                               atol=1e-12)


# ------------------------------------------------------------------------------ faults
def is_train(msg: Message) -> bool:
    return msg.metadata.message_type == MessageType.TRAIN


def msg_round(msg: Message) -> int:
    return int(msg.content["config"]["server-round"])


def with_metrics(reply: Message, msg: Message, arrays: ArrayRecord | None = None,
                 **changes: Any) -> Message:
    """A copy of ``reply`` with metric values changed (None: removed) and other arrays."""
    values = dict(reply.content["metrics"])
    for key, value in changes.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    records: dict[str, Any] = {"metrics": MetricRecord(values)}
    arrays = reply.content["arrays"] if arrays is None else arrays
    records["arrays"] = arrays
    return Message(RecordDict(records), reply_to=msg)


def with_delta(reply: Message, msg: Message, delta: np.ndarray) -> Message:
    return with_metrics(reply, msg, ArrayRecord({"delta-b": to_array(delta)}))


def corrupt(kind: str, app: ClientCallable, msg: Message, context: Context,
            memory: dict[str, Message]) -> Message:
    """Run the real ClientApp, then break its reply in one way (``kind``)."""
    if kind == "raise-before":
        raise RuntimeError("injected crash")
    reply = app(msg, context)  # the device has written its state for this round
    delta = from_array(reply.content["arrays"]["delta-b"])
    d = delta.shape[0]
    if kind == "raise-after":
        raise RuntimeError("injected crash")
    if kind == "nan":
        bad = delta.copy()
        bad[1] = np.nan
        return with_delta(reply, msg, bad)
    if kind == "inf":
        return with_delta(reply, msg, np.full(d, np.inf))
    if kind == "wrong-shape":
        return with_delta(reply, msg, np.zeros(d + 1))
    if kind == "oversized":  # 32 MB where d floats are due
        return with_delta(reply, msg, np.zeros(4_000_000))
    if kind == "wrong-shape-2d":
        return with_delta(reply, msg, delta.reshape(d, 1))
    if kind == "wrong-dtype":
        return with_delta(reply, msg, delta.astype(np.float32))
    if kind == "missing-delta":
        return with_metrics(reply, msg, ArrayRecord({"db": to_array(delta)}))
    if kind == "missing-arrays":
        return Message(RecordDict({"metrics": reply.content["metrics"]}), reply_to=msg)
    if kind == "missing-metrics":
        return Message(RecordDict({"arrays": reply.content["arrays"]}), reply_to=msg)
    if kind == "missing-loss":
        return with_metrics(reply, msg, **{"loss-mean": None})
    if kind == "missing-state-ok":
        return with_metrics(reply, msg, **{"state-ok": None})
    if kind == "inf-loss":
        return with_metrics(reply, msg, **{"loss-mean": float("inf")})
    if kind == "bad-dual":
        return with_metrics(reply, msg, **{"dual-mean": 1.5})
    if kind == "wrong-n":
        return with_metrics(reply, msg, **{"n-train": int(reply.content["metrics"]["n-train"])
                                           + 1})
    if kind == "wrong-round":
        return with_metrics(reply, msg, round=msg_round(msg) - 1)
    if kind == "wrong-task":
        return with_metrics(reply, msg, **{"task-id": int(reply.content["metrics"]["task-id"])
                                           + 1})
    if kind == "replayed":  # the previous round's reply, delivered again
        old = memory["previous"]
        return Message(RecordDict({"arrays": old.content["arrays"],
                                   "metrics": old.content["metrics"]}), reply_to=msg)
    if kind == "error-reply":
        return Message(Error(code=0, reason="injected error reply"), reply_to=msg)
    raise ValueError(kind)


def fault_at(kind: str, node: int, rounds: set[int]) -> Callable[[ClientCallable], ClientCallable]:
    """Break the train replies of ``node`` in the given rounds (others pass through)."""

    def wrap(app: ClientCallable) -> ClientCallable:
        memory: dict[str, Message] = {}

        def client(msg: Message, context: Context) -> Message:
            if context.node_id == node and is_train(msg) and msg_round(msg) in rounds:
                return corrupt(kind, app, msg, context, memory)
            reply = app(msg, context)
            if context.node_id == node and is_train(msg):
                memory["previous"] = reply
            return reply

        return client

    return wrap


def late_at(node: int, rounds: set[int], delay: float) -> Callable[[ClientCallable],
                                                                   ClientCallable]:
    """The node's train call takes ``delay`` seconds longer in the given rounds."""

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if context.node_id == node and is_train(msg) and msg_round(msg) in rounds:
                time.sleep(delay)
            return reply

        return client

    return wrap


# ------------------------------------------------------------------------------ server kills
class ServerKilled(Exception):
    """Stands for the server process dying."""


def killed_in(strategy_cls: type, kill_round: int) -> type:
    """A subclass of ``strategy_cls`` whose process 'dies' once the train replies of
    ``kill_round`` have arrived, before it aggregates them (the devices have already written
    their state for that round)."""

    class Killed(strategy_cls):  # type: ignore[misc, valid-type]
        def aggregate_train(self, server_round: int, replies: Iterable[Message]):
            if server_round == kill_round:
                raise ServerKilled(server_round)
            return super().aggregate_train(server_round, replies)

    Killed.__name__ = f"Killed{strategy_cls.__name__}"
    return Killed


class Killed(Exception):
    """Raised by :class:`KilledOFMTL` where the server process would die."""


class KilledOFMTL(OFMTL):
    """OFMTL that dies at newcomer ``task``'s protocol step ``step`` (before sending it)."""

    def __init__(self, *args: Any, task: int, step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kill_at = (task, step)

    def _newcomer_step(self, grid, task, node, step, omega, c):
        if (task, step) == self.kill_at:
            raise Killed
        return super()._newcomer_step(grid, task, node, step, omega, c)
