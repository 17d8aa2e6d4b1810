"""Decoupling outlying tasks from MOCHA's task relationships (robust mode), Flower-free.

In MOCHA (and Mb-SGD on MOCHA's primal) every task owns its model, and the tasks are tied only
by the regulariser's matrix: W = B M with M = K^-1, so task s moves task t's model through
the off-diagonal entry M_st. A lying device cannot take another task's model, but through
M_st it can pull every coupled model (and, through the Omega-step, the relationships
themselves). Robust mode therefore *decouples* a task whose updates are outliers against the
federation (:class:`OutlierWatch`): its row and column of M lose their off-diagonal entries,

    M' = M with M'_st = M'_ts = 0 for every decoupled s and t != s,
    M'_ss = the median of the coupled tasks' M_tt,

a principal-submatrix block of a symmetric positive definite matrix and positive diagonal
entries, so M' is symmetric positive definite: the regulariser K' = M'^-1 is block diagonal,
valid, and every duality gap computed with it is a true bound for it. The coupled tasks'
models W_H = B_H M_HH are exactly what they would be if the decoupled tasks' dual images were
0 (their replies lost); a decoupled task keeps training its own model w_s = b_s M'_ss,
regularised like a typical task (its diagonal is the coupled tasks' median; for the fixed
formulations, whose diagonal is constant, that is its own M_ss). The Omega-step of a learned
formulation sees the decoupled tasks' models as 0 (:func:`coupled_models`), so they shape no
relationship either (for ``probabilistic`` and ``clustered`` a zero column makes the step's
Gram matrix, and so Omega, block diagonal; ``graphical``'s lasso too, up to its tolerance,
and M' removes the rest).

On the factored server path (M = V diag(s) V^T + c I, :mod:`.factored`, for m > 1000
tasks) M' is the same matrix kept in factored form (:func:`decoupled_factor`): the coupled
rows of V diag(s) V^T refactored with orthonormal columns that vanish on the decoupled rows,
and one unit column per decoupled task of weight M'_ss - c; the coupling weights come from
the factor's absolute row sums, computed once per M.

Decoupling is sticky for the run: a device caught once (e.g. one that lies only every other
round) stays decoupled; the statistics are re-checked every round and only add tasks.

Why the size of an image is not enough, and what is (:func:`consensus_fence`)
------------------------------------------------------------------------------
Colluders that keep |b_s| just under a size fence (a few times the federation's median) but
point it against the honest tasks' common direction still steer them when the coupling is
strong: with ``mean`` and lam / lam2 = 10, w_t = (b_t - b_mean) / (lam + lam2) + b_mean / lam2,
so each task moves the shared part b_mean by b_s / m, and 2 of 10 tasks at 4.5 times an
honest |b| against 8 honest ones cancel the shared model (0.51 honest test error against 0.16
with their replies lost). The damage is *coherent direction*, not size: what a coupled task s
adds to another task's model is M_st b_s, and against the consensus c (the coordinate-wise
median of the coupled tasks' normalised images b_t / scale_t) it splits into

    M_st b_s = M_st scale_s c  +  M_st scale_s (b_s / scale_s - c),

the pull of a task *at* the consensus (which only reinforces the honest tasks' common part,
as one more honest task would) plus a deviation. So robust mode also bounds the deviation
|b_s / scale_s - c| of every coupled task by the fence of the federation's deviations
(median + :data:`CONSENSUS_MADS` MADs, at least the median deviation times
1 + :data:`CONSENSUS_MADS` :data:`CONSENSUS_REL_FLOOR` and at least the median |b_t| / scale_t),
and decouples a task beyond it in :data:`IMAGE_PERSISTENCE` rounds running (as for the size).

Proof sketch (breakdown). Let f < m_c / 2 of the m_c coupled tasks with images collude. In
every coordinate the median lies between two honest values, so c is within the honest
tasks' coordinate range; the median and the MAD of the deviations and the median size are
order statistics of which more than half are honest, so each lies between two honest tasks'
values: the fence r is at most what the honest deviations alone make plausible (their
(m_c / 2 + f)-th smallest values in place of the median, whatever the colluders send). A
colluder that is never decoupled therefore satisfies |b_s / scale_s - c| <= r, and the f of
them move any coupled model w_t by

    sum_s M_st b_s = (sum_s M_st scale_s) c + e,   |e| <= r sum_s |M_st| scale_s,

i.e. like f tasks at the honest consensus plus at most f honest-sized deviations: against
the (m_c - f) honest deviations, which are of the same size, they can no longer outvote the
honest tasks (a size fence alone allowed each colluder a deviation of the fence factor
times the *size* of the consensus, which is what cancelled it). Any colluder beyond r is
decoupled after :data:`IMAGE_PERSISTENCE` rounds, and a decoupled task moves no other model
(W_H = B_H M'_HH above). Both cases keep W = B M' with M' symmetric positive definite:
nothing here changes what the certificate certifies (a consistent (W, alpha) pair for the
valid regulariser K' = M'^-1).

What it does not give, and the pull fence that does (:func:`coupling_weights`)
------------------------------------------------------------------------------
The bound above holds the colluders' *deviation* to r; its multiplier, sum_s |M_st| scale_s,
is the same for every pair under a fixed formulation but learned otherwise, and r is relative
to the honest tasks' own spread: where their images point different ways (clustered tasks
under a learned Omega), r is wide. 2 of 10 colluders kept just under every fence above with
``probabilistic`` (lam = 0.01) took the honest error from 0.130 (replies lost) to 0.242 (the
Byzantine suite's table, ``python -m tests.strategies.test_byzantine_mocha``) through the
Omega-step: Sigma = (W^T W)^(1/2) / trace gave their models 10 times the honest median and,
worse, their columns of M the largest off-diagonal entries (each honest w_t received 5 to
12 times more from the two colluders' b_s than from its own b_t, median 9.7). Neither fence
above can be tightened for it on honest data: the consensus fence would decouple honest tasks of
``small`` (whose distances reach 2.7 times their median), and a fence on the models' sizes
(tried) decoupled an honest task under ``graphical``, whose model reaches 8 times the
others' median. Nor does a robust Omega-step: columns of W clipped to the median column norm
before the step, or Sigma's diagonal capped at 1.5 times its median (a congruence D Sigma D,
still a valid regulariser) left the honest error at 0.171 and 0.210: the harm is the
coupling of large b_s, not the size of their models.

What moves the others is the *pull* of a task, the sum over t != s of |M_ts| |b_s| /
scale_s: its normalised image times its coupling weight ``sum_{t != s} |M_ts|``. So with a
learned formulation robust mode also fences the pull (``coupling`` of
:meth:`OutlierWatch.update`, dense server path): beyond :data:`PULL_FENCE_FACTOR` times the
federation's median pull (no MAD term: under attack the honest tasks' pulls spread, and a
MAD-widened fence let the second colluder through), :data:`IMAGE_PERSISTENCE` rounds
running, a task is decoupled. With fewer than half the tasks colluding the median lies
between two honest tasks' pulls, so a colluder that is never decoupled pulls the coupled
models at most 10 times as hard as a typical honest task, whatever the colluders send. Honest pulls
measured: their largest at most 4.9 times their median (``small``, ``synthetic``,
``eat-voc`` under ``probabilistic``, ``clustered`` and ``graphical``; the suite's honest
runs 2.2), colluders under every other fence 10 to 25 times; decoupled, the 2-of-10 case
above ends at 0.130 (lost: 0.130). Under a fixed formulation the coupling weights are equal
and the pull is the image's size, fenced tighter already, so the pull is not passed there.
The fence bounds the harm, it does not remove it: colluders that know this fence too and
keep their pull at 0.9 of it were never decoupled by it and took that case's honest error
to 0.155 (lost: 0.130; the suite's table, fence-aware "pull"). A tighter factor has no
margin left: ``small`` under ``graphical`` reaches 4.9 times the median honestly.

Why the pull is not enough, and the coupling fence (:func:`coupling_fence`)
----------------------------------------------------------------------------
The pull mixes two things of different honest spread: the normalised |b_s| of honest tasks
differs with their data (``small``: up to 2.9 times the median), and a sparse learned Omega
leaves most tasks' coupling near 0 (``graphical``), so their product spreads wide. The
coupling weight ``sum_{t != s} |M_ts|`` alone is narrow on honest data where the tasks are
alike (at most 2.4 times the median of the tasks with an image; ``graphical``'s sparse Omega
spreads it wider, to 3.3 times, and then its logarithms' MAD says so), and it is what the
colluders inflate. Their b_s are identical and, unlike an honest task's, never shrink as
their models grow (an honest dual image answers a larger M_ss with fewer margin violations,
so a smaller b_t), so the Omega-steps act on them as a power iteration: with W = B M and M
proportional to Sigma, Sigma <- (Sigma B^T B Sigma)^(1/2) / trace multiplies each
direction's weight by the square root of B^T B's eigenvalue there (exactly so when the two
commute), and two identical columns double theirs. At 0.9 of the pull fence they held 9 to
12 times the honest median M_ss and 6 to 7 times its coupling weight. So with a learned
formulation robust mode also fences the coupling weight: beyond
:data:`COUPLING_FENCE_FACTOR` times the median of the tasks with an image that are not
decoupled (on the log scale, widened by :data:`COUPLING_FENCE_MADS` scaled MADs where the
honest weights spread more, as for ``small`` under ``graphical`` with lam = 0.1, whose 3.3
is then inside), in :data:`IMAGE_PERSISTENCE` rounds running (same rule), a task is
decoupled. There is no fence when that median is 0 (most tasks uncoupled: no coupling is
typical) or with fewer than 3 references. A task with no image is judged too (it is no
reference): a colluder cannot reset its streak by emptying its b_t for a round. With fewer
than half the tasks colluding, the median and the MAD lie between honest tasks' values, so a
colluder that is never decoupled enters the others' models with at most the fence's weight,
that of a few honest tasks, while the size and consensus fences hold its normalised b_s.

Measured (the Byzantine suite's problem, seeds 3, 4, 5): colluders at 0.9 of the pull fence
are decoupled on every seed (honest error 0.128, 0.139, 0.143 against 0.130, 0.130, 0.124
with their replies lost); colluders that also know the coupling fence and scale their b_t so
that an Omega-step would leave them at 0.9 of it (fence-aware "coupling") end at 0.135,
0.125, 0.131. Honest runs (``small``, ``synthetic``, ``eat-voc`` under ``probabilistic``,
``clustered`` and ``graphical``, lam 0.01 and 0.1, also with sys-het high and drops) come
within 0.64 of the fence and keep their records bit for bit. The 2-point target sits at this
problem's noise: colluders that keep their coupling at 0.5 of the fence, an honest task's,
still move seed 3's honest error to 0.151 (lost 0.130) through their direction alone (at 0.3
of it: 0.128).

Early rounds: a federation catching up with a task (:func:`_caught_up`)
-------------------------------------------------------------------------
The persistence rule forgives a round in which the outlier moves back toward the others. Early
in a run the others can also move toward *it*. On ``benchmarks/mocha_multiclass_digits.py``'s
fitting split (``digits-dirichlet``, seed 0, 80 % of each device's training data, the
logistic loss, ``mean`` with lam = 1e-3, lam2 = 1e-5, an intercept) honest task 4, with 2.5
times the median number of samples, had an image 4 times the others' after round 1 (2.0e-4
of its bound against 4.7e-5) and then held still (2.05, 2.03, 2.02e-4) while the others
grew 20 to 40 % a round: its distance from the consensus was 2.0, 1.4 and 1.1 times the
consensus fence in rounds 1 to 3 (0.92 in round 4) and it was decoupled in round 3. So a
round in which a task's distance held still (grew by at most :data:`IMAGE_RETREAT`) while its
multiple of the fence shrank by :data:`IMAGE_RETREAT` does not count either (the last
round's multiple is kept in the watch's state). An attacker holding still beyond the fence
gains only the rounds in which the honest tasks' spread grows 5 % a round or faster, which
ends when their images settle (they are bounded); one that moves away, or holds still while
the federation does, is decoupled as before. The size, pull and coupling fences keep the
plain rule (the digits runs' sizes stayed within their fence).
"""

