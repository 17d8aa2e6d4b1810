"""Record-level differential privacy for OFMTL: the server's half.

The devices do the mechanism (:mod:`fmtl_flower.core.ofmtl_privacy`): rows clipped to
``dp.clip`` C; in MOCHA's (re)trainings MOCHA's record-level DP as is
(:mod:`fmtl_flower.strategies.record_dp`, the same noise multiplier); in a newcomer's
exchange one separable round per round trip, released with Gaussian noise calibrated to
one record. The server

* fixes the noise multiplier z once, at the start: ``dp.noise-multiplier``, or the smallest
  whose :func:`~fmtl_flower.core.ofmtl_privacy.release_budget` releases (the most any
  device can make in the run) cost at most ``dp.epsilon`` at ``dp.delta``;
* counts every device's releases in one account (:class:`~fmtl_flower.core.record_dp.
  RecordAccountant`, MOCHA's): the MOCHA rounds of every (re)training (each MOCHA's own
  account, added when it ends) and each newcomer round trip (when sent);
* reports ``epsilon`` (the largest over the devices so far) and ``dp_releases_max`` in every
  record, and ``final["privacy"]["epsilon_per_task"]``;
* bounds a newcomer's reply by C (not the reported row norm) widened by the noise's
  high-probability norm, and drops the ``newcomer_gap`` (the device withholds it: an exact
  statistic of its records);
* keeps the account in checkpoints (a resumed run continues it).

What stays certified: nothing the server can check. The newcomer's reply w is its *noisy*
model (b~ - lam c) / (lam omega); the subproblem's duality gap is withheld. The pair the
device holds, (alpha, w_own = (b - lam c) / (lam omega)), is a consistent primal-dual pair
of its subproblem for the last (omega, c), but the device's separable steps were taken at
the noisy w_pub, so no gap of it is reported either. Test errors: the founding and retrained
devices evaluate the (noisy) column of W the server holds; a newcomer since the last
training evaluates its model without its own noise, w_own (post-processing on the device),
when the column the server sends is the one it released last (``docs/guides/privacy.md``).
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

    def newcomer_allowance(self, n: int, dim: int, lam: float, omega: float, steps: int,
                           releases: int) -> float:
        """What the noise of ``releases`` newcomer releases may add to |b~| (box bound of
        the sensitivity: it holds for every w_pub)."""
        std = float(self.noise_multiplier or 0.0) * newcomer_sensitivity(
            self.clip, max(int(n), 1), lam, omega, steps)
        return float(noise_norm_allowance(std, dim, releases))


def enable_ofmtl_record_dp(strategy: Any, settings: DPSettings) -> Any:
    """``strategy`` (an :class:`~fmtl_flower.strategies.ofmtl.OFMTL`) with record-level DP
    on (module docstring); returns it.

    Raises
    ------
    ConfigError
        For another strategy, or settings other than ``dp.mechanism=record``.
    """
    from .ofmtl import OFMTL  # noqa: PLC0415 (ofmtl imports this module)

    if not isinstance(strategy, OFMTL):
        raise ConfigError(f"enable_ofmtl_record_dp takes an OFMTL strategy, got "
                          f"{type(strategy).__name__}")
    if not isinstance(settings, DPSettings) or settings.mechanism != "record":
        raise ConfigError(f"OFMTL supports dp.mechanism=record only (record-level DP on the "
                          f"device), got {getattr(settings, 'mechanism', settings)!r}")
    if settings.epsilon is not None and math.isinf(settings.epsilon):
        log(INFO, "OFMTL record-level DP: dp.epsilon=inf, no noise (rows still clipped)")
    strategy.privacy = OfmtlRecordDP(settings)
    return strategy
