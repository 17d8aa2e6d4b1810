"""Local solvers and server steps of MOCHA's baselines: CoCoA, Mb-SDCA and Mb-SGD.

All three share MOCHA's conventions (:mod:`fmtl_flower.core.sdca`): task t holds X (n x d,
rows are samples), labels y in {-1, +1}, committed dual variables alpha with
``0 <= y * alpha <= 1``, receives its model w = w_t(alpha) from the server and visits the
coordinates in the order ``order[s % n]`` (a permutation from
:func:`fmtl_flower.core.rng.coordinate_order`). The objective is MOCHA's W-step

    P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T),   L_t(w) = (1/n_t) sum_i max(0, 1 - y_ti x_ti^T w),

with K positive definite, M = K^-1, m_tt = M_tt, and dual variables b_t = X_t^T alpha_t / n_t,
W(alpha) = B K^-1. Everything here is pure numpy/numba (no Flower); the per-step loops are
compiled by numba when it is installed, else run by their numpy implementations (the
``*_numpy`` functions, :mod:`fmtl_flower.core.jit`). Zero-norm rows follow the one rule of
:mod:`fmtl_flower.core.sdca`: a step sets them to ``y_i a_i = 1``.

CoCoA (:func:`cocoa_local_update`)
    MOCHA's local subproblem, solved by SDCA until its *true* local duality gap, relative to
    the gap at ``d_alpha = 0``, is <= theta (one theta for every node and round), or until a
    step cap. Returns the number of steps, which varies across nodes and rounds.
Mb-SDCA (:func:`mbsdca_local_update`, :func:`mbsdca_scale`)
    Every coordinate step uses the stale model w_t; the server scales every update by
    beta / b, b the round's total number of coordinate steps.
Mb-SGD (:func:`mbsgd_local_gradient`, :func:`mbsgd_server_step`, :func:`mbsgd_step_size`,
:func:`mbsgd_radius`)
    Sums of hinge subgradients at the stale w_t; the server takes a projected stochastic
    subgradient step on P with the regulariser's gradient W K included.
"""

from __future__ import annotations

from .cocoa import cocoa_local_gap, cocoa_local_update
from .mbsdca import mbsdca_local_update, mbsdca_scale
from .mbsgd import (
    mbsgd_local_gradient,
    mbsgd_objective,
    mbsgd_radius,
    mbsgd_server_step,
    mbsgd_step_size,
)

__all__ = [
    "cocoa_local_gap",
    "cocoa_local_update",
    "mbsdca_local_update",
    "mbsdca_scale",
    "mbsgd_local_gradient",
    "mbsgd_objective",
    "mbsgd_radius",
    "mbsgd_server_step",
    "mbsgd_step_size",
]
