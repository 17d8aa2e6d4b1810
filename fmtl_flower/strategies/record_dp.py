"""Record-level differential privacy for MOCHA's family: the server's half.

The devices do the mechanism (:mod:`fmtl_flower.core.record_dp`: rows clipped to
``dp.clip`` C, a separable local step, ``delta-b`` released with Gaussian noise calibrated to
one record); the server

* sends ``dp-clip`` and ``dp-noise-multiplier`` in every message (train and evaluate: the
  devices clip their rows before anything else, so their dual state is the clipped data's);
* counts every device's releases (one per train message with work: not ``dropped``,
  budget > 0; counted when sent, so a lost reply counts too) and reports in every record
  ``epsilon``, the largest epsilon over the devices at ``dp.delta`` (RDP accountant,
  :class:`~fmtl_flower.core.record_dp.RecordAccountant`), and ``dp_releases_max``; ``final``
  is the last record, so it carries the run's largest epsilon;
* widens its norm checks of ``delta-b`` (and, in robust mode, of b_t) by the noise's
  high-probability norm (:func:`~fmtl_flower.core.record_dp.noise_norm_allowance`), takes
  C as every task's row-norm bound, and computes no primal, dual or gap (the devices
  withhold ``loss-mean`` and ``dual-mean``, which are exact statistics of their records:
  see ``docs/guides/privacy.md``, "What stays certified").

Its W is built from the noisy B, so it holds every device's accepted noise; the test errors
in the records are those of the devices' own models, each without its own noise
(w_t - m_tt e_t, :func:`~fmtl_flower.core.record_dp.own_noise_free`, computed on the device
from the ``w`` and ``m-tt`` every train and evaluate message carries). Under record-level
DP a fixed Omega (``mean`` or ``identity``) does better than a learned one, whose
Omega-step learns coupling from the noise (``docs/results.md``).

A target ``dp.epsilon`` sets the noise multiplier once, at the first round, to the smallest
whose ``num_rounds`` releases cost at most that epsilon (a device releases at most once per
round). Checkpoints keep the release counts (the account resumes).
"""

from __future__ import annotations

import math
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log

from ..core.decoupling import coupled_models
from ..core.formulations import ProbabilisticFormulation
from ..core.omega import sigma_from_gram
from ..core.privacy import noise_multiplier_for_epsilon
from ..core.record_dp import (
    RecordAccountant,
    debiased_gram,
    noise_norm_allowance,
    record_contribution,
    release_noise_gram,
    release_sensitivity,
)
from ..settings import ConfigError, DPSettings

#: The methods record-level DP covers: Mb-SDCA's step is separable already; MOCHA's and
#: CoCoA's devices take the separable step over their budget instead of their sequential
#: SDCA (CoCoA: instead of SDCA to a relative accuracy theta, whose data-dependent number
#: of steps would leak; under DP ``theta`` is not used).
RECORD_DP_METHODS = ("mocha", "cocoa", "mb-sdca")
#: A round's steps as the server knows them: (loss name, each task's step curvature, |w_t|).
Step = tuple[str, np.ndarray, np.ndarray]


