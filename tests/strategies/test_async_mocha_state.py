"""Asynchronous MOCHA's per-message state (issue 30): each ``train`` message's
:class:`~fmtl_flower.strategies.async_mocha.SentRequest` (its Request, its Exchange) is the one
thing its reply is read and checked against.

* On the wall clock, a reply that answers no message in flight (a second copy of a reply, a
  reply to a message that expired) is a logged drop, counted ``unknown``: the run's records
  and W are those of the run without it.
* A reply is checked against the w its request was sent with, even after other tasks'
  replies moved the server's W (coupled tasks).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Message

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED, INVALID, AsyncMOCHAServer
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMOCHA
from fmtl_flower.systems.timing import node_times

from .helpers import PassThroughGrid, make_problem

WALL = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01}, concurrency=4, tau=6,
            seed=3, clock="wall")
STRAY = "answers no train message in flight"


class ReplayGrid(PassThroughGrid):
    """The in-process grid, whose pulls also return every reply of the previous pull that
    returned any (a second copy of each: a SuperLink delivering twice), and, with
    ``hold_node``, hold that node's replies back while the server awaits them and return
    each on the first pull after the server stopped asking for it (its message expired: a
    late reply)."""

    def __init__(self, grid: InProcessGrid, *, repeat: bool = True,
                 hold_node: int | None = None) -> None:
        super().__init__(grid)
        self.repeat, self.hold_node = repeat, hold_node
        self.previous: list[Message] = []
        self.held: dict[str, Message] = {}  # message id -> its reply, held back
        self.held_ids: set[str] = set()
        self.strays = 0  # replies returned that answer no message awaited

    def push_messages(self, messages):  # noqa: D102
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for message, mid in zip(messages, ids, strict=True):
            if message.metadata.dst_node_id == self.hold_node:
                self.held_ids.add(mid)
        return ids

    def pull_messages(self, message_ids):  # noqa: D102
        message_ids = list(message_ids)
        fresh = []
        for reply in self.inner.pull_messages(message_ids):
            mid = reply.metadata.reply_to_message_id
            if mid in self.held_ids:
                self.held[mid] = reply
            else:
                fresh.append(reply)
        late = [self.held.pop(mid) for mid in list(self.held) if mid not in message_ids]
        again = self.previous if self.repeat and fresh else []
        if fresh:
            self.previous = fresh
        out = fresh + again + late
        self.strays += len(again) + sum(r.metadata.reply_to_message_id not in message_ids
                                        for r in late)
        return out


def _wall_run(problem, grid=None, rounds=3, **knobs):
    inner = InProcessGrid(make_async_mocha_client_app(problem.load), problem.num_tasks)
    strategy = AsyncMOCHA(**{**WALL, **knobs})
    strategy.start(inner if grid is None else grid(inner), num_rounds=rounds)
    return strategy


def _without_time(records):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in records]


def test_second_copies_of_replies_are_logged_drops_and_change_nothing(caplog):
    """Every pull also returns the previous pull's replies again (their messages were read
    already): each copy is logged and counted ``unknown``; the records and W are exactly those
    of the run without copies."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    clean = _wall_run(problem)
    grids = []

    def replay(inner):
        grids.append(ReplayGrid(inner))
        return grids[0]

    with caplog.at_level(logging.WARNING):
        replayed = _wall_run(problem, replay)
    strays = grids[0].strays
    assert strays >= problem.num_tasks  # the test delivered copies
    logged = [r for r in caplog.records if STRAY in r.getMessage()]
    assert len(logged) == strays
    final, clean_final = replayed.results()["final"], clean.results()["final"]
    assert final["replies_unknown"] == clean_final["replies_unknown"] + strays
    assert _without_time(replayed.run.records) == _without_time(clean.run.records)
    assert np.array_equal(replayed.run.server.state.W, clean.run.server.state.W)
    assert final["replies_applied"] == 3 * problem.num_tasks


