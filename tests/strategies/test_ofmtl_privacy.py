"""OFMTL's record-level DP end to end (strategies/ofmtl_privacy.py, strategies/ofmtl.py,
clients/ofmtl.py): what a newcomer releases and the server keeps, the account in every
record, a hostile reply, resume, and the settings."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.apps.common import strategy_from_config
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.config import RunConfig
from fmtl_flower.core.ofmtl import (
    extend_sigma,
    newcomer_server_quantities,
    ofmtl_omega_step,
    omega_from_sigma,
)
from fmtl_flower.core.ofmtl_privacy import (
    newcomer_noise_rng,
    private_newcomer_fit,
    release_budget,
)
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.core.record_dp import clip_rows
from fmtl_flower.engine import run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.ofmtl import OFMTL
from fmtl_flower.strategies.ofmtl_privacy import enable_ofmtl_record_dp
from fmtl_flower.wire import from_array, to_array

from .helpers import Killed, KilledOFMTL, Problem, make_problem
from .hostile import run_on_hostile_grid, untouched

SETTINGS = {"initial_tasks": 2, "lam": 0.05, "mocha_rounds": 6, "outer": 4, "inner": 3,
            "discovery_timeout": 5.0, "arrival_timeout": 2.0, "seed": 3}
NOISE_SEED = 17


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=4, dim=4, samples_per_task=40, seed=5)


def _private(strategy: OFMTL, **dp) -> OFMTL:
    return enable_ofmtl_record_dp(strategy, DPSettings(mechanism="record", **dp))


def _nodes(problem):
    return [{"dp-noise-seed": NOISE_SEED}] * problem.num_tasks


def _run(problem, strategy: OFMTL) -> None:
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, make_ofmtl_client_app(problem.load), problem.num_tasks,
                  node_configs=_nodes(problem))


class SnapshotOFMTL(OFMTL):
    """OFMTL that keeps (W, Sigma) before every newcomer's admission."""

    def _admit(self, grid, task, node):
        self.before = getattr(self, "before", {})
        self.before[task] = (np.array(self.W), np.array(self.Sigma))
        return super()._admit(grid, task, node)


def _replay(problem, strategy, task: int, clip: float, z: float) -> tuple[np.ndarray, ...]:
    """Newcomer ``task``'s protocol recomputed without Flower from the server's (W, Sigma)
    before it: the dense server steps and the device's private step, the same noise
    stream; returns (its column, Sigma, its model without the noise)."""
    W_old, Sigma_old = strategy.before[task]
    X = clip_rows(problem.Xs[task], clip)
    y = problem.ys[task]
    d = X.shape[1]
    sigma = extend_sigma(Sigma_old)
    omega_mat = omega_from_sigma(sigma)
    alpha = None
    W = np.hstack([W_old, np.zeros((d, 1))])
    for step in range(strategy.outer):
        omega, c = newcomer_server_quantities(W_old, omega_mat)
        out = private_newcomer_fit(
            X, y, omega=omega, c=c, lam=strategy.lam, rounds=strategy.inner,
            local_frac=strategy.newcomer_frac, seed=strategy.seed, task_id=task,
            alpha=alpha, first_round=step * strategy.inner + 1, clip=clip,
            noise_multiplier=z, rng=newcomer_noise_rng(NOISE_SEED, task, step))
        alpha, own = out.alpha, out.w
        W[:, -1] = out.released
        if step < strategy.outer - 1:
            sigma, omega_mat = ofmtl_omega_step(W, strategy.omega_eps)
    return W[:, -1], sigma, own


@pytest.mark.parametrize(("clip", "z"), [(1e6, 0.0), (0.5, 0.8)])
def test_the_server_holds_exactly_the_newcomers_private_releases(problem, clip, z):
    """Newcomers' columns and the final Sigma are those of the Flower-free replay of the
    private protocol (same noise stream) bit for bit: at z = 0 with a clip that never binds
    the protocol without noise, at z = 0.8 with clipped rows the gap target and the
    calibrated noise on every reply."""
    strategy = _private(SnapshotOFMTL(problem.num_tasks, retrain_ratio=math.inf, **SETTINGS),
                        clip=clip, noise_multiplier=z)
    _run(problem, strategy)
    assert strategy.m == problem.num_tasks
    for task in (2, 3):
        column, sigma, _ = _replay(problem, strategy, task, clip, z)
        np.testing.assert_array_equal(strategy.W[:, task], column)
    np.testing.assert_array_equal(strategy.Sigma, sigma)
    assert all(r["epsilon"] == (math.inf if z == 0.0 else r["epsilon"]) > 0
               for r in strategy.records)
    assert all(r["newcomer_gap"] is None for r in strategy.records)


