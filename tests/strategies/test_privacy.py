"""Client-level DP for FedEM's family (fmtl_flower.strategies.privacy): the mechanism's
numbers (clipping, the fixed denominator, the noise's calibration), its accounting in the
records, equality with the run without DP when it changes nothing, Flower's wrappers, and
the settings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.config import RunConfig
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.engine import run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.privacy import ClientLevelDP, enable_client_dp, from_flower

pytest.importorskip("dp_accounting")

NUM_TASKS = 8


def equal_size_problem(num_tasks: int = NUM_TASKS, dim: int = 5, n: int = 80, seed: int = 0):
    """Tasks of equal training size (so FedEM's n-weighted mean is the uniform one) drawn
    from a task-specific mixture of two linear rules."""
    rng = np.random.default_rng(seed)
    thetas = rng.normal(size=(2, dim)) * 4
    pis = rng.dirichlet([0.5, 0.5], size=num_tasks)
    data = []
    for t in range(num_tasks):
        parts = []
        for size in (n, 100):
            X = rng.uniform(-1, 1, size=(size, dim))
            z = rng.random(size) < pis[t, 0]
            parts += [X, np.where(z, X @ thetas[0] > 0, X @ thetas[1] > 0).astype(float)]
        data.append(tuple(parts))
    return data


@pytest.fixture(scope="module")
def problem():
    return equal_size_problem()


def run(data, strategy: FedEM, rounds: int, wrap=None) -> FedEM:
    app = make_fedem_client_app(lambda context: data[default_task_id(context)])
    app = app if wrap is None else wrap(app)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    run_inprocess(server, app, len(data))
    return strategy


FEDEM_SETTINGS = {"num_components": 2, "lr": 0.5, "batch_size": 32, "robust": False,
                  "aggregation": "sampled", "discovery_timeout": 5.0}


def fedem(cls: type = FedEM, **kwargs: Any) -> FedEM:
    return cls(NUM_TASKS, **{**FEDEM_SETTINGS, **kwargs})


# ------------------------------------------------------------------ the mechanism itself
def test_noise_std_is_z_clip_over_the_sampled_count():
    """The empirical variance of the released mean's noise is (z C / K)^2 (200 000
    coordinates: the estimate's relative standard error is 0.3 %)."""
    z, clip, k = 1.3, 0.7, 5
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=z),
                       noise_seed=1)
    current = np.zeros((2, 100_000))
    rng = np.random.default_rng(0)
    returned = [current + 1e-4 * rng.normal(size=current.shape) for _ in range(k)]
    out = dp.aggregate(current, returned, k, [], 10)
    noise = out - np.mean(returned, axis=0)  # no update clipped (norms ~0.045 < 0.7)
    assert dp.record_fields([])["dp_clipped"] == 0
    assert np.var(noise) == pytest.approx((z * clip / k) ** 2, rel=0.02)
    assert abs(np.mean(noise)) < 4 * z * clip / k / np.sqrt(noise.size)


def test_each_update_is_clipped_to_the_norm_and_a_drop_counts_as_zero():
    clip = 1.0
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=0.0))
    current = np.full((2, 3), 5.0)
    big = current + np.arange(6.0).reshape(2, 3)  # update of norm sqrt(55) > 1
    small = current + 0.1  # norm 0.245: kept
    out = dp.aggregate(current, [big, small], 4, [], 1)  # 4 sampled, 2 replied
    scaled = (big - current) / np.sqrt(55.0)
    np.testing.assert_allclose(out, current + (scaled + (small - current)) / 4, rtol=1e-14)
    fields = dp.record_fields([])
    assert fields["dp_clipped"] == 1 and fields["dp_noise_std"] == 0.0
    assert fields["epsilon"] == float("inf")  # no noise: no guarantee


def test_the_noise_is_not_the_runs_seed():
    """Without noise_seed two releases of the same inputs differ (OS entropy)."""
    settings = DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0)
    current = np.zeros((1, 50))
    a = ClientLevelDP(settings).aggregate(current, [current], 1, [], 1)
    b = ClientLevelDP(settings).aggregate(current, [current], 1, [], 1)
    assert not np.array_equal(a, b)


