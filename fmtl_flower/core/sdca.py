"""MOCHA's local solver: SDCA on a task's quadratic subproblem (numba, or numpy without it).

For task t with data X_t (n rows), labels y in {-1, +1}, committed dual variables alpha,
model w_t sent by the server, diagonal entry ``m_tt = (K^-1)_tt`` of the inverse regulariser
matrix, aggregation parameter ``sigma'`` and a loss l of :mod:`fmtl_flower.core.losses`
(dual term D(a) = -l*(-a) of a = y alpha), the local subproblem is (MOCHA paper, eq. (4))

    G(d_alpha) = (1/n) sum_i D(y_i (alpha_i + d_alpha_i)) - w_t^T d_b - (sigma' m_tt / 2) |d_b|^2,
    d_b = X_t^T d_alpha / n.

One coordinate step on sample i maximises G exactly over d_alpha_i, keeping y_i alpha_i in
the loss's dual domain: with v = w_t + sigma' m_tt d_b, z = y_i x_i^T v and
q = sigma' m_tt |x_i|^2 / n, it is :func:`~fmtl_flower.core.losses.coordinate_step`; for the
hinge (the default, D(a) = a on [0, 1])

    a_new = clip(a_old + (1 - y_i x_i^T v) / q, 0, 1).

Only ``d_b`` (d floats) leaves the device.

Zero-norm rows, the one rule of every SDCA kernel here (MOCHA, CoCoA, Mb-SDCA, OFMTL; CoCoA+
in :mod:`fmtl_flower.core.fsvrg` follows it for the logistic loss): a row with
``|x_i| = 0`` has loss l(0) whatever the model, and its coordinate's only term in G is
``D(y_i a_i) / n``, so its exact maximiser is ``a_i = argmax D``
(:func:`~fmtl_flower.core.losses.dual_peak`: 1 for the hinge, ``alpha_i = y_i``). A step on
such a row sets it there (the division by ``|x_i|^2`` is never made; the model does not move),
so the duality gap can close.

The kernel is compiled by numba when it is installed; :func:`_sdca_kernel_numpy` is its numpy
implementation (:mod:`fmtl_flower.core.jit`). Both take the loss as its integer ``code``
(:attr:`~fmtl_flower.core.losses.Loss.code`); the hinge's step is written out as before. The
numpy implementation asks the :class:`~fmtl_flower.core.losses.Loss` of the code for its
step and peak, so a loss registered in Python (no compiled branch) runs there, in every
kernel mode (the kernels' ``compiles`` guard, :func:`~fmtl_flower.core.losses.has_kernels`).
"""

from __future__ import annotations

import numpy as np

from .jit import kernel, steps_work
from .losses import (
    HINGE,
    LOSS_BY_CODE,
    Loss,
    compiled_loss_call,
    coordinate_step,
    dual_peak,
    get_loss,
    numpy_step_cost_of,
)

#: numba's fast-math flags of every SDCA-family kernel. Reassociation lets LLVM vectorise the
#: dot product and the axpy (SIMD); no other fast-math flag is set, so NaN/inf semantics are
#: IEEE (inputs are validated finite anyway).
FASTMATH = {"reassoc", "contract"}


@kernel(compiles=compiled_loss_call, inline="always")
def _zero_row_delta(yi, a_old, loss):  # pragma: no cover - compiled
    """The one zero-row rule of every SDCA kernel: a row with ``|x_i| = 0`` goes to its exact
    coordinate maximiser ``y_i a_i = argmax D`` (1 for the hinge; its only term is
    ``D(y_i a_i) / n``; module docstring); the change of ``d_alpha_i`` from
    ``a_old = y_i (alpha_i + d_alpha_i)``."""
    return yi * (dual_peak(loss) - a_old)


