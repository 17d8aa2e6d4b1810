"""The weighted local SGD solver: torch.optim.SGD's update written out by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.local_sgd import SGDConfig, sgd_epochs
from fmtl_flower.core.models import LogisticModel, make_model


def problem(model, n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, model.dim))
    y = rng.integers(0, model.num_classes, size=n)
    w = rng.random(n)
    return model.init_params(rng), X, y, w


def reference(model, params, buf, X, y, w, cfg, seed, anchor=None):
    """torch.optim.SGD (dampening 0, no Nesterov) on (1/|B|) sum w_i l_i, step by step."""
    rng = np.random.default_rng(seed)
    p, b = params.copy(), buf.copy()
    anchor = params.copy() if anchor is None else anchor
    losses = []
    for _ in range(cfg.epochs):
        order = rng.permutation(len(y))
        for batch in np.array_split(order, np.arange(cfg.batch_size, len(y), cfg.batch_size)):
            loss, g = model.loss_grad(p, X[batch], y[batch], w[batch])
            losses.append(loss / len(batch))
            g = g / len(batch) + cfg.weight_decay * p
            if cfg.prox_mu > 0:
                g = g + cfg.prox_mu * (p - anchor)
            b = cfg.momentum * b + g
            p = p - cfg.lr * b
    return p, b, float(np.mean(losses))


def test_one_step_equals_formula():
    model = LogisticModel(4)
    params, X, y, w = problem(model, 10)
    buf = np.random.default_rng(1).normal(size=model.num_params)
    cfg = SGDConfig(lr=0.3, momentum=0.9, weight_decay=0.01, batch_size=16)  # one batch
    new, new_buf, loss = sgd_epochs(model, params, buf, X, y, w, cfg, np.random.default_rng(2))
    total, grad = model.loss_grad(params, X, y, w)  # order does not matter for a full batch
    g = grad / 10 + 0.01 * params
    np.testing.assert_allclose(new_buf, 0.9 * buf + g, rtol=1e-12)
    np.testing.assert_allclose(new, params - 0.3 * (0.9 * buf + g), rtol=1e-12)
    assert loss == pytest.approx(total / 10, rel=1e-12)


def test_momentum_accumulates_over_two_steps():
    model = make_model("softmax", 3, num_classes=3)
    params, X, y, w = problem(model, 8, seed=3)
    cfg = SGDConfig(lr=0.1, momentum=0.5, weight_decay=0.0, batch_size=4)
    new, buf, loss = sgd_epochs(model, params, np.zeros_like(params), X, y, w, cfg,
                                np.random.default_rng(7))
    order = np.random.default_rng(7).permutation(8)
    first, second = order[:4], order[4:]
    l1, g1 = model.loss_grad(params, X[first], y[first], w[first])
    g1 /= 4
    p1 = params - 0.1 * g1  # fresh buffer: buf = g
    l2, g2 = model.loss_grad(p1, X[second], y[second], w[second])
    g2 /= 4
    b2 = 0.5 * g1 + g2
    np.testing.assert_allclose(buf, b2, rtol=1e-12)
    np.testing.assert_allclose(new, p1 - 0.1 * b2, rtol=1e-12)
    assert loss == pytest.approx((l1 / 4 + l2 / 4) / 2, rel=1e-12)


def test_zero_weight_batch_still_decays():
    model = make_model("mlp", 3, num_classes=2, hidden=4)
    params, X, y, _ = problem(model, 5)
    buf = np.full(model.num_params, 0.2)
    cfg = SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.05, batch_size=5)
    new, new_buf, loss = sgd_epochs(model, params, buf, X, y, np.zeros(5), cfg,
                                    np.random.default_rng(0))
    assert loss == 0.0
    np.testing.assert_allclose(new_buf, 0.9 * buf + 0.05 * params, rtol=1e-12)
    np.testing.assert_allclose(new, params - 0.1 * (0.9 * buf + 0.05 * params), rtol=1e-12)


def test_prox_term_pulls_toward_anchor():
    model = LogisticModel(3)
    params, X, y, _ = problem(model, 6)
    anchor = np.arange(model.num_params, dtype=float)
    cfg = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, batch_size=6, prox_mu=1.0)
    zero = np.zeros(6)
    new, _, _ = sgd_epochs(model, params, np.zeros(4), X, y, zero, cfg,
                           np.random.default_rng(0), anchor=anchor)
    np.testing.assert_allclose(new, (params + anchor) / 2, rtol=1e-12)  # halfway there
    # with real data the proximal step ends closer to the anchor than plain SGD does
    w = np.ones(6)
    plain = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, batch_size=2, epochs=3)
    prox = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, batch_size=2, epochs=3,
                     prox_mu=0.5)
    far, _, _ = sgd_epochs(model, params, np.zeros(4), X, y, w, plain, np.random.default_rng(1))
    near, _, _ = sgd_epochs(model, params, np.zeros(4), X, y, w, prox, np.random.default_rng(1),
                            anchor=params)
    assert np.linalg.norm(near - params) < np.linalg.norm(far - params)
    # default anchor = the starting point: no data, no decay -> nothing moves
    same, _, _ = sgd_epochs(model, params, np.zeros(4), X, y, zero, prox,
                            np.random.default_rng(0))
    np.testing.assert_array_equal(same, params)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["logistic", "softmax", "mlp"]), n=st.integers(1, 40),
       batch_size=st.integers(1, 50), epochs=st.integers(1, 3),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), weight_decay=st.sampled_from([0.0, 5e-4]),
       prox_mu=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**32 - 1))
def test_matches_step_by_step_reference(name, n, batch_size, epochs, momentum, weight_decay,
                                        prox_mu, seed):
    model = make_model(name, 4, num_classes=2 if name == "logistic" else 3, hidden=5)
    params, X, y, w = problem(model, n, seed=seed)
    buf = np.random.default_rng(seed + 1).normal(size=model.num_params) * 0.1
    cfg = SGDConfig(lr=0.05, momentum=momentum, weight_decay=weight_decay,
                    batch_size=batch_size, epochs=epochs, prox_mu=prox_mu)
    got = sgd_epochs(model, params, buf, X, y, w, cfg, np.random.default_rng(seed))
    want = reference(model, params, buf, X, y, w, cfg, seed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)
    assert got[2] == pytest.approx(want[2], rel=1e-10)


def test_deterministic_given_seed_and_inputs_untouched():
    model = make_model("mlp", 5, num_classes=3, hidden=6)
    params, X, y, w = problem(model, 50)
    buf = np.zeros_like(params)
    copies = [a.copy() for a in (params, buf, X, y, w)]
    cfg = SGDConfig(lr=0.1, batch_size=8, epochs=2)
    a = sgd_epochs(model, params, buf, X, y, w, cfg, np.random.default_rng(11))
    b = sgd_epochs(model, params, buf, X, y, w, cfg, np.random.default_rng(11))
    c = sgd_epochs(model, params, buf, X, y, w, cfg, np.random.default_rng(12))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]
    assert not np.array_equal(a[0], c[0])
    for orig, copy in zip((params, buf, X, y, w), copies, strict=True):
        np.testing.assert_array_equal(orig, copy)
    assert a[0] is not params and a[1] is not buf


def test_logistic_regression_learns_separable_data():
    rng = np.random.default_rng(0)
    d, n = 10, 500
    X = rng.normal(size=(n, d))
    w_true = rng.normal(size=d)
    y = (X @ w_true + 0.5 + 0.05 * rng.normal(size=n) > 0).astype(int)
    model = LogisticModel(d)
    params = model.init_params(rng)
    buf = np.zeros_like(params)
    start = model.per_sample_loss(params, X, y).mean()
    cfg = SGDConfig(lr=0.1, batch_size=32, epochs=5, weight_decay=0.0)
    for _ in range(10):  # persistent momentum across calls, as across FedEM rounds
        params, buf, _ = sgd_epochs(model, params, buf, X, y, np.ones(n), cfg, rng)
    end = model.per_sample_loss(params, X, y).mean()
    accuracy = np.mean(np.argmax(model.predict_proba(params, X), axis=1) == y)
    assert start > 0.3 and end < 0.1
    assert accuracy > 0.98


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lr": 0.0}, "lr must be > 0"),
    ({"lr": -1.0}, "lr must be > 0"),
    ({"lr": float("nan")}, "lr must be finite"),
    ({"lr": "0.1"}, "lr must be a real number"),
    ({"lr": 0.1, "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"lr": 0.1, "momentum": -0.1}, r"momentum must be in \[0, 1\)"),
    ({"lr": 0.1, "weight_decay": -1e-4}, "weight_decay must be >= 0"),
    ({"lr": 0.1, "batch_size": 0}, "batch_size must be >= 1"),
    ({"lr": 0.1, "batch_size": 2.5}, "batch_size must be an integer"),
    ({"lr": 0.1, "batch_size": True}, "batch_size must be an integer"),
    ({"lr": 0.1, "epochs": 0}, "epochs must be >= 1"),
    ({"lr": 0.1, "prox_mu": -0.5}, "prox_mu must be >= 0"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SGDConfig(**kwargs)


def test_config_normalises_numpy_scalars():
    cfg = SGDConfig(lr=np.float32(0.5), batch_size=np.int64(16), epochs=2)
    assert type(cfg.lr) is float and type(cfg.batch_size) is int and cfg.batch_size == 16
    assert SGDConfig(lr=1).lr == 1.0


def test_argument_validation():
    model = LogisticModel(3)
    params, X, y, w = problem(model, 6)
    cfg = SGDConfig(lr=0.1)
    rng = np.random.default_rng(0)
    zeros = np.zeros_like(params)
    with pytest.raises(ValueError, match="momentum_buf: params must have shape"):
        sgd_epochs(model, params, np.zeros(3), X, y, w, cfg, rng)
    with pytest.raises(ValueError, match="anchor: params has 1 non-finite"):
        bad = params.copy()
        bad[0] = np.nan
        sgd_epochs(model, params, zeros, X, y, w, SGDConfig(lr=0.1, prox_mu=1.0), rng,
                   anchor=bad)
    with pytest.raises(ValueError, match="non-finite"):
        sgd_epochs(model, np.full_like(params, np.inf), zeros, X, y, w, cfg, rng)
    with pytest.raises(ValueError, match="at least one sample"):
        sgd_epochs(model, params, zeros, X[:0], y[:0], w[:0], cfg, rng)
    with pytest.raises(ValueError, match="sample_weight"):
        sgd_epochs(model, params, zeros, X, y, -w, cfg, rng)
    with pytest.raises(ValueError, match="outside 0..1"):
        sgd_epochs(model, params, zeros, X, np.full(6, 2), w, cfg, rng)
    with pytest.raises(ValueError, match="rng must be a numpy Generator"):
        sgd_epochs(model, params, zeros, X, y, w, cfg, 0)
    with pytest.raises(ValueError, match="config must be an SGDConfig"):
        sgd_epochs(model, params, zeros, X, y, w, {"lr": 0.1}, rng)
