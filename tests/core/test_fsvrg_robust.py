"""fmtl_flower.core.fsvrg.robust: what the FSVRG family's server believes of a device's word."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from fmtl_flower.core.fsvrg import local_gram_product, local_loss_grad_sums
from fmtl_flower.core.fsvrg.robust import (
    GRADIENT_PAIRING_FLOOR,
    clip_rows,
    gradient_pairing_problem,
    gram_reply_problem,
    trusted_counts,
)
from fmtl_flower.data.sparse_federated import make_sparse_federated


@pytest.mark.parametrize(("tasks", "dim", "seed"), [(10, 300, 0), (20, 500, 3), (100, 2000, 0)])
def test_honest_pareto_counts_are_not_cut_by_the_fence(tasks, dim, seed):
    n = make_sparse_federated(num_tasks=tasks, dim=dim, seed=seed).n_train
    trusted = trusted_counts(n, 10**9, 1.0)
    assert trusted.dtype == np.int64
    np.testing.assert_array_equal(trusted, n)


def test_a_claim_is_cut_to_the_other_counts_fence_and_the_share_cap():
    n = np.array([35, 40, 42, 42, 45, 50, 60, 70, 86, 10**9])
    fenced = trusted_counts(n, 10**9, 1.0)
    np.testing.assert_array_equal(fenced[:-1], n[:-1])
    assert 10 * 42 <= fenced[-1] <= 12 * 42  # 10x the others' median, at least
    capped = trusted_counts(n, 10**9, 0.25)
    np.testing.assert_array_equal(capped[:-1], n[:-1])
    assert capped[-1] == int(n[:-1].sum() / 3)  # a share of 1/4: a third of the others'
    assert trusted_counts(n, 1000, 1.0)[-1] <= 1000  # the operator's max_n


@pytest.mark.parametrize("scale", [0.0, 1e-3, 1.0, 30.0, 1e4])
def test_honest_loss_and_gradient_sums_meet_their_pairing(scale):
    """``-W(1/e) n <= w . grad-sum <= loss-sum`` for the true sums at any ``w`` (small and huge
    margins of both signs); the floor is reached: a row at ``z = 1 + W(1/e)`` sits on it."""
    data = make_sparse_federated(num_tasks=3, dim=300, seed=1).task(0)
    rng = np.random.default_rng(7)
    for _ in range(20):
        w = scale * rng.normal(size=300)
        loss, grad = local_loss_grad_sums(data.X_train, data.y_train, w)
        assert gradient_pairing_problem(w, grad, loss, data.n_train) is None
    x = np.array([[1.0, 0.0]])
    z = 1.0 + GRADIENT_PAIRING_FLOOR  # argmin of -z sigma(-z)
    loss, grad = local_loss_grad_sums(sp.csr_matrix(x), np.array([1.0]), np.array([z, 0.0]))
    assert float(np.array([z, 0.0]) @ grad) == pytest.approx(-GRADIENT_PAIRING_FLOOR, rel=1e-12)
    assert gradient_pairing_problem(np.array([z, 0.0]), grad, loss, 1) is None


def test_a_gradient_pushing_against_w_beyond_the_floor_is_refused():
    data = make_sparse_federated(num_tasks=3, dim=300, seed=1).task(0)
    w = np.random.default_rng(3).normal(size=300)
    loss, grad = local_loss_grad_sums(data.X_train, data.y_train, w)
    n = data.n_train
    pushed = grad - (float(w @ grad) + 1.01 * GRADIENT_PAIRING_FLOOR * n) / float(w @ w) * w
    assert "below -W(1/e) n-train" in gradient_pairing_problem(w, pushed, loss, n)
    pulled = grad + (loss - float(w @ grad) + 1e-3 * n) / float(w @ w) * w
    assert "above loss-sum" in gradient_pairing_problem(w, pulled, loss, n)
    # at w = 0 every gradient pairs to 0: the first round's reply is not limited by it
    assert gradient_pairing_problem(np.zeros(300), pushed, n * np.log(2), n) is None


def test_gram_reply_checks_what_the_server_can_verify():
    rng = np.random.default_rng(0)
    X = sp.random(40, 30, density=0.2, random_state=1, format="csr")
    v = rng.normal(size=30)
    v /= np.linalg.norm(v)
    u = local_gram_product(X, v)
    lam_max = float(np.linalg.eigvalsh((X.T @ X).toarray())[-1])
    assert gram_reply_problem(v, u, lam_max * (1 + 1e-9)) is None
    assert "< 0" in gram_reply_problem(v, -1e3 * v, lam_max)
    assert "above" in gram_reply_problem(v, 10 * lam_max * v, lam_max)


def test_clip_rows_moves_only_the_far_rows():
    center = np.array([1.0, -2.0, 0.5])
    rows = center + np.array([[0.1, 0.0, 0.0], [0.0, 0.2, 0.0], [0.0, 0.0, 0.15],
                              [100.0, 0.0, 0.0]])
    out, radius, moved = clip_rows(rows, center)
    assert radius == pytest.approx(3 * 0.175)
    np.testing.assert_array_equal(moved, [False, False, False, True])
    np.testing.assert_array_equal(out[:3], rows[:3])  # bit for bit
    assert np.linalg.norm(out[3] - center) == pytest.approx(radius)