class RecordLevelDP:
    """The server half of record-level DP for a MOCHA-family strategy.

    Parameters
    ----------
    settings : DPSettings
        ``mechanism`` ``record``, ``clip`` (the row norm C), and ``noise_multiplier`` or a
        target ``epsilon`` at ``delta``.
    """

    def __init__(self, settings: DPSettings) -> None:
        if not isinstance(settings, DPSettings) or settings.mechanism != "record":
            raise ValueError(f"RecordLevelDP needs DPSettings with mechanism record, got "
                             f"{settings!r}")
        self.settings = settings
        self.clip = float(settings.clip)
        self.noise_multiplier: float | None = settings.noise_multiplier
        self.accountant: RecordAccountant | None = None
        self._counts: np.ndarray | None = None  # restored from a checkpoint, until resolved
        #: Per-coordinate noise variance accumulated in each b_t (:meth:`note_accepted`).
        self.noise_var: np.ndarray | None = None

    def resolve(self, num_rounds: int, num_tasks: int) -> RecordAccountant:
        """The accountant, built at the first call: the noise multiplier as given, or the
        smallest meeting the target epsilon over ``num_rounds`` releases."""
        if self.accountant is None:
            if self.noise_multiplier is None:
                eps = float(self.settings.epsilon)
                self.noise_multiplier = 0.0 if math.isinf(eps) else \
                    noise_multiplier_for_epsilon(eps, self.settings.delta, int(num_rounds))
                log(INFO, "record-level DP: noise multiplier %.4f for epsilon=%g at delta=%g "
                    "over %d rounds", self.noise_multiplier, eps, self.settings.delta,
                    num_rounds)
            counts = np.zeros(num_tasks, dtype=np.int64) if self._counts is None \
                else self._counts
            self.accountant = RecordAccountant(self.noise_multiplier, self.settings.delta,
                                               counts)
        return self.accountant

    def count(self, released: np.ndarray) -> None:
        """One release for every task where ``released`` is true, and the log line."""
        assert self.accountant is not None
        self.accountant.add(released)
        log(INFO, "record-level DP: %d devices released, largest epsilon %.4g at delta=%g "
            "(%d releases)", int(np.count_nonzero(released)), self.accountant.epsilon(),
            self.settings.delta, int(self.accountant.counts.max(initial=0)))

    def wire_config(self) -> dict[str, float]:
        """What every message adds: ``dp-clip`` and ``dp-noise-multiplier``."""
        assert self.noise_multiplier is not None, "resolve() first"
        return {"dp-clip": self.clip, "dp-noise-multiplier": float(self.noise_multiplier)}

    def record_fields(self) -> dict[str, Any]:
        """The privacy keys of a record: ``epsilon`` (largest over the devices so far) and
        ``dp_releases_max``; 0 and 0 before the first round."""
        if self.accountant is None:
            return {"epsilon": 0.0, "dp_releases_max": 0}
        return {"epsilon": self.accountant.epsilon(),
                "dp_releases_max": int(self.accountant.counts.max(initial=0))}

    def epsilons(self) -> list[float]:
        """Every device's epsilon (by task id)."""
        return [] if self.accountant is None else self.accountant.epsilons().tolist()

    def noise_std(self, n: np.ndarray, dual_radius: float, scale: float,
                  blocks: int = 1, steps: Step | None = None) -> np.ndarray:
        """The noise std z * Delta of each task's release (``n``: lifted sizes); with
        ``steps`` = (loss, curvatures, |w_t|) the step-bounded Delta the devices use
        (:func:`~fmtl_flower.core.record_dp.record_contribution`), else the box's."""
        z = float(self.noise_multiplier or 0.0)
        out = []
        for i, k in enumerate(n.tolist()):
            k = max(int(k), 1)
            c = None if steps is None else record_contribution(
                self.clip, k, dual_radius, float(steps[1][i]), float(steps[2][i]), steps[0])
            out.append(z * release_sensitivity(self.clip, k, dual_radius, scale, c) * blocks)
        return np.array(out)

    def note_accepted(self, num_tasks: int, tasks: np.ndarray, resets: np.ndarray,
                      std: np.ndarray) -> None:
        """Track the noise in B: b_t of the ``resets`` restarted at 0 (its noise gone), then
        every accepted task's b_t took one release of noise std ``std`` (per coordinate)."""
        if self.noise_var is None or len(self.noise_var) != num_tasks:
            self.noise_var = np.zeros(num_tasks)
        self.noise_var[np.asarray(resets, dtype=np.int64)] = 0.0
        self.noise_var[np.asarray(tasks, dtype=np.int64)] += np.square(std)

    def omega_step(self, state: Any) -> None:
        """The Omega-step of a server state. With ``dp.omega-debias`` and the
        ``probabilistic`` formulation on a dense state: learned from W^T W with the releases'
        known noise discounted (:func:`~fmtl_flower.core.record_dp.debiased_gram`: the
        noise in b_t is e_t, of per-coordinate variance :attr:`noise_var` [t], so W = B M
        holds E M); the formulation's own step otherwise (the factored state keeps no M).
        Off by default: measured on ``synthetic`` and ``small`` it does not help
        (``docs/results.md``)."""
        form = state.formulation
        M = getattr(state, "M", None)
        if not (self.settings.omega_debias and isinstance(form, ProbabilisticFormulation)) \
                or M is None or self.noise_var is None:
            state.omega_step()
            return
        W = coupled_models(state.W, state.decoupled)
        keep = np.ones(W.shape[1]) if state.decoupled is None else \
            (~np.asarray(state.decoupled, dtype=bool)).astype(np.float64)
        noise = release_noise_gram(M, self.noise_var, W.shape[0]) * np.outer(keep, keep)
        form.set_omega(sigma_from_gram(debiased_gram(W, noise), form.eps_rel))
        state._take_inverse()  # noqa: SLF001 - the state's own step does the same two
        state.recompute_models()

    def allowance(self, n: np.ndarray, dim: int, dual_radius: float, scale: float,
                  blocks: int = 1, releases: Any = 1, steps: Step | None = None
                  ) -> np.ndarray:
        """What the noise of ``releases`` releases may add to a norm (per task)."""
        return noise_norm_allowance(self.noise_std(n, dual_radius, scale, blocks, steps), dim,
                                    releases)

    def fingerprint(self) -> list[Any]:
        """The settings a checkpoint must share to be resumed by this run."""
        s = self.settings
        return [s.mechanism, s.clip, s.noise_multiplier, s.epsilon, s.delta] + (
            ["omega-debias"] if s.omega_debias else [])  # off: as before the key

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The release counts, for a checkpoint."""
        counts = self._counts if self.accountant is None else self.accountant.counts
        out = {} if counts is None else {"dp.releases": np.asarray(counts, dtype=np.int64)}
        if self.noise_var is not None:
            out["dp.noise-var"] = self.noise_var.copy()
        return out

    def restore(self, arrays: dict[str, np.ndarray], num_tasks: int) -> None:
        """The release counts of a checkpoint (:meth:`state_arrays`)."""
        counts = arrays.get("dp.releases")
        if counts is None:
            raise ValueError("the checkpoint holds no record-level DP account (dp.releases): "
                             "it was written by a run without dp.mechanism=record")
        if counts.shape != (num_tasks,) or (counts < 0).any():
            raise ValueError(f"checkpoint 'dp.releases' must be (num_tasks,) >= 0, got "
                             f"{counts.shape}")
        self._counts = counts.astype(np.int64)
        noise_var = arrays.get("dp.noise-var")
        if noise_var is not None:
            if noise_var.shape != (num_tasks,) or not (noise_var >= 0).all():
                raise ValueError(f"checkpoint 'dp.noise-var' must be (num_tasks,) >= 0, got "
                                 f"{noise_var.shape}")
            self.noise_var = noise_var.astype(np.float64)
        if self.accountant is not None:
            self.accountant.counts = self._counts.copy()


def enable_record_dp(strategy: Any, settings: DPSettings) -> Any:
    """``strategy`` (MOCHA, CoCoA's or Mb-SDCA's :class:`~fmtl_flower.strategies.mocha.MOCHA`)
    with record-level DP on; returns it.

    Raises
    ------
    ConfigError
        For another strategy or method, or a loss with an unbounded dual domain (squared).
    """
    from .mocha import MOCHA  # noqa: PLC0415 (mocha imports this module's users)

    if not isinstance(strategy, MOCHA):
        raise ConfigError(f"dp.mechanism=record covers MOCHA's family (methods "
                          f"{', '.join(RECORD_DP_METHODS)}); got {type(strategy).__name__}")
    method = strategy.settings.method
    if method not in RECORD_DP_METHODS:
        raise ConfigError(f"dp.mechanism=record covers methods {', '.join(RECORD_DP_METHODS)}"
                          f", not {method!r} (its local solver is sequential SDCA to a "
                          "relative accuracy: one record moves every coordinate's step)")
    if not math.isfinite(get_dual_radius(strategy)):
        raise ConfigError(f"dp.mechanism=record needs a loss with a bounded dual domain "
                          f"(hinge, smoothed-hinge, logistic), not {strategy.settings.loss!r}")
    strategy.privacy = RecordLevelDP(settings)
    return strategy


def get_dual_radius(strategy: Any) -> float:
    """The dual radius of the strategy's loss."""
    from ..core.losses import get_loss  # noqa: PLC0415

    return get_loss(strategy.settings.loss).dual_radius
