"""MOCHA's record-level DP end to end (strategies/record_dp.py, clients/mocha.py): what the
devices release, what the server adds to B, the account in every record, drops, packing,
resume, and the settings it refuses."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.apps.common import make_client_app, make_server_app, strategy_from_config
from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.config import RunConfig
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.core.record_dp import clip_rows, noise_rng, record_contribution
from fmtl_flower.engine import FIRST_NODE_ID, run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.privacy import enable_client_dp
from fmtl_flower.strategies.record_dp import RecordLevelDP, enable_record_dp
from fmtl_flower.systems.heterogeneity import drop_mask
from fmtl_flower.wire import from_array

from .helpers import ServerKilled, TracingMOCHA, fault_at, killed_in, make_problem

SETTINGS = {"lam": 0.05, "omega": "probabilistic", "omega_every": 2, "seed": 3,
            "local_frac": 0.5, "discovery_timeout": 5.0}
ROUNDS = 6
NOISE_SEED = 11


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=5, dim=4, samples_per_task=40, seed=11)


def _run(problem, strategy: MOCHA, rounds: int = ROUNDS, wrap=None,
         run_config: dict | None = None, noise_seed: int | None = NOISE_SEED) -> Any:
    """One in-process run; every device's noise seeded by ``noise_seed`` (node config)."""
    app = make_mocha_client_app(problem.load)
    client = wrap(app) if wrap is not None else app
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    nodes = [{} if noise_seed is None else {"dp-noise-seed": noise_seed}] * problem.num_tasks
    return run_inprocess(server_app, client, problem.num_tasks, run_config=run_config,
                         node_configs=nodes)


def _private(strategy: MOCHA, **dp: Any) -> MOCHA:
    return enable_record_dp(strategy, DPSettings(mechanism="record", **dp))


def _committed(grid, strategy, t: int) -> np.ndarray:
    """Device t's tracked vector as the server's B holds it: the committed one, plus the
    pending change when the server accepted that round's reply (under record-level DP
    [alpha_t; e_t], n_t + d entries)."""
    from .helpers import STATE_ARRAYS, STATE_META

    context = grid.contexts[strategy.task_to_node[t]]
    duals = from_array(context.state[STATE_ARRAYS]["duals"])
    tracked = np.array(duals[0])
    if int(context.state[STATE_META]["pending-round"]) == int(strategy.last_accepted[t]):
        tracked = tracked + duals[1]
    return tracked


def _true_images(problem, grid, strategy, clip: float) -> np.ndarray:
    """X_t^T alpha_t / n_t of every device's committed alpha, on its clipped rows."""
    out = np.zeros_like(strategy.state.B)
    for t in range(problem.num_tasks):
        X = clip_rows(problem.Xs[t], clip)
        out[:, t] = X.T @ _committed(grid, strategy, t)[:X.shape[0]] / X.shape[0]
    return out


def _device_noise(problem, grid, strategy, t: int) -> np.ndarray:
    """The accepted noise e_t device t keeps (after its duals in the tracked vector)."""
    return _committed(grid, strategy, t)[problem.Xs[t].shape[0]:]


@pytest.fixture
def evaluated(monkeypatch) -> dict[int, np.ndarray]:
    """The model each device last computed test errors of, by task id (after a run: the
    final ``evaluate``'s), recorded where every MOCHA device (packed or not) counts them."""
    from fmtl_flower.clients import mocha as mocha_client

    models: dict[int, np.ndarray] = {}
    count = mocha_client.eval_metrics

    def recording(task, w, config):
        out = count(task, w, config)
        if out:
            models[task.task_id] = np.array(w)
        return out

    monkeypatch.setattr(mocha_client, "eval_metrics", recording)
    return models


def _without_own_noise(problem, grid, strategy, clip: float) -> np.ndarray:
    """Column t: W of the server's B with column t replaced by device t's true image (its
    own noise removed, the others' accepted noise kept), M the server's."""
    true = _true_images(problem, grid, strategy, clip)
    M = np.asarray(strategy.state.M)
    out = np.empty_like(true)
    for t in range(problem.num_tasks):
        B = strategy.state.B.copy()
        B[:, t] = true[:, t]
        out[:, t] = (B @ M)[:, t]
    return out


