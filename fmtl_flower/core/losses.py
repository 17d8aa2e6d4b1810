"""The losses of MOCHA's model family: one entry each in :data:`LOSSES`.

MOCHA, CoCoA and Mb-SDCA minimise (``fmtl_flower.core.objective``)

    P(W) = sum_t (1/n_t) sum_i l(y_ti x_ti^T w_t) + (1/2) tr(W K W^T)

for a convex loss l of the margin z = y x^T w, labels y in {-1, +1}. Their dual variables
alpha_ti enter through the signed value a = y alpha, whose dual term is the concave

    D(a) = -l*(-a),     l*(u) = sup_z (u z - l(z))   (the convex conjugate),

so the dual's data part is sum_t (1/n_t) sum_i D(a_ti) and Fenchel-Young's inequality reads
l(z) - D(a) + a z >= 0 for every z and every a in D's domain, with equality iff
a in -dl(z) (a subgradient pair). The entries (smoothing gamma = 1 for ``smoothed-hinge``, as in
Shalev-Shwartz & Zhang, "Stochastic dual coordinate ascent methods for regularized loss
minimization", JMLR 2013, section 6):

=================  ===========================  =====================  ===========  ========
name               l(z)                         D(a) = -l*(-a)         domain of a  D range
=================  ===========================  =====================  ===========  ========
``hinge``          max(0, 1 - z)                a                      [0, 1]       [0, 1]
``smoothed-hinge`` 0 (z >= 1); 1/2 - z (z <= 0) a - a^2 / 2            [0, 1]       [0, 1/2]
                   (1 - z)^2 / 2 otherwise
``logistic``       log(1 + e^-z)                -a log a - (1-a) log   [0, 1]       [0, log 2]
                                                (1-a) (entropy)
``squared``        (1 - z)^2 / 2 = (y-x^Tw)^2/2  a - a^2 / 2           R            (-inf, 1/2]
=================  ===========================  =====================  ===========  ========

**The SDCA coordinate step.** The local subproblem of :mod:`fmtl_flower.core.sdca` restricted
to one coordinate is, with z = y_i x_i^T v at the running local model v and
q = sigma' m_tt |x_i|^2 / n (times n, dropping constants),

    max_a  f(a) = D(a) - z (a - a_old) - (q / 2) (a - a_old)^2   over D's domain,

solved exactly by :func:`coordinate_step` (q >= 0):

* ``hinge``: a = clip(a_old + (1 - z) / q, 0, 1);
* ``smoothed-hinge``: a = clip(a_old + (1 - z - a_old) / (1 + q), 0, 1);
* ``squared``: a = a_old + (1 - z - a_old) / (1 + q) (no box);
* ``logistic``: f'(a) = log((1 - a) / a) - z - q (a - a_old) = 0 has no closed form; in
  u = logit(a) it reads g(u) = -u - z - q (s(u) - a_old) = 0 (s the sigmoid), g strictly
  decreasing with g' in [-1 - q/4, -1], and its root lies in [-z - q (1 - a_old),
  -z + q a_old]: a few Newton steps on g, safeguarded by bisection of that bracket
  (:data:`NEWTON_STEPS` at most; in practice 3 to 6), then a = s(u) (Shalev-Shwartz & Zhang
  also solve this 1-D problem numerically).

A row with x_i = 0 has q = 0 and z = 0: its step is a = argmax D, the **zero-row rule**
(:func:`dual_peak`: 1 for the hinges and the squared loss, 1/2 for the logistic loss), which
every formula above gives at q = 0 except the hinge's, which the kernels special-case.

**What a loss changes and what it does not.** sigma' (Lemma 9 of the MOCHA appendix) and
gamma bound the *quadratic* part of the dual across tasks and hold for any loss; the loss's
smoothness (1/mu: the hinge is not smooth, ``smoothed-hinge`` and ``squared`` are
1-smooth, ``logistic`` 1/4-smooth) only changes the convergence rate (linear for a smooth
loss). The dual domain bounds |alpha_ti| by 1 for the three classification losses, which is
what bounds a reply's ``delta-b`` (:mod:`fmtl_flower.strategies.mocha`); the squared loss's
domain is unbounded (:attr:`Loss.dual_radius` is inf), so that bound does not apply to it.

**Adding a loss** is one :class:`Loss` subclass written in Python/numpy (its value and dual
term, vectorised; its exact or numeric coordinate step :meth:`Loss.sdca_step`; its zero-row
peak, dual domain and range, smoothness and :meth:`Loss.value_bound`) and one call,
:func:`register_loss`, in every process of the run (server and devices: a module both
import). No kernel is edited. The four losses above keep their compiled branches (the
scalar kernels below, keyed by :attr:`Loss.code`); a registered loss gets a code of its own
that no kernel compiles (:func:`has_kernels`), and every SDCA-family kernel called with it
runs its numpy implementation, whatever ``FMTL_KERNELS`` says (the guard is the kernels'
``compiles`` predicate, :func:`fmtl_flower.core.jit.kernel`). The numpy implementations ask
the :class:`Loss` object for each scalar piece (:meth:`Loss.sdca_step`, :attr:`Loss.peak`,
:meth:`Loss.loss_at`, :meth:`Loss.dual_at`), which for the four built-in losses are the
compiled kernels' own Python code, so their numbers do not change. ``tests/core/
test_toy_loss.py`` adds a squared hinge this way and runs MOCHA to a certified gap.
"""

