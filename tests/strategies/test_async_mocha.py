"""AsyncMOCHA over Flower's Message API, in-process: the records equal the Flower-free core's
for the same seed and virtual clock, and hostile or lost replies are turned away at the trust
boundary without touching the state."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import APPLIED, INVALID, simulate_async_mocha
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.async_mocha import AsyncMOCHA
from fmtl_flower.systems.timing import node_times
from fmtl_flower.wire import from_array, to_array

from .helpers import ServerKilled, make_problem

KNOBS = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01}, concurrency=4,
             tau=5, latency_sigma=1.0, omega_every=0, seed=3)


def _run(problem, rounds, client=None, **knobs):
    app = client or make_async_mocha_client_app(problem.load)
    grid = InProcessGrid(app, problem.num_tasks)
    strategy = AsyncMOCHA(**{**KNOBS, **knobs})
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


@pytest.mark.parametrize("extra", [{"loss": "logistic"}, {"fit_intercept": True}])
def test_async_methods_take_every_loss_and_the_intercept(extra):
    """The settings no longer refuse a loss other than the hinge or an intercept for the
    barrier-free methods (they did before): the strategy gets them."""
    from fmtl_flower.settings import MOCHASettings

    strategy = AsyncMOCHA.from_settings(MOCHASettings(method="async-mocha", **extra))
    assert strategy.loss == extra.get("loss", "hinge")
    assert strategy.fit_intercept == extra.get("fit_intercept", False)


@pytest.mark.parametrize(("loss", "intercept"), [("smoothed-hinge", False), ("logistic", True),
                                                 ("squared", False), ("hinge", True)])
def test_every_loss_and_the_intercept_over_flower_equal_the_core(loss, intercept):
    """Over the Message API (the devices append the intercept's constant feature, 0.5,
    themselves; the loss travels in the config) the records equal the core's on the same
    data, with the feature appended, for the same seed."""
    from fmtl_flower.core.multiclass import with_intercept

    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    extra = {"loss": loss, "fit_intercept": intercept, "intercept_scaling": 0.5}
    strategy = _run(problem, 6, **extra)
    tasks = [(with_intercept(X, 0.5) if intercept else X, y) for X, y in problem.train()]
    k = KNOBS
    n = np.array([len(y) for y in problem.ys])
    core = simulate_async_mocha(
        tasks, node_times(n, problem.dim + intercept, "mocha", "lte", loss=loss), lam=k["lam"],
        omega=k["omega"], formulation_options=k["formulation_options"], replies=36,
        concurrency=k["concurrency"], tau=k["tau"], latency_sigma=k["latency_sigma"],
        seed=k["seed"], loss=loss)
    assert strategy.run.records == core.records
    assert np.array_equal(strategy.run.server.state.W, core.server.state.W)
    assert strategy.run.server.state.dim == problem.dim + intercept
    assert strategy.results()["final"]["gap"] >= 0


def test_multiclass_devices_lift_as_the_server_decided():
    """Devices built with ``labels="auto"`` whose data hold three classes report them; the
    server decides the class list and the one-vs-rest lifting (dim 3 x (d + 1) with the
    intercept), the devices lift alike, and the run is certified (gap >= 0, W = B M)."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    rng = np.random.default_rng(0)
    ys = [rng.integers(0, 3, size=len(y)) for y in problem.ys]
    tests = [rng.integers(0, 3, size=len(y)) for y in problem.yt]

    def load(context):
        t = int(context.node_config["partition-id"])
        return problem.Xs[t], ys[t], problem.Xt[t], tests[t]

    app = make_async_mocha_client_app(load, labels="auto")
    strategy = AsyncMOCHA(**{**KNOBS, "loss": "logistic", "fit_intercept": True})
    strategy.start(InProcessGrid(app, problem.num_tasks), num_rounds=4)
    server = strategy.run.server
    assert strategy.lifting.classes == (0, 1, 2) and server.state.dim == 3 * 6
    assert server.counts[APPLIED] == 24 and server.counts[INVALID] == 0
    assert strategy.results()["final"]["gap"] >= 0
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12


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


# ------------------------------------------------------------------------- checkpoints
def _killed_at(record_count):
    """AsyncMOCHA whose server 'dies' while handling its ``record_count``-th event (after
    the reply was applied, before any checkpoint of that event is written)."""
    class Killed(AsyncMOCHA):
        def _on_event(self, record, m):
            if len(self.run.records) == record_count:
                raise ServerKilled(record_count)
            super()._on_event(record, m)
    return Killed


def _start(strategy, grid, rounds, ckpt=None, every=1):
    if ckpt is not None:
        strategy.enable_checkpoints(ckpt, every=every)
    strategy.start(grid, num_rounds=rounds)
    return strategy


RESUME_KNOBS = {"omega": "probabilistic", "formulation_options": {}, "omega_every": 2}


