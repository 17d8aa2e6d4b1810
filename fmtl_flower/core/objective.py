"""MOCHA's primal and dual objectives, assembled from per-task sums.

P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T),   L_t = (1/n_t) sum_i l(y_ti x_ti^T w_t),
D(alpha) = sum_t A_t(alpha_t) - (1/2) tr(B K^-1 B^T),   A_t = (1/n_t) sum_i D_l(y_ti alpha_ti),

for the run's loss l and its dual term D_l(a) = -l*(-a) (:mod:`fmtl_flower.core.losses`; the
hinge's is D_l(a) = a, so A_t is the mean of y * alpha).

For the consistent pair W = W(alpha) = B K^-1, both quadratic terms equal
(1/2) sum_t w_t^T b_t, which the server computes in O(d m) from W and B alone; the devices
report only the scalars L_t and A_t. The duality gap P - D is >= 0 by weak duality.
"""

from __future__ import annotations

import numpy as np


def regulariser_value(W: np.ndarray, B: np.ndarray) -> float:
    """(1/2) tr(W K W^T) for W = B K^-1, computed as (1/2) sum_t w_t . b_t."""
    return 0.5 * float(np.einsum("ij,ij->", W, B))


def primal_dual_gap(
    loss_means: np.ndarray, dual_means: np.ndarray, W: np.ndarray, B: np.ndarray
) -> tuple[float, float, float]:
    """Primal P, dual D and gap P - D of a consistent pair (W(alpha), alpha).

    Parameters
    ----------
    loss_means, dual_means : ndarray of shape (m,)
        Per-task mean loss at w_t and mean dual term D_l(y * alpha) (for the hinge, the
        mean of y * alpha).
    W, B : ndarray of shape (d, m)
        Models and dual images ``b_t = X_t^T alpha_t / n_t``.
    """
    reg = regulariser_value(W, B)
    primal = float(np.sum(loss_means)) + reg
    dual = float(np.sum(dual_means)) - reg
    return primal, dual, primal - dual
