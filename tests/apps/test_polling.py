"""fmtl_flower.polling: a deployment's replies pulled every ``reply-poll-interval`` seconds
(Flower's HttpGrid loop pauses 3 s), on a fake grid with a fake clock, and its wiring into
``TaskStrategy.start`` and the ServerApp."""

import logging
import math

import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.grid import http_grid

from fmtl_flower.apps.client_app import app as client_app
from fmtl_flower.config import ConfigError, RunConfig
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.polling import PollingGrid, poll_replies


class Clock:
    """A fake clock: ``sleep`` advances ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class SlowNodes:
    """A fake deployment grid: message i's reply is ready ``arrival[i]`` seconds after the
    push (None: never); a pull hands each ready reply over once (as the SuperLink does)."""

    def __init__(self, clock: Clock, arrival: list[float | None]) -> None:
        self.clock, self.arrival = clock, arrival
        self.pulls = 0
        self.handed: list[str] = []

    def push_messages(self, messages):
        self.pushed_at = self.clock.now
        self.sent = {}
        for i, message in enumerate(messages):
            message.metadata.__dict__["_message_id"] = f"m{i}"
            self.sent[f"m{i}"] = message
        return list(self.sent)

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for mid in list(message_ids):
            due = self.arrival[int(mid[1:])]
            if mid in self.handed or due is None or self.clock.now - self.pushed_at < due:
                continue
            self.handed.append(mid)
            out.append(Message(RecordDict(), reply_to=self.sent[mid]))
        return out


def messages(count: int) -> list[Message]:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # as a ServerApp
    return [Message(RecordDict(), dst_node_id=10 + i, message_type="train") for i in range(count)]


def polling(arrival, interval, clock=None):
    clock = clock or Clock()
    fake = SlowNodes(clock, arrival)
    return PollingGrid(fake, interval, sleep=clock.sleep, clock=clock.time), fake, clock


def flower_loop(arrival, timeout, monkeypatch):
    """Flower's own ``HttpGrid.send_and_receive`` on the same fake grid and clock."""
    clock = Clock()
    fake = SlowNodes(clock, arrival)
    monkeypatch.setattr(http_grid.time, "time", clock.time)
    monkeypatch.setattr(http_grid.time, "sleep", clock.sleep)
    replies = http_grid.HttpGrid.send_and_receive(fake, messages(len(arrival)), timeout=timeout)
    return replies, fake, clock


def reply_ids(replies):
    return [r.metadata.reply_to_message_id for r in replies]


def test_replies_arriving_after_k_polls_end_the_round_within_one_interval():
    """Replies ready 0.1, 1.2 and 2.3 s after the push: pulls at 0, 0.5, ..., 2.5 s (6
    pulls), the round over at 2.5 s; Flower's loop would end it at 3 s."""
    grid, fake, clock = polling([0.1, 1.2, 2.3], 0.5)
    replies = grid.send_and_receive(messages(3), timeout=60.0)
    assert sorted(reply_ids(replies)) == ["m0", "m1", "m2"]
    assert fake.pulls == 6
    assert clock.sleeps == [0.5] * 5
    assert clock.now - fake.pushed_at == pytest.approx(2.5)


def test_the_timeout_is_honoured_and_the_late_reply_left_out():
    """A node that never answers: the others' replies, the round over at the first pull
    time >= the timeout (2.0 s with interval 0.5), no pull after it."""
    grid, fake, clock = polling([0.2, None, 0.7], 0.5)
    replies = grid.send_and_receive(messages(3), timeout=2.0)
    assert sorted(reply_ids(replies)) == ["m0", "m2"]
    assert clock.now - fake.pushed_at == pytest.approx(2.0)
    assert fake.pulls == 4  # at 0, 0.5, 1.0, 1.5 s


def test_no_reply_is_lost_or_duplicated():
    """Many replies at scattered times: each exactly once, and only missing ones asked for."""
    arrival = [(7 * i % 23) / 10 for i in range(40)]
    grid, fake, _ = polling(arrival, 0.3)
    replies = grid.send_and_receive(messages(40), timeout=60.0)
    assert sorted(reply_ids(replies)) == sorted(f"m{i}" for i in range(40))
    assert len(replies) == 40
    assert sorted(fake.handed) == sorted(reply_ids(replies))


@pytest.mark.parametrize("arrival,timeout", [
    ([0.1, 1.2, 2.3], 60.0), ([0.2, None, 0.7], 5.0), ([4.0, 8.5, 0.0], None),
    ([0.0, 0.0], 0.0), ([None, 1.0], 0.5)])
