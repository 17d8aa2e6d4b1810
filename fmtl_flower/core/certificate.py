"""The duality-gap certificate: what the server can check of a device's (loss, dual) pair.

A reported duality gap is assembled from numbers the devices report about themselves: each
task's primal loss at the model it was sent and its dual value at its committed dual
variables. The server cannot recompute either without the data, but it holds the coupling
term that ties them, and Fenchel-Young's inequality then bounds what a truthful pair can be.

Hinge loss (MOCHA, CoCoA, Mb-SDCA; :mod:`fmtl_flower.core.objective`)
----------------------------------------------------------------------
Task t reports ``loss-mean`` L_t = (1/n_t) sum_i max(0, 1 - y_i x_i^T w_t) at the w_t the
server sent, and ``dual-mean`` A_t = (1/n_t) sum_i y_i alpha_i with beta_i = y_i alpha_i in
[0, 1]; the server holds w_t and b_t = X_t^T alpha_t / n_t (design decision 2). The hinge
phi(z) = max(0, 1 - z) has conjugate phi*(-beta) = -beta on [0, 1], so Fenchel-Young,
phi(z) + phi*(-beta) >= -beta z, gives with z_i = y_i x_i^T w_t and y_i^2 = 1 for each sample
max(0, 1 - y_i x_i^T w_t) >= y_i alpha_i - alpha_i x_i^T w_t; averaged over the task's rows:

    s_t = L_t - A_t + w_t . b_t >= 0   (for ANY w_t, and beta in the box).

The box is part of the check: ``dual-mean`` in [0, 1] and ``loss-mean`` >= 0.

Any loss of MOCHA's family (:mod:`fmtl_flower.core.losses`)
------------------------------------------------------------
Nothing above uses the hinge beyond Fenchel-Young: for a convex loss l with dual term
D(a) = -l*(-a), task t reports ``loss-mean`` L_t = (1/n_t) sum_i l(y_i x_i^T w_t) and
``dual-mean`` A_t = (1/n_t) sum_i D(y_i alpha_i), and per sample
l(z_i) - D(a_i) + a_i z_i >= 0 with z_i = y_i x_i^T w_t, a_i = y_i alpha_i, a_i z_i =
alpha_i x_i^T w_t, so s_t = L_t - A_t + w_t . b_t >= 0 as before. The box is the loss's:
``dual-mean`` within the range of D (:attr:`~fmtl_flower.core.losses.Loss.dual_range`:
[0, 1] hinge, [0, 1/2] smoothed hinge, [0, log 2] logistic, at most 1/2 squared) and
``loss-mean`` >= 0 (every loss here is >= 0). :func:`pair_problems` checks it.

The sum. The server reports P = sum_t L_t + r and D = sum_t A_t - r with
r = (1/2) sum_t w_t . b_t (:func:`~fmtl_flower.core.objective.regulariser_value`), so

    P - D = sum_t (L_t - A_t) + sum_t w_t . b_t = sum_t s_t >= 0:

the regulariser terms cancel against the tasks' coupling terms exactly (the same r is added
to P and subtracted from D), whatever W is. What W = W(alpha) = B K^-1 adds is that these P and
D are the objective and the dual of the problem ((1/2) tr(W K W^T) = (1/2) tr(B K^-1 B^T) =
r), so the gap bounds P(W) - P*. The server keeps W = B M incrementally (W += delta_B M), equal
to B M up to rounding, which moves P and D by rounding only; the identity P - D = sum_t s_t
holds for the W the server sends and reports. A device that restarted from alpha = 0
(``state-ok`` 0) has b_t = 0 on its side: its coupling term is 0.

Logistic loss (CoCoA+; :mod:`fmtl_flower.core.fsvrg.cocoa_plus`)
----------------------------------------------------------------
Node k reports ``loss-sum`` sum_i log(1 + exp(-y_i x_i^T w)) and ``dual-sum``
sum_i H(y_i alpha_i) (H the binary entropy, beta_i = y_i alpha_i in [0, 1]); the server holds
w and the node's share v_k = X_k^T alpha_k / (lam n) of w. The logistic loss
l(z) = log(1 + e^-z) has conjugate l*(-beta) = -H(beta), so per sample
l(y_i x_i^T w) - H(beta_i) + alpha_i x_i^T w >= 0 and, summed over the node's rows,

    s_k = loss-sum_k - dual-sum_k + lam n (w . v_k) >= 0.

The box: ``dual-sum`` in [0, n_k log 2], ``loss-sum`` >= 0. The reported gap is
f(w) - D(alpha) = (1/n) sum_k (loss-sum_k - dual-sum_k) + lam |w|^2 = (1/n) sum_k s_k when
w = sum_k v_k, which the server's ledger keeps (up to rounding): whatever the server adds to w
must be added to the shares too, or the sum no longer cancels.

What is certified
-----------------
Each pair is checked up to :data:`PAIR_SLACK` relative to its terms' sizes (the devices'
and the server's rounding), so a gap built only from pairs that passed is
>= -PAIR_SLACK sum_t (|L_t| + |A_t| + |w_t . b_t|) (rounding of the sums aside): never
materially below 0. It is an upper bound on the suboptimality *if the devices computed their
numbers honestly*: a device can still claim a lower loss than its true one as long as its
pair stays consistent (s_t >= 0), which understates the gap by at most its true s_t but never
drives it below 0. A pair that fails is rejected like any invalid reply (the task counts as a
drop, so the record carries no gap), with a reason starting with :data:`REASON_PREFIX`.
"""