# ------------------------------------------------------------------ the release and B

def capturing_sent(sent: dict[tuple[int, int], tuple]):
    """A ClientApp wrapper factory that records, per (task, round) of each train message,
    what the device's noise scale is computed from: (|w_t|, m_tt, sigma', budget)."""
    def capture(app):
        def client(msg, context):
            config = msg.content["config"]
            if msg.metadata.message_type == "train":
                w = from_array(msg.content["arrays"]["w"])
                sent[(int(config["task-id"]), int(config["server-round"]))] = (
                    float(np.linalg.norm(w)), float(config["m-tt"]),
                    float(config["sigma-prime"]), int(config["budget"]))
            return app(msg, context)
        return client
    return capture

@pytest.mark.parametrize("method", ["mocha", "cocoa"])
def test_the_server_adds_exactly_the_calibrated_noise_of_the_accepted_replies(problem, method):
    """MOCHA, and CoCoA (whose devices take the separable step over their budget under
    record-level DP, not SDCA to the accuracy theta). With a seeded noise stream:
    B - X^T alpha / n (clipped rows, the devices' committed alpha) is, for every task, the
    sum over the rounds the server accepted its reply of the noise N(0, (z 2 c / n_t)^2 I)
    the device drew for that round (c: one record's step-bounded contribution at the w_t,
    m_tt, sigma' and budget it was sent). Task 2's node replies with a non-finite delta-b
    in rounds 2 and 3 (rejected): their noise is discarded with their d_alpha, so the
    commit protocol keeps B and alpha apart by the accepted noise only."""
    z, clip = 0.7, 0.72  # round 1 (w = 0) has step bounds 0.707 and 0.72-0.73: both sides
    strategy = _private(TracingMOCHA(problem.num_tasks, **SETTINGS, method=method),
                        clip=clip, noise_multiplier=z)
    sent: dict[tuple[int, int], tuple] = {}  # (task, round) -> (|w|, m_tt, sigma', budget)
    capture = capturing_sent(sent)
    grid = _run(problem, strategy,
                wrap=lambda app: capture(fault_at("nan", FIRST_NODE_ID + 2, {2, 3})(app)))
    accepted = {t: [r for r in range(1, ROUNDS + 1)
                    if strategy.trace[r]["last_after"][t] == r] for t in range(5)}
    assert accepted[2] == [1, 4, 5, 6]
    assert all(accepted[t] == list(range(1, ROUNDS + 1)) for t in (0, 1, 3, 4))
    offset = strategy.state.B - _true_images(problem, grid, strategy, clip)
    bounds: dict[tuple[int, int], float] = {}
    for t in range(problem.num_tasks):
        n, d = problem.Xs[t].shape

        def std(r: int, t: int = t, n: int = n) -> float:
            w_norm, m_tt, sigma_p, budget = sent[(t, r)]
            bound = record_contribution(clip, n, 1.0, sigma_p * m_tt * min(budget, n),
                                        w_norm)
            bounds[(t, r)] = bound
            return z * 2 * bound / n

        expected = sum(noise_rng(NOISE_SEED, t, r).normal(0.0, std(r), size=d)
                       for r in accepted[t])
        np.testing.assert_allclose(offset[:, t], expected, rtol=0, atol=1e-12,
                                   err_msg=f"task {t}")
        # the device keeps exactly that noise as its e_t (task 2's rejected rounds not in it)
        np.testing.assert_allclose(_device_noise(problem, grid, strategy, t), expected,
                                   rtol=0, atol=1e-12, err_msg=f"task {t}")
    # both bounds were the smaller one: already in round 1 (w = 0, no noise yet, so this
    # does not depend on the draws) the step bound is below C for some tasks, C for others
    first = [b for (_, r), b in bounds.items() if r == 1]
    assert min(first) < clip and max(first) == clip


