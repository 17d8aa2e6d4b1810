"""Weighted local mini-batch SGD with momentum: the local solver of FedEM and its baselines.

The update is exactly that of ``torch.optim.SGD`` (dampening 0, no Nesterov) on the weighted
mini-batch loss FedEM minimises for one component,

    L(batch) = (1/|batch|) sum_{i in batch} w_i l_i(params)

(normalised by the batch size, not by the sum of the weights), plus torch's weight decay and
an optional FedProx proximal term (mu/2) |params - anchor|^2. Per mini-batch:

    g      = grad L(batch) + weight_decay * params + prox_mu * (params - anchor)
    buf    = momentum * buf + g
    params = params - lr * buf

A zero momentum buffer means "fresh": torch's first step sets buf = g, which is the same.
Each epoch visits the samples in the order ``rng.permutation(n)``, in consecutive mini-batches
of ``batch_size`` (the last one smaller when batch_size does not divide n).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # models.Model.sgd_epochs calls this module: no import back at run time
    from .models import Model

__all__ = ["SGDConfig", "sgd_epochs"]


@dataclass(frozen=True)
class SGDConfig:
    """Settings of the local solver (validated on construction).

    Attributes
    ----------
    lr : float
        Step size, > 0.
    momentum : float
        Heavy-ball momentum in [0, 1) (FedEM: 0.9).
    weight_decay : float
        L2 coefficient added to the gradient, >= 0 (FedEM: 5e-4).
    batch_size : int
        Mini-batch size, >= 1.
    epochs : int
        Passes over the local data, >= 1.
    prox_mu : float
        FedProx proximal coefficient mu >= 0 (0: no proximal term).
    """

    lr: float
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 128
    epochs: int = 1
    prox_mu: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "weight_decay", "prox_mu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                                 np.floating)):
                raise ValueError(f"{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("batch_size", "epochs"):
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                object.__setattr__(self, name, operator.index(value))
            except TypeError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.prox_mu < 0:
            raise ValueError(f"prox_mu must be >= 0, got {self.prox_mu}")


def sgd_epochs(model: Model, params: np.ndarray, momentum_buf: np.ndarray, X: np.ndarray,
               y: np.ndarray, sample_weight: np.ndarray, config: SGDConfig,
               rng: np.random.Generator,
               anchor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """``config.epochs`` epochs of weighted mini-batch SGD with momentum (torch semantics).

    Parameters
    ----------
    model : Model
    params : ndarray of shape (num_params,)
        Starting parameters (not modified).
    momentum_buf : ndarray of shape (num_params,)
        Momentum buffer from the previous call; zeros for a fresh optimiser (not modified).
    X : ndarray of shape (n, dim), n >= 1
    y : ndarray of shape (n,)
    sample_weight : ndarray of shape (n,)
        Nonnegative per-sample weights w_i (FedEM's responsibilities q_{m,i}); a batch whose
        weights are all 0 still takes the weight-decay (and proximal) step, as torch does.
    config : SGDConfig
    rng : numpy Generator
        Source of the per-epoch permutations (one ``rng.permutation(n)`` per epoch).
    anchor : ndarray of shape (num_params,), optional
        Centre of the proximal term (only used when ``config.prox_mu`` > 0); default the
        parameters at the start of the call.

    Returns
    -------
    params : ndarray of shape (num_params,)
        The new parameters (a new array).
    momentum_buf : ndarray of shape (num_params,)
        The new momentum buffer (a new array).
    loss : float
        Mean over the mini-batches seen of the weighted batch loss (1/|batch|) sum w_i l_i,
        each evaluated at the parameters before that batch's step (without the weight-decay
        and proximal terms).
    """
    if not callable(getattr(model, "_loss_grad", None)):  # a core.models.Model
        raise ValueError(f"model must be a Model, got {type(model).__name__}")
    if not isinstance(config, SGDConfig):
        raise ValueError(f"config must be an SGDConfig, got {type(config).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")
    theta = model.check_params(params).copy()
    try:
        buf = model.check_params(momentum_buf).copy()
    except ValueError as err:
        raise ValueError(f"momentum_buf: {err}") from None
    X = model.check_X(X)
    n = X.shape[0]
    if n < 1:
        raise ValueError("X must have at least one sample")
    y = model.check_y(y, n)
    w = model.check_weights(sample_weight, n)
    prox = config.prox_mu > 0
    if prox:
        if anchor is None:
            centre = theta.copy()
        else:
            try:
                centre = model.check_params(anchor)
            except ValueError as err:
                raise ValueError(f"anchor: {err}") from None

    lr, beta, wd, mu = config.lr, config.momentum, config.weight_decay, config.prox_mu
    bs = config.batch_size
    total = 0.0
    batches = 0
    for _ in range(config.epochs):
        order = rng.permutation(n)
        for start in range(0, n, bs):
            idx = order[start:start + bs]
            size = idx.shape[0]
            loss, g = model._loss_grad(theta, X[idx], y[idx], w[idx])
            total += loss / size
            batches += 1
            g /= size
            if wd:
                g += wd * theta
            if prox:
                g += mu * (theta - centre)
            buf *= beta
            buf += g
            theta -= lr * buf
    return theta, buf, total / batches