from __future__ import annotations

import math

import numpy as np

from .factored import FactoredMatrix
from .robust import coordinate_median, log_upper_fence, upper_fence

__all__ = [
    "CONSENSUS_MADS",
    "CONSENSUS_MIN_TASKS",
    "CONSENSUS_REL_FLOOR",
    "COUPLING_FENCE_FACTOR",
    "COUPLING_FENCE_MADS",
    "FENCE_FACTOR",
    "FENCE_MADS",
    "IMAGE_FENCE_FACTOR",
    "IMAGE_PERSISTENCE",
    "IMAGE_RETREAT",
    "OutlierWatch",
    "PULL_FENCE_FACTOR",
    "PULL_FENCE_MADS",
    "STEP_SHARE_FLOOR",
    "block_diagonal_regulariser",
    "consensus_fence",
    "coupled_models",
    "coupling_fence",
    "coupling_weights",
    "decoupled_factor",
    "decoupled_inverse",
    "federation_scale",
    "outlying",
    "project_blocks",
]

#: The share of its step bound an update must use, at least, to be an outlier: late in a run
#: honest steps fall to 1e-8 of their bounds at unequal speeds, so a task still moving at
#: 1e-3 would otherwise stand out; a device pushing at the bound uses all of it.
STEP_SHARE_FLOOR = 0.5