def test_epsilon_per_device_in_every_record_and_the_largest_in_final(problem):
    """Founding devices release once per MOCHA round, newcomers once per round trip; every
    record's epsilon is the largest so far; final has every device's."""
    z = 1.3
    strategy = _private(OFMTL(problem.num_tasks, retrain_ratio=math.inf, **SETTINGS),
                        clip=0.5, noise_multiplier=z)
    _run(problem, strategy)
    final = strategy.results()["final"]
    counts = [SETTINGS["mocha_rounds"]] * 2 + [SETTINGS["outer"]] * 2
    expected = [rdp_epsilon([(z, 1.0, k)], 1e-5) for k in counts]
    assert final["privacy"]["epsilon_per_task"] == pytest.approx(expected, rel=1e-12)
    assert final["epsilon"] == max(expected)
    assert final["dp_releases_max"] == max(counts)
    assert [r["epsilon"] for r in strategy.records] == [expected[0]] * len(strategy.records)


def test_a_target_epsilon_is_met_by_every_device_with_retraining(problem):
    strategy = _private(OFMTL(problem.num_tasks, retrain_ratio=1.0, **SETTINGS), clip=0.5,
                        epsilon=4.0)
    _run(problem, strategy)
    assert strategy.retrainings >= 1
    eps = strategy.results()["final"]["privacy"]["epsilon_per_task"]
    assert max(eps) <= 4.0 and max(eps) > 0
    budget = release_budget(2, problem.num_tasks, 1.0, SETTINGS["mocha_rounds"],
                            SETTINGS["outer"], strategy.max_attempts)
    assert strategy.privacy.accountant.counts.max() <= budget


def test_a_newcomer_evaluates_its_model_without_its_own_noise(problem, monkeypatch):
    """The test errors of a newcomer (column unchanged since its last release) are those of
    its model without its own noise, (b - lam c) / (lam omega) (the replay's), not of the
    noisy column the server holds; a founding device's are of its column."""
    from fmtl_flower.clients import ofmtl as ofmtl_client

    seen: list[tuple[np.ndarray, np.ndarray]] = []
    count = ofmtl_client.classification_errors

    def recording(X, y, w):
        seen.append((np.array(X), np.array(w)))
        return count(X, y, w)

    monkeypatch.setattr(ofmtl_client, "classification_errors", recording)
    strategy = _private(SnapshotOFMTL(problem.num_tasks, retrain_ratio=math.inf, **SETTINGS),
                        clip=0.5, noise_multiplier=1.0)
    _run(problem, strategy)

    def last_model(task: int) -> np.ndarray:
        return [w for X, w in seen if np.array_equal(X, problem.Xt[task])][-1]

    for task in (2, 3):
        *_, own = _replay(problem, strategy, task, 0.5, 1.0)
        np.testing.assert_array_equal(last_model(task), own)
        assert not np.array_equal(last_model(task), strategy.W[:, task])
    np.testing.assert_array_equal(last_model(0), strategy.W[:, 0])


def test_a_reply_beyond_the_noisy_bound_is_a_logged_drop(problem, caplog):
    """A newcomer's w scaled 1e6 (|lam omega w + lam c| far above C + the noise allowance)
    is rejected at the trust boundary: the attempt fails, W and Sigma stay as they were,
    the run goes on (the next attempt is honest)."""
    strategy = _private(OFMTL(3, retrain_ratio=math.inf, max_attempts=2, **SETTINGS),
                        clip=0.5, noise_multiplier=1.0)
    tampered = []

    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or not message.metadata.message_type.endswith(".ofmtl") \
                or "arrays" not in reply.content or "w" not in reply.content["arrays"] \
                or tampered:
            return untouched(message, reply)
        tampered.append(True)
        w = from_array(reply.content["arrays"]["w"]) * 1e6
        content = RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                              "metrics": reply.content["metrics"]})
        return [Message(content, reply_to=message)]

    with caplog.at_level(logging.INFO):
        run_on_hostile_grid(lambda grid: strategy.start(grid=grid, timeout=60.0),
                            make_ofmtl_client_app(problem.load), 3, tamper,
                            node_configs=_nodes(problem)[:3])
    assert tampered
    assert strategy.m == 3 and np.all(np.isfinite(strategy.W))
    assert any("lambda omega w" in r.getMessage() for r in caplog.records)
    # the failed attempt's round trip was sent: it counts
    assert strategy.privacy.accountant.counts[2] == 1 + SETTINGS["outer"]