def test_replies_to_expired_messages_are_logged_drops(caplog):
    """Task 1's replies come only after their messages expired (each is re-sent meanwhile):
    every late reply is logged and counted ``unknown``, none is applied (task 1's b stays 0),
    and the others' run goes on."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    grids = []

    def holding(inner):
        grids.append(ReplayGrid(inner, repeat=False, hold_node=sorted(inner.get_node_ids())[1]))
        return grids[0]

    with caplog.at_level(logging.WARNING):
        strategy = _wall_run(problem, holding, rounds=2, pull_timeout_s=0.25)
    server, final = strategy.run.server, strategy.results()["final"]
    late = grids[0].strays
    assert late >= 1  # a late reply reached the server
    assert len([r for r in caplog.records if STRAY in r.getMessage()]) == late
    assert final["replies_unknown"] == late and final["replies_expired"] >= late
    assert final["replies_applied"] == 2 * problem.num_tasks
    assert not any(r["task"] == 1 and r["status"] == APPLIED for r in strategy.run.records)
    assert not server.state.B[:, 1].any() and server.confirm_id[1] == 0


def test_reply_is_checked_against_the_w_it_was_sent_with(monkeypatch, caplog):
    """Coupled tasks (the mean formulation), 4 in flight: task 2's device claims, on a request
    whose reply is applied after other replies moved W[:, 2], a loss just above the bound of
    the w it was sent with (1 + R |w_sent| for the hinge), and within the bound of the
    server's current W[:, 2]. It is rejected (invalid), and B is the run's where that reply
    never came."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    X, _ = problem.train()[2]
    R = float(np.sqrt(np.einsum("ij,ij->i", X, X).max()))
    knobs = dict(WALL, clock="virtual", latency_sigma=1.0, max_row_norm=R)
    seen = {}  # count -> (|w sent|, |W[:, 2]| when its reply is applied)
    receive = AsyncMOCHAServer.receive

    def spying(server, reply):
        request = server.in_flight.get(reply.task)
        if reply.task == 2 and request is not None and request.request_id == reply.request_id:
            seen[request.count] = (float(np.linalg.norm(request.w)),
                                   float(np.linalg.norm(server.state.W[:, 2])))
        return receive(server, reply)

    monkeypatch.setattr(AsyncMOCHAServer, "receive", spying)
    honest = AsyncMOCHA(**knobs)
    honest.start(InProcessGrid(make_async_mocha_client_app(problem.load), 6), num_rounds=4)
    moved = {count: (sent, now) for count, (sent, now) in seen.items() if now > sent * 1.2}
    assert moved, seen  # some replies of task 2 are applied after W[:, 2] moved
    count = min(moved)
    sent_norm, now_norm = moved[count]
    forged = 1.0 + R * (sent_norm + 0.5 * (now_norm - sent_norm))  # between the two bounds
    base = make_async_mocha_client_app(problem.load)

    def client(message, context):
        reply = base(message, context)
        if message.metadata.message_type == "train" \
                and message.content["config"]["task-id"] == 2 \
                and message.content["config"]["count"] == count:
            reply.content["metrics"]["loss-mean"] = forged
        return reply

    seen.clear()
    forging = AsyncMOCHA(**knobs)
    with caplog.at_level(logging.WARNING):
        forging.start(InProcessGrid(client, 6), num_rounds=4)
    assert seen[count] == pytest.approx(moved[count], rel=1e-12)  # the same moment
    assert forging.run.server.counts[INVALID] == 1
    assert (2, INVALID) in [(r["task"], r["status"]) for r in forging.run.records]
    assert any("task 2's reply rejected: loss-mean" in r.getMessage() for r in caplog.records)


def test_replies_after_their_virtual_expiry_are_logged_drops(caplog):
    """On the virtual clock, with log-normal delays and a timeout near the typical request
    time, some replies come after their request expired: each is logged and counted
    ``unknown``, and the run applies its replies as without them (W = B M)."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    n = np.array([len(y) for y in problem.ys])
    timeout = float(np.median(node_times(n, problem.dim, "mocha", "lte")))
    strategy = AsyncMOCHA(**{**WALL, "clock": "virtual", "latency_sigma": 1.0,
                             "request_timeout_s": timeout})
    with caplog.at_level(logging.WARNING):
        strategy.start(InProcessGrid(make_async_mocha_client_app(problem.load), 6),
                       num_rounds=4)
    final, server = strategy.results()["final"], strategy.run.server
    logged = [r for r in caplog.records if "answers no request in flight" in r.getMessage()]
    assert final["replies_unknown"] >= 1 and len(logged) == final["replies_unknown"]
    assert final["replies_applied"] == 4 * problem.num_tasks
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12
