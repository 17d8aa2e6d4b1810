"""Adaptive clipping (Andrew et al. 2021; fmtl_flower.core.privacy.AdaptiveClip and the
``dp.adaptive`` settings): the clip follows the target quantile of a stream of norms, equals
a direct implementation of the paper's geometric update, uses Flower's noise split, and
drives FedEM's and the FSVRG family's releases; Flower's adaptive wrappers convert."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fmtl_flower.core.privacy import AdaptiveClip, adaptive_noise_params, rdp_epsilon
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.privacy import FSVRGDP, ClientLevelDP, enable_client_dp, from_flower

pytest.importorskip("dp_accounting")


def norm_stream(rounds: int, k: int, seed: int = 0) -> np.ndarray:
    """``rounds`` x ``k`` update norms, log-normal around 1 (median 1, 0.8-quantile
    exp(0.5 z_0.8) = 1.524)."""
    return np.random.default_rng(seed).lognormal(0.0, 0.5, size=(rounds, k))


def andrew_et_al(norms: np.ndarray, clip: float, quantile: float, lr: float, sigma_b: float,
                 rng: np.random.Generator) -> list[float]:
    """The paper's Algorithm 1, written out: b_i = 1[|Delta_i| <= C], b = (sum_i b_i +
    N(0, sigma_b^2)) / m, C <- C exp(-eta_C (b - gamma))."""
    clips = [clip]
    for row in norms:
        bits = float(np.sum(row <= clip))
        noisy = (bits + (rng.normal(0.0, sigma_b) if sigma_b > 0 else 0.0)) / len(row)
        clip = clip * math.exp(-lr * (noisy - quantile))
        clips.append(clip)
    return clips


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_the_clip_follows_the_target_quantile_of_a_stream(quantile):
    """300 rounds of 100 norms, noise on the count: the clip ends within 5 % of the
    stream's quantile, and equals the paper's update step for step."""
    norms = norm_stream(300, 100)
    clip = AdaptiveClip(0.1, quantile, 0.2, count_stddev=5.0)
    rng = np.random.default_rng(7)
    ours = [clip.clip]
    for row in norms:
        clip.update(clip.fits(row), len(row), rng)
        ours.append(clip.clip)
    direct = andrew_et_al(norms, 0.1, quantile, 0.2, 5.0, np.random.default_rng(7))
    np.testing.assert_allclose(ours, direct, rtol=1e-12)
    truth = float(np.exp(0.5 * _normal_quantile(quantile)))  # the log-normal's quantile
    assert np.mean(ours[-50:]) == pytest.approx(truth, rel=0.05)
    assert np.mean(norms[-50:] <= np.array(ours[-51:-1])[:, None]) == pytest.approx(
        quantile, abs=0.03)


def _normal_quantile(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


def test_a_silent_device_counts_as_the_zero_update_and_a_device_clip_as_clipped():
    clip = AdaptiveClip(1.0, 0.5, 0.2)
    fits = clip.fits(np.array([0.5, 1.0, 1.0 - 1e-12, 2.0]), clipped_by_device=True)
    assert fits.tolist() == [True, False, False, False]  # on the clip: the device clipped
    assert clip.fits(np.array([1.0])).tolist() == [True]  # the server's own: fits
    fraction = clip.update([True, False], 4, np.random.default_rng(0))  # 2 silent
    assert fraction == 0.75 and clip.clip == pytest.approx(math.exp(-0.2 * 0.25))


def test_the_noise_split_is_flowers():
    """(sigma_b, z_update) as Flower's compute_adaptive_noise_params, and the pair's cost
    (z_update on the update, sigma_b on a count of sensitivity 1/2) is one release of z:
    z_update^-2 + (2 sigma_b)^-2 = z^-2."""
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    for z, k, sigma in [(1.0, 100, None), (0.5, 20, 3.0), (2.0, 1000, 10.0), (0.0, 10, None)]:
        ours = adaptive_noise_params(z, k, sigma)
        assert ours == pytest.approx(compute_adaptive_noise_params(z, k, sigma), rel=1e-15)
        if z > 0:
            count_std, z_update = ours
            assert z_update ** -2 + (2 * count_std) ** -2 == pytest.approx(z ** -2, rel=1e-12)
    with pytest.raises(ValueError, match="clipped-count-stddev > 1"):
        adaptive_noise_params(2.0, 20)  # K / 20 = 1: the count alone costs more than z = 2


def test_flowers_own_adaptive_loop_counts_clipped_updates_and_runs_away():
    """Flower 1.4x's ``DifferentialPrivacyServerSideAdaptiveClipping`` feeds its geometric
    update the fraction of *clipped* updates (``adaptive_clip_inputs_inplace`` returns
    scaling < 1): on the same stream its clip collapses towards 0 while ours tracks the
    median; fed the fraction that fits, Flower's update is ours bit for bit."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg
    from flwr.supercore.differential_privacy import adaptive_clip_inputs_inplace

    norms = norm_stream(100, 10, seed=1)
    flower = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), 0.0, 10, initial_clipping_norm=0.1, target_clipped_quantile=0.5)
    mirror = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), 0.0, 10, initial_clipping_norm=0.1, target_clipped_quantile=0.5)
    ours = AdaptiveClip(0.1, 0.5, 0.2)
    rng = np.random.default_rng(0)
    for row in norms:
        bits = [adaptive_clip_inputs_inplace([np.array([n])], flower.clipping_norm)
                for n in row]
        flower._geometric_update(flower._noisy_fraction(int(sum(bits)), len(row)))
        mirror._geometric_update(float(np.sum(row <= mirror.clipping_norm)) / len(row))
        ours.update(ours.fits(row), len(row), rng)
        assert mirror.clipping_norm == pytest.approx(ours.clip, rel=1e-12)
    assert flower.clipping_norm < 1e-3 and 0.8 < ours.clip < 1.25