from __future__ import annotations

import math

import numpy as np

from .hinge import hinge_conjugate_value, hinge_loss, mean_hinge_loss
from .jit import kernel

__all__ = ["HINGE", "LOGISTIC", "LOGISTIC_ITERATION_FLOPS", "LOGISTIC_NEWTON_ITERATIONS",
           "LOGISTIC_STEP_FLOPS", "LOSSES", "LOSS_BY_CODE", "NEWTON_STEPS", "SMOOTHED_HINGE",
           "SQUARED", "Loss", "compiled_loss_call", "coordinate_step", "dual_peak",
           "dual_value", "get_loss", "has_kernels", "loss_value", "numpy_step_cost_of",
           "register_loss", "unregister_loss"]

#: The integer codes the compiled kernels switch on (:attr:`Loss.code`).
HINGE, SMOOTHED_HINGE, LOGISTIC, SQUARED = 0, 1, 2, 3
_COMPILED_CODES = frozenset((HINGE, SMOOTHED_HINGE, LOGISTIC, SQUARED))
#: The first code :func:`register_loss` hands out (a loss of Python code only: no kernel
#: compiles it).
_FIRST_PYTHON_CODE = 100

#: At most this many safeguarded Newton steps per logistic coordinate step: enough for the
#: bisection alone to shrink the bracket (width q) to the 1e-15 relative tolerance for any
#: q below 1e17 (about 110 halvings), so the step converges to rounding even when Newton's
#: steps are rejected. It was 60: at q = 5.4e7 (a large m_tt) the step stopped unconverged
#: (g = 8e-4) and one ulp of q moved a by 2.5e-5 relative, so the compiled and numpy kernels
#: disagreed. A well-scaled step still takes 3 to 6.
NEWTON_STEPS = 200

_LOG2 = math.log(2.0)