def test_every_device_evaluates_its_model_without_its_own_noise(problem, evaluated):
    """Device t's final model (the one whose test errors it reports) is column t of
    W(B') = B' M, B' the server's B with column t replaced by the device's true image
    X_t^T alpha_t / n_t: the other devices' accepted noise stays in it, its own is gone
    (w_t - m_tt e_t). Task 2's replies of rounds 2 and 3 are rejected (their noise is not
    removed: the server never added it)."""
    clip = 1.0
    strategy = _private(MOCHA(problem.num_tasks, **SETTINGS), clip=clip,
                        noise_multiplier=0.7)
    grid = _run(problem, strategy, wrap=fault_at("nan", FIRST_NODE_ID + 2, {2, 3}))
    expected = _without_own_noise(problem, grid, strategy, clip)
    for t in range(problem.num_tasks):
        np.testing.assert_allclose(evaluated[t], expected[:, t], rtol=0, atol=1e-12,
                                   err_msg=f"task {t}")
        own = np.linalg.norm(evaluated[t] - strategy.state.W[:, t])
        assert own > 1e-3 * np.linalg.norm(strategy.state.W[:, t])  # the server's w_t differs


def test_a_device_restarted_from_its_state_file_keeps_its_noise(problem, evaluated,
                                                               tmp_path):
    """Device 1 loses its ``context.state`` before round 4 (a restart): it reads its
    state file, e_t included, so no task is reset and every final model is still the
    one without the device's own noise."""

    def restart(app):
        def client(msg, context):
            if (context.node_id == FIRST_NODE_ID + 1 and msg.metadata.message_type == "train"
                    and int(msg.content["config"]["server-round"]) == 4):
                for key in list(context.state.keys()):
                    del context.state[key]
            return app(msg, context)
        return client

    clip = 1.0
    strategy = _private(MOCHA(problem.num_tasks, **SETTINGS), clip=clip,
                        noise_multiplier=0.7)
    grid = _run(problem, strategy, wrap=restart,
                run_config={"client-state-dir": str(tmp_path / "devices")})
    assert sum(r.get("num_resets") or 0 for r in strategy.results()["rounds"]) == 0
    expected = _without_own_noise(problem, grid, strategy, clip)
    for t in range(problem.num_tasks):
        np.testing.assert_allclose(evaluated[t], expected[:, t], rtol=0, atol=1e-12,
                                   err_msg=f"task {t}")


def test_rows_are_clipped_and_whoami_reports_the_clip(problem):
    """A clip that binds (0.3, below every row's norm) and no noise: B is X^T alpha / n of
    the clipped rows exactly; the devices report dp.clip as their max-row-norm when the
    run config says record-level DP."""
    clip = 0.3
    assert min(np.linalg.norm(X, axis=1).min() for X in problem.Xs) > clip
    strategy = _private(TracingMOCHA(problem.num_tasks, **SETTINGS), clip=clip,
                        noise_multiplier=0.0)
    grid = _run(problem, strategy, run_config={"dp.mechanism": "record", "dp.clip": clip})
    np.testing.assert_allclose(strategy.state.B, _true_images(problem, grid, strategy, clip),
                               rtol=0, atol=1e-14)
    assert np.abs(strategy.state.B).max() > 0
    np.testing.assert_array_equal(strategy.directory.row_norm, clip)


def test_noise_zero_and_a_clip_that_never_binds_is_the_run_without_dp(problem):
    """Mb-SDCA, whose step is separable already: with record-level DP at noise 0 and a clip
    above every row, W and every record's test error are those of the run without DP bit
    for bit (the records only lack the withheld primal, dual and gap)."""
    options = {**SETTINGS, "method": "mb-sdca", "eval_every": 1}
    plain = TracingMOCHA(problem.num_tasks, **options)
    _run(problem, plain)
    private = _private(TracingMOCHA(problem.num_tasks, **options), clip=1e6,
                       noise_multiplier=0.0)
    _run(problem, private)
    np.testing.assert_array_equal(private.state.W, plain.state.W)
    np.testing.assert_array_equal(private.state.B, plain.state.B)
    ours, theirs = private.results()["rounds"], plain.results()["rounds"]
    assert [r["test_error"] for r in ours] == [r["test_error"] for r in theirs]
    assert all(r["gap"] is None and r["primal"] is None for r in ours)
    assert all(r["gap"] is not None for r in theirs)


