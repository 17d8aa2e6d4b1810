"""AsyncMOCHA's robust mode against a device that pushes its task's dual image in one fixed
direction as hard as its bounds allow: the task is decoupled from the others (its updates
are outliers against the federation's, :class:`~fmtl_flower.core.decoupling.OutlierWatch`),
logged, and the honest tasks end as accurate as without it. (The old code had no decoupling
in the barrier-free methods: the hostile task pulled every coupled model, and these tests
fail there.)"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED, AsyncMOCHAServer, simulate_async_mocha
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.mocha import MOCHAServerState
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMOCHA
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem

KNOBS = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01}, concurrency=4,
             tau=5, latency_sigma=1.0, omega_every=0, seed=3)
HOSTILE = 2


class PushingDevice:
    """Task ``HOSTILE``'s device: every reply's ``delta-b`` is the largest its bounds allow,
    ``R min(budget, n) / n`` (R its true row norm), in the fixed direction ``direction``,
    stopping short of ``|b_t| <= R`` (the dual-image bound). It keeps track of what the
    server applied (``confirm-id``, ``confirm-gamma``) and claims the scalars that let every
    push through whole: the conjugate change the safeguard needs for g = 1, a ``dual-mean``
    equal to what it claimed so far and the largest ``loss-mean`` allowed, so that the
    certificate's checks pass until its claimed conjugate term reaches the box's top."""

    def __init__(self, problem, direction: np.ndarray) -> None:
        X = problem.train()[HOSTILE][0]
        self.R = float(np.sqrt(np.einsum("ij,ij->i", X, X).max()))
        self.n = X.shape[0]
        self.u = direction / np.linalg.norm(direction)
        self.b, self.conjugate = np.zeros(problem.dim), 0.0
        self.pending: tuple[int, np.ndarray, float] | None = None

    def tamper(self, message: Message, reply: Message) -> None:
        if message.metadata.message_type != "train" \
                or message.content["config"]["task-id"] != HOSTILE:
            return
        config = message.content["config"]
        if self.pending is not None and self.pending[0] == config["confirm-id"]:
            g = config["confirm-gamma"]
            self.b, self.conjugate = self.b + g * self.pending[1], self.conjugate + \
                g * self.pending[2]
        w = from_array(message.content["arrays"]["w"])
        limit = self.R * min(config["budget"], self.n) / self.n * (1 - 1e-9)
        room = self._room(limit)
        d_b = room * self.u
        delta = float(w @ d_b) + 0.5 * config["m-tt"] * float(d_b @ d_b) + 1e-12
        delta = min(max(delta, 0.0), 1.0 - self.conjugate)
        metrics = reply.content["metrics"]
        metrics["loss-mean"] = (1.0 + self.R * float(np.linalg.norm(w))) * (1 - 1e-9)
        metrics["dual-mean"] = self.conjugate
        metrics["delta-dual-mean"] = delta
        reply.content["arrays"]["delta-b"] = to_array(d_b)
        self.pending = (config["request-id"], d_b, delta)

    def _room(self, limit: float) -> float:
        """The largest step along u within ``limit`` keeping |b + s u| <= R (1 - 1e-9)."""
        bu = float(self.b @ self.u)
        disc = bu * bu - float(self.b @ self.b) + (self.R * (1 - 1e-9)) ** 2
        return float(np.clip(-bu + np.sqrt(max(disc, 0.0)), 0.0, limit))


def _run(problem, tamper=None, rounds=30, **knobs):
    app = make_async_mocha_client_app(problem.load)

    def client(message: Message, context: Context) -> Message:
        reply = app(message, context)
        if tamper is not None:
            tamper(message, reply)
        return reply

    strategy = AsyncMOCHA(**{**KNOBS, **knobs})
    strategy.start(InProcessGrid(client, problem.num_tasks), num_rounds=rounds)
    return strategy


def _honest_error(problem, W) -> float:
    """The honest tasks' mean test error (in [0, 1])."""
    errors = [float(np.mean(np.where(problem.Xt[t] @ W[:, t] >= 0, 1.0, -1.0) != problem.yt[t]))
              for t in range(problem.num_tasks) if t != HOSTILE]
    return float(np.mean(errors))