from __future__ import annotations

import math

import numpy as np

from .losses import LOSSES, Loss, get_loss

__all__ = ["PAIR_SLACK", "REASON_PREFIX", "certificate_rejections", "hinge_pair_problems",
           "logistic_pair_problem", "pair_fails", "pair_problems"]

#: Relative slack of the Fenchel-Young check: honest pairs differ from exact arithmetic by
#: rounding (float64 sums over a task's rows, B accumulated over the rounds), orders of
#: magnitude below it.
PAIR_SLACK = 1e-9

#: Every rejection by the certificate's check starts with this (how the records count them).
REASON_PREFIX = "certificate check: "

#: The dual box's rounding margin (a device's mean of D sums to its top + a few ulps).
_BOX_SLACK = 1e-9


def pair_fails(loss: np.ndarray, dual: np.ndarray, coupling: np.ndarray) -> np.ndarray:
    """Which pairs break Fenchel-Young: ``loss - dual + coupling`` below
    ``-PAIR_SLACK (|loss| + |dual| + |coupling|)``, or not a number (elementwise)."""
    with np.errstate(over="ignore", invalid="ignore"):
        slack = loss - dual + coupling
        scale = np.abs(loss) + np.abs(dual) + np.abs(coupling)
        return ~(slack >= -PAIR_SLACK * scale)


def pair_problems(loss: str | Loss, loss_mean: np.ndarray, dual_mean: np.ndarray,
                  coupling: np.ndarray) -> dict[int, str]:
    """The (``loss-mean``, ``dual-mean``) pairs of MOCHA's family with ``loss`` that fail the
    certificate's check, ``{row: reason}``.

    Parameters
    ----------
    loss : str or Loss
        The run's loss (:data:`~fmtl_flower.core.losses.LOSSES`): its dual range is the box.
    loss_mean, dual_mean : ndarray of shape (k,)
        The replies' ``loss-mean`` and ``dual-mean``.
    coupling : ndarray of shape (k,)
        w_t . b_t of each row's task as the server holds them (0 for a device that restarted
        from alpha = 0).
    """
    lo, hi = get_loss(loss).dual_range
    box = ~((loss_mean >= 0) & (dual_mean >= lo - _BOX_SLACK) & (dual_mean <= hi + _BOX_SLACK))
    fails = pair_fails(loss_mean, dual_mean, coupling)
    out: dict[int, str] = {}
    for i in np.flatnonzero(box | fails).tolist():
        out[i] = REASON_PREFIX + (
            f"loss-mean must be >= 0 and dual-mean in [{lo:.6g}, {hi:.6g}] "
            f"({get_loss(loss).name} loss)" if box[i] else (
                f"loss-mean - dual-mean + w_t.b_t = {loss_mean[i]:.6g} - {dual_mean[i]:.6g} + "
                f"{coupling[i]:.6g} < 0, impossible for a truthful pair (Fenchel-Young)"))
    return out


def hinge_pair_problems(loss_mean: np.ndarray, dual_mean: np.ndarray,
                        coupling: np.ndarray) -> dict[int, str]:
    """:func:`pair_problems` of the hinge loss (its box: ``dual-mean`` in [0, 1])."""
    return pair_problems(LOSSES["hinge"], loss_mean, dual_mean, coupling)


def logistic_pair_problem(loss_sum: float, dual_sum: float, n_train: int,
                          coupling: float) -> str | None:
    """Why a logistic pair fails the certificate's check (None: it passes).

    ``coupling`` is lam n (w . v_k) for the node's share v_k of w (0 for a node that restarted
    from alpha = 0); ``n_train`` bounds ``dual-sum`` by n_k log 2."""
    if not (loss_sum >= 0 and 0 <= dual_sum <= n_train * math.log(2.0) * (1 + 1e-12)):
        return (REASON_PREFIX + f"dual-sum must be in [0, n-train log 2] and loss-sum >= 0, "
                f"got {dual_sum!r} and {loss_sum!r}")
    if pair_fails(np.array([loss_sum]), np.array([dual_sum]), np.array([coupling]))[0]:
        return (REASON_PREFIX + f"loss-sum - dual-sum + lambda n w.v_k = {loss_sum:.6g} - "
                f"{dual_sum:.6g} + {coupling:.6g} < 0, impossible for a truthful pair "
                "(Fenchel-Young)")
    return None


def certificate_rejections(failed: dict[int, str]) -> int:
    """How many of an exchange's rejected replies (``{task: reason}``) failed the check."""
    return sum(1 for reason in failed.values() if reason.startswith(REASON_PREFIX))
