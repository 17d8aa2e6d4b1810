"""AsyncMocha over Flower's Message API, in-process: the records equal the Flower-free core's
for the same seed and virtual clock, and hostile or lost replies are turned away at the trust
boundary without touching the state."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED, INVALID, simulate_async_mocha
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMocha
from fmtl_flower.systems.timing import node_times
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem

KNOBS = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01}, concurrency=4,
             tau=5, latency_sigma=1.0, omega_every=0, seed=3)


def _run(problem, rounds, client=None, **knobs):
    app = client or make_async_mocha_client_app(problem.load)
    grid = InProcessGrid(app, problem.num_tasks)
    strategy = AsyncMocha(**{**KNOBS, **knobs})
    strategy.start(grid, num_rounds=rounds)
    return strategy


def _core(problem, rounds, **knobs):
    k = {**KNOBS, **knobs}
    n = np.array([len(y) for y in problem.ys])
    seconds = node_times(n, problem.dim, "mocha", "lte")
    return simulate_async_mocha(
        problem.train(), seconds, lam=k["lam"], omega=k["omega"],
        formulation_options=k["formulation_options"], replies=rounds * problem.num_tasks,
        concurrency=k["concurrency"], tau=k["tau"], latency_sigma=k["latency_sigma"],
        omega_every=k["omega_every"], seed=k["seed"])


@pytest.mark.parametrize("knobs", [{}, {"omega": "probabilistic", "formulation_options": {},
                                        "omega_every": 2}])
def test_inprocess_flower_run_equals_the_core(knobs):
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    strategy = _run(problem, 6, **knobs)
    core = _core(problem, 6, **knobs)
    assert strategy.run.records == core.records
    assert np.array_equal(strategy.run.server.state.W, core.server.state.W)
    final = strategy.results()["final"]
    assert final["virtual_time_s"] == core.virtual_time_s > 0
    assert final["replies_applied"] == 36
    assert final["gap"] == core.records[-1]["gap"] and final["gap"] >= 0
    if not knobs:  # fixed Omega (an Omega-step changes the dual function itself)
        duals = np.array([r["dual"] for r in core.records])
        assert np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max())


def _tampering(app, tamper):
    def client(message: Message, context: Context) -> Message:
        reply = app(message, context)
        if message.metadata.message_type == "train":
            tamper(message, reply)
        return reply
    return client


def test_hostile_reply_is_rejected_and_the_run_goes_on():
    """Task 2's device sends an inflated delta-b on its 3rd request: the boundary rejects it
    (invalid, theta = 1), B is untouched by it, the device discards that step on its next
    request, and W = B M with B = the devices' committed duals at the end."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    base = make_async_mocha_client_app(problem.load)

    def tamper(message, reply):
        config = message.content["config"]
        if config["task-id"] == 2 and config["count"] == 3:
            d_b = from_array(reply.content["arrays"]["delta-b"])
            reply.content["arrays"]["delta-b"] = to_array(d_b * 1e6)

    strategy = _run(problem, 5, client=_tampering(base, tamper))
    server = strategy.run.server
    statuses = [(r["task"], r["status"]) for r in strategy.run.records]
    assert (2, INVALID) in statuses and server.counts[INVALID] == 1
    assert server.counts[APPLIED] == 30
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12
    assert np.all(np.isfinite(server.state.W))


@pytest.mark.parametrize("strategy", ["async-mocha", "async-cocoa"])
def test_fmtl_run_async(strategy, tmp_path):
    """`fmtl run async-mocha` / `async-cocoa`: --rounds N applies N x m replies; the results
    JSON's final keeps primal, dual, gap and adds virtual_time_s; records are time-stamped."""
    from fmtl_flower.cli import main

    out = tmp_path / "r.json"
    assert main(["run", strategy, "--rounds", "4", "--quiet", "--out", str(out), "--set",
                 "mocha.latency-sigma=1.0", "--set", "mocha.concurrency=10", "--set",
                 "mocha.omega=identity", "--set", "mocha.lambda=0.01"]) == 0
    import json

    results = json.loads(out.read_text())
    final, m = results["final"], 30
    assert final["replies_applied"] == 4 * m and final["round"] == 4
    assert final["virtual_time_s"] > 0 and final["gap"] >= 0
    assert final["primal"] - final["dual"] == pytest.approx(final["gap"])
    times = [r["time_s"] for r in results["rounds"]]
    assert times == sorted(times) and times[-1] == final["virtual_time_s"]
    assert results["config"]["mocha.concurrency"] == 10


def test_packed_nodes_are_refused_clearly(capsys):
    from fmtl_flower.cli import main

    assert main(["run", "async-mocha", "--rounds", "1", "--quiet", "--set",
                 "tasks-per-node=3"]) == 2
    assert "does not run on packed nodes yet" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{"loss": "logistic"}, {"fit_intercept": True}])
