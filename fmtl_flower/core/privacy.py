"""Privacy accounting for the Gaussian mechanism composed over rounds (Flower-free).

A thin, checkpointable layer over Google's ``dp-accounting`` library (pip
``dp-accounting``, the optional extra ``fmtl-flower[privacy]``; imported only when an
epsilon is computed, so neither the device side nor a run without DP needs it). Why that
library: it is maintained by Google's differential-privacy team, offers both the RDP
accountant (Mironov 2017; Mironov, Talwar and Zhang 2019 for the subsampled Gaussian) and
the tighter privacy-loss-distribution (PLD) accountant behind one ``DpEvent`` vocabulary,
and depends only on numpy/scipy/mpmath (Opacus' accountants pull in torch, which the
numpy families of this package do not need).

The mechanism accounted for: each release adds N(0, (z * S)^2) to a sum whose
sensitivity is S (the clip norm of one device's update under add/remove-one adjacency),
z being the *noise multiplier*. A release may be preceded by Poisson subsampling of rate
q (each device joins the round independently with probability q): only then does the RDP
analysis of the subsampled Gaussian apply (``sampling_rate < 1``); a fixed-size sample
without replacement is accounted as q = 1 (no amplification claimed), which is valid
because a device outside the sample contributes nothing.

The accountant's state is the list of (noise multiplier, sampling rate, steps) it has
composed, so it is saved in a checkpoint as plain numbers (:meth:`GaussianAccountant.state`)
and rebuilt from them (:meth:`GaussianAccountant.from_state`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Bounds of the noise-multiplier search of :func:`noise_multiplier_for_epsilon`.
MAX_NOISE_MULTIPLIER = 1e4


#: Relative slack under which an update counts as within the clip norm: one a device clipped
#: itself lands on the norm only up to rounding.
CLIP_SLACK = 1e-9


def clip_update(update: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """``update`` scaled to L2 norm at most ``clip`` (Flower's ``clip_inputs_inplace``: one
    norm over every entry), and its norm before."""
    norm = float(np.linalg.norm(update))
    return (update if norm <= clip else update * (clip / norm)), norm


def clip_towards(received: np.ndarray, trained: np.ndarray, clip: float) -> np.ndarray:
    """``trained`` moved back towards ``received`` so that their difference has L2 norm at
    most ``clip`` (a device's own clipping, Flower's ``fixedclipping_mod``); a ValueError
    unless ``clip`` is a finite number > 0."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) \
            or not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"dp-clip must be a finite number > 0, got {clip!r}")
    return received + clip_update(trained - received, float(clip))[0]


def _dp_accounting() -> Any:
    """Import ``dp_accounting`` or say how to install it."""
    try:
        import dp_accounting  # noqa: PLC0415 (optional dependency, imported on use)
        from dp_accounting.rdp import rdp_privacy_accountant  # noqa: F401, PLC0415
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("privacy accounting needs the dp-accounting package: "
                          "pip install 'fmtl-flower[privacy]' (or dp-accounting>=0.4)") from err
    return dp_accounting


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """``noise_multiplier`` as a float >= 0, else a ValueError naming ``name``."""
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)) \
            or not math.isfinite(noise_multiplier) or noise_multiplier < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def check_sampling_rate(rate: Any) -> float:
    """``rate`` as a float in (0, 1], else a ValueError."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
            or not math.isfinite(rate) or not 0 < rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {rate!r}")
    return float(rate)


def check_delta(delta: Any) -> float:
    """``delta`` as a float in (0, 1), else a ValueError."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) \
            or not math.isfinite(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def gaussian_event(noise_multiplier: float, sampling_rate: float = 1.0, steps: int = 1) -> Any:
    """The ``dp_accounting`` event of ``steps`` (Poisson-subsampled) Gaussian releases."""
    dpa = _dp_accounting()
    event = dpa.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1.0:
        event = dpa.PoissonSampledDpEvent(sampling_rate, event)
    return dpa.SelfComposedDpEvent(event, steps) if steps != 1 else event


