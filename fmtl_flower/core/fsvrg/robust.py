"""What the FSVRG family's server believes of a device's word (robust mode), Flower-free.

Every quantity a device reports about itself is capped by what the rest of the federation
makes plausible (fences of :mod:`fmtl_flower.core.robust` across the tasks), and the updates
of the one global model are aggregated Byzantine-robustly. The strategy
(:mod:`fmtl_flower.strategies.fsvrg`) applies these with ``robust = True``; the choices and
the figures behind them:

* **Row counts** (:func:`trusted_counts`). ``n_k`` weights device k in the objective
  (``f = sum_k (n_k/n) F_k``) and sets the default ``lam = 1/n``. A claim above the
  log-scale fence ``exp(median(log n) + max(12 MAD(log n), log 10))`` of the *other* tasks'
  counts (:func:`count_fences`) and the operator's ``max_n`` is cut to it. The fence is wide
  because honest FSVRG data is Pareto-unbalanced: on ``sparse-federated`` (seeds 0, 1, 3;
  K = 10 .. 1000) the largest honest ``n_k`` is 2 to 198 times the median, and 12 MADs is the
  smallest multiple that caps none of them (5 MADs caps K = 1000's largest devices at a
  tenth of their rows). So it stops absurd claims only: a claim of 1e9 is cut to 451 rows at
  K = 10 (seed 0; median 42), but to 5e3 .. 1.6e6 on other seeds and sizes.
* **Weight shares**: then, but for CoCoA+ (whose rows all weigh ``1/n``, and whose devices
  refuse an ``n`` below their own ``n_k``), no device keeps more than ``max_share`` of the
  total (:func:`~fmtl_flower.core.robust.cap_shares`, the other counts unchanged). This is what
  bounds a liar's weight in the gradient methods. Honest largest shares on
  ``sparse-federated`` (seed 0): 0.17 at K = 10, 0.48 at K = 20 (one author with 1022 of 2147
  rows), 0.39 at K = 30, 0.33 at K = 100, 0.06 at K = 1000 (the paper's scale). At small K
  the default cap (0.25) therefore changes the objective being minimised (logged when it
  binds); the operator sets ``max-weight-share = 1`` for such a federation. Capped counts are
  floored to integers (at least 1) and equal the reported counts bit for bit when nothing
  binds.
* **Gram products** (GD's power iteration, :func:`gram_reply_problem`): ``u_k = X_k^T X_k v``
  for a unit ``v`` is checked for what the server can verify: ``v . u_k = |X_k v|^2 >= 0`` and
  ``|u_k|^2 <= rho (v . u_k)`` with ``rho`` the Rayleigh-quotient bound of the task (for a PSD
  operator ``|A v|^2 <= lambda_max(A) v^T A v``); ``rho`` per row is fenced across the
  federation (:data:`QUOTIENT_FACTOR` times the median, or more when the honest values spread).
* **Squared row norms** (``sq-norm-sum / n-train``, the mean squared row norm of the device):
  fenced across the federation on the log scale (:data:`SQ_NORM_FACTOR`; honest values on
  ``sparse-federated`` lie within 1.3x of their median), so the bounds the gradient, loss
  and CoCoA+'s ``d-w`` are checked against no longer grow with what the device says.
* **Gradient pairings** (:func:`gradient_pairing_problem`): a reply's ``grad-sum`` and
  ``loss-sum`` at ``w_t`` must satisfy ``-W(1/e) n_k <= w_t . grad-sum <= loss-sum``, which
  every logistic row meets exactly (``w . grad l_i = -z_i sigma(-z_i)``). A gradient that
  keeps pushing one way is refused from the round in which the server has moved ``w``
  against it by more than the floor: FSVRG's gradient at 3x the median per-row gradient in a
  fixed direction moved the honest objective to 3.32x in 8 rounds, 1.04x with the check
  (GD 1.058 -> 1.025); honest runs are unchanged bit for bit.
* **Updates** (:func:`clip_rows`): local models ``w_k - w_t`` are clipped to
  :data:`CLIP_FACTOR` (3) times the median of their norms, per-row gradients
  ``grad-sum_k / n_k`` to :data:`GRADIENT_CLIP_FACTOR` (2) times theirs
  (:func:`~fmtl_flower.core.robust.robust_radius`). CoCoA+'s share of ``w`` per row is fenced
  on the log scale (:func:`share_outliers`, :data:`SHARE_FENCE_MADS`; a reply over it is
  rejected): honest shares spread more as K grows (largest / median 1.9 at K = 10, 45 at
  K = 100 in round 1), and 12 MADs no longer stop a share kept at the verifiable bound
  ``sqrt(n_k S_k) / (lam n)`` (35x the honest objective at K = 10). The fence alone refused
  94 of 10,000 honest replies at K = 1000 in 10 rounds (5 MADs: 248): in rounds 1 to 3 the
  shares of most devices are alike (a MAD of 0.42 on the log scale) while a few (most of them
  small, 30 to 50 rows) hold up to 500 times the median per row, a tail no MAD fence of the
  bulk admits. Those shares are small for their rows (at most 3.4 % of their verifiable
  bound), so a share is refused only if it is also above :data:`SHARE_BOUND_FLOOR` (5 %) of
  its bound: no honest reply refused at K = 10 (200 rounds), 30 (20), 100 (20) or 1000 (10)
  (seed 0; ``benchmarks/fsvrg_byzantine.py shares``), and a share at its bound is refused
  wherever the fence alone refused it. Honest shares do pass the floor as CoCoA+ converges
  (K = 10: 4.0 % of the bound at round 30, 7.9 % at round 200), by then with the per-row
  fence wide: the two did not meet in any honest run measured. No coordinate-wise trimming:
  the data is sparse (96 % of the features are on fewer than 10 % of the devices), and in a
  coordinate only a few devices touch, the devices with signal are the extremes a trimmed mean
  or a median cuts.
  Measured on the per-row gradients (K = 10, d = 300, 8 rounds, the honest devices' objective
  against the run without task 9's replies; ``benchmarks/fsvrg_byzantine.py``): with all ten
  devices honest, clipping at 3x or 2x the median gives FSVRG 1.018 and GD 1.027 (no honest
  per-row gradient clipped: the run without clipping, bit for bit), at 1.5x FSVRG 1.0185
  (7 of the 80 honest per-row gradients clipped), at 1x 1.066 / 1.055, clip then a weighted
  trimmed mean (trim 0.1) 1.214 / 1.219, the weighted coordinate median 3.07 / 1.54. Against
  the push bent onto the pairing floor (below) FSVRG / GD: 2.01 / 1.33 at 3x, 1.58 / 1.16 at
  2x, 1.36 / 1.11 at 1.5x, 1.23 / 1.12 at 1x; so 2x, the lowest factor that clips no honest
  per-row gradient here. At K = 30 (``cost --tasks 30 --rounds 20``, d = 20,000) 2x moved
  FSVRG with ``max-weight-share = 1`` from a relative sub-optimality of 1.71e-2 to 1.51e-2
  (robust off 1.73e-2; honest task 17's per-row gradient, the largest, is clipped in 17 of
  the 20 rounds, at 3x in 5) and left GD bit for bit; at K = 1000 (``cost --tasks 1000
  --rounds 10``) FSVRG's relative sub-optimality is 8.878e-2 against 8.783e-2 robust off
  (8.784e-2 with the 3x clip): the cost of the lower factor at the paper's scale (GD's
  f = 0.608210 against 0.608230, bit for bit at 3x). Clipping
  around the previous round's aggregate per-row gradient instead of 0 (centered clipping,
  Karimireddy et al. 2021) gave the same (2x: FSVRG 1.61, GD 1.15): the aggregate is small
  beside each device's per-row gradient, which does not shrink at the optimum.

Known limits (``python benchmarks/fsvrg_byzantine.py floor``: one JSON line; K = 10, d = 300,
8 rounds, task 9 hostile, the honest devices' objective against the run without task 9's
replies). **The floor an honest-looking device sets**: task 9 truthful to every message for
its own rows with the labels flipped: FSVRG 1.077, GD 1.082, CoCoA+ 1.185 (1.139 over 30
rounds); for its rows repeated to 200 (the size the attack below claims), labels flipped:
1.533 / 1.297 / 1.217. No reply of such a device can be refused, and on this non-IID
federation it is beyond the issue's 5 % (cf. Karimireddy, He and Jaggi 2022: on heterogeneous
data no aggregator beats Omega(delta zeta^2)). **The worst attacks found**, replies inside
every check, pushing one way as far as the checks allow: FSVRG 7.87x, GD 1.68x (robust off
14.1x / 1.79x): a claim of 200 rows (inside the count fence; 160 after the share cap) with
the gradient at its bound in one direction, turned orthogonal to ``w_t`` each round (``w_t .
grad-sum = 0``, inside the pairing check; the per-row gradient is then near the median, below
any clip radius: the push is the weight the share cap leaves it); bent onto the pairing floor
instead (its component along ``w_t`` raised to ``-W(1/e) n-train``) 3.79x / 1.33x; neither
1.14x (round 1's push, at ``w = 0``, before any pairing). Honest per-row pairings ``w_t .
grad-sum / n_k`` lie between -0.24 and -0.14 here: a fence on them would move the attacker to
their median, between the two. The gradient at the clip radius bent onto the pairing floor:
FSVRG 1.58x, GD 1.16x (2.01x / 1.33x with the 3x clip); kept orthogonal to ``w_t``: 1.58x /
1.18x. FSVRG's local passes take ``h`` times the gradient and ``A = K / omega^j`` multiplies
rare features, so a push GD shrugs off moves FSVRG far. CoCoA+'s share of ``w`` kept as large
as honest shares are (2.9x the median ``d-w`` a round) in one direction: 1.06x in 8 rounds,
1.38x in 30, as much as with robust mode off: ``w`` is the sum of the devices' shares, and
honest shares are large and cancel (their norms add up to 6x ``|w|``). The share fence itself
widens as honest shares spread: at K = 1000 it let a share at its verifiable bound through in
round 9 for every device (8,866 of 10,000 device-rounds refused over 10 rounds;
``benchmarks/fsvrg_byzantine.py shares --tasks 1000``).

Tried and left out (measured on the same federation): (1) *convexity of a device's losses
across rounds*: each new gradient's tangent plane below every earlier ``(w_r, loss-sum_r)`` of
the device (chained over its replies, a budget of ``n_k log 2`` on the work the device does on
the model). Sound (honest sums meet it), and with the 3x clip it refused the bent pushes above
from their second or third round (FSVRG 2.01x -> 1.23x, GD 1.33x -> 1.03x), but a device that
also bends its gradient to meet it (it knows the models it was sent and its own replies;
projected onto the half-spaces, reporting the largest loss allowed) passed it every round with
the same damage (FSVRG 2.07x; 4.56x with the 200-row claim): a push held against the honest
devices' pull does no work, and the pull towards 0 the pairing bend adds wins budget back as
``|w|`` grows. An earlier check of the gradients' monotonicity between consecutive replies
fared no better (2.36x). (2) *A per-device drift budget*: the running sum of a device's clipped
per-row deviations from the aggregate, after 8 rounds, is 1.3 to 1.6x the median for honest
devices, 1.86x for the bent push and 0.85x for the 200-row claim (weighted by the trusted rows:
honest up to 1.68x, the claim 2.67x, but weighted sums grow with a device's rows, which honest
Pareto devices have: a cap there is the share cap again). (3) *A tighter CoCoA+ share fence*
(per row, 2x the median or 3 MADs of the logs, instead of 3x or 8 MADs): it refused no honest
share at K = 10 (200 rounds) or K = 30 (20 rounds; ``shares``), but held the share kept in one
direction only from 1.38x to 1.27x in 30 rounds (1.24x for one at 2.4x the median ``d-w``): the
attacker's share stays below :data:`SHARE_BOUND_FLOOR` (5 %) of its verifiable bound (its
``sq-norm-sum`` x3 widens the bound), which no share fence refuses; without that floor the
tighter fence holds it to 1.13x, but the floor is what keeps K = 1000's honest early shares (up
to 3.4 % of their bounds, 500x the median per row). Not adopted; a floor that follows the
honest shares' fraction of their bounds instead of a constant is the lead (not measured at K =
100 or 1000). (4) *A larger default* ``max-weight-share`` would spare honest unbalanced
federations (at K = 30 the largest honest share is 0.39 and the 0.25 cap makes FSVRG minimise
another objective, relative sub-optimality 6.75e-2 against 1.73e-2 robust off; ``cost --tasks
30``): 0.4 spares K = 30 but not K = 20 (0.48), and lets the 200-row claim weigh 200 rows:
3.79x -> 4.49x (a 451-row claim, just inside the count fence: 2.52x -> 4.35x; GD 1.33x ->
1.36x); a smaller one does not hold the worst attack either: 0.2 (no honest device capped at K
= 10) leaves the orthogonal 200-row claim 120 rows and 4.83x (GD 1.62x), 7.87x / 1.68x at 0.25.
The share cap stays on every device, not only on claims the count fence cut: with it on cut
claims only, a device claiming 451 rows with the gradient at its bound moved FSVRG's honest
objective to 1.50x with lambda at 0.56 of the true ``1/n``, against 1.05x with lambda at 0.81.
The reported objective still sums what devices say about their losses (a liar's claimed rows
weigh at most its trusted count).
"""