def _consensus(problem) -> np.ndarray:
    """The honest tasks' common direction: the mean of their least-squares models."""
    return np.mean([np.linalg.lstsq(X, y, rcond=None)[0]
                    for t, (X, y) in enumerate(problem.train()) if t != HOSTILE], axis=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hostile_device_pushing_its_bounds_is_decoupled_and_honest_tasks_unharmed(
        seed, caplog):
    """Coupled tasks (the mean formulation), 4 of 6 in flight, log-normal delays. Task 2's
    device pushes against the honest tasks' common direction from its first reply: robust
    mode decouples it at the first check (m applied replies), logs it, and the honest tasks'
    mean test error ends within 2 points of the run where its device is honest (which
    decouples nothing)."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=200, seed=seed)
    honest = _run(problem)
    device = PushingDevice(problem, -_consensus(problem))
    with caplog.at_level(logging.WARNING):
        hostile = _run(problem, device.tamper)
    server = hostile.run.server
    assert np.flatnonzero(server.decoupled).tolist() == [HOSTILE]
    assert server.decoupled_log == [(problem.num_tasks, [HOSTILE])]
    assert hostile.results()["final"]["tasks_decoupled"] == [HOSTILE]
    assert server.counts[APPLIED] == 30 * problem.num_tasks
    assert any("decoupled" in r.getMessage() and f"[{HOSTILE}]" in r.getMessage()
               for r in caplog.records)
    assert not honest.run.server.decoupled.any()
    assert honest.results()["final"]["tasks_decoupled"] == []
    error, clean = _honest_error(problem, server.state.W), _honest_error(
        problem, honest.run.server.state.W)
    assert abs(error - clean) <= 0.02
    M = server.state.M
    assert np.all(M[HOSTILE, np.arange(6) != HOSTILE] == 0)  # it moves no other model
    assert np.abs(server.state.W - server.state.B @ M).max() <= 1e-12
    assert hostile.results()["final"]["gap"] >= 0


# ------------------------------------------------------------------------- the core's rules
def _core_pusher(tasks, direction):
    """A ``deliver`` for :func:`simulate_async_mocha`: task ``HOSTILE``'s replies carry the
    largest delta-b its bounds allow along ``direction`` (within |b_t| <= R), a zero
    conjugate change and the largest loss allowed (the certificate's checks pass)."""
    X = tasks[HOSTILE][0]
    R, n = float(np.sqrt(np.einsum("ij,ij->i", X, X).max())), X.shape[0]
    u = direction / np.linalg.norm(direction)
    seen = {"b": np.zeros(X.shape[1]), "pending": None}

    def deliver(request, reply):
        if request.task != HOSTILE:
            return [reply]
        pending = seen["pending"]
        if pending is not None and pending[0] == request.confirm_id:
            seen["b"] = seen["b"] + request.confirm_gamma * pending[1]
        b = seen["b"]
        bu = float(b @ u)
        room = -bu + np.sqrt(max(bu * bu - float(b @ b) + (R * (1 - 1e-9)) ** 2, 0.0))
        d_b = float(np.clip(room, 0.0, R * min(request.budget, n) / n * (1 - 1e-9))) * u
        seen["pending"] = (request.request_id, d_b)
        loss = (1.0 + R * float(np.linalg.norm(request.w))) * (1 - 1e-9)
        return [dataclasses.replace(reply, d_b=d_b, delta_dual=0.0, loss_mean=loss,
                                    dual_mean=0.0)]
    return deliver


def test_without_the_safeguard_decoupling_waits_for_the_drain():
    """With the safeguard off, a request in flight was computed for the old M and nothing
    would scale it at the new one: the outlier found at a check (every m applied replies,
    requests in flight) is decoupled once the next Omega-step's drain (every 2 m applied
    replies, then the <= 5 other requests in flight come back) has emptied the flight."""
    tasks = [(X, y) for X, y in make_problem(num_tasks=6, dim=5, samples_per_task=60).train()]
    direction = -np.mean([np.linalg.lstsq(X, y, rcond=None)[0] for X, y in tasks], axis=0)
    seen = []

    def on_event(run, record):
        seen.append((record["applied"], bool(run.server.decoupling_due),
                     bool(run.server.decoupled.any())))

    run = simulate_async_mocha(tasks, np.linspace(1.0, 2.0, 6), lam=0.05,
                               omega="probabilistic", omega_every=2, replies=6 * 6,
                               concurrency=6, tau=6, latency_sigma=1.0, seed=1,
                               safeguard=False, deliver=_core_pusher(tasks, direction),
                               on_event=on_event)
    server = run.server
    assert np.flatnonzero(server.decoupled).tolist() == [HOSTILE]
    found = min(a for a, due, _ in seen if due)
    assert found % 6 == 0  # at a check, with requests in flight
    [(applied, tasks)] = server.decoupled_log
    drain = -(-found // 12) * 12  # the first Omega-step's drain starts here
    assert tasks == [HOSTILE] and found <= drain < applied <= drain + 5
    assert not any(dec for a, _, dec in seen if a < applied)
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12


def test_decoupling_survives_a_checkpoint():
    """The decoupled tasks, the watch's streaks and the lower-bound flags are in the
    server's checkpoint arrays; a server restored from them decouples as the first did."""
    tasks = [(X, y) for X, y in make_problem(num_tasks=6, dim=5, samples_per_task=60).train()]
    direction = -np.mean([np.linalg.lstsq(X, y, rcond=None)[0] for X, y in tasks], axis=0)
    run = simulate_async_mocha(tasks, np.ones(6), lam=0.05, omega="mean",
                               formulation_options={"lam2": 0.01}, replies=6 * 3,
                               deliver=_core_pusher(tasks, direction), seed=2)
    server = run.server
    arrays, meta = server.state_arrays()
    fresh = AsyncMOCHAServer(MOCHAServerState.zeros(5, make_formulation("mean", 6, lam=0.05,
                                                                        lam2=0.01)),
                             server.budgets, concurrency=6, bounds=server.bounds)
    fresh.restore(arrays, meta)
    assert np.flatnonzero(fresh.decoupled).tolist() == [HOSTILE]
    assert np.array_equal(fresh.state.M, server.state.M)
    for name in ("streak", "image", "astray", "deviation"):
        assert np.array_equal(getattr(fresh.watch, name), getattr(server.watch, name))