#: Mean safeguarded Newton iterations of a logistic coordinate step (loop passes of
#: ``_logistic_step``): 14.6, the mean over every step of four 20-round MOCHA runs on the
#: synthetic tasks of ``tests/strategies/helpers.make_problem`` (5 tasks x d = 10 x 60
#: samples, seed 1; 8 x 20 x 100, seed 2; each with Omega ``mean`` and the default: 12.7,
#: 14.1, 14.7 and 16.8; median 5 to 9, the 99th percentile 51 to 54, the bisection's tail),
#: measured 2026-11-27 by replaying the recorded (a_old, z, q) of each step
#: (``python benchmarks/logistic_newton_passes.py`` prints them).
LOGISTIC_NEWTON_ITERATIONS = 14.6
#: FLOPs of one Newton iteration of ``_logistic_step``, counting a scalar op 1 and ``exp``
#: 20 (its range reduction and polynomial; a convention, not a measurement): the bracket's
#: convergence test 5, the sigmoid 3 + 20, g 5 and its two sign tests 2, the Newton step 5,
#: the bracket test of the next point 3, the step-size test 5.
LOGISTIC_ITERATION_FLOPS = 48
#: :attr:`Loss.step_flops` of ``logistic``: the hinge's 8 (the margin and the update's
#: bookkeeping, as every step), the bracket's set-up 9 and the final sigmoid 23, and the
#: mean Newton iterations (about 740, 90 times the hinge's 8).
LOGISTIC_STEP_FLOPS = round(8 + 9 + 23 + LOGISTIC_NEWTON_ITERATIONS * LOGISTIC_ITERATION_FLOPS)


# ---------------------------------------------------------------------------- scalar kernels
# One home of each formula of the four built-in losses for the compiled kernels and the numpy
# twins alike (the numpy twins ask the Loss object, whose built-in methods call the plain
# Python functions, ``.py_func``). A kernel called as Python with another loss's code asks
# that loss (``fallback``); numba is never asked to compile one (``compiles``).


def has_kernels(code: int) -> bool:
    """Whether the compiled kernels have a branch for the loss with ``code`` (the four
    built-in losses); a registered loss runs the kernels' numpy implementations."""
    return code in _COMPILED_CODES


def compiled_loss_call(*args) -> bool:
    """The ``compiles`` predicate of a kernel whose last argument is a loss code."""
    return args[-1] in _COMPILED_CODES


def _first_is_compiled(code, *args) -> bool:
    return code in _COMPILED_CODES


def _ask_the_loss(method: str):
    """The Python implementation of a scalar kernel: ``LOSS_BY_CODE[code].method(*args)``."""
    def call(code, *args):
        return getattr(LOSS_BY_CODE[code], method)(*args)

    call.__name__ = f"{method}_of_code"
    return call


@kernel(inline="always")
def _sigmoid(u):  # pragma: no cover - compiled
    """1 / (1 + e^-u), without overflow."""
    if u >= 0.0:
        return 1.0 / (1.0 + math.exp(-u))
    e = math.exp(u)
    return e / (1.0 + e)


@kernel(_ask_the_loss("loss_at"), compiles=_first_is_compiled, inline="always")
def loss_value(code, z):  # pragma: no cover - compiled
    """l(z) of the loss with ``code`` at margin ``z``."""
    if code == SMOOTHED_HINGE:
        if z >= 1.0:
            return 0.0
        if z <= 0.0:
            return 0.5 - z
        return 0.5 * (1.0 - z) * (1.0 - z)
    if code == LOGISTIC:
        if z > 0.0:
            return math.log1p(math.exp(-z))
        return -z + math.log1p(math.exp(z))
    if code == SQUARED:
        return 0.5 * (1.0 - z) * (1.0 - z)
    r = 1.0 - z
    return r if r > 0.0 else 0.0


@kernel(_ask_the_loss("dual_at"), compiles=_first_is_compiled, inline="always")
def dual_value(code, a):  # pragma: no cover - compiled
    """D(a) = -l*(-a) of the loss with ``code``, for ``a`` in its domain."""
    if code == SMOOTHED_HINGE or code == SQUARED:
        return a - 0.5 * a * a
    if code == LOGISTIC:
        out = 0.0
        if a > 0.0:
            out -= a * math.log(a)
        if a < 1.0:
            out -= (1.0 - a) * math.log1p(-a)
        return out
    return a


@kernel(lambda code: LOSS_BY_CODE[code].peak, compiles=_first_is_compiled, inline="always")
def dual_peak(code):  # pragma: no cover - compiled
    """argmax D: a zero row's coordinate maximiser (the zero-row rule)."""
    if code == LOGISTIC:
        return 0.5
    return 1.0