from __future__ import annotations

import math

import numpy as np

from fmtl_flower.core.robust import cap_shares, log_upper_fence, robust_radius

__all__ = [
    "CLIP_FACTOR",
    "GRADIENT_CLIP_FACTOR",
    "GRADIENT_PAIRING_FLOOR",
    "N_FENCE_FACTOR",
    "N_FENCE_MADS",
    "QUOTIENT_FACTOR",
    "SHARE_BOUND_FLOOR",
    "SHARE_FENCE_MADS",
    "SQ_NORM_FACTOR",
    "clip_rows",
    "count_fences",
    "gradient_pairing_problem",
    "gram_reply_problem",
    "share_outliers",
    "trusted_counts",
]

#: A row count may exceed the federation's median by this factor always (log-scale fence).
N_FENCE_FACTOR = 10.0
#: ... and by this many scaled MADs of log n when the honest counts spread (Pareto data).
N_FENCE_MADS = 12.0
#: A mean squared row norm may exceed the federation's median by this factor.
SQ_NORM_FACTOR = 4.0
#: A per-row Rayleigh quotient of a Gram reply may exceed the federation's median by this.
QUOTIENT_FACTOR = 10.0
#: Updates are clipped to this many times the median of their norms.
CLIP_FACTOR = 3.0
#: Per-row gradients are clipped to this many times the median of their norms (lower than
#: :data:`CLIP_FACTOR`: a push the checks cannot refuse is held to this size; the honest
#: per-row gradients of ``sparse-federated`` at K = 10 stay within it, module docstring).
GRADIENT_CLIP_FACTOR = 2.0
#: CoCoA+'s share of ``w`` per row may exceed the round's median by this many scaled MADs of
#: the logs (or :data:`CLIP_FACTOR` times, whichever is more).
SHARE_FENCE_MADS = 8.0
#: ... but a share within this fraction of its verifiable bound ``sqrt(n_k S_k) / (lam n)`` is
#: never refused (honest shares on ``sparse-federated``: at most 3.4 % in the first 10 rounds
#: at K = 1000, when the per-row fence is narrow; they grow as CoCoA+ converges).
SHARE_BOUND_FLOOR = 0.05
#: ``max_z z sigma(-z) = W(1/e)`` (Lambert's W): for one row ``i`` with ``z_i = y_i x_i . w``,
#: ``w . grad l_i(w) = -z_i sigma(-z_i)`` lies in ``[-W(1/e), l_i(w)]``.
GRADIENT_PAIRING_FLOOR = 0.2784645427610738


