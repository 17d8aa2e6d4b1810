"""Record-level DP's numerics (core/record_dp.py): row clipping, the sensitivity of one
release to one record, the noise's calibration, and the account's composition."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.baselines import mbsdca_local_update
from fmtl_flower.core.privacy import rdp_epsilon
from fmtl_flower.core.record_dp import (
    RecordAccountant,
    clip_rows,
    noise_norm_allowance,
    noise_rng,
    noisy_release,
    own_noise_free,
    record_contribution,
    release_sensitivity,
    separable_m_tt,
)
from fmtl_flower.core.sdca import sdca_local_update
from fmtl_flower.experiments.privacy_figure import exact_gaussian_epsilon


def test_clip_rows_scales_long_rows_to_the_norm_and_keeps_the_others_bit_for_bit():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 6)) * rng.uniform(0.1, 3.0, size=(50, 1))
    clip = 2.0
    out = clip_rows(X, clip)
    norms = np.linalg.norm(X, axis=1)
    long = norms > clip
    assert 0 < long.sum() < len(X)
    np.testing.assert_array_equal(out[~long], X[~long])
    np.testing.assert_allclose(np.linalg.norm(out[long], axis=1), clip, rtol=1e-14)
    np.testing.assert_allclose(out[long] * (norms[long] / clip)[:, None], X[long],
                               rtol=1e-13)  # the direction kept
    with pytest.raises(ValueError, match="dp-clip"):
        clip_rows(X, 0.0)


def _separable_release(X, y, alpha, w, m_tt, sigma_p, order):
    n = len(y)
    return mbsdca_local_update(X, y, alpha, w, m_tt=separable_m_tt(m_tt, sigma_p, n),
                               budget=n, order=order)[1]


@pytest.mark.parametrize("trial", range(20))
def test_one_record_moves_a_separable_release_by_at_most_the_sensitivity(trial):
    """Replace one record (adversarially: the opposite row and label, or a random one) with
    the rest and the duals held: the separable step's delta-b moves by <= 2 C / n."""
    rng = np.random.default_rng(trial)
    n, d, clip = 12, 4, 1.5
    X = clip_rows(rng.normal(size=(n, d)) * 2.0, clip)
    y = rng.choice([-1.0, 1.0], size=n)
    alpha = y * rng.uniform(0, 1, size=n)
    w = rng.normal(size=d) * 0.3
    order = rng.permutation(n)
    i = int(rng.integers(n))
    X2, y2, alpha2 = X.copy(), y.copy(), alpha.copy()
    if trial % 2:
        X2[i], y2[i], alpha2[i] = -X[i], -y[i], -alpha[i] * 0.0
    else:
        X2[i] = clip_rows(rng.normal(size=(1, d)) * 3, clip)[0]
        y2[i] = -y[i]
        alpha2[i] = y2[i] * rng.uniform()
    moved = np.linalg.norm(_separable_release(X, y, alpha, w, 0.7, 2.0, order)
                           - _separable_release(X2, y2, alpha2, w, 0.7, 2.0, order))
    assert moved <= release_sensitivity(clip, n) * (1 + 1e-12)


def test_only_the_separable_step_keeps_the_other_duals_independent_of_a_record():
    """Why the device's step is separable under record-level DP: after one round of MOCHA's
    own sequential SDCA, replacing record 0 has moved the duals of the other records (the
    device's hidden state, which every later release depends on), so no later release has a
    per-record bound; after the separable step only alpha_0 differs."""
    rng = np.random.default_rng(3)
    n, d, clip = 40, 3, 1.0
    X = clip_rows(rng.normal(size=(n, d)) * 0.2 + np.array([1.0, 0.0, 0.0]), clip)
    y = np.ones(n)
    X2 = X.copy()
    X2[0] = -0.3 * X[0]
    order = np.arange(n)
    common = {"alpha": np.zeros(n), "w": np.zeros(d), "order": order}
    sequential = [sdca_local_update(data, y, budget=n, m_tt=10.0, sigma_prime=1.0,
                                    **common)[0] for data in (X, X2)]
    separable = [mbsdca_local_update(data, y, budget=n, m_tt=separable_m_tt(10.0, 1.0, n),
                                     **common)[0] for data in (X, X2)]
    assert np.abs(sequential[0][1:] - sequential[1][1:]).max() > 1e-3
    np.testing.assert_array_equal(separable[0][1:], separable[1][1:])
    assert separable[0][0] != separable[1][0]