@kernel(inline="always")
def _logistic_step(a_old, z, q):  # pragma: no cover - compiled
    """The logistic coordinate maximiser: safeguarded Newton on g(u) (module docstring)."""
    lo = -z - q * (1.0 - a_old)
    hi = -z + q * a_old
    u = -z
    if u < lo:
        u = lo
    if u > hi:
        u = hi
    for _ in range(NEWTON_STEPS):
        if hi - lo <= 1e-15 * (1.0 + abs(u)):
            break
        s = _sigmoid(u)
        g = -u - z - q * (s - a_old)
        if g == 0.0:
            break
        if g > 0.0:
            lo = u
        else:
            hi = u
        step = g / (1.0 + q * s * (1.0 - s))
        nxt = u + step
        if nxt <= lo or nxt >= hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - u) <= 1e-15 * (1.0 + abs(u)):
            u = nxt
            break
        u = nxt
    return _sigmoid(u)


@kernel(_ask_the_loss("sdca_step"), compiles=_first_is_compiled, inline="always")
def coordinate_step(code, a_old, z, q):  # pragma: no cover - compiled
    """The exact maximiser of f(a) = D(a) - z (a - a_old) - (q/2) (a - a_old)^2 over D's
    domain (module docstring), ``q >= 0`` (q = 0: a zero row, :func:`dual_peak`)."""
    if code == SMOOTHED_HINGE or code == SQUARED:
        a = a_old + (1.0 - z - a_old) / (1.0 + q)
        if code == SQUARED:
            return a
    elif code == LOGISTIC:
        return _logistic_step(a_old, z, q)
    else:
        if q <= 0.0:
            return 1.0
        a = a_old + (1.0 - z) / q
    if a < 0.0:
        return 0.0
    if a > 1.0:
        return 1.0
    return a


# ---------------------------------------------------------------------------- the registry