def trusted_counts(n_train: np.ndarray, max_n: int, max_share: float) -> np.ndarray:
    """The row counts the server weights devices by (module docstring): each reported count
    cut to the federation's fence and ``max_n``, then no share above ``max_share``; int64,
    at least 1 where the report is >= 1, ``n_train`` itself where nothing binds."""
    n = np.asarray(n_train, dtype=np.int64)
    seen = n > 0
    capped = np.minimum(n.astype(np.float64), np.minimum(float(max_n), count_fences(n)))
    if seen.any():
        capped[seen] = _cap_shares_keeping_the_others(capped[seen], max_share)
    if np.all(capped >= n):
        return n.copy()
    out = np.where(capped >= n, n, np.floor(capped).astype(np.int64))
    return np.where(seen, np.maximum(out, 1), 0).astype(np.int64)


def count_fences(n_train: np.ndarray) -> np.ndarray:
    """Each task's fence for its row count, from the *other* tasks' counts (the log-scale
    fence of the module docstring; a claim does not widen its own fence: with 12 MADs, one
    claim of 1e9 among ten honest counts moved the fence from 10x to 57x the median). Only
    the counts above half the smallest possible fence are compared (the others are below
    any fence); ``inf`` where no other count is known."""
    n = np.asarray(n_train, dtype=np.float64)
    seen = n > 0
    out = np.full(n.shape, np.inf)
    if not seen.any():
        return out
    out[:] = log_upper_fence(n[seen], factor=N_FENCE_FACTOR, k=N_FENCE_MADS)
    for t in np.flatnonzero(seen & (n > 0.5 * N_FENCE_FACTOR * np.median(n[seen]))):
        others = seen.copy()
        others[t] = False
        out[t] = log_upper_fence(n[others], factor=N_FENCE_FACTOR, k=N_FENCE_MADS)
    return out


