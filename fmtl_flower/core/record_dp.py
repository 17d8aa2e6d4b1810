"""Record-level differential privacy for MOCHA's family on the device (Flower-free).

What is protected: one training record (x_i, y_i) of one device, under *replacement*
adjacency (the device's n is public; the run's sizes go to the server at discovery). What
the device releases: each round's ``delta-b``; everything else it sends in this mode is a
constant or data-independent (see ``docs/guides/privacy.md``: the test errors of the held-out
test rows are the one exception, an evaluation output outside the guarantee).

The mechanism, per device and round:

1. The device trains on its rows clipped to L2 norm C (:func:`clip_rows`): the dataset the
   guarantee speaks of is the clipped one, and every |x_i| <= C.
2. Its local step is *separable* (:func:`separable_m_tt`): every coordinate step of the
   round is taken at the model w_t the server sent (Mini-batch SDCA's step), never at a
   model the round's earlier steps moved. So alpha_i's whole history depends on record i and
   on what the server sent (public: computed from the noisy releases), and on nothing else
   of the device's data. Replacing record i changes one term of
   ``delta-b = gamma * s * sum_j x_j d_alpha_j / n``: with |d_alpha_j| <= r (the loss's dual
   radius, 1 for the hinge, the smoothed hinge and the logistic loss: y_j alpha_j stays in
   [0, 1]) the release moves by at most

           Delta = 2 * C * r * gamma * s / n     (:func:`release_sensitivity`)

   (gamma: MOCHA's aggregation parameter, s: Mb-SDCA's scale; 1 otherwise). For the hinge
   and the smoothed hinge the step itself is bounded too, by public numbers (the w_t sent,
   the step's curvature): C r is then replaced by the smaller
   :func:`record_contribution`, often by far (MOCHA's separable step divides every
   coordinate's step by the b coordinates it updates). MOCHA's own
   sequential SDCA has no such bound: a record moves the local model, hence every later
   coordinate step of the round, and through alpha every later round (Delta would be
   2 C r min(budget, n) / n, no better than releasing nothing useful). For MOCHA the
   separable step keeps the subproblem's safety: with b coordinates updated,
   |sum_j x_j d_j|^2 <= b sum_j |x_j d_j|^2, so the step of each coordinate with the
   curvature sigma' m_tt b (instead of sigma' m_tt) maximises a separable lower bound of
   G that equals it at 0: G never decreases, and sigma' keeps its meaning across tasks.
3. It releases ``delta-b + N(0, (z Delta)^2 I_d)`` (:func:`noisy_release`), z the noise
   multiplier, and keeps its *true* d_alpha pending (the commit protocol is unchanged: a
   reply the server drops discards the noisy delta-b there and the d_alpha here), and the
   round's noise with it: e_t, the sum of its accepted noises, is the noise in the
   server's b_t.
4. It evaluates its model without its own noise, w_t - m_tt e_t (:func:`own_noise_free`:
   post-processing on the device; its training steps stay at the w_t sent, whose norm the
   step bound uses).

Composition: each round the device is sent work (not ``dropped``, budget > 0) is one
Gaussian mechanism of noise multiplier z, adaptively composed (the next round's w_t is
post-processing of earlier releases); the epsilon of k releases is
:func:`~fmtl_flower.core.privacy.rdp_epsilon` ``[(z, 1, k)]``. No amplification by sampling
is claimed. Releases whose reply is lost count too (the server counts the messages it sent).

The noise stream (:func:`noise_rng`) is never the run's ``seed`` (the server knows it and
could subtract the noise): it is the operating system's entropy, or, for tests and
reproducible experiments only, ``[noise_seed, task, round, TAG_RECORD_DP]`` with a
``noise_seed`` the device holds (node config ``dp-noise-seed``).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .losses import Loss, get_loss
from .privacy import check_delta, check_noise_multiplier, rdp_epsilon
from .rng import TAG_RECORD_DP

#: Standard deviations of slack, beyond sqrt(d), that the server allows the norm of a noise
#: vector N(0, std^2 I_d): P(|N| > std (sqrt(d) + t)) <= exp(-t^2 / 2) = exp(-50) at t = 10.
NOISE_TAIL = 10.0


def check_clip(clip: Any) -> float:
    """``clip`` as a float > 0 (finite), else a ValueError."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) \
            or not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"dp-clip must be a finite number > 0, got {clip!r}")
    return float(clip)


