"""MOCHA's model family beyond the hinge (``mocha.loss``): federated runs that certify their
gap and agree with an independent optimum (scipy L-BFGS on the same primal, Omega fixed), the
loss on the wire, the server's loss-specific checks, and the methods that refuse a loss."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message

from fmtl_flower.config import RunConfig, settings_from_config
from fmtl_flower.core.certificate import pair_problems
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.experiments.mocha_losses import lbfgs_optimum, primal_value, run_loss
from fmtl_flower.settings import ConfigError, MbSGDSettings, MOCHASettings, OFMTLSettings
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import make_problem, run_federation, with_metrics

SMOOTH = ["smoothed-hinge", "logistic", "squared"]
TARGET = 1e-4
MEAN = {"omega": "mean", "lam": 1e-2, "lam2": 1e-1, "omega_every": 0}


def _regulariser_matrix(num_tasks: int, **kwargs) -> np.ndarray:
    s = MOCHASettings(**kwargs)
    return make_formulation(s.omega, num_tasks, lam=s.lam,
                            **s.formulation_options).regulariser_matrix()


@pytest.mark.parametrize("loss", SMOOTH)
def test_federated_mocha_certifies_the_gap_and_reaches_the_lbfgs_optimum(loss):
    """Omega fixed (``mean``: tasks coupled): the record's certified relative gap reaches
    1e-4, its primal is the loss's P of the server's W (the devices report the loss's
    loss-mean), and W agrees with L-BFGS's optimum of the same primal."""
    problem = make_problem(num_tasks=5, dim=4, samples_per_task=24, seed=3)
    run = run_federation(problem, 80, loss=loss, **MEAN)
    final = run.final
    assert final["gap_certified"] and final["certificate_rejections_total"] == 0
    assert final["gap"] <= TARGET * final["primal"]
    K = _regulariser_matrix(problem.num_tasks, loss=loss, **MEAN)
    W = run.strategy.state.W
    own, _ = primal_value(problem.train(), K, W, loss)
    assert final["primal"] == pytest.approx(own, rel=1e-10)
    best, W_star = lbfgs_optimum(problem.train(), K, loss)
    assert final["dual"] <= best * (1 + 1e-9) and best <= final["primal"] * (1 + 1e-9)
    assert abs(final["primal"] - best) <= TARGET * best
    # strong convexity (K >= lam2 I): |W - W*|_F^2 <= 2 (P(W) - P*) / lam2
    assert np.linalg.norm(W - W_star) ** 2 <= 2 * final["gap"] / MEAN["lam2"] + 1e-9


@pytest.mark.parametrize("loss", SMOOTH)
def test_local_special_case_matches_scikit_learn(loss):
    """Omega = m I (``identity``): each task is its own regularised problem, c = lambda m;
    the logistic and squared ones are scikit-learn's LogisticRegression and Ridge."""
    from sklearn.linear_model import LogisticRegression, Ridge

    problem = make_problem(num_tasks=3, dim=4, samples_per_task=40, seed=7)
    lam, m = 0.05, problem.num_tasks
    run = run_federation(problem, 60, loss=loss, omega="identity", lam=lam, omega_every=0)
    assert run.final["gap"] <= TARGET * run.final["primal"] and run.final["gap_certified"]
    W = run.strategy.state.W
    for t, (X, y) in enumerate(problem.train()):
        n = X.shape[0]
        if loss == "logistic":
            ref = LogisticRegression(C=1.0 / (n * lam * m), fit_intercept=False, tol=1e-12,
                                     max_iter=100000).fit(X, y).coef_.ravel()
        elif loss == "squared":  # (1/2n)|y - Xw|^2 + (c/2)|w|^2 = Ridge(alpha = n c) / 2n
            ref = Ridge(alpha=n * lam * m, fit_intercept=False, tol=1e-12).fit(X, y).coef_
        else:  # no scikit-learn twin: the task's own L-BFGS
            ref = lbfgs_optimum([(X, y)], np.array([[lam * m]]), loss)[1].ravel()
        # |w - w*|^2 <= 2 gap_t / c, gap_t <= the run's gap
        assert np.linalg.norm(W[:, t] - ref) ** 2 <= 2 * run.final["gap"] / (lam * m) + 1e-8


def test_the_loss_travels_in_every_message_and_hinge_runs_send_none():
    problem = make_problem(num_tasks=3, dim=4, samples_per_task=20, seed=1)
    seen: dict[str, list] = {"logistic": [], "hinge": []}

    def spy(loss):
        def wrap(client):
            def call(message: Message, context):
                config = message.content.get("config")
                if config is not None and "task-id" in config:
                    seen[loss].append(config.get("loss"))
                return client(message, context)
            return call
        return wrap

    run_federation(problem, 3, loss="logistic", wrap=spy("logistic"))
    run_federation(problem, 3, wrap=spy("hinge"))
    assert len(seen["logistic"]) == 3 * 3 + 3  # train rounds and the final evaluate
    assert set(seen["logistic"]) == {"logistic"}
    assert set(seen["hinge"]) == {None}  # the hinge's messages are as before


