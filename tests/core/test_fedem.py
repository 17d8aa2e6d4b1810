"""FedEM's numerics: E-step, pi update, EM on pi alone, aggregation, sampling, lr schedule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fmtl_flower.core.fedem import (
    PI_FLOOR,
    aggregate_components,
    check_simplex,
    e_step,
    fit_mixture_weights,
    learning_rate,
    local_update,
    mixture_log_likelihood,
    mixture_proba,
    robust_aggregate_components,
    sample_clients,
    trimmed_device_count,
    update_pi,
)
from fmtl_flower.core.local_sgd import SGDConfig
from fmtl_flower.core.models import make_model
from fmtl_flower.core.robust import trimmed_mean


def direct_e_step(pi: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """q[m, i] = pi_m exp(-l[m, i]) / sum_m' pi_m' exp(-l[m', i]), computed naively."""
    joint = pi[:, None] * np.exp(-losses)
    return joint / joint.sum(axis=0, keepdims=True)


def test_e_step_matches_direct_computation_on_small_cases():
    rng = np.random.default_rng(0)
    for M in (1, 2, 3, 5):
        pi = rng.dirichlet(np.ones(M))
        losses = rng.exponential(2.0, size=(M, 40))
        np.testing.assert_allclose(e_step(pi, losses), direct_e_step(pi, losses), rtol=1e-12)


def test_pi_update_matches_direct_mean_and_sums_to_one():
    rng = np.random.default_rng(1)
    pi = rng.dirichlet(np.ones(3))
    losses = rng.exponential(1.0, size=(3, 25))
    q = direct_e_step(pi, losses)
    new = update_pi(e_step(pi, losses))
    np.testing.assert_allclose(new, q.mean(axis=1), rtol=1e-9)
    assert new.sum() == pytest.approx(1.0, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, (3, 7), elements=st.floats(0, 1e300)),
       st.lists(st.floats(0, 1), min_size=3, max_size=3).filter(lambda v: sum(v) > 0))
def test_e_step_columns_on_simplex_and_finite_for_extreme_losses(losses, weights):
    pi = np.array(weights) / sum(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = e_step(pi, losses)
        new = update_pi(q)
    assert np.all(np.isfinite(q)) and np.all(q >= 0)
    np.testing.assert_allclose(q.sum(axis=0), 1.0, atol=1e-12)
    assert np.all(q[pi == 0] == 0)
    assert np.all(new >= PI_FLOOR * 0.99) and new.sum() == pytest.approx(1.0)


def test_e_step_infinite_losses_fall_back_on_the_prior():
    pi = np.array([0.2, 0.8])
    losses = np.array([[np.inf, 1.0, 1e4], [np.inf, np.inf, 1e4]])
    q = e_step(pi, losses)
    np.testing.assert_allclose(q[:, 0], pi)
    np.testing.assert_allclose(q[:, 1], [1.0, 0.0])
    np.testing.assert_allclose(q[:, 2], pi)  # equal large losses: the prior decides
    with pytest.raises(ValueError, match="NaN"):
        e_step(pi, np.array([[np.nan], [1.0]]))
    with pytest.raises(ValueError, match="shape"):
        e_step(pi, np.ones((3, 2)))


def test_pi_floor_keeps_components_alive():
    q = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    pi = update_pi(q)
    assert pi[1] >= PI_FLOOR * 0.99 and pi.sum() == pytest.approx(1.0)
    # a component at the floor can come back: its responsibilities are not 0
    assert e_step(pi, np.array([[50.0], [0.0]]))[1, 0] > 0.5
    with pytest.raises(ValueError, match="floor"):
        update_pi(q, floor=0.6)


def test_fit_mixture_weights_reaches_the_maximum_likelihood():
    rng = np.random.default_rng(2)
    losses = rng.exponential(1.0, size=(3, 200))
    pi, iters = fit_mixture_weights(losses, tol=1e-13, max_iter=20000)
    assert iters < 20000
    # stationarity on the simplex: d/dpi_m sum_i log p_i = sum_i exp(-l_mi) / p_i = n for
    # every component with pi_m above the floor
    p = pi @ np.exp(-losses)
    grad = np.exp(-losses) @ (1.0 / p)
    live = pi > 10 * PI_FLOOR
    np.testing.assert_allclose(grad[live], losses.shape[1], rtol=1e-6)
    assert np.all(grad[~live] <= losses.shape[1] * (1 + 1e-6))
    # and EM never decreases the log-likelihood
    values, current = [], np.full(3, 1 / 3)
    for _ in range(20):
        values.append(mixture_log_likelihood(current, losses).sum())
        current = update_pi(e_step(current, losses))
    assert np.all(np.diff(values) >= -1e-9)


def test_check_simplex_rejects_bad_pi():
    check_simplex(np.array([0.5, 0.5]), 2)
    for bad, match in ((np.array([0.5, 0.6]), "simplex"), (np.array([1.5, -0.5]), "simplex"),
                       (np.array([np.nan, 1.0]), "non-finite"), (np.ones(3) / 3, "expected 2")):
        with pytest.raises(ValueError, match=match):
            check_simplex(bad, 2)


def test_aggregation_authors_rule_and_unbiased_rule():
    current = np.array([[0.0, 0.0], [1.0, 1.0]])
    a = (np.array([[1.0, 2.0], [3.0, 3.0]]), np.array([10.0, 10.0]))
    b = (np.array([[3.0, 2.0], [1.0, 1.0]]), np.array([30.0, 30.0]))
    # authors: N = 100 with 60 samples on clients that did not reply (they hold current)
    out = aggregate_components(current, [a, b], total_weight=100.0)
    expected = (10 * a[0] + 30 * b[0] + 60 * current) / 100
    np.testing.assert_allclose(out, expected)
    # unbiased: average over the replies only
    out = aggregate_components(current, [a, b])
    np.testing.assert_allclose(out, (10 * a[0] + 30 * b[0]) / 40)
    # a component nobody trained keeps its value
    c = (np.array([[5.0, 5.0], [9.0, 9.0]]), np.array([10.0, 0.0]))
    out = aggregate_components(current, [c])
    np.testing.assert_allclose(out, [[5.0, 5.0], [1.0, 1.0]])


def test_sample_clients_count_and_determinism():
    ids = np.arange(300)
    rng = np.random.default_rng(3)
    s = sample_clients(ids, 0.1, rng)
    assert s.size == 30 and np.unique(s).size == 30 and np.all(np.diff(s) > 0)
    assert sample_clients(ids, 0.001, rng).size == 1
    np.testing.assert_array_equal(sample_clients(ids, 1.0, rng), ids)
    np.testing.assert_array_equal(sample_clients(ids, 0.5, np.random.default_rng(4)),
                                  sample_clients(ids, 0.5, np.random.default_rng(4)))
    with pytest.raises(ValueError, match="fraction"):
        sample_clients(ids, 0.0, rng)


def test_learning_rate_schedules():
    assert learning_rate(0.1, 77, 200, "constant") == 0.1
    assert learning_rate(0.1, 100, 200, "multi-step") == pytest.approx(0.1)
    assert learning_rate(0.1, 101, 200, "multi-step") == pytest.approx(0.01)
    assert learning_rate(0.1, 151, 200, "multi-step") == pytest.approx(0.001)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate(0.1, 1, 10, "cosine")


def _mixture_data(seed: int = 0, n: int = 400, d: int = 5):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1, 1, size=(n, d))
    thetas = rng.normal(size=(2, d)) * 3
    z = rng.random(n) < 0.7
    y = np.where(z, X @ thetas[0] > 0, X @ thetas[1] > 0).astype(np.int64)
    return X, y


def test_local_update_mixture_mode_trains_every_component_and_updates_pi():
    X, y = _mixture_data()
    model = make_model("logistic", X.shape[1])
    rng = np.random.default_rng(0)
    comps = np.stack([model.init_params(np.random.default_rng(m)) for m in range(2)])
    out = local_update(model, comps, np.full(2, 0.5), np.zeros_like(comps), X, y,
                       SGDConfig(lr=0.1, batch_size=32), rng)
    assert np.all(out.weights == X.shape[0])
    assert not np.allclose(out.components, comps)
    assert out.pi.sum() == pytest.approx(1.0)
    losses = np.stack([model.per_sample_loss(t, X, y) for t in comps])
    np.testing.assert_allclose(out.pi, update_pi(e_step(np.full(2, 0.5), losses)))
    assert out.train_loss == pytest.approx(-mixture_log_likelihood(out.pi, losses).mean())


def test_local_update_cluster_mode_trains_only_the_best_component():
    X, y = _mixture_data(1)
    model = make_model("logistic", X.shape[1])
    good = np.zeros(model.num_params)
    good[:-1] = np.linalg.lstsq(X, 2.0 * y - 1, rcond=None)[0] * 5
    comps = np.stack([-good, good])
    out = local_update(model, comps, np.full(2, 0.5), np.zeros_like(comps), X, y,
                       SGDConfig(lr=0.05), np.random.default_rng(0), mode="cluster")
    np.testing.assert_array_equal(out.weights, [0.0, X.shape[0]])
    np.testing.assert_array_equal(out.components[0], comps[0])
    np.testing.assert_array_equal(out.pi, [0.0, 1.0])


def test_mixture_proba_is_the_weighted_mixture():
    X, _ = _mixture_data(2, n=30)
    model = make_model("logistic", X.shape[1])
    comps = np.stack([model.init_params(np.random.default_rng(m)) for m in range(3)])
    pi = np.array([0.2, 0.3, 0.5])
    expected = sum(w * model.predict_proba(t, X) for w, t in zip(pi, comps, strict=True))
    np.testing.assert_allclose(mixture_proba(model, comps, pi, X), expected)


# ----------------------------------------------------------------------------- robust mode
def _honest_updates(rng: np.random.Generator, current: np.ndarray, k: int = 9
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` replies whose updates have alike sizes (nothing to clip) and weights 20..100."""
    return [(current + 0.1 * rng.normal(size=current.shape) + 0.05,
             np.full(current.shape[0], float(rng.integers(20, 100)))) for _ in range(k)]


@pytest.mark.parametrize("total", [None, 5000.0])
def test_robust_mean_with_nothing_to_cut_is_the_plain_rule(total):
    rng = np.random.default_rng(0)
    current = rng.normal(size=(2, 6))
    updates = _honest_updates(rng, current)
    np.testing.assert_allclose(
        robust_aggregate_components(current, updates, total, aggregator="mean",
                                    max_share=1.0),
        aggregate_components(current, updates, total), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("aggregator", ["trimmed-mean", "median"])
def test_one_device_far_out_with_a_huge_weight_is_cut_whole(aggregator):
    """Honest devices agreeing on one update v; the hostile one at 1e6 in every coordinate
    claiming 1e9 examples: the robust aggregate is v (the plain rule: the hostile's)."""
    current = np.zeros((2, 5))
    v = np.array([[0.1, -0.2, 0.3, 0.0, 0.5], [1.0, 1.0, -1.0, 0.2, 0.0]])
    updates = [(current + v, np.full(2, 50.0 + k)) for k in range(9)]
    updates.append((current + 1e6, np.full(2, 1e9)))
    robust = robust_aggregate_components(current, updates, aggregator=aggregator,
                                         max_share=0.25)
    np.testing.assert_allclose(robust, v, rtol=1e-12)
    assert np.all(aggregate_components(current, updates) > 9e5)


def test_the_trimmed_window_gives_no_device_more_than_max_share():
    """A hostile device inside the honest range of every coordinate (not cut) with a huge
    weight carries at most max_share of the trimmed mean's window: its pull on the
    aggregate is at most max_share of its distance to the honest result."""
    current = np.zeros((1, 1))
    honest = np.linspace(-1.0, 1.0, 9)
    updates = [(np.array([[x]]), np.array([100.0])) for x in honest]
    alone = robust_aggregate_components(current, updates, max_share=0.25, trim=0.2)
    hostile = 0.75  # inside the honest range: not at an extreme
    pulled = robust_aggregate_components(
        current, [*updates, (np.array([[hostile]]), np.array([1e9]))], max_share=0.25,
        trim=0.2)
    assert 0 < pulled[0, 0] - alone[0, 0] <= 0.25 * (hostile - alone[0, 0])


def test_a_component_nobody_trained_keeps_its_value_and_zero_weights_are_ignored():
    """IFCA: each reply trains one component (weight 0 for the others)."""
    current = np.arange(6.0).reshape(3, 2)
    updates = [(current + np.array([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]) + k * 0.01,
                np.array([10.0, 0.0, 0.0])) for k in range(5)]
    updates.append((current + np.array([[0, 0], [7.0, 7.0], [0, 0]]), np.array([0, 10.0, 0])))
    out = robust_aggregate_components(current, updates)
    np.testing.assert_array_equal(out[2], current[2])
    np.testing.assert_allclose(out[1], current[1] + 7.0)  # its one trainer, clipped to 3x itself
    assert np.all(np.abs(out[0] - current[0] - 1.02) <= 0.02 + 1e-12)


def test_a_reversed_update_far_out_pulls_no_further_than_the_honest_spread():
    """Nine devices agreeing on g up to a spread of 0.01 per coordinate, a tenth sending
    -100 g: clipped to the ball around the median of twice the honest median distance,
    it moves the mean by a tenth of that radius (clipped around 0 to a multiple of the
    updates' size, as before, it took 0.4 |g| off the step)."""
    rng = np.random.default_rng(3)
    current = np.zeros((1, 5))
    g = np.array([[0.5, -0.4, 0.3, 0.2, -0.6]])
    updates = [(g + 0.01 * rng.normal(size=g.shape), np.array([50.0])) for _ in range(9)]
    updates.append((-100.0 * g, np.array([50.0])))
    out = robust_aggregate_components(current, updates, aggregator="mean", max_share=1.0)
    assert np.linalg.norm(out - g) < 0.02 * np.linalg.norm(g)


def test_a_small_cluster_keeps_its_devices_sizes():
    """IFCA: a cluster of 3 devices (86, 192 and 1000 examples) among 10 is averaged with
    those weights (a trimmed mean over 3 cuts no device, and none holds max_share of the
    round's data); before, its shares were equalised and cut to the coordinate median."""
    current = np.zeros((2, 2))
    small = [np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([0.9, 0.9])]
    n = np.array([86.0, 192.0, 1000.0])
    updates = [(np.stack([u, np.zeros(2)]), np.array([w, 0.0])) for u, w in zip(small, n,
                                                                                strict=True)]
    updates += [(np.stack([np.zeros(2), np.full(2, 0.1 * k)]), np.array([0.0, 1000.0]))
                for k in range(7)]
    out = robust_aggregate_components(current, updates, max_share=0.25, trim=0.2)
    np.testing.assert_allclose(out[0], n @ np.stack(small) / n.sum(), rtol=1e-12)


@pytest.mark.parametrize(("contributors", "cut"), [(1, 0), (3, 0), (4, 0), (5, 1), (9, 1),
                                                   (10, 2), (300, 60)])
def test_the_trimmed_mean_cuts_whole_devices_and_none_from_a_small_cluster(contributors,
                                                                            cut):
    assert trimmed_device_count(0.2, contributors) == cut


def test_robust_aggregation_names_a_wrong_aggregator():
    with pytest.raises(ValueError, match="aggregator"):
        robust_aggregate_components(np.zeros((1, 2)), [(np.ones((1, 2)), np.ones(1))],
                                    aggregator="krum")


@pytest.mark.parametrize("total", [None, 900.0])
def test_responsibility_scaled_updates_give_fedem_s_own_step(total):
    """Devices whose updates are their responsibility times one direction per component
    (d_k = r[k, m] g_m, as a responsibility-weighted local loss gives): the robust mean is
    the authors' rule, sum_k n_k d_k / Z, however the devices' mixtures differ."""
    rng = np.random.default_rng(1)
    current = rng.normal(size=(3, 4))
    g = rng.normal(size=(3, 4))
    resp = rng.dirichlet(np.ones(3), size=8)
    n = rng.integers(20, 100, size=8).astype(float)
    updates = [(current + resp[k][:, None] * g, np.full(3, n[k])) for k in range(8)]
    np.testing.assert_allclose(
        robust_aggregate_components(current, updates, total, aggregator="mean",
                                    max_share=1.0, responsibilities=resp),
        aggregate_components(current, updates, total), rtol=1e-10)


#: Local SGD steps of devices with 86 to 1000 examples at batch 32, one epoch each.
STEPS = np.ceil(np.array([86.0, 192, 69, 1000, 936, 115, 145, 304, 710]) / 32)


def test_updates_compared_per_local_step_give_fednova_s_step_unclipped():
    """Honest devices that each take tau_k local steps along one direction (d_k =
    r[k, m] tau_k g_m: a device with 15 times the data moves 15 times as far): compared per
    step (``local_steps``) they are alike, nothing is clipped, and the robust mean is the
    authors' rule; compared at their own scale, devices whose step counts are far from the
    median's lie outside twice the median distance and were clipped (the mean 11 % off the
    authors' rule in one component here)."""
    rng = np.random.default_rng(4)
    current = rng.normal(size=(2, 5))
    g = rng.normal(size=(2, 5))
    resp = rng.dirichlet(np.ones(2), size=STEPS.size)
    updates = [(current + r[:, None] * tau * g, np.full(2, 32.0 * tau))
               for r, tau in zip(resp, STEPS, strict=True)]
    plain = aggregate_components(current, updates)
    per_step = robust_aggregate_components(current, updates, aggregator="mean", max_share=1.0,
                                           responsibilities=resp, local_steps=STEPS)
    np.testing.assert_allclose(per_step, plain, rtol=1e-10)
    own_scale = robust_aggregate_components(current, updates, aggregator="mean",
                                            max_share=1.0, responsibilities=resp)
    off = np.linalg.norm(own_scale - plain, axis=1) / np.linalg.norm(plain - current, axis=1)
    assert off.max() > 0.1


@pytest.mark.parametrize("contributors", [9, 10])
def test_fedem_s_trimmed_mean_cuts_trim_of_the_weight_whatever_the_count(contributors):
    """FedEM's soft responsibilities: the trimmed mean cuts ``trim`` of the weight from each
    end with 9 contributors as with 10 (it cut floor(trim K) / K: 1/9 against 2/10, so a
    tenth device's reply moved the aggregate of the other nine)."""
    values = np.array([0.11, 0.12, 0.3, 0.4, 0.5, 0.55, 0.6, 0.85, 0.89, 0.5])[:contributors]
    updates = [(np.array([[0.5 * x, 0.0], [0.0, 0.0]]), np.full(2, 10.0)) for x in values]
    out = robust_aggregate_components(np.zeros((2, 2)), updates, trim=0.2,
                                      responsibilities=np.full((contributors, 2), 0.5))
    assert out[0, 0] / 0.5 == pytest.approx(float(trimmed_mean(values, 0.2)), rel=1e-12)