def test_async_methods_refuse_what_their_device_handlers_do_not_train(extra):
    from fmtl_flower.settings import ConfigError, MochaSettings

    with pytest.raises(ConfigError, match="async-mocha"):
        MochaSettings(method="async-mocha", **extra)
    MochaSettings(method="mocha", **extra)  # the synchronous method takes them


# ------------------------------------------------------------------------- robust checks
def _hostile_run(problem, tamper, rounds=6, **knobs):
    base = make_async_mocha_client_app(problem.load)
    return _run(problem, rounds, client=_tampering_all(base, tamper), **knobs)


def _tampering_all(app, tamper):
    """A client whose replies (whoami's too) pass through ``tamper(message, reply)``."""
    def client(message: Message, context: Context) -> Message:
        reply = app(message, context)
        tamper(message, reply)
        return reply
    return client


def _is_train_of(message, task, from_count=1):
    if message.metadata.message_type != "train":
        return False
    config = message.content["config"]
    return config["task-id"] == task and config["count"] >= from_count


def test_forged_loss_pair_is_rejected_and_never_certified():
    """From its 3rd request on, task 2's device claims a loss of 0 at every model it is sent
    (a forged pair: loss-mean - dual-mean + w . b_t < 0). Each such reply is rejected by the
    certificate's check and counted; the certificate keeps task 2's last honest loss, and every
    certified gap is >= 0."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)

    def tamper(message, reply):
        if _is_train_of(message, 2, from_count=3):
            reply.content["metrics"]["loss-mean"] = 0.0

    strategy = _hostile_run(problem, tamper)
    server, records = strategy.run.server, strategy.run.records
    forged = [r for r in records if r["task"] == 2 and r["status"] != APPLIED]
    assert len(forged) >= 2 and all(r["status"] == INVALID for r in forged)
    assert server.sent[2] == 2 + len(forged)  # every forged reply was rejected
    assert strategy.results()["final"]["certificate_rejections_total"] == len(forged)
    X, y = problem.train()[2]
    honest = float(np.mean(np.maximum(0.0, 1.0 - y * (X @ server.eval_W[:, 2]))))
    assert server.eval_loss[2] == pytest.approx(honest, rel=1e-12) and honest > 0
    assert all(r["gap"] >= 0 for r in records if r["gap"] is not None)
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12


def _largest_old_delta_b(problem, claim):
    """Task 2's device claims rows ``claim`` times longer than they are and sends the largest
    delta-b the claim allows (R_claimed min(budget, n) / n, against its model: the safeguard's
    ascent is then as large as it can be), with its honest scalars."""
    def tamper(message, reply):
        if message.metadata.message_type == "query.whoami" \
                and reply.content["info"]["task-id"] == 2:
            reply.content["info"]["max-row-norm"] = reply.content["info"]["max-row-norm"] * claim
        elif _is_train_of(message, 2):
            config = message.content["config"]
            n = len(problem.ys[2])
            bound = problem_row_norm(problem, 2) * claim * min(config["budget"], n) / n
            w = from_array(message.content["arrays"]["w"])
            direction = -w / np.linalg.norm(w) if np.linalg.norm(w) > 0 else \
                np.ones_like(w) / np.sqrt(w.size)
            reply.content["arrays"]["delta-b"] = to_array(direction * bound * (1 - 1e-9))
    return tamper


def problem_row_norm(problem, task):
    X, _ = problem.train()[task]
    return float(np.sqrt(np.einsum("ij,ij->i", X, X).max()))


def test_largest_delta_b_of_the_old_bounds_barely_moves_the_honest_tasks():
    """Coupled tasks (the mean formulation). Task 2's device claims row norms 1e4 times its
    true ones and sends the largest delta-b that claim allowed. Robust mode (the fence on the
    claimed row norms, the dual-image bound) keeps the honest tasks' models within 10 % of
    those of a run where task 2's replies are all unreadable (rejected at the boundary): its
    replies are all rejected, so they are equal. Before the checks, the safeguard alone let
    them end 24 % of their size away."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)

    def unreadable(message, reply):
        if _is_train_of(message, 2):
            reply.content["arrays"]["delta-b"] = to_array(np.full(problem.dim, np.nan))

    silent = _hostile_run(problem, unreadable).run.server.state.W
    hostile = _hostile_run(problem, _largest_old_delta_b(problem, 1e4)).run.server
    others = [t for t in range(problem.num_tasks) if t != 2]
    moved = np.linalg.norm(hostile.state.W[:, others] - silent[:, others])
    assert moved <= 0.1 * np.linalg.norm(silent[:, others])
    assert hostile.counts[INVALID] >= 1 and np.all(np.isfinite(hostile.state.W))


def test_robust_off_takes_the_claimed_row_norms():
    """robust=False: the device's claim is its bound (the fence and the image bound are off),
    so the same hostile replies pass; the certificate's check stays on."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    strategy = _hostile_run(problem, _largest_old_delta_b(problem, 1e4), robust=False)
    assert strategy.run.server.counts[INVALID] == 0
    assert strategy.row_norm[2] == pytest.approx(1e4 * problem_row_norm(problem, 2))