def _cap_shares_keeping_the_others(counts: np.ndarray, max_share: float) -> np.ndarray:
    """``counts`` with the largest cut so that none holds more than ``max_share`` of the
    total (:func:`~fmtl_flower.core.robust.cap_shares`), the uncut ones unchanged."""
    shares = cap_shares(counts, max_share)
    cut = shares < counts * (1.0 - 1e-12)
    if not cut.any() or cut.all():
        return counts if not cut.any() else shares
    scale = float(counts[~cut].sum()) / float(shares[~cut].sum())
    return np.where(cut, shares * scale, counts)


def gram_reply_problem(v: np.ndarray, u: np.ndarray, rho: float) -> str | None:
    """Why ``u`` cannot be ``A v`` for a PSD ``A`` with ``lambda_max(A) <= rho`` and the unit
    ``v`` (None: it can)."""
    vu = float(v @ u)
    if not vu >= 0.0:
        return f"v . gram-v = {vu:.6g} < 0, but v^T X^T X v = |X v|^2 >= 0"
    uu = float(u @ u)
    if uu > rho * vu * (1.0 + 1e-9) + 1e-300:
        return (f"|gram-v|^2 / (v . gram-v) = {uu / vu if vu > 0 else math.inf:.6g} above the "
                f"Rayleigh-quotient bound {rho:.6g} the federation makes plausible")
    return None


