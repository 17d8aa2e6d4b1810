"""pFedMe (Dinh, Tran and Nguyen 2020): personalisation by Moreau envelopes, device side.

Each client i keeps a personalised model theta_i tied to its local copy w of the global model
by the Moreau envelope

    F_i(w) = min_theta  f_i(theta) + (lambda / 2) || theta - w ||^2 ,

f_i being the client's loss (here the mean cross-entropy of a mini-batch plus the solver's
weight decay (wd / 2) |theta|^2). One round on the device, from the received global model w:

* for every local step (one mini-batch D; ``epochs`` passes over the data in mini-batches):

  - **inner solve**: theta approximately minimises h(theta) = f_D(theta) + (lambda/2)
    |theta - w|^2 by ``inner_steps`` (the paper's K) gradient steps of size
    ``personal_lr``, warm-started at the previous step's theta (at w for the first step);
  - **local update**: w <- w - eta lambda (w - theta), i.e. a gradient step of size eta on
    the Moreau envelope (grad F_i(w) = lambda (w - theta*(w)));

* the device sends w back; the server takes w <- (1 - beta) w + beta * (average of the
  clients' w), beta = 1 being the plain average;
* the **personalised** model theta_i (after the last local step) is the client's predictor:
  pFedMe is evaluated on it, as the paper does.

The inner steps run through the backend's own solver (:meth:`~fmtl_flower.core.backend.
ModelBackend.sgd_epochs`: one full-batch step per "epoch", no momentum, proximal term
lambda around w), so the numpy models and the torch backend both run pFedMe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backend import ModelBackend
from .local_sgd import SGDConfig

__all__ = ["PFedMeConfig", "PFedMeUpdate", "local_pass", "moreau_objective", "solve_inner"]


@dataclass(frozen=True)
class PFedMeConfig:
    """pFedMe's device settings (validated on construction).

    Attributes
    ----------
    lr : float
        eta, the step of the local model w on the Moreau envelope (> 0; eta * lam <= 1 keeps
        w between itself and theta).
    personal_lr : float
        Step of the inner gradient steps on theta (> 0).
    lam : float
        lambda, the Moreau envelope's regularisation (> 0).
    inner_steps : int
        K, gradient steps of the inner solve per local step (>= 1).
    batch_size, epochs : int
        Local steps: ``epochs`` passes over the data in mini-batches of ``batch_size``.
    weight_decay : float
        L2 coefficient of f_i (>= 0).
    """

    lr: float
    personal_lr: float
    lam: float
    inner_steps: int = 5
    batch_size: int = 32
    epochs: int = 1
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "personal_lr", "lam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not np.isfinite(value) or not value > 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("inner_steps", "batch_size", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (np.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")

    def inner(self, batch: int) -> SGDConfig:
        """The inner solve as the backend's solver: ``inner_steps`` full-batch steps."""
        return SGDConfig(lr=self.personal_lr, momentum=0.0, weight_decay=self.weight_decay,
                         batch_size=batch, epochs=self.inner_steps, prox_mu=self.lam)


def moreau_objective(model: ModelBackend, theta: np.ndarray, w: np.ndarray, X, y,
                     lam: float, weight_decay: float = 0.0) -> float:
    """h(theta) = mean loss on (X, y) + (wd/2)|theta|^2 + (lambda/2)|theta - w|^2."""
    theta = np.asarray(theta, dtype=np.float64)
    loss = float(model.per_sample_loss(theta, X, y).mean())
    return (loss + 0.5 * weight_decay * float(theta @ theta)
            + 0.5 * lam * float((theta - w) @ (theta - w)))


def solve_inner(model: ModelBackend, theta: np.ndarray, w: np.ndarray, X, y,
                config: PFedMeConfig, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """theta after K gradient steps on h (:func:`moreau_objective`) over the batch (X, y),
    started at ``theta``; and the mean batch loss over the K iterates the steps started
    from."""
    n = int(np.shape(X)[0])
    out, _, loss = model.sgd_epochs(theta, np.zeros_like(theta), X, y, np.ones(n),
                                    config.inner(n), rng, anchor=w)
    return out, loss


@dataclass(frozen=True)
class PFedMeUpdate:
    """One device's pFedMe round: the local model w (sent), the personalised theta (kept),
    the mean batch loss of the inner iterates, and the seconds spent."""

    w: np.ndarray
    theta: np.ndarray
    loss: float
    train_s: float


def local_pass(model: ModelBackend, w: np.ndarray, X, y, config: PFedMeConfig,
               rng: np.random.Generator) -> PFedMeUpdate:
    """A device's pFedMe round from the global model ``w`` (see the module docstring).

    Mini-batches in the order ``rng.permutation(n)`` per epoch; the inner solves draw from
    a generator spawned from ``rng`` once (their full-batch steps do not depend on it).
    """
    started = time.perf_counter()
    w = np.array(model.check_params(w), dtype=np.float64, copy=True)
    theta = w.copy()
    n = int(np.shape(X)[0])
    if n < 1:
        raise ValueError("X must have at least one sample")
    inner_rng = np.random.default_rng(rng.integers(2**63))
    losses = []
    step = config.lr * config.lam
    for _ in range(config.epochs):
        order = rng.permutation(n)
        for start in range(0, n, config.batch_size):
            batch = order[start:start + config.batch_size]
            Xb, yb = X[batch], y[batch]
            theta, loss = solve_inner(model, theta, w, Xb, yb, config, inner_rng)
            losses.append(loss)
            w = w - step * (w - theta)
    return PFedMeUpdate(w, theta, float(np.mean(losses)), time.perf_counter() - started)
