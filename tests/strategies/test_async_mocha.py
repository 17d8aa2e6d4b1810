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
