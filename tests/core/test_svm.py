"""The SVM baselines against scikit-learn's LinearSVC (an independent solver)."""

import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.svm import LinearSVC

from fmtl_flower.core.hinge import mean_hinge_loss
from fmtl_flower.core.svm import fit_global_svm, fit_linear_svm, fit_local_svms


def svm_objective(X, y, w, lam):
    return mean_hinge_loss(X, y, w) + 0.5 * lam * w @ w


def test_matches_liblinear_optimum():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 6))
    y = np.sign(X @ rng.normal(size=6) + 0.5 * rng.normal(size=80))
    for lam in (1e-3, 1e-2, 1e-1, 1.0):
        w, gap = fit_linear_svm(X, y, lam, tol=1e-9, max_epochs=100000)  # c = lam
        assert gap <= 1e-9
        svc = LinearSVC(loss="hinge", fit_intercept=False, C=1.0 / (lam * len(y)), tol=1e-12,
                        max_iter=10**5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            svc.fit(X, y)
        ours, theirs = svm_objective(X, y, w, lam), svm_objective(X, y, svc.coef_.ravel(), lam)
        assert ours <= theirs * (1 + 1e-9)  # never worse than the independent solver
        if svc.n_iter_ < 10**5:  # where liblinear converges, the two agree
            assert abs(ours - theirs) / theirs < 1e-8


def test_single_class_task_and_shapes():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30, 4))
    y = -np.ones(30)
    w, gap = fit_linear_svm(X, y, 0.1, tol=1e-8, max_epochs=10000)
    assert gap <= 1e-8
    assert svm_objective(X, y, w, 0.1) < 1.0  # better than w = 0
    tasks = [(X, y), (rng.normal(size=(20, 4)), rng.choice([-1.0, 1.0], size=20))]
    assert fit_local_svms(tasks, 0.1).shape == (4, 2)
    W = fit_global_svm(tasks, 0.1)
    assert W.shape == (4, 2) and np.array_equal(W[:, 0], W[:, 1])
