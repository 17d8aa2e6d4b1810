"""OFMTL's record-level DP numerics (core/ofmtl_privacy.py): the newcomer's private step (its
noise's calibration, its sensitivity to one clipped record), the release budget and the
account's composition."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.ofmtl import newcomer_model
from fmtl_flower.core.ofmtl_privacy import (
    newcomer_noise_rng,
    newcomer_sensitivity,
    private_newcomer_step,
    public_model,
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
    y = np.where(rng.normal(size=n) > 0, 1.0, -1.0)
    return X, y, rng.normal(size=d) * 0.1


def _step(X, y, c, alpha, noise, z, rng, clip=1.0, steps=None, order=None):
    n = X.shape[0]
    return private_newcomer_step(
        X, y, alpha, noise, omega=OMEGA, c=c, lam=LAM, steps=n if steps is None else steps,
        order=np.arange(n) if order is None else order, clip=clip, noise_multiplier=z, rng=rng)


def test_the_released_model_has_the_calibrated_noise():
    """Over 4000 noise draws of one step from a fixed state, the noise the device adds to
    delta-b has variance std^2 = (z Delta)^2 per coordinate within 5 % (relative std of a
    variance estimate: sqrt(2/4000) = 2.2 %), Delta the step-bounded sensitivity at |w_pub|,
    and the reply w moves by that noise / (lam omega) around the noise-free model."""
    X, y, c = _newcomer()
    X = clip_rows(X, 1.0)
    alpha = y * 0.5
    noise = np.full(4, 0.01)
    z = 1.7
    draws = [_step(X, y, c, alpha, noise, z, newcomer_noise_rng(s, 4, 2)) for s in range(4000)]
    w_pub = public_model(X.T @ alpha / X.shape[0] + noise, c, LAM, OMEGA)
    std = z * newcomer_sensitivity(1.0, X.shape[0], LAM, OMEGA, X.shape[0],
                                   float(np.linalg.norm(w_pub)))
    assert all(d.std == std for d in draws)
    added = np.stack([d.noise - noise for d in draws])
    np.testing.assert_allclose(added.var(axis=0, ddof=1), std ** 2, rtol=0.05)
    ws = np.stack([d.w - d.w_own for d in draws])
    np.testing.assert_allclose(ws.var(axis=0, ddof=1), (std / (LAM * OMEGA)) ** 2, rtol=0.05)
    # the true dual step does not depend on the noise drawn
    assert all(np.array_equal(d.alpha, draws[0].alpha) for d in draws)


def test_the_step_is_taken_at_the_public_model_and_its_own_model_is_noise_free():
    X, y, c = _newcomer()
    X = clip_rows(X, 1.0)
    alpha, noise = y * 0.3, np.array([0.05, -0.02, 0.0, 0.1])
    out = _step(X, y, c, alpha, noise, 0.9, newcomer_noise_rng(3, 1, 0))
    np.testing.assert_allclose(out.w_own, newcomer_model(X, out.alpha, omega=OMEGA, c=c,
                                                         lam=LAM), rtol=0, atol=1e-12)
    np.testing.assert_allclose(out.w, out.w_own + out.noise / (LAM * OMEGA), rtol=0,
                               atol=1e-12)
    assert np.all((y * out.alpha >= 0) & (y * out.alpha <= 1))
    # the dual step used w_pub (with the noise), not the device's noise-free model
    plain = _step(X, y, c, alpha, np.zeros(4), 0.0, newcomer_noise_rng(3, 1, 0))
    assert not np.array_equal(plain.alpha, out.alpha)


@pytest.mark.parametrize("trial", range(20))
def test_one_replaced_clipped_record_moves_the_release_by_at_most_the_sensitivity(trial):
    """Neighbouring datasets (record i replaced by an arbitrary row, both clipped to C): the
    noise-free release delta-b of one private step moves by at most the sensitivity computed
    from public numbers (C, n, lam, omega, steps, |w_pub|) and the box's 2 C / n."""
    rng = np.random.default_rng(trial)
    X, y, c = _newcomer(n=25, seed=trial, scale=float(rng.uniform(0.2, 5)))
    clip = float(rng.uniform(0.3, 2.0))
    alpha = y * rng.uniform(0, 1, size=25)
    noise = rng.normal(size=4) * 0.05
    i = int(rng.integers(25))
    X2, y2, alpha2 = X.copy(), y.copy(), alpha.copy()
    X2[i] = rng.normal(size=4) * 10
    y2[i] = -y2[i]
    alpha2[i] = y2[i] * rng.uniform()
    b_pub = clip_rows(X, clip).T @ alpha / 25 + noise  # the server's b~: the same for both
    steps = int(rng.integers(1, 26))
    order = rng.permutation(25)
    moved = []
    for Xs, ys, al in ((X, y, alpha), (X2, y2, alpha2)):
        Xc = clip_rows(Xs, clip)
        own = b_pub - Xc.T @ al / 25  # the device's noise, so that b + e = b~
        out = _step(Xc, ys, c, al, own, 0.0, None, clip=clip, steps=steps, order=order)
        moved.append(out.noise - own + Xc.T @ (out.alpha - al) / 25)  # delta-b released
    w_norm = float(np.linalg.norm(public_model(b_pub, c, LAM, OMEGA)))
    bound = newcomer_sensitivity(clip, 25, LAM, OMEGA, steps, w_norm)
    assert np.linalg.norm(moved[0] - moved[1]) <= bound * (1 + 1e-12)
    assert bound <= newcomer_sensitivity(clip, 25, LAM, OMEGA, steps) == 2 * clip / 25


def test_without_noise_the_release_is_the_noise_free_step():
    X, y, c = _newcomer()
    out = _step(X, y, c, np.zeros(30), np.zeros(4), 0.0, noise_rng(1, 1, 1))
    np.testing.assert_array_equal(out.noise, np.zeros(4))
    np.testing.assert_array_equal(out.w, out.w_own)
    assert out.std == 0.0


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
