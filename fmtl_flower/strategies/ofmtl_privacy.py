"""Record-level differential privacy for OFMTL: the server's half.

The devices do the mechanism (:mod:`fmtl_flower.core.ofmtl_privacy`): rows clipped to
``dp.clip`` C; in MOCHA's (re)trainings MOCHA's record-level DP as is
(:mod:`fmtl_flower.strategies.record_dp`, the same noise multiplier); in a newcomer's
exchange output perturbation: the newcomer solves its strongly convex subproblem to a gap
target and replies its model plus Gaussian noise calibrated to one record,
2 (1 + eta) C / (n lam omega). The server

* fixes the noise multiplier z once, at the start: ``dp.noise-multiplier``, or the smallest
  whose :func:`~fmtl_flower.core.ofmtl_privacy.release_budget` releases (the most any
  device can make in the run) cost at most ``dp.epsilon`` at ``dp.delta``;
* counts every device's releases in one account (:class:`~fmtl_flower.core.record_dp.
  RecordAccountant`, MOCHA's): the MOCHA rounds of every (re)training (each MOCHA's own
  account, added when it ends) and each newcomer round trip (when sent);
* reports ``epsilon`` (the largest over the devices so far) and ``dp_releases_max`` in every
  record, and ``final["privacy"]["epsilon_per_task"]``;
* bounds a newcomer's reply by C (not the reported row norm) widened by lam omega times the
  noise's high-probability norm, and drops the ``newcomer_gap`` (the device withholds it: an
  exact statistic of its records);
* rewrites the account into the newest checkpoint at every release (a resumed run continues
  it, the round trips of an interrupted newcomer included).

What stays certified. The server checks no gap: the newcomer withholds its subproblem's
duality gap, and the w the server holds is the device's model plus noise. On the device,
(alpha, w) is a consistent primal-dual pair of its subproblem for the last (omega, c) with a
duality gap at most G = eta^2 C^2 / (2 n^2 lam omega) (the gap target it reached before
releasing; not sent): its model is within eta C / (n lam omega) of the subproblem's
minimiser. The subproblem itself is built from the noisy columns of the others (c) and the
Sigma learned from noisy columns (omega). Test errors: founding and retrained devices
evaluate the (noisy) column of W the server holds; a newcomer since the last training
evaluates its own model w, without the noise of its release, when the column the server
sends is the one it released last (``docs/guides/privacy.md``).
"""

from __future__ import annotations

import dataclasses
import math
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log

from ..core.ofmtl_privacy import newcomer_sensitivity, release_budget
from ..core.record_dp import noise_norm_allowance
from ..settings import ConfigError, DPSettings
from .record_dp import RecordLevelDP

__all__ = ["OfmtlRecordDP", "enable_ofmtl_record_dp"]


class OfmtlRecordDP(RecordLevelDP):
    """The server half of OFMTL's record-level DP (module docstring): MOCHA's
    :class:`~fmtl_flower.strategies.record_dp.RecordLevelDP` (z, account, wire keys,
    checkpoint arrays), plus what OFMTL's phases need."""

    def start(self, strategy: Any) -> None:
        """Fix z and the account for ``strategy`` (an :class:`~.ofmtl.OFMTL`) at its start."""
        budget = release_budget(strategy.initial_tasks, strategy.num_tasks,
                                strategy.retrain_ratio, strategy.mocha_rounds,
                                strategy.outer, strategy.max_attempts)
        if self.accountant is None:
            log(INFO, "OFMTL record-level DP: at most %d releases per device", budget)
        self.resolve(budget, strategy.num_tasks)

    def mocha_settings(self) -> DPSettings:
        """The DP settings of a MOCHA (re)training: the run's clip and z (fixed)."""
        assert self.noise_multiplier is not None, "start() first"
        return dataclasses.replace(self.settings, noise_multiplier=self.noise_multiplier,
                                   epsilon=None)

    def add_training(self, counts: np.ndarray) -> None:
        """Add a MOCHA training's release counts (its tasks 0 .. len(counts) - 1)."""
        assert self.accountant is not None
        self.accountant.counts[:len(counts)] += np.asarray(counts, dtype=np.int64)
        log(INFO, "record-level DP: after MOCHA over %d tasks, largest epsilon %.4g at "
            "delta=%g", len(counts), self.accountant.epsilon(), self.settings.delta)

    def count_newcomer(self, task: int) -> None:
        """One release of newcomer ``task`` (a round trip sent)."""
        assert self.accountant is not None
        released = np.zeros(len(self.accountant.counts), dtype=bool)
        released[task] = True
        self.count(released)

    def newcomer_allowance(self, n: int, dim: int, lam: float, omega: float) -> float:
        """What the noise of one newcomer release may add to |lam omega w + lam c|
        (lam omega times the noise's high-probability norm)."""
        std = float(self.noise_multiplier or 0.0) * newcomer_sensitivity(
            self.clip, max(int(n), 1), lam, omega)
        return lam * omega * float(noise_norm_allowance(std, dim))


def enable_ofmtl_record_dp(strategy: Any, settings: DPSettings) -> Any:
    """``strategy`` (an :class:`~fmtl_flower.strategies.ofmtl.OFMTL`) with record-level DP
    on (module docstring); returns it.

    Raises
    ------
    ConfigError
        For another strategy, settings other than ``dp.mechanism=record``, or a run whose
        loss is not the hinge (the sensitivity of :mod:`fmtl_flower.core.ofmtl_privacy`
        rests on the hinge being 1-Lipschitz in the margin; :class:`~fmtl_flower.core.losses.
        Loss` states no Lipschitz constant to take instead).
    """
    from .ofmtl import OFMTL  # noqa: PLC0415 (ofmtl imports this module)

    if not isinstance(strategy, OFMTL):
        raise ConfigError(f"enable_ofmtl_record_dp takes an OFMTL strategy, got "
                          f"{type(strategy).__name__}")
    if not isinstance(settings, DPSettings) or settings.mechanism != "record":
        raise ConfigError(f"OFMTL supports dp.mechanism=record only (record-level DP on the "
                          f"device), got {getattr(settings, 'mechanism', settings)!r}")
    if strategy.settings.loss != "hinge":
        raise ConfigError(f"OFMTL's record-level DP is for the hinge loss only (its sensitivity "
                          f"2 C / (lam omega n) uses the hinge's Lipschitz constant 1); got "
                          f"mocha.loss={strategy.settings.loss!r}")
    if settings.epsilon is not None and math.isinf(settings.epsilon):
        log(INFO, "OFMTL record-level DP: dp.epsilon=inf, no noise (rows still clipped)")
    strategy.privacy = OfmtlRecordDP(settings)
    return strategy