def rdp_epsilon(events: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` of the composed (noise multiplier, rate, steps) ``events``
    by dp-accounting's RDP accountant; 0 when nothing was released, inf when a release
    had no noise."""
    events = [e for e in events if e[2] > 0]
    if not events:
        return 0.0
    if any(z == 0 for z, _, _ in events):
        return math.inf
    dpa = _dp_accounting()
    accountant = dpa.rdp.RdpAccountant()  # its default Renyi orders (1.01 .. 1024)
    absl = logging.getLogger("absl")
    level = absl.level
    # A subsampled event's RDP at a few fractional orders near 1 may not converge: those
    # orders are left out of the minimum (so epsilon can only be larger, still valid);
    # dp-accounting warns of each, every call, which would flood a run's log.
    absl.setLevel(max(level, logging.ERROR))
    try:
        for z, q, steps in events:
            accountant.compose(gaussian_event(z, q, steps))
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)


@dataclass
class GaussianAccountant:
    """Epsilon of the Gaussian releases of a run, at a fixed ``delta``.

    Parameters
    ----------
    delta : float
        The delta of the reported (epsilon, delta)-DP guarantee, in (0, 1).

    Attributes
    ----------
    events : list of (noise_multiplier, sampling_rate, steps)
        The releases composed so far, consecutive equal ones merged.
    """

    delta: float
    events: list[tuple[float, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.delta = check_delta(self.delta)

    def compose(self, noise_multiplier: float, sampling_rate: float = 1.0,
                steps: int = 1) -> None:
        """Add ``steps`` releases of the Gaussian mechanism with ``noise_multiplier``
        (std = noise_multiplier * sensitivity), Poisson-subsampled at ``sampling_rate``."""
        z = check_noise_multiplier(noise_multiplier)
        q = check_sampling_rate(sampling_rate)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if steps == 0:
            return
        if self.events and self.events[-1][:2] == (z, q):
            self.events[-1] = (z, q, self.events[-1][2] + steps)
        else:
            self.events.append((z, q, steps))

    @property
    def releases(self) -> int:
        """The number of releases composed."""
        return sum(steps for _, _, steps in self.events)

    def epsilon(self) -> float:
        """Epsilon at :attr:`delta` of everything composed (RDP accountant)."""
        return rdp_epsilon(self.events, self.delta)

    def state(self) -> dict[str, Any]:
        """The accountant as plain numbers (JSON-able), for a checkpoint."""
        return {"delta": self.delta,
                "events": [[float(z), float(q), int(s)] for z, q, s in self.events]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GaussianAccountant:
        """The accountant saved by :meth:`state`; a ValueError when it is malformed."""
        try:
            accountant = cls(delta=state["delta"])
            for z, q, steps in state["events"]:
                accountant.compose(z, q, int(steps))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not an accountant state: {state!r}") from err
        return accountant


def noise_multiplier_for_epsilon(epsilon: float, delta: float, steps: int,
                                 sampling_rate: float = 1.0, tol: float = 1e-4) -> float:
    """The smallest noise multiplier (within relative ``tol``) whose ``steps`` releases at
    ``sampling_rate`` cost at most ``epsilon`` at ``delta`` (RDP accountant; bisection on
    the noise multiplier, epsilon being decreasing in it).

    Raises
    ------
    ValueError
        When ``epsilon`` is not > 0, or needs a noise multiplier above
        :data:`MAX_NOISE_MULTIPLIER`.
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) \
            or not epsilon > 0 or math.isnan(epsilon):
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    delta, q = check_delta(delta), check_sampling_rate(sampling_rate)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if math.isinf(epsilon):
        return 0.0

    def cost(z: float) -> float:
        return rdp_epsilon([(z, q, steps)], delta)

    low, high = 0.0, 1.0
    while cost(high) > epsilon:
        low, high = high, 2 * high
        if high > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"epsilon={epsilon:g} at delta={delta:g} over {steps} releases "
                             f"needs a noise multiplier above {MAX_NOISE_MULTIPLIER:g}")
    while high - low > tol * high:
        mid = (low + high) / 2
        low, high = (low, mid) if cost(mid) <= epsilon else (mid, high)
    return high


# ---------------------------------------------------------------------------- adaptive clipping
#: Andrew et al.'s (and Flower's) defaults: the clip starts at 0.1 and moves by at most a
#: factor exp(0.2) a round.
DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_CLIP_LEARNING_RATE = 0.2
#: Flower's default ``clipped_count_stddev``: the number of sampled devices over 20.
COUNT_STDDEV_PER_DEVICE = 1.0 / 20.0


def adaptive_noise_params(noise_multiplier: float, num_sampled: int,
                          clipped_count_stddev: float | None = None) -> tuple[float, float]:
    """The noise of adaptive clipping: ``(count_stddev, update_noise_multiplier)``.

    Andrew et al. 2021 (Thm. 1) and Flower's ``compute_adaptive_noise_params``: a round
    releases the noisy mean of the clipped updates (noise multiplier ``z_update``) and the
    noisy count of unclipped updates (std ``sigma_b``, each device's bit of sensitivity 1/2
    after centring); the pair costs what one Gaussian release with noise multiplier ``z``
    costs when ``z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2)``. ``sigma_b`` defaults to
    ``num_sampled / 20``; with ``z = 0`` nothing is noised (``(sigma_b or 0, 0)``).

    Raises
    ------
    ValueError
        When ``z >= 2 sigma_b`` (the count's noise alone would cost more than ``z``
        allows), or for a negative argument.
    """
    z = check_noise_multiplier(noise_multiplier)
    if isinstance(num_sampled, bool) or not isinstance(num_sampled, int) or num_sampled < 1:
        raise ValueError(f"num_sampled must be an int >= 1, got {num_sampled!r}")
    if clipped_count_stddev is not None:
        clipped_count_stddev = check_noise_multiplier(clipped_count_stddev,
                                                      "dp.clipped-count-stddev")
    if z == 0:
        return (clipped_count_stddev or 0.0), 0.0
    sigma_b = num_sampled * COUNT_STDDEV_PER_DEVICE if clipped_count_stddev is None \
        else clipped_count_stddev
    if z >= 2 * sigma_b:
        raise ValueError(f"adaptive clipping with noise multiplier {z:g} needs "
                         f"dp.clipped-count-stddev > {z / 2:g} (got {sigma_b:g}"
                         f"{'' if clipped_count_stddev is not None else ', the default: K/20'}"
                         f" with K = {num_sampled}): the noisy count alone would cost more "
                         "than the noise multiplier allows")
    return sigma_b, (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def geometric_clip_update(clip: float, unclipped_fraction: float, target_quantile: float,
                          learning_rate: float) -> float:
    """Andrew et al.'s geometric update of the clip norm:
    ``clip * exp(-learning_rate * (unclipped_fraction - target_quantile))``.

    The clip shrinks while more than ``target_quantile`` of the updates fit under it and
    grows while fewer do, so it tracks the ``target_quantile`` quantile of the update
    norms (the fixed point of the expected update)."""
    return float(clip) * math.exp(-float(learning_rate)
                                  * (float(unclipped_fraction) - float(target_quantile)))


@dataclass
class AdaptiveClip:
    """One stream of adaptively clipped releases (Andrew et al. 2021, as Flower's
    ``DifferentialPrivacyServerSideAdaptiveClipping``).

    Parameters
    ----------
    clip : float
        The current clip norm (> 0), the initial one when built.
    target_quantile : float
        The quantile of the update norms the clip tracks, in [0, 1]: the fraction of
        updates meant to fit under it (Flower's ``target_clipped_quantile``).
    learning_rate : float
        The geometric update's rate (> 0; Flower's ``clip_norm_lr``).
    count_stddev : float
        The std of the Gaussian noise on the count of unclipped updates (>= 0).
    """

    clip: float
    target_quantile: float = DEFAULT_TARGET_QUANTILE
    learning_rate: float = DEFAULT_CLIP_LEARNING_RATE
    count_stddev: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip)
                and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {self.clip!r}")
        if not 0 <= self.target_quantile <= 1:
            raise ValueError(f"target_quantile must be in [0, 1], got {self.target_quantile!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        self.count_stddev = check_noise_multiplier(self.count_stddev, "count_stddev")

    def fits(self, norms: Any, clipped_by_device: bool = False) -> np.ndarray:
        """Which updates of L2 ``norms`` fit under the clip (Flower's ``norm_bit`` negated:
        norm <= clip). With ``clipped_by_device`` the devices clipped their own updates to
        it, so one on the clip (within :data:`CLIP_SLACK`) counts as clipped."""
        norms = np.asarray(norms, dtype=np.float64)
        if clipped_by_device:
            return norms < self.clip * (1 - CLIP_SLACK)
        return norms <= self.clip

    def update(self, fits: Any, num_sampled: int, rng: np.random.Generator) -> float:
        """Move the clip after a release whose replies' updates ``fits`` (booleans:
        :meth:`fits`), of ``num_sampled`` devices sampled (a silent one sent the zero
        update, which fits): the fraction of updates that fit, plus N(0, count_stddev^2)
        on the count, over ``num_sampled`` (a fixed denominator), then the geometric
        update. Returns the noisy fraction."""
        fits = np.asarray(fits, dtype=bool)
        dropped = max(int(num_sampled) - fits.size, 0)
        unclipped = int(np.count_nonzero(fits)) + dropped
        noise = rng.normal(0.0, self.count_stddev) if self.count_stddev > 0 else 0.0
        fraction = (unclipped + noise) / max(int(num_sampled), fits.size, 1)
        self.clip = geometric_clip_update(self.clip, fraction, self.target_quantile,
                                          self.learning_rate)
        return float(fraction)
