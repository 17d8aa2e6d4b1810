"""The device's side of seeding MOCHA from an initial model W0 (``start(initial_arrays=)``).

MOCHA keeps W = W(alpha) = B M, B = [X_t^T alpha_t / n_t]: the models are the image of the
dual variables, which is what makes every duality gap a true bound. A given W0 therefore
cannot simply overwrite W. Instead, in the seeding round (round 1 of a fresh run) the server
sends each task, besides its real w_t, the target model ``seed-w`` = W0[:, t] and the target
dual image ``seed-b`` = (W0 K)[:, t] (K = M^-1, so that B0 M = W0), and the device moves its
dual variables (u = y * alpha in the box [0, 1]^n) to

    argmax_u  mean_i u_i - (b(u) - b0)^T w0 - (rho / 2) |b(u) - b0|^2,
    b(u) = X^T (y * u) / n,  rho = SEED_STIFFNESS * m_tt.

With rho = m_tt this is the dual objective D(alpha) maximised over the task's own alpha_t,
the other tasks' images held at their targets; the extra (rho - m_tt) / 2 |b(u) - b0|^2 is a
proximity penalty that pulls the task's image toward W0's (rho -> inf: the box-constrained
least-squares projection of b0 onto the feasible images, ties broken by the largest dual).
It is MOCHA's local subproblem at the virtual point (b0, w0) with m_tt replaced by rho and
sigma' = 1, so the device solves it with the same SDCA kernel, :data:`SEED_PASSES` passes
from its alpha (effective model w0 + rho (b(alpha) - b0)). The reply's ``delta-b`` is
X^T d_alpha / n of this feasible change, added to B by the server like any other: W stays
W(alpha) and the gaps stay valid whatever W0 is. When W0 = W(alpha*) is an optimum, alpha*
maximises the problem for every rho (it maximises the dual part and zeroes the penalty), so
the run restarts at the optimum up to the passes' accuracy; any other W0 gives a feasible
point whose models are pulled toward W0 (as close as feasible duals and the penalty allow).
Cost: one pass is n coordinate steps of O(d), once per run.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array

from ..core.losses import Loss
from ..core.rng import coordinate_order
from ..core.sdca import sdca_local_update
from ..wire import from_array
from .common import LocalTask

#: SDCA passes over the device's rows that the seeding round runs.
SEED_PASSES = 100
#: rho / m_tt of the seeding problem (module docstring).
SEED_STIFFNESS = 10.0


def read_seed_target(arrays: Mapping[str, Array], dim: int
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(seed-w, seed-b)`` of a seeding message's ``arrays`` (its ArrayRecord or a plain dict
    of it; None when the message does not seed); ValueError unless both are finite float64
    of shape (dim,)."""
    if "seed-w" not in arrays and "seed-b" not in arrays:
        return None
    for key in ("seed-w", "seed-b"):
        if key not in arrays:
            raise ValueError(f"a seeding message needs 'seed-w' and 'seed-b'; {key!r} missing")
    return check_seed_target(from_array(arrays["seed-w"]), from_array(arrays["seed-b"]), dim)


def check_seed_target(w0: np.ndarray, b0: np.ndarray, dim: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``(w0, b0)`` (``seed-w``, ``seed-b``: one task's values, from a one-task message or a
    row of a stacked one); ValueError unless both are finite float64 of shape (dim,)."""
    for key, value in (("seed-w", w0), ("seed-b", b0)):
        if value.dtype != np.float64 or value.shape != (dim,) or not np.all(np.isfinite(value)):
            raise ValueError(f"{key!r} must be finite float64 of shape ({dim},), got "
                             f"{value.dtype} {value.shape}")
    return w0, b0


def seed_duals(task: LocalTask, alpha: np.ndarray, w0: np.ndarray, b0: np.ndarray, *,
               m_tt: float, seed: int, server_round: int,
               loss: str | Loss = "hinge") -> tuple[np.ndarray, np.ndarray, int]:
    """The seeding step (module docstring) from ``alpha``: ``(d_alpha, d_b, steps)``. For a
    loss other than the hinge, ``mean_i u_i`` in the problem is the loss's dual term
    ``mean_i D(u_i)`` and the box its dual domain (:mod:`fmtl_flower.core.losses`)."""
    rho = SEED_STIFFNESS * m_tt
    w_start = w0 + rho * (task.X.T @ alpha / task.n - b0)
    steps = SEED_PASSES * task.n
    d_alpha, d_b = sdca_local_update(
        task.X, task.y, alpha, w_start, budget=steps, m_tt=rho, sigma_prime=1.0,
        order=coordinate_order(seed, task.task_id, server_round, task.n), sqnorm=task.sqnorm,
        loss=loss)
    return d_alpha, d_b, steps