def gradient_pairing_problem(w: np.ndarray, grad_sum: np.ndarray, loss_sum: float,
                             n_train: float) -> str | None:
    """Why ``(loss_sum, grad_sum)`` cannot be the sums over ``n_train`` rows of the logistic
    loss and its gradient at ``w`` (None: they can).

    For a row, ``w . grad l_i(w) = -z_i sigma(-z_i)`` with ``z_i = y_i x_i . w``, which lies in
    ``[-GRADIENT_PAIRING_FLOOR, l_i(w)]``; summed, ``-W(1/e) n_k <= w . grad-sum <= loss-sum``.
    The floor is what stops a push that always points one way: the server moves ``w`` against
    the pushed direction, so ``w . grad-sum`` grows negative with every round the push lasts,
    and a device may only ever claim ``W(1/e) n_k`` of it (convexity with ``l_i >= 0`` says the
    same up to the constant: ``w . grad-sum >= loss-sum - n_k log 2``). An honest reply meets
    both sides exactly, up to a rounding slack relative to ``|w| |grad-sum| + n_k``."""
    pairing = float(w @ grad_sum)
    slack = 1e-9 * (float(np.linalg.norm(w)) * float(np.linalg.norm(grad_sum)) + n_train
                    + abs(loss_sum))
    floor = -GRADIENT_PAIRING_FLOOR * n_train
    if pairing < floor - slack:
        return (f"w . grad-sum = {pairing:.6g} below -W(1/e) n-train = {floor:.6g} (a logistic "
                "row's w . grad l_i(w) = -z sigma(-z) >= -W(1/e))")
    if pairing > loss_sum + slack:
        return (f"w . grad-sum = {pairing:.6g} above loss-sum = {loss_sum:.6g} (a logistic "
                "row's -z sigma(-z) <= log(1 + exp(-z)))")
    return None