def test_sensitivity_scales_and_refuses_an_unbounded_dual():
    assert release_sensitivity(2.0, 10) == pytest.approx(0.4)
    assert release_sensitivity(2.0, 10, scale=0.25) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="bounded dual domain"):
        release_sensitivity(1.0, 10, dual_radius=np.inf)


def test_the_released_noise_has_the_calibrated_variance():
    """Over 4000 seeded releases of a fixed d_b, the empirical variance of every coordinate
    is (z Delta)^2 within 5 % (4000 draws: the relative std of a variance estimate is
    sqrt(2/4000) = 2.2 %), and the mean is d_b."""
    d_b = np.array([0.3, -0.1, 0.0, 2.0, 1.0])
    sensitivity, z = release_sensitivity(1.5, 37), 2.5
    released = np.stack([noisy_release(d_b, sensitivity, z, noise_rng(seed, 3, 7))
                         for seed in range(4000)])
    np.testing.assert_allclose(released.var(axis=0, ddof=1), (z * sensitivity) ** 2,
                               rtol=0.05)
    np.testing.assert_allclose(released.mean(axis=0), d_b, atol=4 * z * sensitivity / 60)
    assert noisy_release(d_b, sensitivity, 0.0, noise_rng(0, 3, 7)) is d_b


def test_the_noise_stream_is_seeded_by_the_device_seed_task_and_round_only_when_given():
    draw = [noise_rng(5, 2, 9).normal(size=3) for _ in range(2)]
    np.testing.assert_array_equal(*draw)
    assert not np.array_equal(noise_rng(5, 2, 9).normal(size=3),
                              noise_rng(5, 2, 10).normal(size=3))
    assert not np.array_equal(noise_rng(5, 2, 9).normal(size=3),
                              noise_rng(5, 3, 9).normal(size=3))
    assert not np.array_equal(noise_rng(None, 2, 9).normal(size=3),
                              noise_rng(None, 2, 9).normal(size=3))  # OS entropy


@pytest.mark.parametrize(("z", "steps"), [(1.0, 1), (1.5, 10), (4.0, 100)])
def test_the_account_composes_like_the_accountant_and_bounds_the_exact_epsilon(z, steps):
    """T releases of one device: the account's epsilon is dp-accounting's RDP epsilon of T
    self-composed Gaussian mechanisms, composed here one event at a time, and it is at
    least the exact epsilon of that composition (the analytic Gaussian mechanism with
    mu = sqrt(T) / z), and within 40 % of it."""
    import dp_accounting

    account = RecordAccountant(z, 1e-5)
    for _ in range(steps):
        account.add(np.array([True, False]))
    direct = dp_accounting.rdp.RdpAccountant()
    for _ in range(steps):
        direct.compose(dp_accounting.GaussianDpEvent(z))
    assert account.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert account.epsilon() == rdp_epsilon([(z, 1.0, steps)], 1e-5)
    assert account.epsilons()[1] == 0.0
    exact = exact_gaussian_epsilon(z, steps, 1e-5)
    assert exact <= account.epsilon() <= 1.4 * exact


def test_the_noise_allowance_bounds_the_noise_norm():
    rng = np.random.default_rng(0)
    std, dim = 0.3, 20
    norms = np.linalg.norm(rng.normal(0, std, size=(20000, dim)), axis=1)
    assert norms.max() < noise_norm_allowance(std, dim)
    summed = np.linalg.norm(rng.normal(0, std, size=(2000, 9, dim)).sum(axis=1), axis=1)
    assert summed.max() < noise_norm_allowance(std, dim, 9)


