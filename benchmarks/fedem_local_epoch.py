"""Milliseconds per local epoch of FedEM's solver: vectorised ``sgd_epochs`` vs a per-sample loop.

The synthetic FedEM setting: one client with n = 1000 samples of d = 150 features, binary
labels, responsibilities q_i in [0, 1] as sample weights; one epoch of mini-batch SGD with
batch 128, momentum 0.9, weight decay 5e-4 (torch.optim.SGD semantics) on
(1/|batch|) sum_i q_i l_i, for the ``logistic`` model and for the ``mlp`` (32 hidden ReLU
units, softmax over 2 classes). Two implementations of the same epoch, from the same
starting point, momentum buffer and permutation:

* vectorised: :func:`fmtl_flower.core.local_sgd.sgd_epochs` (one matrix product per layer and
  mini-batch);
* naive: a Python loop over the samples of each mini-batch, each sample's loss gradient
  computed on its own 1-D vectors (dot products, outer products) and accumulated, then the
  same momentum / weight-decay update.

The script checks that both end at the same parameters (allclose) and times each (best of
``--repeats``, the vectorised one after a warm-up call) with BLAS limited to ``--threads``
threads (default 1: in a simulation many clients share the cores, and a multi-threaded BLAS
on small matrices is slow and erratic when the cores are busy). Prints one JSON line last:
{"logistic": {"vectorised_ms", "naive_ms", "speedup"}, "mlp": {...}}.

Usage: python benchmarks/fedem_local_epoch.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from threadpoolctl import threadpool_limits

from fmtl_flower.core.local_sgd import SGDConfig, sgd_epochs
from fmtl_flower.core.models import Model, make_model

D, N, HIDDEN = 150, 1000, 32


def naive_logistic_grad(params: np.ndarray, X: np.ndarray, y: np.ndarray,
                        w: np.ndarray) -> np.ndarray:
    """sum_i w_i grad BCE-with-logits(x_i^T v + b, y_i), one sample at a time."""
    v, b = params[:-1], params[-1]
    grad = np.zeros_like(params)
    for i in range(X.shape[0]):
        x = X[i]
        z = float(x @ v) + b
        p = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
        r = w[i] * (p - y[i])
        grad[:-1] += r * x
        grad[-1] += r
    return grad


def naive_mlp_grad(params: np.ndarray, X: np.ndarray, y: np.ndarray, w: np.ndarray,
                   d: int, h: int, c: int) -> np.ndarray:
    """sum_i w_i grad cross-entropy of the one-hidden-layer ReLU net, one sample at a time."""
    a, b, e = d * h, d * h + h, d * h + h + h * c
    W1, b1, W2, b2 = (params[:a].reshape(d, h), params[a:b], params[b:e].reshape(h, c),
                      params[e:])
    grad = np.zeros_like(params)
    gW1, gb1 = grad[:a].reshape(d, h), grad[a:b]
    gW2, gb2 = grad[b:e].reshape(h, c), grad[e:]
    for i in range(X.shape[0]):
        x = X[i]
        pre = x @ W1 + b1
        hid = np.maximum(pre, 0.0)
        z = hid @ W2 + b2
        p = np.exp(z - z.max())
        p /= p.sum()
        p[y[i]] -= 1.0
        r = w[i] * p
        gW2 += np.outer(hid, r)
        gb2 += r
        dh = W2 @ r
        dh[pre <= 0.0] = 0.0
        gW1 += np.outer(x, dh)
        gb1 += dh
    return grad


def naive_epoch(model: Model, params: np.ndarray, buf: np.ndarray, X: np.ndarray,
                y: np.ndarray, w: np.ndarray, cfg: SGDConfig,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One epoch with per-sample gradients and the torch.optim.SGD update."""
    p, b = params.copy(), buf.copy()
    order = rng.permutation(X.shape[0])
    for start in range(0, X.shape[0], cfg.batch_size):
        idx = order[start:start + cfg.batch_size]
        if model.name == "logistic":
            g = naive_logistic_grad(p, X[idx], y[idx], w[idx])
        else:
            g = naive_mlp_grad(p, X[idx], y[idx], w[idx], model.dim, model.hidden,
                               model.num_classes)
        g = g / idx.shape[0] + cfg.weight_decay * p
        b = cfg.momentum * b + g
        p = p - cfg.lr * b
    return p, b


def bench(name: str, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    model = make_model(name, D, num_classes=2, hidden=HIDDEN)
    X = rng.normal(size=(N, D)) / np.sqrt(D)
    y = (X @ rng.normal(size=D) + 0.1 * rng.normal(size=N) > 0).astype(np.int64)
    q = rng.random(N)
    params = model.init_params(rng)
    buf = 0.01 * rng.normal(size=model.num_params)  # a buffer carried over from a past round
    cfg = SGDConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=128, epochs=1)

    def vectorised():
        return sgd_epochs(model, params, buf, X, y, q, cfg, np.random.default_rng(1))

    def naive():
        return naive_epoch(model, params, buf, X, y, q, cfg, np.random.default_rng(1))

    fast, slow = vectorised(), naive()
    if not (np.allclose(fast[0], slow[0], rtol=1e-9, atol=1e-12)
            and np.allclose(fast[1], slow[1], rtol=1e-9, atol=1e-12)):
        raise AssertionError(f"{name}: vectorised and naive epochs disagree "
                             f"(max |diff| {np.abs(fast[0] - slow[0]).max():.3g})")
    times = {}
    for label, call, reps in (("vectorised", vectorised, repeats),
                              ("naive", naive, max(1, repeats // 2))):
        best = np.inf
        for _ in range(reps):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
        times[label] = best * 1e3
    return {"vectorised_ms": times["vectorised"], "naive_ms": times["naive"],
            "speedup": times["naive"] / times["vectorised"], "num_params": model.num_params,
            "max_abs_diff": float(np.abs(fast[0] - slow[0]).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (0: no limit)")
    args = parser.parse_args()
    results = {}
    for name in ("logistic", "mlp"):
        with threadpool_limits(args.threads or None, user_api="blas"):
            r = bench(name, args.repeats)
        results[name] = r
        print(f"{name:8s} (P = {r['num_params']:5d}): vectorised {r['vectorised_ms']:8.3f} ms | "
              f"naive {r['naive_ms']:9.2f} ms | speedup {r['speedup']:6.1f}x | "
              f"max |diff| {r['max_abs_diff']:.2e}")
    print(json.dumps({name: {key: r[key] for key in ("vectorised_ms", "naive_ms", "speedup")}
                      for name, r in results.items()}))


if __name__ == "__main__":
    main()