def test_a_resumed_run_continues_every_devices_account(problem, tmp_path):
    plain = _private(OFMTL(problem.num_tasks, **SETTINGS), clip=0.5, noise_multiplier=1.1)
    _run(problem, plain)
    first = _private(KilledOFMTL(problem.num_tasks, task=3, step=2, **SETTINGS), clip=0.5,
                     noise_multiplier=1.1)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(Killed):
        _run(problem, first)
    resumed = _private(OFMTL(problem.num_tasks, **SETTINGS), clip=0.5, noise_multiplier=1.1)
    resumed.enable_checkpoints(tmp_path)
    _run(problem, resumed)
    assert resumed.resumed_from is not None
    # the interrupted newcomer's first two round trips were released: they count too
    extra = np.zeros(problem.num_tasks, dtype=np.int64)
    extra[3] = 2
    np.testing.assert_array_equal(resumed.privacy.accountant.counts,
                                  plain.privacy.accountant.counts + extra)
    plain_no_dp = OFMTL(problem.num_tasks, **SETTINGS)
    plain_no_dp.enable_checkpoints(tmp_path)
    from fmtl_flower.checkpoint import CheckpointError

    with pytest.raises(CheckpointError):
        _run(problem, plain_no_dp)


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="OFMTL"):
        enable_ofmtl_record_dp(MOCHA(3), DPSettings(mechanism="record", clip=1.0,
                                                    noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="record"):
        enable_ofmtl_record_dp(OFMTL(3), DPSettings(mechanism="central", clip=1.0,
                                                    noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="clip"):
        DPSettings(mechanism="record", noise_multiplier=1.0)
    cfg = RunConfig.from_mapping({"strategy": "ofmtl", "dp.mechanism": "record",
                                  "dp.clip": 0.5, "dp.epsilon": 8.0})
    strategy = strategy_from_config(cfg, 4)
    assert strategy.privacy is not None and strategy.privacy.clip == 0.5
    with pytest.raises(ConfigError, match="record"):
        strategy_from_config(RunConfig.from_mapping(
            {"strategy": "ofmtl", "dp.mechanism": "central", "dp.clip": 0.5,
             "dp.noise-multiplier": 1.0}), 4)


def test_noise_zero_and_a_clip_that_never_binds_is_the_run_without_dp(problem):
    """At noise 0 with a clip above every row the newcomer's exchange is the one without DP
    (the same SDCA rounds, no gap target, no noise), and with one coordinate step per MOCHA
    round (``local_frac`` 1/27 of 27 rows) MOCHA's separable step is its sequential SDCA
    step: the run with record-level DP is the run without it, retraining included: W and
    Sigma to 1e-12 (Mb-SDCA's and SDCA's compiled kernels round the same step differently,
    by an ulp), every record's test errors exactly (the records only lack the withheld
    newcomer gap)."""
    problem = Problem([X[:27] for X in problem.Xs], [y[:27] for y in problem.ys],
                      problem.Xt, problem.yt)
    options = {**SETTINGS, "local_frac": 1 / 27, "retrain_ratio": 1.0}
    plain = OFMTL(problem.num_tasks, **options)
    _run(problem, plain)
    private = _private(OFMTL(problem.num_tasks, **options), clip=1e6, noise_multiplier=0.0)
    _run(problem, private)
    assert plain.retrainings == private.retrainings >= 1
    np.testing.assert_allclose(private.W, plain.W, rtol=0, atol=1e-12)
    np.testing.assert_allclose(private.Sigma, plain.Sigma, rtol=0, atol=1e-12)
    assert not np.array_equal(private.W, plain.W)  # the two kernels round differently
    keys = ("event", "devices", "test_error", "test_error_pooled", "cumulative_floats")
    assert [{k: r[k] for k in keys} for r in private.records] == \
        [{k: r[k] for k in keys} for r in plain.records]
    assert all(r["newcomer_gap"] is None for r in private.records)
    assert any(r["newcomer_gap"] is not None for r in plain.records)