#: A task is an outlier when its statistic exceeds the federation's median by this factor
#: *and* by :data:`FENCE_MADS` scaled MADs on the log scale (:func:`~.robust.log_upper_fence`).
FENCE_FACTOR = 10.0
FENCE_MADS = 5.0

#: The factor of the fence on what a task has accumulated (|b_t|, |w_t| R_t): tighter than
#: :data:`FENCE_FACTOR`, as honest tasks' accumulated images are alike (their largest is
#: within 2 to 4 times their median on ``small``, ``synthetic`` and ``eat-voc``) while a
#: device kept just under the fence pulls the coupled models by that factor times an honest
#: task's pull, round after round.
IMAGE_FENCE_FACTOR = 5.0

#: The fence on a task's distance from the federation's consensus (:func:`consensus_fence`):
#: the coupled tasks' median distance plus this many scaled MADs of their distances ...
CONSENSUS_MADS = 5.0

#: ... the MAD taken at least this share of the median distance (a federation whose tasks
#: all lie at about the same distance from the consensus has a MAD near 0).
CONSENSUS_REL_FLOOR = 0.5

#: The fewest reference tasks :func:`consensus_fence` judges by: the MAD of 4 distances is
#: the spread of the two middle ones, too noisy to call a task an outlier (``eat-voc``'s 4
#: honest tasks: one lies twice as far from the others as their typical size).
CONSENSUS_MIN_TASKS = 5

