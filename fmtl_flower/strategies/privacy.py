"""Client-level differential privacy for FedEM's family (fedem, fedavg, fedprox, fedavg-ft,
pfedme; ``local`` releases nothing), with Flower's semantics.

Each round the server

1. clips each sampled device's update, the difference between the components it sent back
   and the ones it was sent (all M components together, one L2 norm), to norm ``clip`` C
   (a device that dropped counts as the zero update);
2. averages the clipped updates over the K devices *sampled* (a fixed denominator, so one
   device moves the mean by at most C / K);
3. adds Gaussian noise N(0, (z C / K)^2) to every coordinate of the mean, z being the noise
   multiplier.

With ``client-clip`` the train messages also carry ``dp-clip`` and each device clips its
own update before replying (Flower's ``DifferentialPrivacyClientSideFixedClipping`` with
``fixedclipping_mod``); the server clips again, which changes nothing for an honest device
and keeps the guarantee whatever a device sends. ``central`` is
exactly Flower's ``DifferentialPrivacyServerSideFixedClipping`` (``flwr.supercore.
differential_privacy``: ``compute_clip_model_update``, ``compute_stdv`` = z C / K) with the
uniform average its accountant requires. The noisy components are what every device
receives next; FedEM's mixture weights pi never leave the devices. The robust aggregation of
``robust`` mode and the n-train weights are not used: the clipped, uniform mean is the
aggregate (its clipping bounds what any one device can move, hostile or not).

Why not Flower's wrappers around these strategies: they assume a strategy whose model is the
``arrays`` that ``start`` passes back into ``configure_train``. FedEM keeps its components
as its own state (the wrapper's noisy ``ArrayRecord`` would be logged and dropped while the
devices received the noise-free components: no privacy at all, silently), its replies carry
``weights`` and ``responsibility`` beside ``components`` (the wrapper zips the reply's
arrays against the model's: ``zip() argument 2 is shorter than argument 1``), and Flower's
generic ``start`` skips what these strategies' ``start`` does (discovery, the run's length,
checkpoints). :func:`from_flower` turns a Flower fixed-clipping wrapper into this mechanism
with the same numbers.

Accounting (:class:`~fmtl_flower.core.privacy.GaussianAccountant`, RDP): each round that
aggregates is one Gaussian release of sensitivity C / K with noise z C / K. The devices are
sampled as a fixed-size subset without replacement (``fraction``), not by Poisson sampling,
so no amplification by sampling is claimed: the epsilon reported is that of the full-
participation Gaussian mechanism composed over the releases (valid, and conservative when
``fraction`` < 1). Every round record carries ``epsilon`` (at ``delta``), so ``final`` does;
a resumed run rebuilds the account from the checkpoint's records (``dp_noise_multiplier``
of each release).

The noise is drawn from the operating system's entropy, never from the run's ``seed`` (which
the devices are sent: noise they could regenerate protects nothing); ``noise_seed`` exists
for tests only.
"""

from __future__ import annotations

import math
import secrets
from logging import INFO
from typing import Any

import numpy as np
from flwr.supercore import log

from ..core.privacy import (
    CLIP_SLACK,
    GaussianAccountant,
    clip_update,
    noise_multiplier_for_epsilon,
)
from ..settings import DP_CLIENT_LEVEL_METHODS, ConfigError, DPSettings