# ------------------------------------------------------------------ in the strategies
def test_fedems_clip_moves_by_the_noisy_fraction_of_updates_that_fit():
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.0,
                                  adaptive=True, target_quantile=0.5,
                                  clip_learning_rate=0.3), noise_seed=0)
    current = np.zeros((1, 3))
    returned = [current + [[0.5, 0, 0]], current + [[0, 3.0, 0]], current + [[0, 0, 0.2]]]
    records = []
    out = dp.aggregate(current, returned, 4, records, 10)  # one of 4 silent
    fields = dp.record_fields(records)
    assert fields["dp_clip"] == 1.0 and fields["dp_unclipped_fraction"] == 0.75
    assert fields["dp_clip_next"] == pytest.approx(math.exp(-0.3 * 0.25), rel=1e-15)
    np.testing.assert_allclose(out, [[0.5 / 4, 1.0 / 4, 0.2 / 4]], rtol=1e-15)
    records.append(fields)
    assert dp.current_clip(records) == fields["dp_clip_next"]  # the records hold the clip


def test_fedem_adaptive_noise_is_z_update_times_the_clip_over_k():
    z, k = 1.0, 10
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=0.4, noise_multiplier=z,
                                  adaptive=True, clipped_count_stddev=2.0), noise_seed=1)
    current = np.zeros((1, 200_000))
    out = dp.aggregate(current, [current] * k, k, [], 10)
    z_update = adaptive_noise_params(z, k, 2.0)[1]
    assert dp.record_fields([])["dp_noise_std"] == z_update * 0.4 / k
    assert np.var(out) == pytest.approx((z_update * 0.4 / k) ** 2, rel=0.02)


def test_each_fsvrg_stream_adapts_its_own_clip():
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.0,
                            adaptive=True, clip_learning_rate=0.2), noise_seed=0)
    n_all = np.array([10, 10])
    dp.gradient_sum([np.full(4, 2.0), np.zeros(4)], [10, 10], n_all, [], 4)  # 2 / 2 fit
    w = np.zeros(4)
    dp.local_models(w, [w + 3.0, w + 3.0], 2, [], 4)  # 0 / 2 fit
    fields = dp.record_fields([])
    assert fields["dp_releases"] == 2
    assert fields["dp_clip_next_gradient"] == pytest.approx(math.exp(-0.2 * 0.5))
    assert fields["dp_clip_next_model"] == pytest.approx(math.exp(0.2 * 0.5))
    assert fields["epsilon"] == float("inf")


