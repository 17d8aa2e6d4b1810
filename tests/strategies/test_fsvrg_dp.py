"""Client-level DP for the FSVRG family (fmtl_flower.strategies.privacy.FSVRGDP): equality
with the run without DP when nothing is clipped or noised, the noise's calibration, the
clipping, the account of every release (two a round for fsvrg-naive and DANE, GD's power
iterations), resume, the refusals and the run config."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.privacy import FSVRGDP, enable_client_dp

pytest.importorskip("dp_accounting")

K = 20
#: Each method's settings (fsvrg-naive needs its step h; GD with a given step makes no
#: power-iteration releases).
METHODS = {"fsvrg-naive": {"h": 0.5}, "dane": {}, "gd": {}}


@pytest.fixture(scope="module")
def data() -> SparseFederatedDataset:
    return make_sparse_federated(num_tasks=K, dim=500, seed=0)


def run(data: SparseFederatedDataset, strategy: FSVRG, rounds: int) -> FSVRG:
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    run_inprocess(server, app, data.num_tasks)
    return strategy


def fsvrg(method: str, cls: type = FSVRG, **kwargs: Any) -> FSVRG:
    return cls(K, method=method, discovery_timeout=5.0,
               **{"robust": False, **METHODS[method], **kwargs})


def private(method: str, cls: type = FSVRG, noise_seed: int | None = None,
            strategy_kwargs: dict | None = None, **dp: Any) -> FSVRG:
    return enable_client_dp(fsvrg(method, cls, **(strategy_kwargs or {})),
                            noise_seed=noise_seed, **{"mechanism": "central", **dp})


# ------------------------------------------------------------------ equality without noise
@pytest.mark.parametrize("method", sorted(METHODS))
def test_no_noise_and_a_clip_that_never_binds_equals_the_run_without_dp(data, method):
    """``weighting=rows`` (the method's own weights), z = 0, a clip no reply reaches: every
    round's w and record equal the run without DP bit for bit (GD's default step included:
    its power iteration's Gram sums go through the same release)."""
    plain = run(data, fsvrg(method), 4)
    dp = run(data, private(method, clip=1e9, noise_multiplier=0.0, weighting="rows"), 4)
    np.testing.assert_array_equal(dp.w, plain.w)
    for a, b in zip(plain.results()["rounds"], dp.results()["rounds"], strict=True):
        assert b["objective"] == a["objective"] and b["test_error"] == a["test_error"]
    final = dp.results()["final"]
    assert final["dp_clipped"] == 0 and final["epsilon"] == float("inf")


def test_uniform_weighting_averages_the_clipped_mean_gradients():
    """Flower's weighting: each device's clipped mean gradient counts 1/K whatever its
    size; released sum / n = that mean (a silent device adds 0)."""
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.0))
    rng = np.random.default_rng(0)
    n_all = np.array([10, 30, 60, 100])
    grads = [rng.normal(size=7) * 0.01 * m for m in n_all[:3]]  # task 3 silent
    big = np.full(7, 5.0) * n_all[2]  # a mean of norm 13.2: clipped to 1
    grads[2] = big
    out = dp.gradient_sum(grads, list(n_all[:3]), n_all, [], 10) / n_all.sum()
    means = [grads[0] / 10, grads[1] / 30, big / 60 / np.linalg.norm(big / 60)]
    np.testing.assert_allclose(out, np.sum(means, axis=0) / 4, rtol=1e-13)
    fields = dp.record_fields([])
    assert fields["dp_clipped"] == 1 and fields["dp_releases"] == 1


def test_rows_weighting_clips_the_mean_and_keeps_the_size():
    dp = FSVRGDP(DPSettings(mechanism="central", clip=0.5, noise_multiplier=0.0,
                            weighting="rows"))
    n_all = np.array([4, 8])
    grads = [np.array([0.0, 4.0]), np.array([0.8, 0.0])]  # means of norm 1 and 0.1
    out = dp.gradient_sum(grads, [4, 8], n_all, [], 10)
    np.testing.assert_array_equal(out, np.array([0.8, 2.0]))  # 4 x 0.5 and 8 x 0.1