def test_the_same_replies_as_flowers_loop(monkeypatch, arrival, timeout):
    """Flower's HttpGrid loop (its 3 s pause) and PollingGrid at 3 s: the same replies in
    the same order, the same pulls and pauses; at 0.5 s the same set of replies whenever
    Flower's loop waits for them all (none missing at its timeout)."""
    flower, flower_fake, flower_clock = flower_loop(arrival, timeout, monkeypatch)
    grid, fake, clock = polling(arrival, 3.0)
    ours = grid.send_and_receive(messages(len(arrival)), timeout=timeout)
    assert reply_ids(ours) == reply_ids(flower)
    assert (fake.pulls, clock.sleeps) == (flower_fake.pulls, flower_clock.sleeps)
    fine, _, fine_clock = polling(arrival, 0.5)
    fine_replies = fine.send_and_receive(messages(len(arrival)), timeout=timeout)
    if len(flower) == sum(a is not None for a in arrival):
        assert sorted(reply_ids(fine_replies)) == sorted(reply_ids(flower))
        assert fine_clock.now <= flower_clock.now


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "soon", True])
def test_the_interval_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="interval"):
        PollingGrid(SlowNodes(Clock(), []), bad)
    with pytest.raises(ConfigError, match="reply-poll-interval"):
        RunConfig.from_mapping({"reply-poll-interval": bad})


def test_only_flowers_deployment_grids_are_wrapped():
    """``poll_replies`` wraps a grid named HttpGrid (Flower's deployment grid) and leaves the
    in-process grid, Flower's simulation grid (which pulls every 0.1 s) and a PollingGrid."""
    inprocess = InProcessGrid(client_app, 2)
    assert poll_replies(inprocess, 0.5) is inprocess
    memory = type("InMemoryGrid", (InProcessGrid,), {})(client_app, 2)
    assert poll_replies(memory, 0.5) is memory
    http = type("HttpGrid", (InProcessGrid,), {})(client_app, 2)
    wrapped = poll_replies(http, 0.25)
    assert isinstance(wrapped, PollingGrid) and wrapped.inner is http
    assert wrapped.interval == 0.25
    assert poll_replies(wrapped, 0.5) is wrapped
    assert list(wrapped.get_node_ids()) == list(http.get_node_ids())
    assert wrapped.run is http.run


class HttpGrid(InProcessGrid):
    """The in-process engine dressed as Flower's deployment grid: its own
    ``send_and_receive`` is Flower's 3 s loop (counted), push/pull are the engine's."""

    flower_loop_calls = 0
    pushes = 0

    def send_and_receive(self, messages, *, timeout=None):
        type(self).flower_loop_calls += 1
        return http_grid.HttpGrid.send_and_receive(self, messages, timeout=timeout)

    def push_messages(self, messages):
        type(self).pushes += 1
        return super().push_messages(messages)


@pytest.mark.parametrize("tasks_per_node", [1, 2])
def test_the_server_app_polls_a_deployment_at_the_run_configs_interval(
        monkeypatch, tasks_per_node):
    """On a deployment grid the ServerApp's rounds never go through Flower's 3 s loop
    (also with packed nodes) and reach the same model as on the in-process engine."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    monkeypatch.setattr(HttpGrid, "flower_loop_calls", 0)
    monkeypatch.setattr(HttpGrid, "pushes", 0)
    seen = []
    monkeypatch.setattr(PollingGrid, "__init__", _recording(PollingGrid.__init__, seen))
    run_config = {"strategy": "mocha", "num-tasks": 4, "dim": 4, "samples-per-task": 20,
                  "num-server-rounds": 2, "reply-poll-interval": 0.25,
                  "tasks-per-node": tasks_per_node}
    results = []
    from fmtl_flower.apps import common

    app = common.make_server_app(on_done=results.append)
    grid = HttpGrid(client_app, 4 // tasks_per_node, run_config=run_config)
    from flwr.app import Context

    app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(run_config)))
    assert HttpGrid.flower_loop_calls == 0
    assert HttpGrid.pushes > 0
    assert seen == [0.25]
    inprocess = []
    run_inprocess(common.make_server_app(on_done=inprocess.append), client_app,
                  4 // tasks_per_node, run_config=run_config)
    assert results[0]["final"]["primal"] == inprocess[0]["final"]["primal"]


def test_start_wraps_a_deployment_grid_given_by_a_python_user(monkeypatch):
    """``MOCHA(...).start(grid=<Flower's deployment grid>)``: replies pulled at the
    strategy's ``reply_poll_interval``, never through Flower's 3 s loop."""
    from flwr.app import Context
    from flwr.serverapp import ServerApp

    from fmtl_flower.strategies.mocha import MOCHA

    logging.getLogger("flwr").setLevel(logging.WARNING)
    monkeypatch.setattr(HttpGrid, "flower_loop_calls", 0)
    seen = []
    monkeypatch.setattr(PollingGrid, "__init__", _recording(PollingGrid.__init__, seen))
    run_config = {"num-tasks": 3, "dim": 4, "samples-per-task": 20}
    strategy = MOCHA(3, reply_poll_interval=0.1)
    app = ServerApp()

    @app.main()
    def main(grid, context):
        strategy.start(grid=grid, num_rounds=2, timeout=30.0)

    grid = HttpGrid(client_app, 3, run_config=run_config)
    app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=run_config))
    assert HttpGrid.flower_loop_calls == 0
    assert seen == [0.1]
    assert strategy.results()["final"]["complete"] is True


def _recording(init, seen):
    def wrapped(self, grid, interval, **kwargs):
        seen.append(interval)
        init(self, grid, interval, **kwargs)

    return wrapped