# ------------------------------------------------------------------ in a FedEM run
def test_no_noise_and_a_clip_that_never_binds_equals_the_run_without_dp(problem):
    plain = run(problem, fedem(), rounds=6)
    private = run(problem, enable_client_dp(fedem(), mechanism="central", clip=1e6,
                                            noise_multiplier=0.0), rounds=6)
    np.testing.assert_allclose(private.components, plain.components, rtol=1e-11, atol=1e-13)
    a, b = plain.results()["final"], private.results()["final"]
    assert b["accuracy_mean"] == a["accuracy_mean"]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-11)
    assert b["dp_clipped"] == 0 and b["epsilon"] == float("inf")


def test_the_noise_of_a_round_in_a_run_has_the_calibrated_variance(problem):
    """Round 1's replies depend only on the initial components, so the noisy run's
    components minus the noise-free run's are the noise: variance (z C / K)^2 over the
    M x P = 2 x 514 coordinates of an MLP (relative standard error ~4.4 %)."""
    z, clip = 0.5, 20.0
    kwargs = {"model": "mlp", "hidden": 64, "fraction": 0.5}
    plain = run(problem, enable_client_dp(fedem(**kwargs), mechanism="central", clip=clip,
                                          noise_multiplier=0.0), rounds=1)
    noisy = run(problem, enable_client_dp(fedem(**kwargs), mechanism="central", clip=clip,
                                          noise_multiplier=z, noise_seed=3), rounds=1)
    noise = noisy.components - plain.components
    k = NUM_TASKS // 2
    assert noise.size == 2 * 514
    assert plain.results()["final"]["dp_clipped"] == 0  # the same replies, none clipped
    assert noisy.results()["final"]["dp_noise_std"] == z * clip / k
    assert np.var(noise) == pytest.approx((z * clip / k) ** 2, rel=0.2)


def test_epsilon_per_round_is_the_accountants(problem):
    z, delta = 2.0, 1e-6
    strategy = run(problem, enable_client_dp(fedem(), mechanism="central", clip=0.5,
                                             noise_multiplier=z, delta=delta), rounds=4)
    rounds = strategy.results()["rounds"]
    assert [r["epsilon"] for r in rounds] == pytest.approx(
        [rdp_epsilon([(z, 1.0, k)], delta) for k in range(1, 5)], rel=1e-12)
    assert strategy.results()["final"]["epsilon"] == rounds[-1]["epsilon"]
    assert all(r["dp_noise_multiplier"] == z for r in rounds)


def test_a_target_epsilon_sets_the_noise_for_the_run(problem):
    strategy = run(problem, enable_client_dp(fedem(), mechanism="central", clip=0.5,
                                             epsilon=4.0), rounds=5)
    final = strategy.results()["final"]
    assert 3.99 < final["epsilon"] <= 4.0
    assert final["dp_noise_multiplier"] > 0


def test_the_account_resumes_from_the_records():
    """The records are the account's state: a resumed run's next release composes on the
    checkpoint's (records restored by the strategy's checkpoint)."""
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.5))
    records = [{"dp_noise_multiplier": 1.5}, {"dp_noise_multiplier": None},
               {"dp_noise_multiplier": 1.5}]
    current = np.zeros((1, 4))
    dp.aggregate(current, [current], 1, records, 10)
    assert dp.record_fields(records)["epsilon"] == rdp_epsilon([(1.5, 1.0, 3)], 1e-5)


def test_client_clip_devices_clip_their_own_update(problem):
    """With client-clip every device's reply is within ``clip`` of what it was sent, and
    the server's release is the central one (its own clipping changes nothing more)."""
    clip, distances = 0.3, []

    def spy(app):
        def handler(msg, context):
            reply = app(msg, context)
            if msg.metadata.message_type == "train" and "arrays" in reply.content:
                sent = msg.content["arrays"]["components"].numpy()
                back = reply.content["arrays"]["components"].numpy()
                distances.append(float(np.linalg.norm(back - sent)))
                assert msg.content["config"]["dp-clip"] == clip
            return reply
        return handler

    client = run(problem, enable_client_dp(fedem(), mechanism="client-clip", clip=clip,
                                           noise_multiplier=0.8, noise_seed=7), 3, wrap=spy)
    central = run(problem, enable_client_dp(fedem(), mechanism="central", clip=clip,
                                            noise_multiplier=0.8, noise_seed=7), 3)
    assert len(distances) == 3 * NUM_TASKS
    assert max(distances) <= clip * (1 + 1e-12) and min(distances) > 0.99 * clip
    np.testing.assert_allclose(client.components, central.components, rtol=1e-12, atol=1e-13)