@kernel(compiles=compiled_loss_call, inline="always")
def _step_start(X, y, alpha, sqnorm, d_alpha, v, i, loss):  # pragma: no cover - compiled
    """The start of every SDCA-family coordinate step on row ``i`` at the model ``v``:
    ``(y_i, a_old, |x_i|^2, x_i^T v)`` with ``a_old = y_i (alpha_i + d_alpha_i)``. A zero row
    is moved to its maximiser here (:func:`_zero_row_delta`) and returned with
    ``|x_i|^2 = 0`` and no dot product: the caller's step ends there."""
    yi = y[i]
    a_old = yi * (alpha[i] + d_alpha[i])
    xx = sqnorm[i]
    if xx <= 0.0:
        d_alpha[i] += _zero_row_delta(yi, a_old, loss)
        return yi, a_old, xx, 0.0
    dot = 0.0
    for j in range(X.shape[1]):
        dot += X[i, j] * v[j]
    return yi, a_old, xx, dot


@kernel(inline="always")
def _clip01(a):  # pragma: no cover - compiled
    """``a`` clipped to the box [0, 1] of ``y_i alpha_i``."""
    if a < 0.0:
        return 0.0
    if a > 1.0:
        return 1.0
    return a


def _sdca_steps_numpy(X, y, alpha, sqnorm, order, start, count, scale, d_alpha, v, loss):
    """:func:`_sdca_steps` with numpy (one coordinate step per Python iteration)."""
    n = X.shape[0]
    inv_n = 1.0 / n
    ys, xxs, base, idx = y.tolist(), sqnorm.tolist(), alpha.tolist(), order.tolist()
    of = LOSS_BY_CODE[loss]
    step, peak = of.sdca_step, of.peak
    for s in range(start, start + count):
        i = idx[s % n]
        yi = ys[i]
        d_old = float(d_alpha[i])
        a_old = yi * (base[i] + d_old)
        xx = xxs[i]
        if xx <= 0.0:
            d_alpha[i] = d_old + yi * (peak - a_old)  # _zero_row_delta
            continue
        row = X[i]
        if loss == HINGE:
            inv_q = 1.0 / (scale * xx * inv_n)
            a_new = a_old + (1.0 - yi * float(row @ v)) * inv_q
            a_new = 0.0 if a_new < 0.0 else (1.0 if a_new > 1.0 else a_new)
        else:
            a_new = step(a_old, yi * float(row @ v), scale * xx * inv_n)
        if a_new != a_old:
            delta = yi * (a_new - a_old)
            d_alpha[i] = d_old + delta
            v += (scale * delta * inv_n) * row


@kernel(_sdca_steps_numpy, boundscheck=False, fastmath=FASTMATH, compiles=compiled_loss_call,
        work=lambda X, y, alpha, sqnorm, order, start, count, scale, d_alpha, v, loss:
        steps_work(count, X.shape[1]) * numpy_step_cost_of(loss))
def _sdca_steps(X, y, alpha, sqnorm, order, start, count, scale, d_alpha, v,
                loss):  # pragma: no cover
    """Steps ``start .. start+count-1`` of SDCA on the local subproblem of the loss with code
    ``loss``: step s visits ``order[s % n]``; keeps ``v = w + scale * X^T d_alpha / n``. The
    one SDCA kernel: MOCHA's (:func:`_sdca_kernel`, from step 0), CoCoA's (in blocks between
    its gap checks), OFMTL's newcomer and the SVM baselines run it."""
    n, d = X.shape
    inv_n = 1.0 / n
    for s in range(start, start + count):
        i = order[s % n]
        yi, a_old, xx, dot = _step_start(X, y, alpha, sqnorm, d_alpha, v, i, loss)
        if xx <= 0.0:
            continue
        if loss == HINGE:
            # 1/q does not depend on the model: computed apart from the dot product, it keeps
            # the division off the step-to-step dependency chain (v -> dot -> a_new -> v).
            inv_q = 1.0 / (scale * xx * inv_n)
            a_new = _clip01(a_old + (1.0 - yi * dot) * inv_q)
        else:
            a_new = coordinate_step(loss, a_old, yi * dot, scale * xx * inv_n)
        if a_new != a_old:
            delta = yi * (a_new - a_old)
            d_alpha[i] += delta
            c = scale * delta * inv_n
            for j in range(d):
                v[j] += c * X[i, j]