def test_a_dual_mean_outside_the_loss_range_is_rejected_by_the_certificate():
    """logistic: D(a) = entropy <= log 2, so a dual-mean of 0.9 (a valid hinge value) is
    impossible; the reply is rejected (counted as a drop) and the record has no gap."""
    problem = make_problem(num_tasks=3, dim=4, samples_per_task=20, seed=1)

    def lie(client):
        def call(message: Message, context):
            reply = client(message, context)
            config = message.content["config"]
            if config.get("task-id") == 1 and config.get("server-round") == 2:
                return with_metrics(reply, message, **{"dual-mean": 0.9})
            return reply
        return call

    run = run_federation(problem, 3, loss="logistic", wrap=lie)
    assert run.rounds[1]["gap"] is None and run.rounds[1]["certificate_rejections"] == 1
    assert run.final["gap_certified"]
    assert pair_problems("hinge", np.array([1.0]), np.array([0.9]), np.array([0.0])) == {}
    assert "dual-mean in [0, 0.693147]" in pair_problems(
        "logistic", np.array([1.0]), np.array([0.9]), np.array([0.0]))[0]


def test_squared_loss_has_no_unit_dual_bound_but_keeps_the_dropped_one():
    """The squared loss's alpha is unbounded: |delta-b| is not held to R_t min(H, n)/n (an
    honest step may exceed it), but a dropped task must still send 0."""
    strategy = MOCHA(2, loss="squared")
    unit = np.array([0.0, 0.5, np.nan])
    limit = strategy._dual_limit(unit)
    assert limit[0] == 0.0 and np.isinf(limit[1]) and np.isnan(limit[2])
    np.testing.assert_array_equal(MOCHA(2, loss="logistic")._dual_limit(unit[:2]), unit[:2])


def test_settings_name_the_valid_losses_and_every_family_takes_them():
    assert MOCHASettings().loss == "hinge"
    assert MOCHA(2, loss="logistic").loss == "logistic"
    assert OFMTLSettings(loss="logistic").loss == "logistic"  # tests/*/test_ofmtl_losses.py
    with pytest.raises(ConfigError, match="mocha.loss .*hinge, smoothed-hinge, logistic, "
                                          "squared"):
        MOCHASettings(loss="cubic")
    assert MbSGDSettings(loss="logistic").loss == "logistic"  # Mb-SGD takes every loss
    cfg = RunConfig.from_mapping({"strategy": "mb-sgd", "mocha.loss": "squared"})
    assert settings_from_config(cfg, 4).loss == "squared"
    with pytest.raises(ConfigError, match="mocha.loss .*hinge, smoothed-hinge"):
        MbSGDSettings(loss="cubic")
    cfg = RunConfig.from_mapping({"strategy": "cocoa", "mocha.loss": "smoothed-hinge"})
    assert settings_from_config(cfg, 4).loss == "smoothed-hinge"


@pytest.mark.parametrize("method", ["cocoa", "mb-sdca"])
def test_cocoa_and_mbsdca_train_another_loss_with_a_certified_gap(method):
    problem = make_problem(num_tasks=4, dim=4, samples_per_task=20, seed=2)
    run = run_federation(problem, 40, loss="logistic", method=method, omega="identity",
                         lam=0.05, omega_every=0, beta=4.0)
    gaps = [r["gap"] for r in run.rounds if r.get("gap") is not None]
    assert run.final["gap_certified"] and all(g >= -1e-12 for g in gaps)
    assert gaps[-1] < 0.05 * gaps[0]


def _run_config(values: dict) -> dict:
    """A run of ``values`` through the apps of ``fmtl run`` (in-process): its results."""
    import math

    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.engine import run_inprocess

    cfg = RunConfig.from_mapping(values)
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                  math.ceil(cfg.num_tasks / cfg.tasks_per_node))
    return box


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s")}


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_stacked_nodes_train_the_loss_bit_for_bit_as_unpacked_ones(loss):
    """Packed nodes (several tasks per stacked message) get the loss in the shared config:
    the run equals the one-task-per-node run bit for bit, and differs from the hinge's."""
    base = {"strategy": "mocha", "num-tasks": 8, "dim": 5, "samples-per-task": 15,
            "num-server-rounds": 4, "mocha.omega-every": 2, "mocha.drop-prob": 0.2}
    one = _run_config({**base, "mocha.loss": loss, "tasks-per-node": 1})
    packed = _run_config({**base, "mocha.loss": loss, "tasks-per-node": 4})
    hinge = _run_config({**base, "tasks-per-node": 4})
    assert [_untimed(r) for r in one["rounds"]] == [_untimed(r) for r in packed["rounds"]]
    assert _untimed(one["final"]) == _untimed(packed["final"])
    assert packed["final"]["gap_certified"] and packed["final"]["primal"] != \
        hinge["final"]["primal"]