#: The factor of the fence on a task's pull on the others (its normalised |b_s| times its
#: coupling weight, :func:`coupling_weights`): honest pulls under a learned Omega reach 2
#: times their median (the Byzantine suite's ``probabilistic``, ``graphical`` and
#: ``clustered`` runs), colluders kept under every other fence 20 times and more.
PULL_FENCE_FACTOR = FENCE_FACTOR

#: ... with no MAD term (the fence is that factor times the median pull).
PULL_FENCE_MADS = 0.0

#: The factor of the fence on a task's coupling weight alone (:func:`coupling_fence`): honest
#: weights under a learned Omega come within 0.64 of the fence (``small``, ``synthetic``,
#: ``eat-voc`` and the Byzantine suite under ``probabilistic``, ``clustered`` and
#: ``graphical``, also with sys-het high and drops: at most 2.4 times their median where they
#: are alike; ``graphical``'s sparse Omega spreads them to 3.3 and, with half the devices
#: dropping, 25 times, and the MAD term widens the fence with them), colluders kept under
#: every other fence 6 to 7 times.
COUPLING_FENCE_FACTOR = 2.5

#: ... and this many scaled MADs of their logarithms, when the honest couplings spread
#: wider.
COUPLING_FENCE_MADS = FENCE_MADS

#: Updating rounds a task's accumulated image must be an outlier (not retreating) to
#: decouple it.
IMAGE_PERSISTENCE = 3

#: The relative shrinkage of an outlying image in one updating round that counts as moving
#: back toward the others (the round then does not count toward :data:`IMAGE_PERSISTENCE`).
IMAGE_RETREAT = 0.05