def share_outliers(share_norms: np.ndarray, n_rows: np.ndarray, bounds: np.ndarray
                   ) -> tuple[np.ndarray, float]:
    """``(outlier, fence)``: which CoCoA+ shares of ``w`` (norms ``|v_k|``, one per reply of
    the round) are refused. A share is an outlier when its size per row ``|v_k| / n_k`` is
    above the round's log-scale fence (:data:`SHARE_FENCE_MADS` scaled MADs, at least
    :data:`CLIP_FACTOR` times the median; ``fence``) *and* the share uses more than
    :data:`SHARE_BOUND_FLOOR` of its verifiable bound ``bounds[k] = sqrt(n_k S_k) / (lam n)``.
    The floor is for the first rounds of a large federation: from ``alpha = 0`` most shares
    are small and alike, and a few devices hold shares hundreds of times the median per row,
    still within 3.4 % of their bounds (module docstring)."""
    per_row = np.asarray(share_norms, dtype=np.float64) / np.maximum(n_rows, 1)
    fence = log_upper_fence(per_row, factor=CLIP_FACTOR, k=SHARE_FENCE_MADS)
    outlier = (per_row > fence) & (np.asarray(share_norms) > SHARE_BOUND_FLOOR * bounds)
    return outlier, fence


def clip_rows(rows: np.ndarray, center: np.ndarray, factor: float = CLIP_FACTOR
              ) -> tuple[np.ndarray, float, np.ndarray]:
    """``(rows', radius, clipped)``: the rows of ``rows`` (K, d) farther than ``radius`` =
    ``factor`` x the median of their distances to ``center`` moved onto that sphere; the others
    unchanged bit for bit. ``clipped`` marks the moved rows."""
    delta = rows - center
    dist = np.linalg.norm(delta, axis=1)
    radius = robust_radius(dist, factor)
    clipped = dist > radius
    out = rows.copy()
    if clipped.any():
        out[clipped] = center + delta[clipped] * (radius / dist[clipped])[:, None]
    return out, radius, clipped