class ClientLevelDP:
    """The server half of client-level DP for a FedEM-family strategy.

    Parameters
    ----------
    settings : DPSettings
        ``mechanism`` ``central`` or ``client-clip``, ``clip``, and ``noise_multiplier``
        or a target ``epsilon`` at ``delta`` for the run.
    noise_seed : int, optional
        Tests only: a seeded noise stream (anyone knowing it can remove the noise).
    """

    def __init__(self, settings: DPSettings, *, noise_seed: int | None = None) -> None:
        if not isinstance(settings, DPSettings) or settings.mechanism not in (
                "central", "client-clip"):
            raise ValueError("ClientLevelDP needs DPSettings with mechanism central or "
                             f"client-clip, got {settings!r}")
        self.settings = settings
        self.clip = float(settings.clip)
        self.noise_multiplier: float | None = settings.noise_multiplier
        self.noise_seed = noise_seed
        self._release: dict[str, Any] | None = None  # this round's, until its record

    def resolve_noise(self, num_rounds: int) -> float:
        """The noise multiplier: as given, or the smallest meeting the target epsilon over
        ``num_rounds`` releases (computed once)."""
        if self.noise_multiplier is None:
            eps = float(self.settings.epsilon)
            self.noise_multiplier = 0.0 if math.isinf(eps) else noise_multiplier_for_epsilon(
                eps, self.settings.delta, int(num_rounds))
            log(INFO, "client-level DP: noise multiplier %.4f for epsilon=%g at delta=%g "
                "over %d rounds", self.noise_multiplier, eps, self.settings.delta, num_rounds)
        return self.noise_multiplier

    def accountant(self, records: list[dict[str, Any]]) -> GaussianAccountant:
        """The account of the releases in ``records`` (each release's record holds its
        ``dp_noise_multiplier``): the records are the state, so a resumed run resumes it."""
        account = GaussianAccountant(delta=self.settings.delta)
        for record in records:
            z = record.get("dp_noise_multiplier")
            if z is not None:
                account.compose(float(z))
        return account

    def aggregate(self, current: np.ndarray, returned: list[np.ndarray], num_sampled: int,
                  records: list[dict[str, Any]], num_rounds: int) -> np.ndarray:
        """``current`` plus the noisy mean of the clipped updates ``returned - current`` over
        the ``num_sampled`` devices sampled (a dropped one adds 0), and the release
        accounted.

        Parameters
        ----------
        current : ndarray (M, P)
            The components every sampled device was sent.
        returned : list of ndarray (M, P)
            The accepted replies' components.
        num_sampled : int
            K, the devices sampled this round (>= len(returned)).
        records : list of dict
            The strategy's round records so far (the releases before this one).
        num_rounds : int
            The run's rounds (to calibrate a target epsilon).
        """
        z = self.resolve_noise(num_rounds)
        k = max(int(num_sampled), len(returned), 1)
        total = np.zeros_like(current)
        clipped = 0
        for theta in returned:
            update, norm = clip_update(np.asarray(theta) - current, self.clip)
            total += update
            clipped += norm > self.clip * (1 + CLIP_SLACK)
        std = z * self.clip / k
        noise = self._rng().normal(0.0, std, size=current.shape) if std > 0 else 0.0
        account = self.accountant(records)
        account.compose(z)
        self._release = {"epsilon": account.epsilon(), "dp_noise_multiplier": z,
                         "dp_noise_std": std, "dp_clipped": clipped}
        log(INFO, "client-level DP: %d/%d updates clipped to %g, noise std %.4g, "
            "epsilon=%.4g at delta=%g after %d releases", clipped, len(returned), self.clip,
            std, self._release["epsilon"], self.settings.delta, account.releases)
        return current + total / k + noise

    def fingerprint(self) -> list[Any]:
        """The settings a checkpoint must share to be resumed by this run (the account
        composes on the checkpoint's releases)."""
        s = self.settings
        return [s.mechanism, s.clip, s.noise_multiplier, s.epsilon, s.delta]

    def wire_config(self) -> dict[str, float]:
        """What the train messages add: ``dp-clip`` (the norm each device clips its own
        update to) with ``client-clip``; nothing with ``central``."""
        return {"dp-clip": self.clip} if self.settings.mechanism == "client-clip" else {}

    def record_fields(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The privacy keys of the round's record: this round's release, or (no release)
        the epsilon so far and ``dp_noise_multiplier`` None."""
        out, self._release = self._release, None
        if out is None:
            out = {"epsilon": self.accountant(records).epsilon(), "dp_noise_multiplier": None,
                   "dp_noise_std": None, "dp_clipped": None}
        return out

    def _rng(self) -> np.random.Generator:
        seed = secrets.randbits(128) if self.noise_seed is None else self.noise_seed
        if self.noise_seed is not None:
            self.noise_seed += 1  # a new stream per release
        return np.random.default_rng(seed)


def enable_client_dp(strategy: Any, settings: DPSettings | None = None, *,
                     noise_seed: int | None = None, **kwargs: Any) -> Any:
    """``strategy`` (a FedEM-family strategy) with client-level DP on; returns it.

    ``settings`` (or ``DPSettings`` keywords: ``mechanism="central", clip=1.0,
    noise_multiplier=1.1``); mechanism ``none`` leaves the strategy as it is.

    Raises
    ------
    ConfigError
        For ``record`` on anything but MOCHA's family (:func:`~.record_dp.enable_record_dp`);
        for a method whose shared models DP does not cover (clustered / ifca, cfl: their
        per-cluster averages have data-dependent counts), or invalid settings.
    """
    settings = DPSettings.resolve(settings, kwargs)
    if not settings.enabled:
        return strategy
    if settings.mechanism == "record":  # MOCHA's family, on the device
        from .record_dp import enable_record_dp  # noqa: PLC0415

        return enable_record_dp(strategy, settings)
    method = getattr(getattr(strategy, "settings", None), "method", None)  # built or not
    if not hasattr(strategy, "privacy") or method not in DP_CLIENT_LEVEL_METHODS + ("local",):
        raise ConfigError(f"dp.mechanism={settings.mechanism} covers "
                          f"{', '.join(DP_CLIENT_LEVEL_METHODS)} (and local, which releases "
                          f"nothing); got {type(strategy).__name__} method={method!r}")
    strategy.privacy = ClientLevelDP(settings, noise_seed=noise_seed)
    return strategy


def from_flower(wrapper: Any) -> Any:
    """The strategy inside Flower's ``DifferentialPrivacyServerSideFixedClipping`` /
    ``DifferentialPrivacyClientSideFixedClipping`` wrapper, with the same mechanism on
    (same noise multiplier and clipping norm; its ``num_sampled_clients`` is replaced by the
    strategy's own count of sampled devices each round). Adaptive clipping is not
    supported (a ValueError)."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    if isinstance(wrapper, DifferentialPrivacyServerSideFixedClipping):
        mechanism = "central"
    elif isinstance(wrapper, DifferentialPrivacyClientSideFixedClipping):
        mechanism = "client-clip"
    else:
        raise ValueError("from_flower takes Flower's DifferentialPrivacyServerSideFixedClipping"
                         " or DifferentialPrivacyClientSideFixedClipping wrapper (adaptive "
                         f"clipping is not supported), got {type(wrapper).__name__}")
    return enable_client_dp(wrapper.strategy, mechanism=mechanism,
                            noise_multiplier=float(wrapper.noise_multiplier),
                            clip=float(wrapper.clipping_norm))
