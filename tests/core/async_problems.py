"""Test problems and read-outs shared by the asynchronous MOCHA core tests."""

from __future__ import annotations

import numpy as np


def coupled_tasks(m: int = 6, d: int = 5, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    """``m`` small binary tasks (12, 17, 22, ... rows, ``d`` features) whose true models
    share a common part: related tasks, so a learned Omega couples them."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal(d)
    out = []
    for t in range(m):
        n = 12 + 5 * t
        X = rng.standard_normal((n, d))
        w = shared + 0.5 * rng.standard_normal(d)
        y = np.where(X @ w + 0.3 * rng.standard_normal(n) >= 0, 1.0, -1.0)
        out.append((X, y))
    return out


def server_alphas(server, devices) -> list[np.ndarray]:
    """The dual variables the server's B stands for: each device's committed alpha plus its
    pending step times the factor the server applied to it (nothing if not applied)."""
    out = []
    for dev in devices:
        alpha = dev.alpha.copy()
        if dev.pending is not None and dev.pending[0] == server.confirm_id[dev.task]:
            alpha = alpha + server.confirm_gamma[dev.task] * dev.pending[1]
        out.append(alpha)
    return out