def _sdca_kernel_numpy(X, y, alpha, sqnorm, w, order, budget, scale, d_alpha, v, loss):
    """:func:`_sdca_kernel` with numpy."""
    _sdca_steps_numpy(X, y, alpha, sqnorm, order, 0, budget, scale, d_alpha, v, loss)


@kernel(_sdca_kernel_numpy, boundscheck=False, fastmath=FASTMATH, compiles=compiled_loss_call,
        work=lambda X, y, alpha, sqnorm, w, order, budget, scale, d_alpha, v, loss:
        steps_work(budget, X.shape[1]) * numpy_step_cost_of(loss))
def _sdca_kernel(X, y, alpha, sqnorm, w, order, budget, scale, d_alpha, v,
                 loss):  # pragma: no cover
    """MOCHA's local SDCA: ``budget`` steps of :func:`_sdca_steps` from step 0 (``w`` is the
    start model, already in ``v``; ``loss`` the loss's code)."""
    _sdca_steps(X, y, alpha, sqnorm, order, 0, budget, scale, d_alpha, v, loss)


def sdca_local_update(
    X: np.ndarray,
    y: np.ndarray,
    alpha: np.ndarray,
    w: np.ndarray,
    *,
    budget: int,
    m_tt: float,
    sigma_prime: float,
    order: np.ndarray,
    sqnorm: np.ndarray | None = None,
    loss: str | Loss = "hinge",
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``budget`` SDCA coordinate steps of MOCHA's local subproblem.

    Parameters
    ----------
    X : ndarray of shape (n, d), float64, C-contiguous
        The task's training samples (rows).
    y : ndarray of shape (n,)
        Labels in {-1, +1} (float64).
    alpha : ndarray of shape (n,)
        Committed dual variables, ``y * alpha`` in the loss's dual domain (``[0, 1]`` for the
        hinge). Not modified.
    w : ndarray of shape (d,)
        The task's current model ``w_t = W(alpha)[:, t]`` from the server.
    budget : int
        Number of coordinate steps H (>= 0); coordinates repeat when ``budget > n``.
    m_tt : float
        ``(K^-1)_tt``, the task's diagonal entry of the inverse regulariser matrix (> 0).
    sigma_prime : float
        The aggregation parameter sigma' (> 0).
    order : ndarray of shape (n,), int64
        A permutation of ``0..n-1``; step s visits ``order[s % n]``.
    sqnorm : ndarray of shape (n,), optional
        Precomputed squared row norms of X (computed when omitted).
    loss : str or Loss, default "hinge"
        A loss of :data:`~fmtl_flower.core.losses.LOSSES` (or its name; a registered loss
        of Python code runs the numpy implementation).

    Returns
    -------
    d_alpha : ndarray of shape (n,)
        The change of the dual variables; ``y * (alpha + d_alpha)`` stays in the loss's dual
        domain.
    d_b : ndarray of shape (d,)
        ``X^T d_alpha / n``, the only quantity sent to the server.
    """
    n = X.shape[0]
    code = get_loss(loss).code
    if m_tt <= 0.0 or sigma_prime <= 0.0:
        raise ValueError(f"m_tt and sigma_prime must be > 0, got {m_tt} and {sigma_prime}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if order.shape != (n,):
        raise ValueError(f"order must have shape ({n},), got {order.shape}")
    if sqnorm is None:
        sqnorm = np.einsum("ij,ij->i", X, X)
    d_alpha = np.zeros(n)
    v = np.array(w, dtype=np.float64, copy=True)
    if n == 0 or budget == 0:
        return d_alpha, np.zeros_like(v)
    scale = float(sigma_prime) * float(m_tt)
    _sdca_kernel(X, y, alpha, sqnorm, w, order, int(budget), scale, d_alpha, v, code)
    # v = w + scale * d_b is what the kernel maintained; recover d_b exactly from d_alpha.
    d_b = (X.T @ d_alpha) / n
    return d_alpha, d_b
