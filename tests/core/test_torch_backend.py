"""The torch backend against the numpy models (float64, same data and initialisation), its
parameter layout (state_dict incl. BatchNorm buffers) and the backend interface."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fmtl_flower.core.backend import (  # noqa: E402
    ModelBackend,
    flatten_arrays,
    layout_signature,
    unflatten_arrays,
)
from fmtl_flower.core.fedem import aggregate_components, local_update, mixture_proba  # noqa: E402
from fmtl_flower.core.local_sgd import SGDConfig  # noqa: E402
from fmtl_flower.core.models import make_model  # noqa: E402
from fmtl_flower.core.torch_backend import TorchBackend  # noqa: E402


def data(n=60, d=5, classes=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = rng.integers(0, classes, size=n)
    return X, y


def linear(d, out):
    return lambda: torch.nn.Linear(d, out).double()


def softmax_to_torch(theta, d, C):
    """numpy softmax layout [W (d x C), b] -> torch Linear state [weight (C x d), bias]."""
    W, b = theta[:d * C].reshape(d, C), theta[d * C:]
    return np.concatenate([W.T.ravel(), b])


def torch_to_softmax(flat, d, C):
    W, b = flat[:d * C].reshape(C, d), flat[d * C:]
    return np.concatenate([W.T.ravel(), b])


def test_both_backends_implement_the_interface():
    assert isinstance(make_model("mlp", 3, 4), ModelBackend)
    assert isinstance(TorchBackend(linear(3, 4)), ModelBackend)


@pytest.mark.parametrize("prox_mu", [0.0, 0.3])
def test_logistic_agrees_with_numpy_over_rounds(prox_mu):
    """Same data, same initialisation, float64: E-step, pi, local SGD with momentum, weight
    decay (and FedProx), aggregation, over 4 rounds of 3 clients, M = 2."""
    d = 5
    npm = make_model("logistic", d)
    tb = TorchBackend(linear(d, 1))
    assert tb.layout() == [("weight", (1, d), "float64"), ("bias", (1,), "float64")]
    clients = [data(n, d, seed=s) for s, n in enumerate((40, 57, 23))]
    comps = np.stack([npm.init_params(np.random.default_rng([7, m])) for m in range(2)])
    state = {name: [(np.full(2, 0.5), np.zeros_like(comps)) for _ in clients]
             for name in ("numpy", "torch")}
    current = {"numpy": comps, "torch": comps.copy()}
    cfg = SGDConfig(lr=0.2, momentum=0.9, weight_decay=5e-4, batch_size=8, epochs=2,
                    prox_mu=prox_mu)
    for rnd in range(4):
        for name, model in (("numpy", npm), ("torch", tb)):
            updates = []
            for k, (X, y) in enumerate(clients):
                pi, mom = state[name][k]
                up = local_update(model, current[name], pi, mom, X, y, cfg,
                                  np.random.default_rng([rnd, k]))
                state[name][k] = (up.pi, up.momentum)
                updates.append((up.components, up.weights))
            current[name] = aggregate_components(current[name], updates, 120.0)
    assert not np.allclose(current["numpy"], comps)  # it did train
    np.testing.assert_allclose(current["torch"], current["numpy"], rtol=0, atol=1e-6)
    for (pa, ma), (pb, mb) in zip(state["numpy"], state["torch"], strict=True):
        np.testing.assert_allclose(pb, pa, atol=1e-6)
        np.testing.assert_allclose(mb, ma, atol=1e-6)
    X, _ = clients[0]
    np.testing.assert_allclose(mixture_proba(tb, current["torch"], np.array([0.3, 0.7]), X),
                               mixture_proba(npm, current["numpy"], np.array([0.3, 0.7]), X),
                               atol=1e-9)


def test_softmax_agrees_with_numpy():
    d, C = 4, 3
    X, y = data(50, d, C)
    npm = make_model("softmax", d, C)
    tb = TorchBackend(linear(d, C))
    theta = npm.init_params(np.random.default_rng(1))
    flat = softmax_to_torch(theta, d, C)
    np.testing.assert_allclose(tb.per_sample_loss(flat, X, y), npm.per_sample_loss(theta, X, y),
                               atol=1e-12)
    np.testing.assert_allclose(tb.predict_proba(flat, X), npm.predict_proba(theta, X),
                               atol=1e-12)
    w = np.random.default_rng(2).random(50)
    cfg = SGDConfig(lr=0.1, batch_size=16, epochs=3)
    a = npm.sgd_epochs(theta, np.zeros_like(theta), X, y, w, cfg, np.random.default_rng(3))
    b = tb.sgd_epochs(flat, np.zeros_like(flat), X, y, w, cfg, np.random.default_rng(3))
    np.testing.assert_allclose(torch_to_softmax(b[0], d, C), a[0], atol=1e-10)
    np.testing.assert_allclose(torch_to_softmax(b[1], d, C), a[1], atol=1e-10)
    assert b[2] == pytest.approx(a[2], abs=1e-12)


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_batchnorm_buffers_travel_and_are_averaged():
    torch.manual_seed(0)
    tb = TorchBackend(BNNet)
    keys = [k for k, _, _ in tb.layout()]
    assert "bn.running_mean" in keys and "bn.num_batches_tracked" in keys
    theta = tb.initial_params()
    X, y = data(40, 3, 2)
    X = X * 3 + 2
    cfg = SGDConfig(lr=0.05, batch_size=10)
    new, buf, _ = tb.sgd_epochs(theta, np.zeros_like(theta), X, y, np.ones(40), cfg,
                                np.random.default_rng(0))
    before, after = tb.param_arrays(theta), tb.param_arrays(new)
    assert not np.allclose(after["bn.running_mean"], before["bn.running_mean"])
    assert after["bn.num_batches_tracked"] == before["bn.num_batches_tracked"] + 4
    assert after["bn.running_mean"].dtype == np.float32
    # buffers have no optimiser state; trainable entries do
    sl = {k: i for i, (k, _, _) in enumerate(tb.layout())}
    arrays = unflatten_arrays(buf, tb.layout())
    assert np.all(arrays["bn.running_var"] == 0) and np.any(arrays["fc.weight"] != 0)
    assert sl  # layout is ordered
    # aggregation averages the running statistics with the weights
    other, _, _ = tb.sgd_epochs(theta, np.zeros_like(theta), X[::-1] * 2, y[::-1],
                                np.ones(40), cfg, np.random.default_rng(1))
    avg = aggregate_components(theta[None], [(new[None], np.array([1.0])),
                                             (other[None], np.array([3.0]))])[0]
    mean = tb.param_arrays(avg)["bn.running_mean"]
    expected = (1 * after["bn.running_mean"].astype(np.float64)
                + 3 * tb.param_arrays(other)["bn.running_mean"].astype(np.float64)) / 4
    np.testing.assert_allclose(mean, expected.astype(np.float32), rtol=1e-6)
    # eval mode uses the running statistics: losses do not depend on the batch
    full = tb.per_sample_loss(new, X, y)
    np.testing.assert_allclose(tb.per_sample_loss(new, X[:5], y[:5]), full[:5], rtol=1e-6)


def test_flatten_roundtrip_is_exact_for_float32_and_counters():
    rng = np.random.default_rng(0)
    arrays = {"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.array(12345678),
              "b": rng.normal(size=4)}
    layout = [(k, v.shape, str(v.dtype)) for k, v in arrays.items()]
    back = unflatten_arrays(flatten_arrays(arrays), layout)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    assert layout_signature(layout) != layout_signature(layout[::-1])
    with pytest.raises(ValueError, match="shape"):
        unflatten_arrays(np.zeros(3), layout)


def test_module_shapes_and_labels_are_checked():
    tb = TorchBackend(linear(3, 2))
    theta = tb.initial_params()
    X, _ = data(5, 3)
    with pytest.raises(ValueError, match="labels outside"):
        tb.per_sample_loss(theta, X, np.array([0, 1, 2, 0, 1]))
    with pytest.raises(ValueError, match="shape"):
        tb.check_params(theta[:-1])
    with pytest.raises(ValueError, match="nn.Module"):
        TorchBackend(lambda: "not a module")
    bad = TorchBackend(lambda: torch.nn.Sequential(torch.nn.Linear(3, 6),
                                                   torch.nn.Unflatten(1, (2, 3))).double())
    with pytest.raises(ValueError, match="logits"):
        bad.per_sample_loss(bad.initial_params(), X, np.zeros(5, dtype=int))