# ------------------------------------------------------------------ the account
def test_epsilon_in_every_record_per_device_and_final_is_the_largest(problem):
    """Task 0 drops out with probability 0.5 (no work: no release). Record k reports the
    largest epsilon over the devices after k rounds, the RDP epsilon of k releases (the
    others release every round); task 0's own epsilon is that of its releases only."""
    z = 1.3
    drop = [0.5, 0.0, 0.0, 0.0, 0.0]
    strategy = _private(MOCHA(problem.num_tasks, **SETTINGS, drop_prob=drop), clip=1.0,
                        noise_multiplier=z)
    _run(problem, strategy)
    results = strategy.results()
    assert [r["epsilon"] for r in results["rounds"]] == [
        rdp_epsilon([(z, 1.0, k)], 1e-5) for k in range(ROUNDS + 1)]
    assert results["final"]["epsilon"] == rdp_epsilon([(z, 1.0, ROUNDS)], 1e-5)
    dropped = sum(bool(drop_mask(5, np.array(drop), seed=3, server_round=r)[0])
                  for r in range(1, ROUNDS + 1))
    assert 0 < dropped < ROUNDS
    per_task = results["privacy"]["epsilon_per_task"]
    assert per_task[0] == rdp_epsilon([(z, 1.0, ROUNDS - dropped)], 1e-5)
    assert max(per_task) == results["final"]["epsilon"] > per_task[0]


def test_a_target_epsilon_sets_the_noise_and_is_met(problem):
    strategy = _private(MOCHA(problem.num_tasks, **SETTINGS), clip=1.0, epsilon=4.0)
    _run(problem, strategy)
    final = strategy.results()["final"]["epsilon"]
    assert 3.99 < final <= 4.0


def test_a_resumed_run_continues_every_devices_account(problem, tmp_path):
    """Killed in round 4 and resumed from round 3's checkpoint: the records' epsilons and
    the devices' epsilons are those of the uninterrupted run (the account resumes)."""
    dp = {"clip": 1.0, "noise_multiplier": 1.1}
    drop = [0.0, 0.5, 0.0, 0.0, 0.0]
    whole = _private(MOCHA(problem.num_tasks, **SETTINGS, drop_prob=drop), **dp)
    _run(problem, whole)
    first = _private(killed_in(MOCHA, 4)(problem.num_tasks, **SETTINGS, drop_prob=drop), **dp)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        _run(problem, first)
    resumed = _private(MOCHA(problem.num_tasks, **SETTINGS, drop_prob=drop), **dp)
    resumed.enable_checkpoints(tmp_path)
    _run(problem, resumed)
    assert resumed.resumed_from == 3
    ours, theirs = resumed.results(), whole.results()
    assert [r["epsilon"] for r in ours["rounds"]] == [r["epsilon"] for r in theirs["rounds"]]
    assert ours["privacy"]["epsilon_per_task"] == theirs["privacy"]["epsilon_per_task"]
    assert len(set(theirs["privacy"]["epsilon_per_task"])) == 2


def test_a_resumed_run_keeps_every_devices_noise(problem, evaluated, tmp_path):
    """Killed in round 4 and resumed from round 3's checkpoint, the devices keeping state
    files: each goes back to its alpha and e_t of round 3 (the stable copy), so every
    device's final model without its own noise is the uninterrupted run's."""
    dp = {"clip": 1.0, "noise_multiplier": 0.7}
    run_config = {"client-state-dir": str(tmp_path / "whole")}
    _run(problem, _private(MOCHA(problem.num_tasks, **SETTINGS), **dp),
         run_config=run_config)
    uninterrupted = dict(evaluated)
    evaluated.clear()
    run_config = {"client-state-dir": str(tmp_path / "devices")}
    first = _private(killed_in(MOCHA, 4)(problem.num_tasks, **SETTINGS), **dp)
    first.enable_checkpoints(tmp_path / "ckpt")
    with pytest.raises(ServerKilled):
        _run(problem, first, run_config=run_config)
    resumed = _private(MOCHA(problem.num_tasks, **SETTINGS), **dp)
    resumed.enable_checkpoints(tmp_path / "ckpt")
    grid = _run(problem, resumed, run_config=run_config)
    assert resumed.resumed_from == 3
    assert sum(r.get("num_resets") or 0 for r in resumed.results()["rounds"]) == 0
    expected = _without_own_noise(problem, grid, resumed, dp["clip"])
    for t in range(problem.num_tasks):
        np.testing.assert_allclose(evaluated[t], uninterrupted[t], rtol=0, atol=1e-12)
        np.testing.assert_allclose(evaluated[t], expected[:, t], rtol=0, atol=1e-12)