@pytest.mark.parametrize(("kill_at", "every", "knobs"), [
    (5, 1, {}), (23, 1, {}), (23, 2, {}), (40, 3, RESUME_KNOBS), (17, 1, RESUME_KNOBS)])
def test_killed_and_resumed_run_is_bit_identical(tmp_path, kill_at, every, knobs):
    """The server dies mid-flight (requests of other tasks in flight, devices ahead of the
    newest checkpoint when ``every`` > 1); the resumed server re-issues the requests that were
    in flight at the checkpoint and the devices go back to their stable copies: the records,
    W and the certificate equal the uninterrupted run's, bit for bit."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    rounds = 8
    whole = _run(problem, rounds, **knobs)
    grid = InProcessGrid(make_async_mocha_client_app(problem.load), problem.num_tasks)
    settings = {**KNOBS, **knobs}
    with pytest.raises(ServerKilled):
        _start(_killed_at(kill_at)(**settings), grid, rounds, tmp_path, every)
    resumed = _start(AsyncMOCHA(**settings), grid, rounds, tmp_path, every)
    m = problem.num_tasks
    applied_at_kill = whole.run.records[kill_at - 1]["applied"]
    assert resumed.resumed_from == (applied_at_kill - 1) // (every * m) * every  # rounds
    assert resumed.run.records == whole.run.records
    assert np.array_equal(resumed.run.server.state.W, whole.run.server.state.W)
    assert np.array_equal(resumed.run.server.state.B, whole.run.server.state.B)
    got, want = resumed.results()["final"], whole.results()["final"]
    assert got["gap"] == want["gap"] and got["virtual_time_s"] == want["virtual_time_s"]
    assert got["replies_resets"] == 0


def test_resumed_with_devices_that_lost_their_state_stays_consistent(tmp_path):
    """The devices lost their state too (a new Flower run: fresh contexts): each task
    restarts from alpha = 0 and says so, the server resets its b_t; the run completes its
    replies with W = B M, the records up to the checkpoint kept and every gap >= 0."""
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    app = make_async_mocha_client_app(problem.load)
    with pytest.raises(ServerKilled):
        _start(_killed_at(20)(**KNOBS), InProcessGrid(app, 6), 6, tmp_path)
    fresh = InProcessGrid(make_async_mocha_client_app(problem.load), 6)
    resumed = _start(AsyncMOCHA(**KNOBS), fresh, 6, tmp_path)
    server, whole = resumed.run.server, _run(problem, 6)
    checkpoint = (whole.run.records[19]["applied"] - 1) // 6  # rounds of 6 replies
    assert resumed.resumed_from == checkpoint > 0 and server.counts[APPLIED] == 36
    assert server.counts["resets"] >= 1
    assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12
    assert all(r["gap"] >= 0 for r in resumed.run.records if r["gap"] is not None)
    kept = [r for r in resumed.run.records if r["applied"] <= 6 * checkpoint]
    assert kept == whole.run.records[:len(kept)]
    assert resumed.run.records != whole.run.records


def test_checkpoint_of_other_settings_is_refused(tmp_path):
    from fmtl_flower.checkpoint import CheckpointError

    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    grid = InProcessGrid(make_async_mocha_client_app(problem.load), 6)
    _start(AsyncMOCHA(**KNOBS), grid, 2, tmp_path)
    with pytest.raises(CheckpointError, match="tau"):
        _start(AsyncMOCHA(**{**KNOBS, "tau": 6}), grid, 3, tmp_path)


# ------------------------------------------------------------------------- engines
ENGINE_CONFIG = {"strategy": "async-mocha", "dataset": "synthetic", "num-tasks": 4, "dim": 5,
                 "samples-per-task": 30, "num-server-rounds": 4, "seed": 3,
                 "mocha.omega": "probabilistic", "mocha.omega-every": 2,
                 "mocha.concurrency": 3, "mocha.tau": 4, "mocha.latency-sigma": 1.0}


def _engine_run(engine: str) -> dict:
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess, run_ray

    cfg = RunConfig.from_mapping(ENGINE_CONFIG)
    box: dict = {}
    server_app, client_app = make_server_app(cfg, on_done=box.update), make_client_app(cfg)
    (run_inprocess if engine == "inprocess" else run_ray)(server_app, client_app, 4)
    assert box, f"{engine}: the ServerApp finished without results"
    return box


@pytest.mark.slow  # Ray's start and shutdown: about 40 s on the 2-core machine
def test_ray_engine_gives_the_inprocess_records():
    """The same run (seed, virtual clock, Omega-steps with drains, 3 requests in flight) on
    Flower's Ray simulation engine and in-process: identical time-stamped records and final
    certificate (the event loop orders replies by virtual finish time, not by arrival)."""
    local, ray = _engine_run("inprocess"), _engine_run("ray")
    assert len(local["rounds"]) >= 16 and local["final"]["replies_applied"] == 16
    assert ray["rounds"] == local["rounds"]
    assert ray["final"] == local["final"] and ray["final"]["gap"] >= 0