def test_a_device_refuses_a_bad_clip():
    from fmtl_flower.core.privacy import clip_towards

    with pytest.raises(ValueError, match="dp-clip"):
        clip_towards(np.zeros(3), np.ones(3), -1.0)
    np.testing.assert_allclose(clip_towards(np.zeros(2), np.array([3.0, 4.0]), 1.0),
                               [0.6, 0.8])


# ------------------------------------------------------------------ Flower's wrappers
def test_flowers_fixed_clipping_wrappers_convert_to_the_same_mechanism(problem):
    direct = run(problem, enable_client_dp(fedem(), mechanism="central", clip=0.8,
                                           noise_multiplier=1.1, noise_seed=5), rounds=3)
    wrapped = DifferentialPrivacyServerSideFixedClipping(fedem(), noise_multiplier=1.1,
                                                         clipping_norm=0.8,
                                                         num_sampled_clients=NUM_TASKS)
    strategy = from_flower(wrapped)
    strategy.privacy.noise_seed = 5
    converted = run(problem, strategy, rounds=3)
    np.testing.assert_array_equal(converted.components, direct.components)
    client_side = from_flower(DifferentialPrivacyClientSideFixedClipping(
        fedem(), noise_multiplier=1.1, clipping_norm=0.8, num_sampled_clients=NUM_TASKS))
    assert client_side.privacy.settings.mechanism == "client-clip"
    adaptive = DifferentialPrivacyServerSideAdaptiveClipping(
        fedem(), noise_multiplier=0.1, num_sampled_clients=NUM_TASKS)
    assert from_flower(adaptive).privacy.settings.adaptive  # test_adaptive_clipping.py
    with pytest.raises(ValueError, match="wrappers"):
        from_flower(fedem())


def test_flowers_wrapper_started_directly_says_what_to_do(problem):
    """The issue's attempt, `DifferentialPrivacyServerSideFixedClipping(FedEM(...)).start`,
    failed with `zip() argument 2 is shorter than argument 1`; it now says what to use."""
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        fedem(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=NUM_TASKS)
    app = make_fedem_client_app(lambda context: problem[default_task_id(context)])
    server, caught = ServerApp(), []

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            wrapped.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
        except RuntimeError as err:
            caught.append(str(err))

    run_inprocess(server, app, NUM_TASKS)
    assert caught and "from_flower" in caught[0]


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mechanism": "central", "noise_multiplier": 1.0}, "dp.clip"),
    ({"mechanism": "central", "clip": 1.0}, "exactly one of"),
    ({"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0, "epsilon": 2.0},
     "exactly one of"),
    ({"clip": 1.0}, "dp.mechanism=none"),
    ({"mechanism": "record", "noise_multiplier": 1.0}, "dp.clip"),
    ({"mechanism": "laplace"}, "dp.mechanism"),
    ({"mechanism": "central", "clip": -1.0, "noise_multiplier": 1.0}, "dp.clip"),
    ({"mechanism": "central", "clip": 1.0, "noise_multiplier": -0.1}, "dp.noise-multiplier"),
    ({"mechanism": "central", "clip": 1.0, "epsilon": 0.0}, "dp.epsilon"),
    ({"mechanism": "central", "clip": 1.0, "epsilon": 1.0, "delta": 1.0}, "dp.delta"),
])
def test_bad_dp_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPSettings(**kwargs)


def test_run_config_keys_build_the_settings():
    cfg = RunConfig.from_mapping({"strategy": "fedavg", "dp.mechanism": "central",
                                  "dp.clip": "0.5", "dp.epsilon": "8", "dp.delta": "1e-6"})
    settings = DPSettings.from_run_config(cfg.to_dict(every_family=True))
    assert settings == DPSettings(mechanism="central", clip=0.5, epsilon=8.0, delta=1e-6)
    with pytest.raises(ConfigError, match="dp.mechanism belongs to"):
        RunConfig.from_mapping({"strategy": "mb-sgd", "dp.mechanism": "central"})