def clip_rows(X: np.ndarray, clip: float) -> np.ndarray:
    """The rows of ``X`` with L2 norm above ``clip`` scaled down to norm ``clip`` (a new
    array; the others unchanged, bit for bit)."""
    clip = check_clip(clip)
    X = np.asarray(X, dtype=np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", X, X))
    over = norms > clip
    out = X.copy()
    out[over] *= (clip / norms[over])[:, None]
    return out


def record_contribution(clip: float, n: int, dual_radius: float = 1.0,
                        curvature: float | None = None, w_norm: float = 0.0,
                        loss: str | Loss = "hinge") -> float:
    """The largest |x_i d_alpha_i| one record can put into a separable step's sum.

    Always at most C r (|x_i| <= C, |d_alpha_i| <= r). For a loss (a registered name or
    :class:`~fmtl_flower.core.losses.Loss`) of finite ``dual_slope`` s = sup |D'| (the
    hinges'; :class:`~fmtl_flower.core.losses.Loss`) whose step's curvature is known
    (q_i = ``curvature`` |x_i|^2 / n, the same for every record: sigma' m_tt b for MOCHA's
    separable step, m_tt for Mb-SDCA's), also: the exact
    1-D maximiser of D(a + t) - m t - q t^2 / 2 over the domain has |t| <= (|D'| + |m|) / q
    (concavity at the maximiser), with |m| = |x_i . w| <= |x_i| |w| for the public w. So
    |x_i d_alpha_i| <= min(r |x|, A (s + |x| |w|) / |x|), A = n / curvature, s = sup |D'|,
    whose largest value over |x| in (0, C] is r min(x*, C), x* the positive root of
    r x^2 = A (s + |w| x)."""
    clip = check_clip(clip)
    box = clip * float(dual_radius)
    slope = get_loss(loss).dual_slope
    if curvature is None or not math.isfinite(slope) or not curvature > 0:
        return box
    a = int(n) / float(curvature)
    r, w = float(dual_radius), float(w_norm)
    crossing = (a * w + math.sqrt((a * w) ** 2 + 4.0 * r * a * slope)) / (2.0 * r)
    return r * min(crossing, clip)


def release_sensitivity(clip: float, n: int, dual_radius: float = 1.0,
                        scale: float = 1.0, contribution: float | None = None) -> float:
    """Delta = 2 c scale / n: the largest L2 change of one release
    ``scale * X^T d_alpha / n`` when one record is replaced, c the largest contribution of
    one record (``contribution``, :func:`record_contribution`; default C r: rows within C,
    every |d_alpha_i| <= r), for a separable step (module docstring)."""
    if not math.isfinite(dual_radius) or dual_radius <= 0:
        raise ValueError(f"record-level DP needs a bounded dual domain, got radius "
                         f"{dual_radius!r} (the squared loss's is unbounded)")
    if isinstance(n, bool) or int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    if not 0 <= scale <= 1:
        raise ValueError(f"scale must be in [0, 1], got {scale!r}")
    c = check_clip(clip) * float(dual_radius) if contribution is None else float(contribution)
    return 2.0 * c * float(scale) / int(n)


def separable_m_tt(m_tt: float, sigma_prime: float, steps: int) -> float:
    """The curvature (as Mb-SDCA's ``m_tt``) of MOCHA's separable step on ``steps``
    coordinates: sigma' m_tt steps (a separable lower bound of the subproblem G)."""
    return float(m_tt) * float(sigma_prime) * max(int(steps), 1)


#: The methods whose sequential local solver record-level DP replaces by the separable step
#: over a data-independent budget (CoCoA's stop at a relative accuracy theta would make the
#: number of steps, hence the release, depend on every record).
SEPARABLE_STEP_METHODS = ("mocha", "cocoa")


def step_curvature(method: str, m_tt: float, sigma_prime: float, steps: int) -> float:
    """The curvature q_i n / |x_i|^2 of a record's step under record-level DP: MOCHA's and
    CoCoA's separable step sigma' m_tt steps (:func:`separable_m_tt`), Mb-SDCA's m_tt."""
    return (separable_m_tt(m_tt, sigma_prime, steps) if method in SEPARABLE_STEP_METHODS
            else float(m_tt))


def noise_rng(noise_seed: int | None, task_id: int, server_round: int
              ) -> np.random.Generator:
    """The device's noise Generator for one release: the ``record-dp-noise`` stream
    ``[noise_seed, task, round, TAG_RECORD_DP]`` when ``noise_seed`` is given (tests,
    reproducible experiments), else 128 bits of the operating system's entropy."""
    if noise_seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([int(noise_seed), int(task_id), int(server_round),
                                  TAG_RECORD_DP])


def noisy_release(d_b: np.ndarray, sensitivity: float, noise_multiplier: float,
                  rng: np.random.Generator) -> np.ndarray:
    """``d_b + N(0, (noise_multiplier * sensitivity)^2 I)``; ``d_b`` itself (the same
    object) when the noise multiplier or the sensitivity is 0."""
    z = check_noise_multiplier(noise_multiplier, "dp-noise-multiplier")
    if z == 0.0 or sensitivity == 0.0:
        return d_b
    return d_b + rng.normal(0.0, z * sensitivity, size=d_b.shape)


def own_noise_free(w: np.ndarray, m_tt: float, noise: np.ndarray) -> np.ndarray:
    """Device t's model without its own accepted noise: ``w - m_tt * noise``.

    The server's B is B_true + E (E: every device's accepted noise, column t = e_t, the
    ``noise`` device t keeps), so the w_t it sends, column t of (B_true + E) M, holds
    M_tt e_t of the device's own noise; without it, w_t - M_tt e_t = sum_{s != t} b~_s M_st
    + b_t M_tt (b~_s the other devices' noisy images, b_t the device's true one): the
    device's best estimate of column t of W(B_true). A function of what the device holds
    (w_t, m_tt received, e_t it drew): post-processing, the guarantee is unchanged. ``w``
    itself (the same object) when ``noise`` is empty (no record-level DP)."""
    if noise.size == 0:
        return w
    if not (math.isfinite(m_tt) and m_tt > 0):
        raise ValueError(f"m-tt must be finite and > 0, got {m_tt!r}")
    return w - float(m_tt) * noise


def noise_norm_allowance(std: np.ndarray | float, dim: int, releases: Any = 1) -> Any:
    """A bound on the norm of the sum of ``releases`` independent N(0, std^2 I_dim) vectors
    that holds but with probability <= exp(-50) (:data:`NOISE_TAIL`): the server widens its
    norm checks of noisy replies by it."""
    return np.asarray(std) * np.sqrt(np.asarray(releases, dtype=np.float64)) * (
        math.sqrt(dim) + NOISE_TAIL)


@dataclass
class RecordAccountant:
    """Every device's epsilon: device t's releases are ``counts[t]`` Gaussian mechanisms of
    one noise multiplier (the run's), composed by the RDP accountant at ``delta``.

    Parameters
    ----------
    noise_multiplier : float
        z >= 0 of every release.
    delta : float
        The delta of the reported guarantee.
    counts : ndarray of int64, shape (m,)
        Releases per task (the train messages with work sent to it).
    """

    noise_multiplier: float
    delta: float
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _cache: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.noise_multiplier = check_noise_multiplier(self.noise_multiplier)
        self.delta = check_delta(self.delta)
        self.counts = np.asarray(self.counts, dtype=np.int64)

    def add(self, released: np.ndarray) -> None:
        """Count one release for every task where ``released`` (bool, (m,)) is true."""
        released = np.asarray(released, dtype=bool)
        if self.counts.shape != released.shape:
            counts = np.zeros(released.shape, dtype=np.int64)
            counts[:min(len(counts), len(self.counts))] = self.counts[:len(counts)]
            self.counts = counts
        self.counts += released

    def epsilon_of(self, releases: int) -> float:
        """Epsilon at :attr:`delta` of ``releases`` releases (cached per count)."""
        k = int(releases)
        if k not in self._cache:
            self._cache[k] = rdp_epsilon([(self.noise_multiplier, 1.0, k)], self.delta)
        return self._cache[k]

    def epsilons(self) -> np.ndarray:
        """Every task's epsilon, (m,)."""
        return np.array([self.epsilon_of(k) for k in self.counts.tolist()], dtype=np.float64)

    def epsilon(self) -> float:
        """The largest epsilon over the devices (0 before any release)."""
        return self.epsilon_of(int(self.counts.max())) if len(self.counts) else 0.0


def release_noise_gram(M: np.ndarray, noise_var: np.ndarray, dim: int) -> np.ndarray:
    """The expected Gram matrix of the noise in W = B M: E[(E M)^T (E M)] = M^T D M with
    D = diag(dim * noise_var), where column t of E (the accepted noise in b_t) has ``dim``
    independent coordinates of variance ``noise_var[t]`` (the sum of the variances of the
    releases accepted since b_t was last reset: public, the server computes every std).

    Parameters
    ----------
    M : ndarray of shape (m, m)
        The current W = B M map.
    noise_var : ndarray of shape (m,)
        Per-coordinate noise variance accumulated in each b_t (>= 0).
    dim : int
        d, the number of coordinates of b_t.
    """
    noise_var = np.asarray(noise_var, dtype=np.float64)
    if noise_var.shape != (M.shape[0],) or (noise_var < 0).any():
        raise ValueError(f"noise_var must be ({M.shape[0]},) >= 0, got {noise_var.shape}")
    return M.T @ ((dim * noise_var)[:, None] * M)


def debiased_gram(W: np.ndarray, noise_gram: np.ndarray) -> np.ndarray:
    """W^T W minus the noise's expected Gram matrix (:func:`release_noise_gram`), projected
    back to the positive semidefinite cone (negative eigenvalues set to 0): an estimate of
    the noise-free models' Gram matrix that the Omega-step can learn the task relationships
    from, instead of the noise's (which is diagonal-heavy and pulls Omega toward independent
    tasks with the noisiest ones least regularised). Symmetric PSD (m, m)."""
    gram = W.T @ W - noise_gram
    evals, evecs = np.linalg.eigh(0.5 * (gram + gram.T))
    out = (evecs * np.clip(evals, 0.0, None)) @ evecs.T
    return 0.5 * (out + out.T)