# ------------------------------------------------------------------ the noise's calibration
@pytest.mark.parametrize("weighting", ["uniform", "rows"])
def test_the_gradients_noise_has_the_calibrated_variance(weighting):
    """Noise on g = released sum / n with variance (z C w_max / n)^2: (z C / K)^2 uniform,
    (z C max_k n_k / n)^2 rows (200 000 coordinates: relative standard error 0.3 %)."""
    z, clip, n_all = 1.3, 0.7, np.array([50, 100, 150, 200, 500])
    dp = FSVRGDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=z,
                            weighting=weighting), noise_seed=5)
    dim = 200_000
    grads = [np.zeros(dim) for _ in n_all]
    noise = dp.gradient_sum(grads, list(n_all), n_all, [], 10) / n_all.sum()
    expected = z * clip / len(n_all) if weighting == "uniform" else z * clip * 500 / 1000
    assert np.var(noise) == pytest.approx(expected ** 2, rel=0.02)
    assert abs(np.mean(noise)) < 4 * expected / np.sqrt(dim)


def test_the_local_models_noise_is_z_clip_over_k():
    z, clip, k = 0.8, 2.0, 8
    dp = FSVRGDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=z), noise_seed=2)
    w = np.ones(200_000)
    models, std = dp.local_models(w, [w + 1e-3] * 6, k, [], 10)  # 2 silent: w itself
    assert len(models) == k and np.array_equal(models[-1], w)
    noise = dp.noisy(np.zeros_like(w), std)
    assert std == z * clip / k
    assert np.var(noise) == pytest.approx((z * clip / k) ** 2, rel=0.02)


def test_gd_rounds_noise_in_a_run_has_the_calibrated_variance():
    """GD with a given step: w_1 = w_0 - step (g + noise), so the noisy run's w_1 minus
    the noise-free run's is -step times the gradient's noise: variance (step z C / K)^2
    over d = 20 000 coordinates (relative standard error 1 %)."""
    data = make_sparse_federated(num_tasks=10, dim=20_000, seed=1)
    z, clip, step = 2.0, 0.5, 3.0

    def gd(noise_multiplier: float) -> FSVRG:
        strategy = FSVRG(10, method="gd", robust=False, step=step, discovery_timeout=5.0)
        return run(data, enable_client_dp(strategy, mechanism="central", clip=clip,
                                          noise_multiplier=noise_multiplier, noise_seed=4), 1)

    plain, noisy = gd(0.0), gd(z)
    noise = (plain.w - noisy.w) / step
    n = int(plain.n_weight.sum())
    assert noisy.results()["final"]["dp_noise_std_gradient"] == pytest.approx(
        z * clip * n / 10, rel=1e-12)  # in the sum's units: / n on g
    # the same replies (round 1's depend on w_0 only), clipped alike: the rest is noise
    assert plain.results()["final"]["dp_clipped"] == noisy.results()["final"]["dp_clipped"]
    assert np.var(noise) == pytest.approx((z * clip / 10) ** 2, rel=0.05)


# ------------------------------------------------------------------ the account
@pytest.mark.parametrize("method", ["fsvrg-naive", "dane"])
def test_two_releases_a_round_are_accounted(data, method):
    """fsvrg-naive and DANE release a gradient and a local model each round: the epsilon
    of record r is that of 2 r Gaussian releases."""
    z, delta = 3.0, 1e-6
    strategy = run(data, private(method, clip=0.5, noise_multiplier=z, delta=delta), 4)
    rounds = strategy.results()["rounds"]
    assert [r["dp_releases"] for r in rounds] == [0, 2, 2, 2, 2]
    assert [r["epsilon"] for r in rounds] == pytest.approx(
        [0.0] + [rdp_epsilon([(z, 1.0, 2 * r)], delta) for r in range(1, 5)], rel=1e-12)


def test_gds_power_iterations_are_accounted(data):
    """GD without a step: each power iteration's Gram sum is a release (record 0's),
    then one gradient a round."""
    z = 2.0
    strategy = run(data, private("gd", clip=5.0, noise_multiplier=z), 3)
    rounds = strategy.results()["rounds"]
    power = strategy.results()["final"]["power_iterations"]
    assert power >= 1 and rounds[0]["dp_releases"] == power
    assert rounds[0]["dp_noise_std_gram"] > 0
    assert [r["dp_releases"] for r in rounds[1:]] == [1, 1, 1]
    assert rounds[-1]["epsilon"] == pytest.approx(rdp_epsilon([(z, 1.0, power + 3)], 1e-5),
                                                  rel=1e-12)