@pytest.mark.parametrize("loss", ["hinge", "smoothed-hinge"])
@pytest.mark.parametrize("trial", range(30))
def test_the_step_bound_holds_for_every_record_and_replacement(loss, trial):
    """The step-bounded contribution (public numbers: C, n, the step's curvature, |w|)
    bounds |x_i d_alpha_i| of every record of a separable step, and one replaced record
    moves the release by at most 2 c / n; rows of every norm in (0, C], margins of both
    signs, duals anywhere in their box."""
    rng = np.random.default_rng(100 + trial)
    n, d, clip = 15, 3, 2.0
    X = rng.normal(size=(n, d))
    X *= (clip * rng.uniform(0.01, 1.0, size=n) / np.linalg.norm(X, axis=1))[:, None]
    y = rng.choice([-1.0, 1.0], size=n)
    alpha = y * rng.uniform(0, 1, size=n)
    w = rng.normal(size=d) * 10 ** rng.uniform(-2, 1)
    curvature = 10 ** rng.uniform(-1, 3)
    order = rng.permutation(n)
    bound = record_contribution(clip, n, 1.0, curvature, float(np.linalg.norm(w)), loss)
    d_alpha = mbsdca_local_update(X, y, alpha, w, m_tt=curvature, budget=n, order=order,
                                  loss=loss)[0]
    assert (np.linalg.norm(X, axis=1) * np.abs(d_alpha)).max() <= bound * (1 + 1e-12)
    X2, y2, alpha2 = X.copy(), y.copy(), alpha.copy()
    i = int(rng.integers(n))  # the other record, with its own dual in its own box
    X2[i], y2[i] = -X[i] * rng.uniform(0.01, 1.0), -y[i]
    alpha2[i] = y2[i] * rng.uniform()
    moved = np.linalg.norm(
        mbsdca_local_update(X, y, alpha, w, m_tt=curvature, budget=n, order=order,
                            loss=loss)[1]
        - mbsdca_local_update(X2, y2, alpha2, w, m_tt=curvature, budget=n, order=order,
                              loss=loss)[1])
    assert moved <= release_sensitivity(clip, n, contribution=bound) * (1 + 1e-12)


def test_the_step_bound_is_the_box_for_other_losses_and_shrinks_with_curvature():
    assert record_contribution(2.0, 10, 1.0, 5.0, 0.1, "logistic") == 2.0
    assert record_contribution(2.0, 10, 1.0, None) == 2.0
    small = record_contribution(2.0, 10, 1.0, 1000.0, 0.0)
    assert small == pytest.approx(np.sqrt(10 / 1000.0))  # x* = sqrt(n / curvature) at w = 0
    assert record_contribution(2.0, 10, 1.0, 0.01, 0.0) == 2.0


def test_the_model_without_own_noise_is_the_column_of_the_true_image_and_the_others_noise():
    """With B = B_true + E and a symmetric positive definite M (any formulation's K^-1),
    w_t - m_tt e_t from the server's w_t is column t of W computed from B_true with only the
    other devices' noise; with no noise to remove the model is w itself."""
    rng = np.random.default_rng(4)
    d, m = 6, 5
    A = rng.normal(size=(m, m))
    M = A @ A.T + m * np.eye(m)
    B_true, E = rng.normal(size=(d, m)), 0.3 * rng.normal(size=(d, m))
    W = (B_true + E) @ M
    for t in range(m):
        others = E.copy()
        others[:, t] = 0.0
        np.testing.assert_allclose(own_noise_free(W[:, t], M[t, t], E[:, t]),
                                   ((B_true + others) @ M)[:, t], rtol=0, atol=1e-12)
    w = W[:, 0]
    assert own_noise_free(w, M[0, 0], np.zeros(0)) is w
    with pytest.raises(ValueError, match="m-tt"):
        own_noise_free(w, float("nan"), E[:, 0])


def test_the_step_bound_asks_the_loss_for_its_dual_slope():
    """The slope is the loss's ``dual_slope`` (the hinges' 1, as before; inf for the
    others), a name or a registered Loss alike; an unknown name is an error, not a box."""
    from fmtl_flower.core.losses import LOSSES

    assert {name: loss.dual_slope for name, loss in LOSSES.items()} == {
        "hinge": 1.0, "smoothed-hinge": 1.0, "logistic": np.inf, "squared": np.inf}
    for name, loss in LOSSES.items():
        a = np.linspace(*np.clip(loss.dual_domain, -5.0, 5.0), 2001)[1:-1]
        slope = np.abs(np.diff(loss.dual(a)) / np.diff(a))
        if np.isfinite(loss.dual_slope):  # a true sup of |D'| over the domain
            assert slope.max() <= loss.dual_slope * (1 + 1e-9)
            assert slope.max() >= 0.99 * loss.dual_slope
        else:
            assert slope.max() > 4.0  # unbounded (as far as the grid reaches)
        args = (2.0, 10, 1.0, 1000.0, 0.3)
        assert record_contribution(*args, loss) == record_contribution(*args, name)
    hinge = record_contribution(2.0, 10, 1.0, 1000.0, 0.3, "hinge")
    assert hinge < 2.0 and record_contribution(2.0, 10, 1.0, 1000.0, 0.3, "squared") == 2.0
    with pytest.raises(ValueError, match="loss must be one of"):
        record_contribution(2.0, 10, 1.0, 1000.0, 0.3, "no-such-loss")
