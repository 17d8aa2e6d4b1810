"""The numpy models: gradients against finite differences, stable losses, input validation."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.models import (
    MODELS,
    LogisticModel,
    MLPModel,
    SoftmaxModel,
    make_model,
)

# (name, dim, num_classes, hidden)
SPECS = [("logistic", 5, 2, 0), ("softmax", 5, 4, 0), ("mlp", 5, 3, 7), ("mlp", 4, 2, 6)]
IDS = [f"{name}-C{c}" for name, _, c, _ in SPECS]


def build(spec):
    name, d, c, h = spec
    return make_model(name, d, num_classes=c, hidden=h or 32)


def random_problem(model, seed, n=9, scale=1.0):
    rng = np.random.default_rng(seed)
    params = scale * rng.normal(size=model.num_params)
    X = rng.normal(size=(n, model.dim))
    y = rng.integers(0, model.num_classes, size=n)
    w = rng.exponential(size=n) * (rng.random(n) < 0.8)  # some exact zeros
    return params, X, y, w


def central_differences(f, x, eps=1e-6):
    out = np.empty_like(x)
    for j in range(x.size):
        e = np.zeros_like(x)
        e[j] = eps
        out[j] = (f(x + e) - f(x - e)) / (2 * eps)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_gradient_matches_finite_differences(spec, seed):
    model = build(spec)
    params, X, y, w = random_problem(model, seed)
    loss, grad = model.loss_grad(params, X, y, w)
    assert grad.shape == (model.num_params,) and grad.dtype == np.float64
    numeric = central_differences(lambda p: model.loss_grad(p, X, y, w)[0], params)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6 * (1 + w.sum()))
    # the loss is the weighted sum of the per-sample losses (not divided by n)
    assert loss == pytest.approx(w @ model.per_sample_loss(params, X, y), rel=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 20))
def test_loss_is_negative_log_of_predicted_probability(spec, seed, n):
    model = build(spec)
    params, X, y, _ = random_problem(model, seed, n=n, scale=2.0)
    proba = model.predict_proba(params, X)
    assert proba.shape == (n, model.num_classes)
    assert np.all(proba >= 0)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.per_sample_loss(params, X, y),
                               -np.log(proba[np.arange(n), y]), rtol=1e-10, atol=1e-12)


def test_logistic_is_two_class_softmax():
    rng = np.random.default_rng(3)
    d, n = 6, 30
    X, y = rng.normal(size=(n, d)), rng.integers(0, 2, size=n)
    w_b = rng.normal(size=d + 1)
    W = np.zeros((d, 2))
    W[:, 1] = w_b[:d]
    soft_params = np.concatenate([W.ravel(), [0.0, w_b[d]]])
    logistic, softmax = LogisticModel(d), SoftmaxModel(d, 2)
    np.testing.assert_allclose(logistic.per_sample_loss(w_b, X, y),
                               softmax.per_sample_loss(soft_params, X, y), rtol=1e-12)
    np.testing.assert_allclose(logistic.predict_proba(w_b, X),
                               softmax.predict_proba(soft_params, X), rtol=1e-12)


def test_mlp_layout_matches_direct_formula():
    model = MLPModel(3, 4, hidden=5)
    rng = np.random.default_rng(4)
    W1, b1 = rng.normal(size=(3, 5)), rng.normal(size=5)
    W2, b2 = rng.normal(size=(5, 4)), rng.normal(size=4)
    params = np.concatenate([W1.ravel(), b1, W2.ravel(), b2])
    assert model.num_params == params.size == 3 * 5 + 5 + 5 * 4 + 4
    X = rng.normal(size=(7, 3))
    logits = np.maximum(X @ W1 + b1, 0) @ W2 + b2
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(model.predict_proba(params, X), expected, rtol=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_extreme_logits_are_stable(spec):
    model = build(spec)
    # logits of order 1e4 (the MLP's two layers multiply the scale)
    params, X, y, w = random_problem(model, 5, n=50, scale=1e2 if model.name == "mlp" else 1e4)
    with warnings.catch_warnings(), np.errstate(over="raise", divide="raise", invalid="raise"):
        warnings.simplefilter("error")
        losses = model.per_sample_loss(params, X, y)
        loss, grad = model.loss_grad(params, X, y, w)
        proba = model.predict_proba(params, X)
    assert np.all(np.isfinite(losses)) and np.all(losses >= 0)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.all(np.isfinite(proba))
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert losses.max() > 100  # confidently wrong samples pay the full (huge) margin


def test_logistic_extreme_logits_exact():
    model = LogisticModel(1)
    X = np.array([[1e4], [-1e4], [40.0], [1e4]])
    params = np.array([1.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = model.per_sample_loss(params, X, np.array([1, 1, 1, 0]))
    # softplus(-z) for y = 1 keeps full relative precision where softplus(z) - z would give 0
    np.testing.assert_allclose(losses, [0.0, 1e4, np.exp(-40.0), 1e4], rtol=1e-12, atol=0)
    assert losses[2] > 0


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_init_params_like_torch_linear(spec):
    model = build(spec)
    a = model.init_params(np.random.default_rng(0))
    b = model.init_params(np.random.default_rng(0))
    assert a.shape == (model.num_params,) and a.dtype == np.float64
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, model.init_params(np.random.default_rng(1)))
    d = model.dim
    first = d * (model.num_classes if model.name == "softmax" else
                 1 if model.name == "logistic" else model.hidden)
    first += first // d  # the first layer's biases
    assert np.all(np.abs(a[:first]) <= 1 / np.sqrt(d))
    if model.name == "mlp":
        assert np.all(np.abs(a[first:]) <= 1 / np.sqrt(model.hidden))


def test_mlp_init_uses_each_layers_fan_in():
    model = MLPModel(100, 3, hidden=4)  # bounds 0.1 and 0.5
    a = model.init_params(np.random.default_rng(0))
    first = 100 * 4 + 4
    assert np.abs(a[:first]).max() <= 0.1 < np.abs(a[first:]).max() <= 0.5


def test_float_and_bool_labels_accepted():
    rng = np.random.default_rng(6)
    X = rng.normal(size=(8, 3))
    y = rng.integers(0, 2, size=8)
    for model in (LogisticModel(3), SoftmaxModel(3, 2), MLPModel(3, 2, hidden=4)):
        params = model.init_params(rng)
        ref = model.per_sample_loss(params, X, y)
        np.testing.assert_array_equal(model.per_sample_loss(params, X, y.astype(float)), ref)
        np.testing.assert_array_equal(model.per_sample_loss(params, X, y.astype(bool)), ref)


@pytest.mark.parametrize(("name", "classes", "bad", "match"), [
    ("logistic", 2, [0, 2, 1], r"outside 0\.\.1: \[2\]"),
    ("logistic", 2, [0, -1.0, 1], r"outside 0\.\.1: \[-1\.0\]"),
    ("logistic", 2, [0, 0.5, 1], r"non-integer labels: \[0\.5\]"),
    ("softmax", 3, [0, 3, 7], r"outside 0\.\.2: \[3, 7\]"),
    ("softmax", 3, [0, np.nan, 1], r"non-integer labels"),
    ("mlp", 3, [0, 1, 2.5], r"non-integer labels: \[2\.5\]"),
    ("mlp", 3, ["a", "b", "c"], r"integer class labels"),
    ("softmax", 3, [0, 1], r"y must have shape \(3,\)"),
    ("softmax", 3, [[0, 1, 2]], r"y must have shape \(3,\)"),
])
def test_label_validation(name, classes, bad, match):
    model = make_model(name, 2, num_classes=classes, hidden=3)
    params = model.init_params(np.random.default_rng(0))
    X = np.ones((3, 2))
    with pytest.raises(ValueError, match=match):
        model.per_sample_loss(params, X, np.array(bad))
    with pytest.raises(ValueError, match=match):
        model.loss_grad(params, X, np.array(bad), np.ones(3))


@pytest.mark.parametrize("name", MODELS)
def test_shape_validation(name):
    model = make_model(name, 3, num_classes=2, hidden=4)
    params = model.init_params(np.random.default_rng(0))
    y = np.array([0, 1])
    for X in (np.ones((2, 4)), np.ones(3), np.ones((2, 3, 1))):
        with pytest.raises(ValueError, match=r"X must have shape \(n, 3\)"):
            model.per_sample_loss(params, X, y)
        with pytest.raises(ValueError, match=r"X must have shape \(n, 3\)"):
            model.predict_proba(params, X)
    X = np.ones((2, 3))
    with pytest.raises(ValueError, match="sample_weight must have shape"):
        model.loss_grad(params, X, y, np.ones(3))
    with pytest.raises(ValueError, match="nonnegative"):
        model.loss_grad(params, X, y, np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="finite"):
        model.loss_grad(params, X, y, np.array([1.0, np.inf]))


@pytest.mark.parametrize("name", MODELS)
def test_check_params(name):
    model = make_model(name, 3, num_classes=2, hidden=4)
    params = model.init_params(np.random.default_rng(0))
    assert model.check_params(params) is params  # no copy of a valid float64 vector
    np.testing.assert_array_equal(model.check_params(params.tolist()), params)
    for bad, match in ((params[:-1], "shape"), (np.append(params, 0.0), "shape"),
                       (params[None, :], "shape"), (np.array("abc"), "numeric")):
        with pytest.raises(ValueError, match=match):
            model.check_params(bad)
    for value in (np.nan, np.inf, -np.inf):
        broken = params.copy()
        broken[1] = value
        with pytest.raises(ValueError, match="non-finite"):
            model.check_params(broken)
        with pytest.raises(ValueError, match="non-finite"):
            model.loss_grad(broken, np.ones((1, 3)), [0], [1.0])


def test_make_model_validation():
    assert make_model("logistic", 4).num_params == 5
    assert make_model("softmax", 4, num_classes=3).num_params == 15
    assert make_model("mlp", 4, num_classes=3, hidden=2).num_params == 4 * 2 + 2 + 2 * 3 + 3
    for kwargs, match in (({"name": "cnn", "dim": 3}, "unknown model name 'cnn'"),
                          ({"name": "logistic", "dim": 3, "num_classes": 3}, "num_classes"),
                          ({"name": "softmax", "dim": 3, "num_classes": 1}, "num_classes"),
                          ({"name": "mlp", "dim": 0}, "dim"),
                          ({"name": "mlp", "dim": 2.5}, "dim"),
                          ({"name": "mlp", "dim": 3, "hidden": 0}, "hidden")):
        with pytest.raises(ValueError, match=match):
            make_model(**kwargs)


def test_inputs_not_modified():
    model = MLPModel(4, 3, hidden=5)
    params, X, y, w = random_problem(model, 8)
    copies = [a.copy() for a in (params, X, y, w)]
    model.loss_grad(params, X, y, w)
    model.per_sample_loss(params, X, y)
    model.predict_proba(params, X)
    for a, b in zip((params, X, y, w), copies, strict=True):
        np.testing.assert_array_equal(a, b)