def outlying(values: np.ndarray, factor: float = FENCE_FACTOR,
             k: float = FENCE_MADS) -> np.ndarray:
    """Whether each positive entry of ``values`` lies above the federation's log-scale upper
    fence ``exp(median(log v) + max(k MAD(log v), log factor))`` of the positive finite
    entries; non-positive entries are never outliers, non-finite ones always are. With fewer
    than 3 positive finite entries no finite entry is an outlier (no majority to compare with).

    The statistics passed in are scale-free ratios (a reply's size over its own bound), so
    tasks of different data scales are compared fairly; only the upper side is flagged (a task
    that did little work, or dropped, is no threat).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(v)
    positive = finite & (v > 0)
    if int(positive.sum()) < 3:
        return ~finite
    fence = log_upper_fence(v[positive], factor=factor, k=k)
    with np.errstate(invalid="ignore"):
        return (v > fence) | ~finite


class OutlierWatch:
    """Which tasks robust mode decouples, decided round by round from scale-free statistics
    of the tasks' updates, each the share of a bound the task used:

    * ``step / step_bound``: the size of this round's update (|delta-b_t|, or Mb-SGD's mean
      subgradient) over the largest a feasible one could have. Honest SDCA steps mix signs
      and shrink as the task converges; a device pushing one direction at the bound uses all
      of it. An outlier (:func:`outlying`, factor :data:`FENCE_FACTOR`) that also uses
      :data:`STEP_SHARE_FLOOR` of its bound is decoupled at once;
    * ``image / image_bound``: the size of what the task has accumulated (|b_t|, or
      |w_t| R_t) over its scale, against the fence of factor :data:`IMAGE_FENCE_FACTOR`. A
      device that pushes more gently, or stopped moving after driving its b_t far, is caught
      here once it has been an outlier in :data:`IMAGE_PERSISTENCE` rounds in which it
      updated without moving back toward the others (its share shrinking by at least
      :data:`IMAGE_RETREAT`), with no round among the others in between: an honest task that
      joins late (or comes back after drop-outs) takes a large first step from alpha = 0 and
      then returns to the others over a few rounds, its share shrinking every round it works;
    * with ``images`` (the accumulated vectors themselves, (d, m), e.g. B): the distance of
      each normalised image ``images[:, t] / image_bound[t]`` from the consensus of the
      coupled tasks' (:func:`consensus_fence`), beyond its fence in
      :data:`IMAGE_PERSISTENCE` rounds running under the same rule (the distance not
      shrinking by :data:`IMAGE_RETREAT`, nor held still while its multiple of the fence
      shrank by that much: :func:`_caught_up`): a device that keeps its size plausible but
      pulls against the others' common direction (module docstring);
    * with ``coupling`` (:func:`coupling_weights` of the current M, learned formulations):
      the task's pull ``image / image_bound * coupling`` beyond :data:`PULL_FENCE_FACTOR`
      times the federation's median pull in :data:`IMAGE_PERSISTENCE` rounds running
      (same rule): a device whose b_t a learned Omega couples to the others far more
      strongly than any honest task's (module docstring); and the coupling weight itself
      beyond :func:`coupling_fence` in :data:`IMAGE_PERSISTENCE` rounds running (same
      rule): the colluders whose identical, never-shrinking b_t the Omega-step couples to
      everybody (module docstring).

    Both bounds should come from :func:`federation_scale`. Tasks with a zero or undefined
    bound (dropped, no R_t) count as 0: no threat, and not part of the federation's median.
    Decoupling is sticky (``decoupled`` only gains tasks).
    """

    def __init__(self, num_tasks: int) -> None:
        self.decoupled = np.zeros(num_tasks, dtype=bool)
        self.streak = np.zeros(num_tasks, dtype=np.int64)  # rounds an outlier by its size
        self.image = np.zeros(num_tasks)  # the shares of the last round
        self.astray = np.zeros(num_tasks, dtype=np.int64)  # rounds away from the consensus
        self.deviation = np.zeros(num_tasks)  # the distances of the last round
        self.astray_ratio = np.zeros(num_tasks)  # ... over the last round's consensus fence
        self.pulling = np.zeros(num_tasks, dtype=np.int64)  # rounds an outlier by its pull
        self.pull = np.zeros(num_tasks)  # the pulls of the last round
        self.bonding = np.zeros(num_tasks, dtype=np.int64)  # rounds an outlier by its coupling
        self.bond = np.zeros(num_tasks)  # the coupling weights of the last round

    #: Everything :meth:`update` carries from round to round, by attribute name.
    STATE = ("decoupled", "streak", "image", "astray", "deviation", "astray_ratio", "pulling",
             "pull", "bonding", "bond")

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The watch's state for a checkpoint, keyed ``watch.<name>`` (:data:`STATE`): a
        resumed run must decouple exactly when the uninterrupted one would, so the streaks
        and the last round's values are kept as well as ``decoupled``."""
        return {f"watch.{name}": getattr(self, name).copy() for name in self.STATE}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Load :meth:`state_arrays`' output from a checkpoint's ``arrays`` (other keys are
        ignored). Names it lacks keep their fresh values; a checkpoint written before the
        streaks were saved holds ``decoupled`` alone, under that key.

        Raises
        ------
        ValueError
            If an array's shape is not (m,).
        """
        for name in self.STATE:
            value = arrays.get(f"watch.{name}")
            if value is None and name == "decoupled":
                value = arrays.get("decoupled")
            if value is None:
                continue
            fresh = getattr(self, name)
            value = np.asarray(value)
            if value.shape != fresh.shape:
                raise ValueError(f"checkpoint watch.{name} must have shape {fresh.shape}")
            setattr(self, name, value.astype(fresh.dtype))

    def update(self, step: np.ndarray, step_bound: np.ndarray, image: np.ndarray,
               image_bound: np.ndarray, updated: np.ndarray,
               images: np.ndarray | None = None,
               coupling: np.ndarray | None = None) -> np.ndarray:
        """Take the round's statistics (``updated``: bool, the tasks whose update this round
        was applied; ``images``: optional (d, m) accumulated vectors whose norms are
        ``image``; ``coupling``: optional (m,) :func:`coupling_weights` of the current M);
        decouple the outliers; return the newly decoupled tasks (bool)."""
        used = _share(step, step_bound)
        pushing = outlying(used) & (used >= STEP_SHARE_FLOOR) & updated
        share = _share(image, image_bound)
        far = outlying(share, factor=IMAGE_FENCE_FACTOR)
        self.streak = _persisting(far, updated, share, self.image, self.streak)
        self.image = share
        if images is not None:
            _, fence, deviation = consensus_fence(images, image_bound, self.decoupled)
            ratio = deviation / fence  # 0 where the fence is inf
            caught_up = _caught_up(deviation, self.deviation, ratio, self.astray_ratio)
            self.astray = _persisting(deviation > fence, updated & ~caught_up, deviation,
                                      self.deviation, self.astray)
            self.deviation, self.astray_ratio = deviation, ratio
        if coupling is not None:
            coupling = np.array(coupling, dtype=np.float64)  # a copy: kept as self.bond
            pull = share * coupling
            far = outlying(pull, factor=PULL_FENCE_FACTOR, k=PULL_FENCE_MADS)
            self.pulling = _persisting(far, updated, pull, self.pull, self.pulling)
            self.pull = pull
            far = coupling > coupling_fence(coupling, share > 0, self.decoupled)
            self.bonding = _persisting(far, updated, coupling, self.bond, self.bonding)
            self.bond = coupling
        persistent = ((self.streak >= IMAGE_PERSISTENCE) | (self.astray >= IMAGE_PERSISTENCE)
                      | (self.pulling >= IMAGE_PERSISTENCE) | (self.bonding >= IMAGE_PERSISTENCE))
        new = (pushing | persistent) & ~self.decoupled
        self.decoupled |= new
        return new


def _persisting(outlier: np.ndarray, updated: np.ndarray, value: np.ndarray,
                previous: np.ndarray, streak: np.ndarray) -> np.ndarray:
    """The streaks of :class:`OutlierWatch`: +1 for an outlier that updated without moving
    back (``value`` not below ``1 - IMAGE_RETREAT`` of ``previous``), kept for one that did
    not update, 0 for a task that is no outlier."""
    holding = updated & (value > (1.0 - IMAGE_RETREAT) * previous)
    return np.where(outlier, streak + holding, 0)


def _caught_up(value: np.ndarray, previous: np.ndarray, ratio: np.ndarray,
               previous_ratio: np.ndarray) -> np.ndarray:
    """The tasks the federation is catching up with (module docstring, "Early rounds"): their
    distance from the consensus held still (grew by at most :data:`IMAGE_RETREAT`) while its
    multiple of the fence shrank by at least :data:`IMAGE_RETREAT`; such a round does not
    count toward :data:`IMAGE_PERSISTENCE`."""
    still = value <= (1.0 + IMAGE_RETREAT) * previous
    return still & (ratio <= (1.0 - IMAGE_RETREAT) * previous_ratio)


def consensus_fence(images: np.ndarray, scale: np.ndarray, excluded: np.ndarray
                    ) -> tuple[np.ndarray, float, np.ndarray]:
    """The consensus of the federation's normalised images and how far from it a task may
    lie (module docstring): ``(center, fence, deviation)``.

    The normalised image of task t is ``images[:, t] / scale[t]`` (0 where the scale is 0 or
    undefined). The reference tasks are those with a usable scale, a non-zero image and not
    ``excluded`` (bool, (m,): the decoupled ones). ``center`` is the coordinate-wise median
    of their normalised images (:func:`~.robust.coordinate_median`), ``deviation`` (m,) every
    task's distance from it, and ``fence`` the largest of the references' median deviation +
    :data:`CONSENSUS_MADS` scaled MADs (the MAD at least :data:`CONSENSUS_REL_FLOOR` of that
    median, :func:`~.robust.upper_fence`) and their median normalised size (a task within a
    typical task's size of the consensus is never an outlier). With fewer than
    :data:`CONSENSUS_MIN_TASKS` references the fence is ``inf``."""
    B = np.asarray(images, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)
    usable = np.isfinite(s) & (s > 0)
    V = np.divide(B, s, out=np.zeros_like(B), where=usable[None, :])
    size = np.linalg.norm(V, axis=0)
    reference = usable & (size > 0) & ~np.asarray(excluded, dtype=bool)
    if int(reference.sum()) < CONSENSUS_MIN_TASKS:
        return np.zeros(B.shape[0]), math.inf, np.zeros(B.shape[1])
    center = coordinate_median(V[:, reference].T)
    deviation = np.linalg.norm(V - center[:, None], axis=0)
    deviation[~usable] = 0.0
    fence = max(upper_fence(deviation[reference], k=CONSENSUS_MADS,
                            rel_floor=CONSENSUS_REL_FLOOR),
                float(np.median(size[reference])))
    return center, fence, deviation


def coupling_weights(M: np.ndarray | FactoredMatrix) -> np.ndarray:
    """How strongly each task's dual image enters the others' models under W = B M:
    ``sum_{t != s} |M_ts|`` for every task s ((m,), 0 for a task without coupling, e.g. a
    decoupled one). Times the task's normalised |b_s|, it bounds the task's pull on the
    federation (the sum over t != s of |M_ts b_s| / scale_s; module docstring).

    ``M`` is an (m, m) array or a :class:`~fmtl_flower.core.factored.FactoredMatrix` (the
    factored server path: its absolute row sums, O(m^2 r / 2) flops in tiles,
    :meth:`~fmtl_flower.core.factored.FactoredMatrix.abs_row_sums`, so compute them once per
    M, not per round)."""
    if isinstance(M, FactoredMatrix):
        return M.abs_row_sums() - np.abs(M.diag())
    A = np.abs(np.asarray(M, dtype=np.float64))
    return A.sum(axis=0) - np.diag(A)


def coupling_fence(coupling: np.ndarray, imaged: np.ndarray, excluded: np.ndarray) -> float:
    """How strongly a task may be coupled to the others (module docstring):
    :data:`COUPLING_FENCE_FACTOR` times the median :func:`coupling_weights` of the reference
    tasks, those with a dual image (``imaged``, bool (m,)) that are not ``excluded`` (bool
    (m,): the decoupled ones), zeros included; ``inf`` with fewer than 3 references or a
    median of 0 (a sparse learned Omega, e.g. ``graphical``'s lasso, leaves most tasks
    uncoupled: then no coupling is typical, and none is fenced)."""
    reference = np.asarray(imaged, dtype=bool) & ~np.asarray(excluded, dtype=bool)
    values = np.asarray(coupling, dtype=np.float64)[reference]
    values = values[np.isfinite(values)]
    if values.size < 3:
        return math.inf
    if float(np.median(values)) <= 0:
        return math.inf
    return log_upper_fence(values, factor=COUPLING_FENCE_FACTOR, k=COUPLING_FENCE_MADS)


def federation_scale(bound: np.ndarray) -> np.ndarray:
    """The scale the statistics of :class:`OutlierWatch` divide by: each task's own bound
    (e.g. R~_t), but at most the federation's median of them, so that a device claiming a
    larger scale than the others' (within what the fences let through) cannot hide a larger
    update behind it; NaN bounds stay NaN."""
    b = np.asarray(bound, dtype=np.float64)
    finite = b[np.isfinite(b)]
    return np.minimum(b, float(np.median(finite))) if finite.size else b


def _share(value: np.ndarray, bound: np.ndarray) -> np.ndarray:
    value = np.asarray(value, dtype=np.float64)
    bound = np.asarray(bound, dtype=np.float64)
    usable = np.isfinite(bound) & (bound > 0)
    return np.divide(value, bound, out=np.zeros_like(value), where=usable)


def decoupled_inverse(M: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """M' of the module docstring: ``M`` (m, m, symmetric positive definite) with the
    off-diagonal entries of the ``decoupled`` (bool, (m,)) tasks' rows and columns set to 0
    and their diagonal set to the median of the other tasks' (their own when every task is
    decoupled). ``M`` itself when no task is decoupled."""
    mask = np.asarray(decoupled, dtype=bool)
    if not mask.any():
        return M
    diag = np.diag(M).copy()
    out = np.array(M, dtype=np.float64, copy=True)
    out[mask, :] = 0.0
    out[:, mask] = 0.0
    coupled = diag[~mask]
    diag[mask] = float(np.median(coupled)) if coupled.size else diag[mask]
    out[np.flatnonzero(mask), np.flatnonzero(mask)] = diag[mask]
    return out


def decoupled_factor(M: FactoredMatrix, decoupled: np.ndarray) -> FactoredMatrix:
    """M' of the module docstring (:func:`decoupled_inverse`) for M = V diag(s) V^T + c I in
    factored form (the factored server path), again an orthonormal factor with the same c.

    With P the projection onto the coupled tasks' coordinates and E the decoupled tasks'
    unit vectors, M' = P V diag(s) V^T P + c I + (mu - c) E E^T, mu the median of the
    coupled tasks' diagonal entries of M: the coupled block is M's (P (c I) P and c E E^T
    make c I), the decoupled tasks' rows and columns are mu on the diagonal and 0 elsewhere.
    The first term is refactored on the coupled rows alone (thin SVD of V_H = V[coupled] =
    U S Z^T, then the eigenvectors of the r x r core S Z^T diag(s) Z S), so its columns stay
    orthonormal and 0 on the decoupled rows, orthogonal to E; E joins them as k columns of
    weight mu - c. Cost O(m r^2) (as the Omega-step's) and k more columns of V, so the
    products with M' cost O(m d (r + k)) for k decoupled tasks.

    ``M`` itself when no task is decoupled.
    """
    mask = np.asarray(decoupled, dtype=bool)
    if not mask.any():
        return M
    diag = M.diag()
    coupled = np.flatnonzero(~mask)
    isolated = np.flatnonzero(mask)
    mu = np.full(isolated.size, float(np.median(diag[coupled]))) if coupled.size \
        else diag[isolated]
    m, r = M.V.shape
    columns, weights = [], []
    if coupled.size and r:
        U, S, Zt = np.linalg.svd(M.V[coupled], full_matrices=False)
        core = (S[:, None] * Zt * M.s) @ (Zt.T * S[None, :])
        values, E = np.linalg.eigh(0.5 * (core + core.T))
        if np.all(M.s >= 0):  # a congruence keeps s >= 0: no rounding below 0
            values = np.maximum(values, 0.0)
        block = np.zeros((m, values.size))
        block[coupled] = U @ E
        columns.append(block)
        weights.append(values)
    units = np.zeros((m, isolated.size))
    units[isolated, np.arange(isolated.size)] = 1.0
    columns.append(units)
    weights.append(mu - M.c)
    return FactoredMatrix(np.hstack(columns), np.concatenate(weights), M.c)


def coupled_models(W: np.ndarray, decoupled: np.ndarray | None) -> np.ndarray:
    """The models an Omega-step may learn the relationships from: ``W`` with the decoupled
    tasks' columns set to 0 (``W`` itself when none is)."""
    if decoupled is None or not np.any(decoupled):
        return W
    out = W.copy()
    out[:, np.asarray(decoupled, dtype=bool)] = 0.0
    return out


def block_diagonal_regulariser(K: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """K' = M'^-1 (:func:`decoupled_inverse` of M = K^-1) for a primal method: the coupled
    tasks' block is the inverse of M's (the Schur complement of K: the regulariser minimised
    over the decoupled tasks' models), every decoupled task a 1 x 1 block ``1 / M'_ss``."""
    mask = np.asarray(decoupled, dtype=bool)
    if not mask.any():
        return K
    M = np.linalg.inv(0.5 * (K + K.T))
    M = decoupled_inverse(0.5 * (M + M.T), mask)
    out = np.zeros_like(M)
    keep = np.flatnonzero(~mask)
    if keep.size:
        block = np.linalg.inv(M[np.ix_(keep, keep)])
        out[np.ix_(keep, keep)] = 0.5 * (block + block.T)
    idx = np.flatnonzero(mask)
    out[idx, idx] = 1.0 / M[idx, idx]
    return out


def project_blocks(W: np.ndarray, K: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """Project the coupled tasks' columns of W onto the Frobenius ball of radius
    ``sqrt(m_H / lambda_min(K_HH))`` and each decoupled task's column onto the ball of radius
    ``sqrt(1 / K_ss)``, for a block-diagonal K (:func:`block_diagonal_regulariser`): each
    block is its own problem, whose optimum lies in its ball
    (:func:`~fmtl_flower.core.baselines.mbsgd_radius`), so a decoupled task's large column no
    longer shrinks the others by a shared projection."""
    mask = np.asarray(decoupled, dtype=bool)
    out = W.copy()
    keep = np.flatnonzero(~mask)
    if keep.size:
        lam_min = float(np.linalg.eigvalsh(K[np.ix_(keep, keep)])[0])
        out[:, keep] = _onto_ball(out[:, keep], np.sqrt(keep.size / lam_min))
    for s in np.flatnonzero(mask).tolist():
        out[:, [s]] = _onto_ball(out[:, [s]], np.sqrt(1.0 / K[s, s]))
    return out


def _onto_ball(W: np.ndarray, radius: float) -> np.ndarray:
    size = float(np.linalg.norm(W))
    return W * (radius / size) if size > radius else W
