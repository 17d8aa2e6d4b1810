"""OFMTL's record-level DP numerics (core/ofmtl_privacy.py): the newcomer's private step (its
noise's calibration, its sensitivity to one clipped record, the step without noise), the
release budget and the account's composition."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.ofmtl import newcomer_duality_gap, newcomer_fit
from fmtl_flower.core.ofmtl_privacy import (
    gap_target,
    newcomer_noise_rng,
    newcomer_sensitivity,
    private_newcomer_fit,
    release_budget,
    retraining_sizes,
)
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.core.record_dp import RecordAccountant, clip_rows, noise_rng
from fmtl_flower.experiments.privacy_figure import exact_gaussian_epsilon

LAM, OMEGA = 0.1, 3.0


def _newcomer(n: int = 30, d: int = 4, seed: int = 0, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * scale
    y = np.where(X @ rng.normal(size=d) + rng.normal(size=n) > 0, 1.0, -1.0)
    return X, y, rng.normal(size=d) * 0.1


def _fit(X, y, c, z, rng, clip=1.0, alpha=None, rounds=3, seed=0):
    return private_newcomer_fit(X, y, omega=OMEGA, c=c, lam=LAM, rounds=rounds,
                                local_frac=0.5, seed=seed, task_id=4, alpha=alpha,
                                first_round=1, clip=clip, noise_multiplier=z, rng=rng)


def test_the_released_model_has_the_calibrated_noise():
    """Over 4000 noise draws of one step, the released w has variance std^2 =
    (z Delta)^2 per coordinate within 5 % (relative std of a variance estimate:
    sqrt(2/4000) = 2.2 %) around the device's model, Delta = 2 (1 + eta) C / (n lam omega),
    and the model itself does not depend on the draw."""
    X, y, c = _newcomer()
    X = clip_rows(X, 1.0)
    z = 1.7
    draws = [_fit(X, y, c, z, newcomer_noise_rng(s, 4, 2)) for s in range(4000)]
    std = z * newcomer_sensitivity(1.0, 30, LAM, OMEGA)
    assert std == pytest.approx(z * 2 * 1.1 / (30 * LAM * OMEGA), rel=1e-12)
    assert all(d.std == std for d in draws)
    noise = np.stack([d.released - d.w for d in draws])
    np.testing.assert_allclose(noise.var(axis=0, ddof=1), std ** 2, rtol=0.05)
    np.testing.assert_allclose(noise.mean(axis=0), 0.0, atol=4 * std / 60)
    assert all(np.array_equal(d.w, draws[0].w) for d in draws)


def test_the_step_reaches_the_gap_target_and_without_noise_is_the_step_without_dp():
    X, y, c = _newcomer()
    X = clip_rows(X, 1.0)
    out = _fit(X, y, c, 1.0, newcomer_noise_rng(3, 1, 0))
    gap = newcomer_duality_gap(X, y, out.alpha, omega=OMEGA, c=c, lam=LAM)
    assert gap <= gap_target(1.0, 30, LAM, OMEGA) and out.rounds > 3
    plain = newcomer_fit(X, y, omega=OMEGA, c=c, lam=LAM, rounds=3, local_frac=0.5, seed=0,
                         task_id=4, track_gap=False)
    silent = _fit(X, y, c, 0.0, None)
    np.testing.assert_array_equal(silent.w, plain.w)
    np.testing.assert_array_equal(silent.alpha, plain.alpha)
    assert silent.released is silent.w and silent.std == 0.0 and silent.rounds == 3


@pytest.mark.parametrize("trial", range(20))
def test_one_replaced_clipped_record_moves_the_model_by_at_most_the_sensitivity(trial):
    """Neighbouring datasets (record i replaced by an arbitrary row and label, both clipped
    to C), different warm starts and coordinate orders: the noise-free w of one private step
    moves by at most Delta = 2 (1 + eta) C / (n lam omega)."""
    rng = np.random.default_rng(trial)
    X, y, c = _newcomer(n=25, seed=trial, scale=float(rng.uniform(0.2, 5)))
    clip = float(rng.uniform(0.3, 2.0))
    i = int(rng.integers(25))
    X2, y2 = X.copy(), y.copy()
    X2[i] = rng.normal(size=4) * 10
    y2[i] = -y2[i]
    ws = [_fit(clip_rows(Xs, clip), ys, c, 1.0, np.random.default_rng(0), clip=clip,
               alpha=ys * rng.uniform(0, 1, size=25), rounds=int(rng.integers(0, 4)),
               seed=int(rng.integers(100))).w
          for Xs, ys in ((X, y), (X2, y2))]
    bound = newcomer_sensitivity(clip, 25, LAM, OMEGA)
    assert np.linalg.norm(ws[0] - ws[1]) <= bound * (1 + 1e-12)


def test_a_step_that_cannot_move_is_refused():
    X, y, c = _newcomer(n=3)
    with pytest.raises(ValueError, match="no SDCA step"):
        private_newcomer_fit(X, y, omega=OMEGA, c=c, lam=LAM, rounds=1, local_frac=0.2,
                             seed=0, task_id=0, alpha=None, first_round=1, clip=1.0,
                             noise_multiplier=1.0, rng=np.random.default_rng(0))


def test_the_newcomer_stream_differs_from_mochas_of_the_same_device():
    a = newcomer_noise_rng(5, 2, 3).normal(size=4)
    np.testing.assert_array_equal(a, newcomer_noise_rng(5, 2, 3).normal(size=4))
    assert not np.array_equal(a, noise_rng(5, 2, 3).normal(size=4))
    assert not np.array_equal(a, newcomer_noise_rng(5, 2, 4).normal(size=4))


def test_the_retraining_schedule_and_the_release_budget():
    assert retraining_sizes(2, 6, 1.5) == [2, 5]  # 3 newcomers since 2 tasks: 3 >= 3
    assert retraining_sizes(1, 30, 1.5) == [1, 3, 8, 20]
    assert retraining_sizes(10, 30, float("inf")) == [10]
    # founding: 2 trainings x 20 rounds; task 2 (joins before the retraining at 5):
    # 10 x 3 attempts + 20; task 5: 10 x 3 and no retraining after it
    assert release_budget(2, 6, 1.5, 20, 10, 3) == max(40, 30 + 20, 30)
    assert release_budget(10, 30, float("inf"), 50, 10, 1) == 50
    assert release_budget(10, 30, float("inf"), 5, 10, 3) == 30


@pytest.mark.parametrize(("z", "k"), [(1.0, 1), (2.0, 10), (5.0, 60)])
def test_the_account_of_k_releases_is_the_accountants_and_bounds_the_exact_epsilon(z, k):
    """A device's k releases (MOCHA rounds and newcomer steps alike: one z) are composed by
    MOCHA's account: its epsilon is dp-accounting's RDP epsilon of k Gaussian mechanisms,
    at least the exact epsilon of that composition (Gaussian mechanism, mu = sqrt(k) / z)
    and within 40 % of it."""
    account = RecordAccountant(z, 1e-5)
    for _ in range(k):
        account.add(np.array([True, False, True]))
    assert account.epsilon() == rdp_epsilon([(z, 1.0, k)], 1e-5)
    exact = exact_gaussian_epsilon(z, k, 1e-5)
    assert exact <= account.epsilon() <= 1.4 * exact