def test_a_checkpoint_without_dp_is_not_resumed_with_it(problem, tmp_path):
    first = killed_in(MOCHA, 3)(problem.num_tasks, **SETTINGS)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        _run(problem, first)
    private = _private(MOCHA(problem.num_tasks, **SETTINGS), clip=1.0, noise_multiplier=1.0)
    private.enable_checkpoints(tmp_path)
    with pytest.raises(Exception, match="(?i)checkpoint|fingerprint|settings"):
        _run(problem, private)


# ------------------------------------------------------------------ packing
def _cli_run(values: dict, noise_seed: int) -> dict:
    cfg = RunConfig.from_mapping(values)
    box: dict = {}
    nodes = math.ceil(cfg.num_tasks / cfg.tasks_per_node) if cfg.num_tasks else None
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg), nodes,
                  node_configs=[{"dp-noise-seed": noise_seed}] * nodes)
    return box


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s")}


def test_packed_nodes_release_what_one_task_per_node_releases(evaluated):
    """``fmtl run mocha`` with record-level DP (noise seeded per device) on packed nodes
    (4 tasks a node) gives the records of one task per node bit for bit, and every
    device evaluates the same model (its own noise removed) packed or not."""
    values = {"strategy": "mocha", "dataset": "synthetic", "num-tasks": 8,
              "num-server-rounds": 3, "dp.mechanism": "record", "dp.clip": 3.0,
              "dp.noise-multiplier": 0.8}
    one = _cli_run({**values, "tasks-per-node": 1}, 5)
    one_models = dict(evaluated)
    evaluated.clear()
    packed = _cli_run({**values, "tasks-per-node": 4}, 5)
    assert [_untimed(r) for r in one["rounds"]] == [_untimed(r) for r in packed["rounds"]]
    assert sorted(evaluated) == sorted(one_models) == list(range(8))
    for t, model in one_models.items():  # the models without the device's own noise
        np.testing.assert_array_equal(evaluated[t], model)
    assert one["final"]["epsilon"] == rdp_epsilon([(0.8, 1.0, 3)], 1e-5)
    assert one["final"]["test_error"] < 0.5


# ------------------------------------------------------------------ settings
def test_record_level_dp_is_refused_outside_mochas_separable_methods(problem):
    record = {"mechanism": "record", "clip": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ConfigError, match="MOCHA's family"):
        enable_client_dp(FedEM(num_tasks=4, num_components=2), **record)
    with pytest.raises(ConfigError, match="bounded dual domain"):
        enable_client_dp(MOCHA(5, loss="squared"), **record)
    with pytest.raises(ConfigError, match="covers"):
        enable_client_dp(MOCHA(5), mechanism="central", clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="dp.clip"):
        DPSettings(mechanism="record", noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="exactly one of"):
        DPSettings(mechanism="record", clip=1.0)
    strategy = enable_client_dp(MOCHA(5), **record)
    with pytest.raises(ValueError, match="seeding round"):
        strategy.seed_model(ArrayRecord([np.zeros((4, 5))]))


def test_the_run_config_turns_it_on_for_mocha():
    cfg = RunConfig.from_mapping({"strategy": "mocha", "dp.mechanism": "record",
                                  "dp.clip": "2", "dp.epsilon": "8"})
    strategy = strategy_from_config(cfg, num_tasks=5)
    assert isinstance(strategy.privacy, RecordLevelDP)
    assert strategy.privacy.clip == 2.0 and strategy.privacy.settings.epsilon == 8.0