def _run_strategy(problem, strategy: MOCHA, rounds: int) -> None:
    from flwr.serverapp import Grid, ServerApp

    from fmtl_flower.clients.mocha import make_mocha_client_app
    from fmtl_flower.engine import run_inprocess

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    run_inprocess(server_app, make_mocha_client_app(problem.load), problem.num_tasks)


@pytest.mark.parametrize(("first", "second"), [("hinge", "logistic"), ("squared", "hinge")])
def test_a_checkpoint_of_another_loss_is_refused(first, second, tmp_path):
    """B is the image of one loss's duals: a run of another loss never resumes it."""
    from fmtl_flower.checkpoint import CheckpointError

    problem = make_problem(num_tasks=3, dim=4, samples_per_task=20, seed=1)
    kwargs = {"omega": "identity", "lam": 0.05, "discovery_timeout": 5.0}
    one = MOCHA(3, loss=first, **kwargs)
    one.enable_checkpoints(tmp_path)
    _run_strategy(problem, one, 2)
    other = MOCHA(3, loss=second, **kwargs)
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="loss"):
        _run_strategy(problem, other, 3)
    same = MOCHA(3, loss=first, **kwargs)  # the same loss resumes
    same.enable_checkpoints(tmp_path)
    _run_strategy(problem, same, 3)
    assert len(same.records) == 4


def test_fit_mocha_is_the_federation_bit_for_bit_for_another_loss():
    from fmtl_flower.centralized import fit_mocha

    problem = make_problem(num_tasks=4, dim=4, samples_per_task=20, seed=5)
    kwargs = {"loss": "logistic", "omega": "probabilistic", "omega_every": 2, "lam": 0.05,
              "drop_prob": 0.2, "sys_het": "high"}
    run = run_federation(problem, 5, **kwargs)
    fit = fit_mocha(problem.train(), rounds=5, **kwargs)
    np.testing.assert_array_equal(run.strategy.state.W, fit.W)
    assert run.final["primal"] == fit.history[-1]["primal"]
    assert run.final["dual"] == fit.history[-1]["dual"]


@pytest.mark.parametrize("loss", ["logistic", "squared"])
def test_seeding_from_the_optimum_of_a_loss_restarts_there_packed_or_not(loss):
    """``initial_arrays``: the seeding round solves the loss's own seeding problem (its dual
    term and domain), on one-task and stacked nodes alike: a W0 at the loss's optimum
    restarts near it, bit for bit the same packed (where the hinge's seeding would not)."""
    from .test_initial_arrays import TASKS, record, run_mocha, untimed

    problem = make_problem(num_tasks=TASKS, dim=4, samples_per_task=40, seed=5)
    solved, solved_result = run_mocha(problem, 60, loss=loss)
    W_star = solved_result.arrays["W"].numpy()
    assert solved.results()["final"]["gap"] < 1e-6 * solved.results()["final"]["primal"]
    _, cold = run_mocha(problem, 1, loss=loss)
    warm, warm_result = run_mocha(problem, 1, record(W=W_star), loss=loss)
    packed, _ = run_mocha(problem, 1, record(W=W_star), loss=loss, per_node=2)
    cold_gap = cold.evaluate_metrics_clientapp[1]["gap"]
    warm_gap = warm_result.evaluate_metrics_clientapp[1]["gap"]
    assert -1e-12 <= warm_gap < 0.05 * cold_gap, (warm_gap, cold_gap)
    assert np.linalg.norm(warm.state.W - W_star) < 0.05 * np.linalg.norm(W_star)
    assert untimed(packed.results()["rounds"]) == untimed(warm.results()["rounds"])
    assert np.array_equal(packed.state.W, warm.state.W)


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["small", "synthetic"])
@pytest.mark.parametrize("loss", SMOOTH)
def test_datasets_reach_a_certified_1e4_gap_at_the_lbfgs_optimum(dataset, loss):
    """The table of docs/results.md ("MOCHA losses"): ``small`` and ``synthetic``, Omega
    fixed (``mean``, lambda 1e-3, lambda2 1e-2), 300 rounds."""
    run = run_loss(dataset, loss, rounds=300, target=TARGET,
                   overrides={"mocha.omega": "mean", "mocha.lambda": "1e-3",
                              "mocha.lambda2": "1e-2"})
    assert run.passes(TARGET), run.row()
