"""The robust statistics of core.robust against brute force and their defining properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import trim_mean

from fmtl_flower.core.robust import (
    cap_shares,
    clip_to_ball,
    coordinate_median,
    krum_select,
    log_upper_fence,
    median_mad,
    outlier_mask,
    robust_radius,
    trimmed_mean,
    upper_fence,
)

weights_lists = st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(weights_lists, st.floats(0.01, 1.0))
def test_cap_shares_caps_every_share_keeps_the_total_and_the_order(weights, max_share):
    w = np.array(weights)
    out = cap_shares(w, max_share)
    total = w.sum()
    assert out.sum() == pytest.approx(total, rel=1e-9, abs=1e-12)
    assert np.all(out >= 0)
    if total > 0 and np.count_nonzero(w) > 1:
        share = max(max_share, 1.0 / w.size)
        # no share above the cap unless too few devices carry weight to spread it
        if np.count_nonzero(w) * share >= 1.0 - 1e-9:
            assert np.all(out / out.sum() <= share * (1 + 1e-9))
    # the order of the weights is kept (ties may form at the cap)
    order = np.argsort(w, kind="stable")
    assert np.all(np.diff(out[order]) >= -1e-9 * max(total, 1.0))


def test_cap_shares_leaves_weights_under_the_cap_alone_and_caps_a_liar():
    w = np.array([3.0, 2.0, 1.0, 4.0])
    assert np.array_equal(cap_shares(w, 0.5), w)
    liar = cap_shares(np.array([1e9, 1.0, 1.0, 1.0, 1.0]), 0.25)
    assert liar[0] / liar.sum() == pytest.approx(0.25)
    assert np.allclose(liar[1:], liar[1])  # the honest ones keep their proportions


def test_cap_shares_refuses_negative_or_non_finite_weights():
    for bad in ([1.0, -1.0], [1.0, math.nan], [math.inf, 1.0]):
        with pytest.raises(ValueError, match="finite, non-negative"):
            cap_shares(np.array(bad), 0.5)


@settings(max_examples=100, deadline=None)
@given(st.integers(3, 25), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_unweighted_trimmed_mean_equals_scipy_where_the_cut_is_whole(k, d, seed):
    points = np.random.default_rng(seed).normal(size=(k, d))
    for cut in range(0, (k - 1) // 2 + 1):
        trim = cut / k
        if trim >= 0.5:
            continue
        assert np.allclose(trimmed_mean(points, trim), trim_mean(points, trim, axis=0))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 25), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_unweighted_median_equals_numpy(k, d, seed):
    points = np.random.default_rng(seed).normal(size=(k, d))
    assert np.allclose(coordinate_median(points), np.median(points, axis=0))


def test_integer_weights_equal_repeated_rows():
    rng = np.random.default_rng(1)
    points = rng.normal(size=(6, 3))
    counts = np.array([1, 3, 2, 1, 4, 1])
    repeated = np.repeat(points, counts, axis=0)
    assert np.allclose(coordinate_median(points, counts), np.median(repeated, axis=0))
    # a trim of 2/12 of the weight cuts exactly 2 repeated rows from each end
    assert np.allclose(trimmed_mean(points, 2 / 12, counts), trim_mean(repeated, 2 / 12, axis=0))


def test_one_liar_moves_the_trimmed_mean_and_median_by_little_and_the_mean_by_much():
    rng = np.random.default_rng(2)
    honest = rng.normal(size=(9, 50))
    liar = np.full((1, 50), 1e6)
    points = np.vstack([honest, liar])
    assert np.abs(points.mean(axis=0)).max() > 1e4
    assert np.abs(trimmed_mean(points, 0.2)).max() < 3.0
    assert np.abs(coordinate_median(points)).max() < 3.0


def test_clip_to_ball_moves_only_the_rows_outside():
    center = np.array([1.0, 1.0])
    points = np.array([[1.5, 1.0], [11.0, 1.0], [1.0, -9.0]])
    out = clip_to_ball(points, center, 2.0)
    assert np.array_equal(out[0], points[0])
    assert np.allclose(out[1], [3.0, 1.0])
    assert np.allclose(out[2], [1.0, -1.0])


def test_robust_radius_and_fences_ignore_one_liar():
    sizes = np.array([1.0, 1.2, 0.9, 1.1, 1e9])
    assert robust_radius(sizes, 3.0) == pytest.approx(3.3)
    assert upper_fence(sizes, k=5) < 2.0
    assert log_upper_fence(sizes, factor=10.0) < 20.0
    assert outlier_mask(sizes).tolist() == [False, False, False, False, True]
    assert outlier_mask(np.array([1.0, math.nan, 1.0, 1.0])).tolist() == [False, True, False, False]
    assert median_mad(np.array([math.nan]))[0] != median_mad(np.array([math.nan]))[0]  # nan
    assert upper_fence(np.array([math.inf])) == math.inf


def test_krum_picks_the_honest_cluster():
    rng = np.random.default_rng(3)
    honest = rng.normal(size=(8, 5))
    liars = 50.0 + rng.normal(size=(2, 5))
    chosen = krum_select(np.vstack([honest, liars]), num_malicious=2, num_selected=4)
    assert set(chosen.tolist()) <= set(range(8))


def test_cap_shares_keeps_the_cap_when_the_free_mass_is_subnormal():
    """Found by the property test above: with weights [1, 5e-324] and a cap of 0.625 the
    water-filling's product with a subnormal free mass rounded the shares to 2/3 and 1/3."""
    out = cap_shares(np.array([1.0, 5e-324]), 0.625)
    np.testing.assert_allclose(out / out.sum(), [0.625, 0.375], rtol=1e-12)