def test_a_target_epsilon_is_met_over_every_release(data):
    strategy = run(data, private("dane", clip=0.5, epsilon=4.0), 3)
    final = strategy.results()["final"]
    assert 3.99 < final["epsilon"] <= 4.0  # 6 releases: calibrated over 2 R
    assert final["dp_noise_multiplier"] > 0


def test_a_resumed_run_continues_the_account_and_charges_the_lost_round(data, tmp_path):
    """Killed in round 4 (its noisy gradient already sent in the train messages) and
    resumed from round 3's checkpoint: 6 releases recorded, 2 charged for the round the
    checkpoint does not hold, and 4 for rounds 4-5 (12; the adaptive clip resumes from the
    checkpoint's records)."""
    from tests.strategies.helpers import ServerKilled, killed_in

    z = 2.5
    settings = {"clip": 0.05, "noise_multiplier": z, "adaptive": True,
                "clipped_count_stddev": 5.0}
    first = private("fsvrg-naive", killed_in(FSVRG, 4), **settings)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        run(data, first, 5)
    resumed = private("fsvrg-naive", **settings)
    resumed.enable_checkpoints(tmp_path)
    run(data, resumed, 5)
    assert resumed.resumed_from == 3
    rounds = resumed.results()["rounds"]
    assert rounds[4]["dp_charged_on_resume"] == 2 and rounds[4]["dp_releases"] == 4
    assert rounds[4]["dp_clip_model"] == rounds[3]["dp_clip_next_model"]
    assert rounds[-1]["epsilon"] == pytest.approx(rdp_epsilon([(z, 1.0, 12)], 1e-5),
                                                  rel=1e-12)


def test_a_checkpoint_resumes_only_with_the_same_dp_settings(data, tmp_path):
    from fmtl_flower.checkpoint import CheckpointError

    first = private("dane", clip=0.5, noise_multiplier=1.2)
    first.enable_checkpoints(tmp_path)
    run(data, first, 2)
    for other in (fsvrg("dane"), private("dane", clip=0.5, noise_multiplier=0.6)):
        other.enable_checkpoints(tmp_path)
        with pytest.raises(CheckpointError, match="dp"):
            run(data, other, 3)


# ------------------------------------------------------------------ refusals and settings
@pytest.mark.parametrize(("method", "mechanism", "match"), [
    ("fsvrg", "central", "feature counts"),
    ("cocoa-plus", "central", "w\\(alpha\\)"),
    ("fsvrg-naive", "client-clip", "use dp.mechanism=central"),
])
def test_combinations_that_cannot_be_private_are_refused(method, mechanism, match):
    strategy = FSVRG(K, method=method, h=0.5)
    with pytest.raises(ConfigError, match=match):
        enable_client_dp(strategy, mechanism=mechanism, clip=1.0, noise_multiplier=1.0)


def test_an_adaptive_noise_split_that_cannot_exist_is_refused_before_the_run():
    """z = 2 needs a count std above 1 = K / 20 (Flower's default): refused when enabled."""
    with pytest.raises(ConfigError, match="dp.clipped-count-stddev > 1"):
        enable_client_dp(FSVRG(K, method="dane"), mechanism="central", clip=1.0,
                         noise_multiplier=2.0, adaptive=True)


def test_rows_weighting_is_refused_for_fedem():
    from fmtl_flower.strategies.fedem import FedEM

    with pytest.raises(ConfigError, match="weighting"):
        enable_client_dp(FedEM(4, num_components=2), mechanism="central", clip=1.0,
                         noise_multiplier=1.0, weighting="rows")


@pytest.mark.parametrize("tasks_per_node", [1, 2])
def test_the_server_app_takes_dp_from_the_run_config(tasks_per_node):
    """`flwr run` / `fmtl run`: the dp.* keys reach an FSVRG-family strategy, packed nodes
    (several tasks a node) included."""
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig

    cfg = RunConfig.from_mapping({
        "strategy": "dane", "dataset": "sparse-federated", "num-tasks": 10,
        "num-server-rounds": 3, "tasks-per-node": tasks_per_node, "dp.mechanism": "central",
        "dp.clip": 0.2, "dp.noise-multiplier": 1.5, "dp.adaptive": True,
        "dp.clipped-count-stddev": 2.0})
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                  10 // tasks_per_node)
    final = box["final"]
    assert final["epsilon"] == rdp_epsilon([(1.5, 1.0, 6)], 1e-5)
    assert final["dp_releases"] == 2 and final["dp_clip_next_model"] != 0.2
