"""pFedMe's device numerics: the inner (Moreau envelope) solve and the local pass."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.models import make_model
from fmtl_flower.core.pfedme import PFedMeConfig, local_pass, moreau_objective, solve_inner


def problem(n: int = 64, dim: int = 5, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    model = make_model("softmax", dim, num_classes=classes)
    X = rng.normal(size=(n, dim))
    y = np.argmax(X @ rng.normal(size=(dim, classes)), axis=1)
    w = model.init_params(rng) + rng.normal(size=model.num_params)
    return model, X, y, w


@pytest.mark.parametrize("lam, steps", [(15.0, 5), (1.0, 20), (0.1, 50)])
def test_inner_solve_decreases_the_moreau_objective(lam, steps):
    model, X, y, w = problem()
    config = PFedMeConfig(lr=0.01, personal_lr=0.5 / (lam + 1.0), lam=lam, inner_steps=steps,
                          weight_decay=1e-3)
    rng = np.random.default_rng(1)
    start = w + np.random.default_rng(2).normal(size=w.size)
    before = moreau_objective(model, start, w, X, y, lam, 1e-3)
    theta, _ = solve_inner(model, start, w, X, y, config, rng)
    after = moreau_objective(model, theta, w, X, y, lam, 1e-3)
    assert after < before - 1e-3
    # each further step keeps decreasing it (a small enough step on a smooth objective)
    values = [after]
    for _ in range(3):
        theta, _ = solve_inner(model, theta, w, X, y, config, rng)
        values.append(moreau_objective(model, theta, w, X, y, lam, 1e-3))
    assert np.all(np.diff(values) < 0)


def test_inner_solve_is_gradient_descent_on_the_envelope_objective():
    """One inner step equals theta - lr (grad f + wd theta + lambda (theta - w))."""
    model, X, y, w = problem()
    config = PFedMeConfig(lr=0.01, personal_lr=0.05, lam=3.0, inner_steps=1, weight_decay=0.0)
    theta0 = w + 0.5
    theta, _ = solve_inner(model, theta0, w, X, y, config, np.random.default_rng(0))
    eps = 1e-6
    grad = np.array([(moreau_objective(model, theta0 + eps * e, w, X, y, 3.0)
                      - moreau_objective(model, theta0 - eps * e, w, X, y, 3.0)) / (2 * eps)
                     for e in np.eye(w.size)])
    assert np.allclose(theta, theta0 - 0.05 * grad, atol=1e-7)


def test_local_pass_moves_w_towards_theta_and_fits_the_data():
    model, X, y, w = problem()
    config = PFedMeConfig(lr=0.05, personal_lr=0.05, lam=15.0, inner_steps=5, batch_size=16,
                          epochs=20)
    update = local_pass(model, w, X, y, config, np.random.default_rng(0))
    loss = lambda p: float(model.per_sample_loss(p, X, y).mean())  # noqa: E731
    assert loss(update.theta) < loss(w) and loss(update.w) < loss(w)
    assert np.linalg.norm(update.w - update.theta) < np.linalg.norm(w - update.theta)
    again = local_pass(model, w, X, y, config, np.random.default_rng(0))
    assert np.array_equal(again.w, update.w) and np.array_equal(again.theta, update.theta)


def test_eta_lambda_one_makes_w_the_personalised_model():
    model, X, y, w = problem()
    config = PFedMeConfig(lr=1 / 15.0, personal_lr=0.05, lam=15.0, batch_size=64)
    update = local_pass(model, w, X, y, config, np.random.default_rng(0))
    assert np.allclose(update.w, update.theta, atol=1e-12)


@pytest.mark.parametrize("key, value", [("lr", 0.0), ("personal_lr", -1.0), ("lam", np.inf),
                                        ("inner_steps", 0), ("batch_size", 1.5),
                                        ("weight_decay", -1.0)])
def test_config_checked(key, value):
    settings = {"lr": 0.1, "personal_lr": 0.1, "lam": 1.0, key: value}
    with pytest.raises(ValueError, match=key):
        PFedMeConfig(**settings)