@pytest.mark.parametrize("method", ["cfl", "clustered"])
def test_methods_with_per_cluster_averages_are_refused(method):
    with pytest.raises(ConfigError, match="covers"):
        enable_client_dp(fedem(method=method), mechanism="central", clip=1.0,
                         noise_multiplier=1.0)


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize(("sampling", "q"), [("fixed", 1.0), ("poisson", 0.5)])
def test_a_resumed_run_continues_the_account(problem, tmp_path, every, sampling, q):
    """Killed in round 4, after the checkpoint of round 3 (every=1) or 2 (every=2), and
    resumed: the resumed rounds compose on the checkpoint's releases and on the
    ``checkpoint-every`` releases the interrupted run may have made after it (its rounds'
    noisy aggregates went out in evaluate and train messages; the server cannot tell how
    many, so it charges the most: before, they were not counted at all). With
    ``dp.sampling=poisson`` they compose at q, the checkpoint's read from its records'
    ``dp_sampling_rate``."""
    from tests.strategies.helpers import ServerKilled, killed_in

    z = 1.2
    settings = {"mechanism": "central", "clip": 0.5, "noise_multiplier": z,
                "sampling": sampling}
    first = enable_client_dp(fedem(killed_in(FedEM, 4), fraction=q), **settings)
    first.enable_checkpoints(tmp_path, every=every)
    with pytest.raises(ServerKilled):
        run(problem, first, 5)
    resumed = enable_client_dp(fedem(fraction=q), **settings)
    resumed.enable_checkpoints(tmp_path, every=every)
    run(problem, resumed, 5)
    checkpoint = 3 if every == 1 else 2
    assert resumed.resumed_from == checkpoint
    releases = [*range(1, checkpoint + 1), *range(checkpoint + 1 + every, 6 + every)]
    rounds = resumed.results()["rounds"]
    assert [r["epsilon"] for r in rounds] == pytest.approx(
        [rdp_epsilon([(z, q, k)], 1e-5) for k in releases], rel=1e-12)
    assert rounds[checkpoint]["dp_charged_on_resume"] == every


def test_a_checkpoint_resumes_only_with_the_same_dp_settings(problem, tmp_path):
    from fmtl_flower.checkpoint import CheckpointError

    first = enable_client_dp(fedem(), mechanism="central", clip=0.5, noise_multiplier=1.2)
    first.enable_checkpoints(tmp_path)
    run(problem, first, 2)
    for other in (fedem(), enable_client_dp(fedem(), mechanism="central", clip=0.5,
                                            noise_multiplier=0.6)):
        other.enable_checkpoints(tmp_path)
        with pytest.raises(CheckpointError, match="dp"):
            run(problem, other, 3)


def test_fmtl_runs_final_table_shows_epsilon():
    from fmtl_flower.cli import final_table

    results = {"config": {"strategy": "fedavg", "dataset": "fedem-synthetic",
                          "model": "logistic"},
               "final": {"round": 3, "train_loss": 0.5, "accuracy_mean": 0.9,
                         "epsilon": 7.9998, "dp_noise_multiplier": 1.4259}}
    rows = [line.split() for line in final_table(results).splitlines()]
    assert ["epsilon", "7.9998"] in rows and ["dp_noise_multiplier", "1.4259"] in rows
    del results["final"]["epsilon"]
    assert "epsilon" not in final_table(results)


def test_a_strategy_sized_at_start_keeps_its_dp(problem):
    """num_tasks=None (the ServerApp's default): the strategy built at start keeps DP."""
    strategy = FedEM(None, min_available_nodes=NUM_TASKS, **FEDEM_SETTINGS)
    enable_client_dp(strategy, mechanism="central", clip=0.5, noise_multiplier=2.0)
    run(problem, strategy, 2)
    assert strategy.num_tasks == NUM_TASKS
    assert strategy.results()["final"]["epsilon"] == rdp_epsilon([(2.0, 1.0, 2)], 1e-5)


@pytest.mark.parametrize("tasks_per_node", [1, 3])
@pytest.mark.parametrize("mechanism", ["central", "client-clip"])
def test_the_server_app_takes_dp_from_the_run_config(tasks_per_node, mechanism):
    """`flwr run` / `fmtl run`: the dp.* keys reach the strategy, packed nodes included."""
    from fmtl_flower.apps.common import make_client_app, make_server_app

    cfg = RunConfig.from_mapping({
        "strategy": "fedavg", "dataset": "synthetic", "num-tasks": 12, "dim": 5,
        "samples-per-task": 30, "num-server-rounds": 3, "tasks-per-node": tasks_per_node,
        "dp.mechanism": mechanism, "dp.clip": 0.2, "dp.noise-multiplier": 1.5})
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                  12 // tasks_per_node)
    final = box["final"]
    assert final["epsilon"] == rdp_epsilon([(1.5, 1.0, 3)], 1e-5)
    assert final["dp_noise_std"] == pytest.approx(1.5 * 0.2 / 12)
    assert final["num_replies"] == 12
    # with client-clip the devices clipped already: the server finds nothing above 0.2
    assert (final["dp_clipped"] == 0) == (mechanism == "client-clip")
