"""The certificate's algebra (:mod:`fmtl_flower.core.certificate`): truthful pairs pass the
Fenchel-Young check for any model and any feasible dual, a reported gap is the sum of the
pairs' slacks (so it is >= 0 when every pair passes), and pairs off the bound fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp

from fmtl_flower.core.certificate import (
    PAIR_SLACK,
    REASON_PREFIX,
    certificate_rejections,
    hinge_pair_problems,
    logistic_pair_problem,
)
from fmtl_flower.core.fsvrg import dual_objective, global_objective
from fmtl_flower.core.fsvrg.cocoa_plus import logistic_dual_sum, primal_from_dual
from fmtl_flower.core.fsvrg.logistic import local_loss_grad_sums
from fmtl_flower.core.hinge import hinge_conjugate_value, mean_hinge_loss
from fmtl_flower.core.objective import primal_dual_gap

SEEDS = range(40)


def _hinge_task(rng: np.random.Generator, n: int, d: int, scale: float):
    X = rng.normal(size=(n, d)) * scale
    y = rng.choice([-1.0, 1.0], size=n)
    beta = rng.random(n) * (rng.random(n) < 0.7)  # y alpha in [0, 1], some at 0
    beta[rng.random(n) < 0.2] = 1.0
    return X, y, y * beta


@pytest.mark.parametrize("seed", SEEDS)
def test_truthful_hinge_pairs_pass_and_the_gap_is_the_sum_of_their_slacks(seed):
    rng = np.random.default_rng(seed)
    m, d = 5, 4
    tasks = [_hinge_task(rng, int(rng.integers(1, 30)), d, 10.0 ** rng.uniform(-2, 2))
             for _ in range(m)]
    W = rng.normal(size=(d, m)) * 10.0 ** rng.uniform(-3, 3)  # any models, not W(alpha)
    B = np.stack([X.T @ alpha / len(y) for X, y, alpha in tasks], axis=1)
    loss = np.array([mean_hinge_loss(X, y, W[:, t]) for t, (X, y, _) in enumerate(tasks)])
    dual = np.array([hinge_conjugate_value(alpha, y) for _, y, alpha in tasks])
    coupling = np.einsum("ij,ij->j", W, B)
    assert hinge_pair_problems(loss, dual, coupling) == {}
    slack = loss - dual + coupling
    assert np.all(slack >= -PAIR_SLACK * (np.abs(loss) + np.abs(dual) + np.abs(coupling)))
    _, _, gap = primal_dual_gap(loss, dual, W, B)
    assert gap == pytest.approx(slack.sum(), rel=1e-12, abs=1e-12 * np.abs(coupling).sum())


def test_hinge_pairs_off_the_bound_or_the_box_fail():
    loss, dual, coupling = (np.array(v) for v in ([0.5, 0.0, -0.1, 0.2, 0.3],
                                                   [0.1, 1.0, 0.0, 1.5, 0.5],
                                                   [0.0, 0.3, 0.0, 0.0, 0.2 - 1e-6]))
    problems = hinge_pair_problems(loss, dual, coupling)
    assert sorted(problems) == [1, 2, 3, 4]  # row 0 passes; row 4 is 1e-6 below the bound
    assert all(reason.startswith(REASON_PREFIX) for reason in problems.values())
    assert "Fenchel-Young" in problems[1] and "dual-mean in [0, 1]" in problems[3]
    assert certificate_rejections({0: problems[1], 1: "'delta-b' has non-finite values"}) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_truthful_logistic_pairs_pass_and_the_gap_is_their_sum(seed):
    rng = np.random.default_rng(seed)
    nodes, d, lam = 4, 6, 10.0 ** rng.uniform(-4, -1)
    data = []
    for _ in range(nodes):
        n_k = int(rng.integers(1, 25))
        X = sp.random(n_k, d, density=0.5, random_state=int(rng.integers(1 << 31)), format="csr")
        y = rng.choice([-1.0, 1.0], size=n_k)
        data.append((X, y, y * rng.random(n_k)))
    n = sum(len(y) for _, y, _ in data)
    shares = [primal_from_dual(X, alpha, lam, n) for X, _, alpha in data]
    w = np.sum(shares, axis=0)  # w = w(alpha)
    slacks, losses, duals = [], [], []
    for (X, y, alpha), v in zip(data, shares, strict=True):
        loss, _ = local_loss_grad_sums(X, y, w)
        dual = logistic_dual_sum(y, alpha)
        coupling = lam * n * float(w @ v)
        assert logistic_pair_problem(loss, dual, len(y), coupling) is None
        slacks.append(loss - dual + coupling)
        losses.append(loss)
        duals.append(dual)
    gap = global_objective(w, sum(losses), n, lam) - dual_objective(w, sum(duals), n, lam)
    assert gap == pytest.approx(sum(slacks) / n, rel=1e-9, abs=1e-12)


def test_logistic_pairs_off_the_bound_or_the_box_fail():
    n_k = 10
    assert logistic_pair_problem(5.0, 4.0, n_k, 0.0) is None
    assert "Fenchel-Young" in logistic_pair_problem(5.0, 5.1, n_k, 0.0)
    assert "n-train log 2" in logistic_pair_problem(5.0, n_k * math.log(2.0) + 1e-3, n_k, 9.0)
    assert "n-train log 2" in logistic_pair_problem(-1e-3, 0.0, n_k, 9.0)