class Loss:
    """A loss of MOCHA's model family: its value, conjugate, dual domain and SDCA step.

    The interface every kernel, numpy twin, bound, certificate and seeding rule uses. A new
    loss subclasses it, defines what is marked *required* below in Python/numpy and is
    registered with :func:`register_loss` (module docstring; ``tests/core/test_toy_loss.py``
    is a worked example).

    Attributes
    ----------
    name : str
        The run-config spelling (``mocha.loss``). Required.
    code : int
        What the kernels switch on: 0..3 for the built-in losses (compiled), handed out by
        :func:`register_loss` for a new one (its numpy path; never set it yourself).
    peak : float
        argmax D, a zero row's coordinate maximiser (the zero-row rule). Required.
    dual_domain : (float, float)
        The domain of a = y alpha (D is -inf outside it).
    dual_range : (float, float)
        The range of D over its domain: the box a task's ``dual-mean`` lies in.
    smoothness : float
        1 / mu for a (1/mu)-smooth loss, inf for the non-smooth hinge (rates only).
    numpy_step_cost : float
        The numpy SDCA step's run time relative to the hinge's (the kernels' work estimates,
        :mod:`fmtl_flower.core.jit`; measured with ``FMTL_KERNELS=numpy``, n = 2000, d = 20,
        2026-11-27: hinge 0.98, smoothed hinge 1.46, logistic 10.1, squared 1.73 us/step).
        A registered loss runs numpy in every mode, so its value changes nothing.
    step_flops : float
        The scalar FLOPs of one SDCA coordinate step, beyond its two d-vector loops (the dot
        product and the axpy): the ``b`` of the time model's per-step ``a d + b``
        (:mod:`fmtl_flower.systems.timing`, eq. (30) of the MOCHA paper). 8 for the hinge (its
        clipped closed-form step and the update's bookkeeping), also for ``smoothed-hinge`` and
        ``squared``, whose closed-form steps take a division and a few scalar ops as the
        hinge's does; ``logistic``'s counts its safeguarded Newton solve,
        :data:`LOGISTIC_STEP_FLOPS`.
        A registered loss that leaves it at 8 is timed as the hinge.
    dual_slope : float
        sup |D'(a)| over the dual domain: 1 for the hinge (D(a) = a) and the smoothed hinge
        (D'(a) = 1 - a on [0, 1]); inf when D' is unbounded there (the logistic loss's
        entropy, the squared loss's and the default). Record-level DP's step bound uses a
        finite one (:func:`fmtl_flower.core.record_dp.record_contribution`); with inf a
        record gets the looser box bound C r.
    gradient_flops : float
        The scalar FLOPs of one sampled point of Mb-SGD (the margin and l'(z)'s coefficient,
        beyond the two d-vector loops): the time model's ``b`` for ``mb-sgd``. 3 for the
        hinge (the table's: the margin and a comparison), 5 for the smoothed hinge (a clip),
        2 for the squared loss and 25 for the logistic loss (a sigmoid, ``exp`` counted 20
        as in :data:`LOGISTIC_ITERATION_FLOPS`), counted from :meth:`derivative`.
    """

    name = ""
    code = -1
    peak: float
    numpy_step_cost = 1.0
    step_flops: float = 8
    dual_slope = math.inf
    gradient_flops: float = 3
    dual_domain = (0.0, 1.0)
    dual_range = (0.0, 1.0)
    smoothness = math.inf

    @property
    def dual_radius(self) -> float:
        """The largest |alpha_i| = |a_i| of a feasible dual variable (inf: unbounded)."""
        return max(abs(self.dual_domain[0]), abs(self.dual_domain[1]))

    # -- vectorised values (the device's reports, objectives) ------------------------------
    def value(self, margins: np.ndarray) -> np.ndarray:
        """l(z) elementwise at the margins z = y x^T w. Required."""
        raise NotImplementedError

    def dual(self, a: np.ndarray) -> np.ndarray:
        """D(a) = -l*(-a) elementwise (a in the domain, :meth:`feasible`). Required."""
        raise NotImplementedError

    def conjugate(self, u: np.ndarray) -> np.ndarray:
        """l*(u) = sup_z (u z - l(z)) elementwise; +inf outside -domain."""
        u = np.asarray(u, dtype=np.float64)
        inside = self.feasible_mask(-u)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = -self.dual(np.where(inside, -u, self.dual_domain[0]))
        return np.where(inside, out, np.inf)

    def feasible_mask(self, a: np.ndarray, tol: float = 0.0) -> np.ndarray:
        """Whether each a lies in the dual domain (up to ``tol``)."""
        lo, hi = self.dual_domain
        return (a >= lo - tol) & (a <= hi + tol)

    def feasible(self, alpha: np.ndarray, y: np.ndarray, tol: float = 1e-12) -> bool:
        """Whether every a_i = y_i alpha_i lies in the dual domain (up to ``tol``)."""
        return bool(np.all(self.feasible_mask(y * alpha, tol)))

    def mean_value(self, X: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
        """A task's ``loss-mean``: (1/n) sum_i l(y_i x_i^T w) (0.0 for n = 0)."""
        if X.shape[0] == 0:
            return 0.0
        return float(self.value(y * (X @ w)).mean())

    def dual_mean(self, alpha: np.ndarray, y: np.ndarray) -> float:
        """A task's ``dual-mean``: (1/n) sum_i D(y_i alpha_i) (0.0 for n = 0)."""
        if alpha.shape[0] == 0:
            return 0.0
        return float(self.dual(y * alpha).mean())

    def value_bound(self, margin_bound: np.ndarray) -> np.ndarray:
        """An upper bound on l(z) for |z| <= ``margin_bound`` (R_t |w_t| on the server).
        Required."""
        raise NotImplementedError

    def derivative(self, margins: np.ndarray) -> np.ndarray:
        """l'(z) elementwise (a subgradient where l has a kink): Mb-SGD's step, whose
        sampled point contributes l'(z) y x to the gradient. Required for Mb-SGD only."""
        raise NotImplementedError(f"{type(self).__name__} defines no derivative (Mb-SGD "
                                  "needs one)")

    def derivative_bound(self, margin_bound: np.ndarray) -> np.ndarray:
        """sup |l'(z)| over |z| <= ``margin_bound``: for a convex l, l' is nondecreasing, so
        the larger of |l'(-B)| and |l'(B)| (the server's bound on a Mb-SGD reply's
        |grad| / (count R_t))."""
        bound = np.asarray(margin_bound, dtype=np.float64)
        return np.maximum(np.abs(self.derivative(-bound)), np.abs(self.derivative(bound)))

    # -- scalar pieces (the kernels' numpy implementations) ---------------------------------
    def loss_at(self, z: float) -> float:
        """l(z) at one margin (plain Python float)."""
        return float(self.value(np.float64(z)))

    def dual_at(self, a: float) -> float:
        """D(a) at one point of the domain (plain Python float)."""
        return float(self.dual(np.float64(a)))

    def sdca_step(self, a_old: float, z: float, q: float) -> float:
        """The maximiser over D's domain of f(a) = D(a) - z (a - a_old) - (q/2) (a - a_old)^2
        (module docstring), ``q >= 0`` (q = 0: a zero row, :attr:`peak`), exact or to
        rounding, as a plain float. Required: called once per coordinate step."""
        raise NotImplementedError(f"{type(self).__name__} defines no sdca_step")

    def __repr__(self) -> str:
        return f"<loss {self.name}>"


class _Compiled(Loss):
    """A built-in loss: its scalar pieces are the compiled kernels' branches of its code,
    run as Python (the same code, so the same numbers as before the interface)."""

    def loss_at(self, z):
        return loss_value.py_func(self.code, z)

    def dual_at(self, a):
        return dual_value.py_func(self.code, a)

    def sdca_step(self, a_old, z, q):
        return coordinate_step.py_func(self.code, a_old, z, q)

    @property
    def peak(self) -> float:
        return dual_peak.py_func(self.code)


class _Hinge(_Compiled):
    name, code = "hinge", HINGE
    dual_slope = 1.0

    def value(self, margins):
        return hinge_loss(margins)

    def dual(self, a):
        return np.asarray(a, dtype=np.float64) * 1.0

    def mean_value(self, X, y, w):
        return mean_hinge_loss(X, y, w)  # bit for bit the hinge-only code's numbers

    def derivative(self, margins):  # -1 below the kink, 0 at and above it (Mb-SGD's rule)
        return np.where(np.asarray(margins, dtype=np.float64) < 1.0, -1.0, 0.0)

    def dual_mean(self, alpha, y):
        return hinge_conjugate_value(alpha, y)

    def value_bound(self, margin_bound):
        return 1.0 + margin_bound


class _SmoothedHinge(_Compiled):
    name, code = "smoothed-hinge", SMOOTHED_HINGE
    dual_range = (0.0, 0.5)
    dual_slope = 1.0
    gradient_flops = 5
    smoothness = 1.0
    numpy_step_cost = 1.5

    def value(self, margins):
        z = np.asarray(margins, dtype=np.float64)
        return np.where(z >= 1.0, 0.0, np.where(z <= 0.0, 0.5 - z, 0.5 * (1.0 - z) ** 2))

    def dual(self, a):
        a = np.asarray(a, dtype=np.float64)
        return a - 0.5 * a * a

    def value_bound(self, margin_bound):
        return 0.5 + margin_bound  # l(z) <= 1/2 + |z|

    def derivative(self, margins):
        return -np.clip(1.0 - np.asarray(margins, dtype=np.float64), 0.0, 1.0)


class _Logistic(_Compiled):
    name, code = "logistic", LOGISTIC
    step_flops = LOGISTIC_STEP_FLOPS
    gradient_flops = 25
    dual_range = (0.0, _LOG2)
    smoothness = 0.25
    numpy_step_cost = 10.0

    def value(self, margins):
        z = np.asarray(margins, dtype=np.float64)
        return np.logaddexp(0.0, -z)

    def dual(self, a):
        a = np.asarray(a, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            left = np.where(a > 0.0, -a * np.log(np.where(a > 0.0, a, 1.0)), 0.0)
            right = np.where(a < 1.0, -(1.0 - a) * np.log1p(-np.where(a < 1.0, a, 0.0)), 0.0)
        return left + right

    def value_bound(self, margin_bound):
        return _LOG2 + margin_bound  # log(1 + e^-z) <= log 2 + |z|

    def derivative(self, margins):  # -1 / (1 + e^z) = -sigmoid(-z), without overflow
        z = np.asarray(margins, dtype=np.float64)
        e = np.exp(-np.abs(z))
        return np.where(z >= 0.0, -e / (1.0 + e), -1.0 / (1.0 + e))


class _Squared(_Compiled):
    name, code = "squared", SQUARED
    dual_domain = (-math.inf, math.inf)
    dual_range = (-math.inf, 0.5)
    smoothness = 1.0
    numpy_step_cost = 1.8
    gradient_flops = 2

    def value(self, margins):
        z = np.asarray(margins, dtype=np.float64)
        return 0.5 * (1.0 - z) ** 2

    def dual(self, a):
        a = np.asarray(a, dtype=np.float64)
        return a - 0.5 * a * a

    def value_bound(self, margin_bound):
        return 0.5 * (1.0 + margin_bound) ** 2

    def derivative(self, margins):
        return np.asarray(margins, dtype=np.float64) - 1.0


#: Every loss by its run-config name; ``hinge`` is the default.
LOSSES: dict[str, Loss] = {loss.name: loss for loss in
                           (_Hinge(), _SmoothedHinge(), _Logistic(), _Squared())}


#: Every loss by its kernel code.
LOSS_BY_CODE: dict[int, Loss] = {loss.code: loss for loss in LOSSES.values()}


def numpy_step_cost_of(code: int) -> float:
    """:attr:`Loss.numpy_step_cost` of the loss with kernel ``code`` (1.0 for an unknown one:
    the call fails in the kernel, not in its work estimate)."""
    loss = LOSS_BY_CODE.get(code)
    return 1.0 if loss is None else loss.numpy_step_cost


def get_loss(loss: str | Loss) -> Loss:
    """The registered :class:`Loss` named ``loss`` (or ``loss`` itself when it is registered);
    ValueError naming the valid names otherwise."""
    if isinstance(loss, Loss):
        if LOSS_BY_CODE.get(loss.code) is not loss:
            raise ValueError(f"{loss!r} is not registered: call register_loss on it first "
                             "(fmtl_flower.core.losses)")
        return loss
    found = LOSSES.get(loss) if isinstance(loss, str) else None
    if found is None:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r} (a loss of "
                         "your own must be registered with fmtl_flower.core.losses."
                         "register_loss in this process too)")
    return found


#: Fenchel-Young's slack may dip this far below 0 at :func:`register_loss`'s check (rounding).
_FY_TOL = 1e-9


def register_loss(loss: Loss) -> Loss:
    """Add ``loss`` (an instance of a :class:`Loss` subclass written in Python/numpy) to
    :data:`LOSSES` under its ``name``, give it a kernel code of its own (its kernel calls run
    numpy, :func:`has_kernels`) and return it. Call it in every process of a run (server and
    devices) before the run, e.g. at the import of the module that defines the loss.

    A quick check guards the duality-gap certificate, which rests on Fenchel-Young: on a grid
    of margins z and dual points a of the domain, l(z) - D(a) + a z >= 0; the step at
    q = 0 is :attr:`Loss.peak`; a few steps stay in the dual domain and beat every grid
    point of their 1-D problem. ValueError names what fails (also a name already taken, a
    missing required piece, a code set by hand).
    """
    if not isinstance(loss, Loss) or type(loss) is Loss:
        raise ValueError(f"register_loss takes an instance of a Loss subclass, got {loss!r}")
    if not isinstance(loss.name, str) or not loss.name.strip():
        raise ValueError(f"{type(loss).__name__}.name must be a non-empty string")
    if loss.name in LOSSES:
        raise ValueError(f"a loss named {loss.name!r} is already registered")
    if loss.code != Loss.code:
        raise ValueError(f"{type(loss).__name__}.code is set ({loss.code}); register_loss "
                         "hands out the code (the compiled ones belong to the built-in losses)")
    missing = [m for m in ("value", "dual", "value_bound", "sdca_step")
               if getattr(type(loss), m) is getattr(Loss, m)]
    if not hasattr(loss, "peak"):
        missing.append("peak")
    if missing:
        raise ValueError(f"{type(loss).__name__} does not define {', '.join(missing)}")
    _check_fenchel_young(loss)
    loss.code = max(_FIRST_PYTHON_CODE - 1, *LOSS_BY_CODE) + 1
    LOSSES[loss.name] = loss
    LOSS_BY_CODE[loss.code] = loss
    return loss


def unregister_loss(name: str) -> None:
    """Remove the registered loss ``name`` (tests); the built-in losses cannot be removed."""
    loss = LOSSES.get(name)
    if loss is None or has_kernels(loss.code):
        raise ValueError(f"{name!r} is not a registered loss of Python code")
    del LOSSES[name], LOSS_BY_CODE[loss.code]
    loss.code = Loss.code


def _check_fenchel_young(loss: Loss) -> None:
    """:func:`register_loss`'s check (its docstring)."""
    lo, hi = loss.dual_domain
    a = np.linspace(max(lo, -10.0), min(hi, 10.0), 41)
    z = np.linspace(-10.0, 10.0, 81)
    slack = (loss.value(z)[:, None] - loss.dual(a)[None, :] + a[None, :] * z[:, None])
    if not np.all(slack >= -_FY_TOL * (1.0 + np.abs(a[None, :] * z[:, None]))):
        i, j = np.unravel_index(np.argmin(slack), slack.shape)
        raise ValueError(f"{loss!r}: l(z) - D(a) + a z = {slack[i, j]:.3g} < 0 at z = "
                         f"{z[i]:.3g}, a = {a[j]:.3g}: value and dual are not a conjugate "
                         "pair (Fenchel-Young), so a duality gap of them bounds nothing")
    peak = float(loss.peak)
    for a_old in a[::10]:
        if loss.sdca_step(float(a_old), 0.0, 0.0) != peak:
            raise ValueError(f"{loss!r}: sdca_step(a_old, 0, 0) must be peak = {peak} (a zero "
                             f"row's step), got {loss.sdca_step(float(a_old), 0.0, 0.0)}")
        for zz, q in ((-3.0, 0.5), (0.3, 2.0), (4.0, 10.0)):
            _check_step(loss, float(a_old), zz, q, a)


def _check_step(loss: Loss, a_old: float, z: float, q: float, grid: np.ndarray) -> None:
    """The step is a float of the domain at least as good as every point of ``grid`` for
    f(a) = D(a) - z (a - a_old) - (q/2) (a - a_old)^2 (up to rounding)."""
    step = loss.sdca_step(a_old, z, q)
    if not (isinstance(step, float) and loss.feasible_mask(np.array([step]))[0]):
        raise ValueError(f"{loss!r}: sdca_step({a_old:.3g}, {z}, {q}) = {step!r} is not a "
                         "float of the dual domain")
    points = np.append(grid, step)
    f = loss.dual(points) - z * (points - a_old) - 0.5 * q * (points - a_old) ** 2
    if f[-1] < f[:-1].max() - _FY_TOL * (1.0 + abs(f[-1])):
        raise ValueError(f"{loss!r}: sdca_step({a_old:.3g}, {z}, {q}) = {step:.6g} is not the "
                         f"coordinate maximiser (a = {grid[np.argmax(f[:-1])]:.6g} is better)")