def test_adaptive_settings_are_validated():
    with pytest.raises(ConfigError, match="clipped-count-stddev"):
        DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0,
                   clipped_count_stddev=2.0)  # without dp.adaptive
    for bad in ({"target_quantile": 1.5}, {"clip_learning_rate": 0.0},
                {"clipped_count_stddev": -1.0}):
        with pytest.raises(ConfigError):
            DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0, adaptive=True,
                       **bad)
    with pytest.raises(ConfigError, match="set with dp.mechanism=none"):
        DPSettings(adaptive=True)


def test_run_config_keys_build_the_adaptive_settings():
    settings = DPSettings.from_run_config({
        "dp.mechanism": "central", "dp.clip": 0.1, "dp.noise-multiplier": 1.0,
        "dp.adaptive": "true", "dp.target-quantile": 0.7, "dp.clip-learning-rate": 0.1,
        "dp.clipped-count-stddev": "", "dp.weighting": "rows"})
    assert settings.adaptive and settings.target_quantile == 0.7
    assert settings.clip_learning_rate == 0.1 and settings.clipped_count_stddev is None
    assert settings.weighting == "rows"


# ------------------------------------------------------------------ Flower's wrappers
@pytest.mark.parametrize("side", ["Server", "Client"])
def test_flowers_adaptive_wrappers_convert_to_the_same_mechanism(side):
    import flwr.serverapp.strategy as flower

    from fmtl_flower.strategies.fedem import FedEM

    cls = getattr(flower, f"DifferentialPrivacy{side}SideAdaptiveClipping")
    wrapper = cls(FedEM(8, num_components=2), 1.1, 8, initial_clipping_norm=0.3,
                  target_clipped_quantile=0.6, clip_norm_lr=0.15, clipped_count_stddev=4.0)
    strategy = from_flower(wrapper)
    s = strategy.privacy.settings
    assert s.mechanism == ("central" if side == "Server" else "client-clip")
    assert s.adaptive and s.clip == 0.3 and s.target_quantile == 0.6
    assert s.clip_learning_rate == 0.15 and s.clipped_count_stddev == 4.0
    assert s.noise_multiplier == pytest.approx(1.1, rel=1e-12)  # z, not the update's
    assert strategy.privacy.accountant([{"dp_noise_multiplier": s.noise_multiplier}]
                                       ).epsilon() == pytest.approx(
        rdp_epsilon([(1.1, 1.0, 1)], 1e-5), rel=1e-9)


def test_flowers_server_side_adaptive_wrapper_converts_for_fsvrg():
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping

    from fmtl_flower.strategies.fsvrg import FSVRG

    wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
        FSVRG(20, method="dane"), 0.8, 20, clipped_count_stddev=2.0)
    strategy = from_flower(wrapper)
    assert isinstance(strategy.privacy, FSVRGDP) and strategy.privacy.settings.adaptive
    with pytest.raises(ConfigError, match="central"):
        from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping

        from_flower(DifferentialPrivacyClientSideAdaptiveClipping(
            FSVRG(20, method="dane"), 0.8, 20, clipped_count_stddev=2.0))


def test_enable_client_dp_keeps_the_adaptive_client_clip_current():
    """client-clip: the train messages carry the clip of the newest record."""
    from fmtl_flower.strategies.fedem import FedEM

    strategy = enable_client_dp(FedEM(4, num_components=2), mechanism="client-clip",
                                clip=0.5, noise_multiplier=0.0, adaptive=True)
    assert strategy.privacy.wire_config() == {"dp-clip": 0.5}
    strategy.records = [{"dp_clip_next": 0.42}]
    assert strategy.privacy.wire_config() == {"dp-clip": 0.42}
