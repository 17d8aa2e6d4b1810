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
    AdaptiveClip,
    GaussianAccountant,
    adaptive_noise_params,
    clip_update,
    noise_multiplier_for_epsilon,
)
from ..settings import DP_CLIENT_LEVEL_METHODS, DP_FSVRG_METHODS, ConfigError, DPSettings


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
        self._charged = 0  # releases of an interrupted run, charged with the next release
        self._records: Any = lambda: []  # the strategy's records (bound by enable_client_dp)

    def current_clip(self, records: list[dict[str, Any]], stream: str | None = None) -> float:
        """The clip norm of ``stream``'s next release: ``dp.clip``, or with adaptive
        clipping the newest record's ``dp_clip_next`` (``dp_clip_next_<stream>`` for a
        named stream, :attr:`FSVRGDP.STREAMS`): the records are the state, so a resumed
        run resumes the clip."""
        if not self.settings.adaptive:
            return self.clip
        key = "dp_clip_next" if stream is None else f"dp_clip_next_{stream}"
        for record in reversed(records):
            if record.get(key) is not None:
                return float(record[key])
        return self.clip

    def _adaptive(self, clip: float, num_sampled: int) -> tuple[AdaptiveClip, float]:
        """The adaptive clip of one release and the update's noise multiplier (the pair
        costs :meth:`resolve_noise`'s z; :func:`~fmtl_flower.core.privacy.
        adaptive_noise_params`)."""
        s = self.settings
        try:
            count_std, z_update = adaptive_noise_params(
                float(self.noise_multiplier or 0.0), int(num_sampled), s.clipped_count_stddev)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        return AdaptiveClip(clip, s.target_quantile, s.clip_learning_rate, count_std), z_update

    def resolve_noise(self, num_releases: int) -> float:
        """The noise multiplier: as given, or the smallest meeting the target epsilon over
        ``num_releases`` releases (computed once)."""
        if self.noise_multiplier is None:
            eps = float(self.settings.epsilon)
            self.noise_multiplier = 0.0 if math.isinf(eps) else noise_multiplier_for_epsilon(
                eps, self.settings.delta, int(num_releases))
            log(INFO, "client-level DP: noise multiplier %.4f for epsilon=%g at delta=%g "
                "over %d releases", self.noise_multiplier, eps, self.settings.delta,
                num_releases)
        return self.noise_multiplier

    def accountant(self, records: list[dict[str, Any]]) -> GaussianAccountant:
        """The account of the releases in ``records`` (a record with releases holds their
        ``dp_noise_multiplier`` and, when more than one, their number ``dp_releases``):
        the records are the state, so a resumed run resumes it. With adaptive clipping a
        release and its noisy count are one release of noise multiplier z (Andrew et al.,
        Thm. 1; as Flower accounts them)."""
        account = GaussianAccountant(delta=self.settings.delta)
        for record in records:
            z = record.get("dp_noise_multiplier")
            if z is not None:
                account.compose(float(z), steps=int(record.get("dp_releases") or 1))
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
        clip = self.current_clip(records)
        adaptive, z_update = self._adaptive(clip, k) if self.settings.adaptive else (None, z)
        rng = self._rng()
        total = np.zeros_like(current)
        norms = []
        for theta in returned:
            update, norm = clip_update(np.asarray(theta) - current, clip)
            total += update
            norms.append(norm)
        clipped = sum(norm > clip * (1 + CLIP_SLACK) for norm in norms)
        std = z_update * clip / k
        noise = rng.normal(0.0, std, size=current.shape) if std > 0 else 0.0
        account = self.accountant(records)
        charged, self._charged = self._charged, 0
        account.compose(z, steps=1 + charged)
        self._release = {"epsilon": account.epsilon(), "dp_noise_multiplier": z,
                         "dp_noise_std": std, "dp_clipped": clipped}
        if charged:
            self._release.update(dp_releases=1 + charged, dp_charged_on_resume=charged)
        if adaptive is not None:  # the clip moves on the noisy count of updates that fit
            self._release["dp_clip"] = clip
            fits = adaptive.fits(norms, self.settings.mechanism == "client-clip")
            self._release["dp_unclipped_fraction"] = adaptive.update(fits, k, rng)
            self._release["dp_clip_next"] = adaptive.clip
        log(INFO, "client-level DP: %d/%d updates clipped to %g, noise std %.4g, "
            "epsilon=%.4g at delta=%g after %d releases", clipped, len(returned), clip,
            std, self._release["epsilon"], self.settings.delta, account.releases)
        return current + total / k + noise

    def fingerprint(self) -> list[Any]:
        """The settings a checkpoint must share to be resumed by this run (the account
        composes on the checkpoint's releases)."""
        s = self.settings
        out = [s.mechanism, s.clip, s.noise_multiplier, s.epsilon, s.delta]
        if s.adaptive:
            out += [s.target_quantile, s.clip_learning_rate, s.clipped_count_stddev]
        return out + ([s.weighting] if s.weighting != "uniform" else [])

    def wire_config(self) -> dict[str, float]:
        """What the train messages add: ``dp-clip`` (the norm each device clips its own
        update to: the current one with adaptive clipping) with ``client-clip``; nothing
        with ``central``."""
        if self.settings.mechanism != "client-clip":
            return {}
        return {"dp-clip": self.current_clip(self._records())}

    def charge_after_checkpoint(self, releases: int, num_releases: int | None = None) -> None:
        """Account ``releases`` releases a resumed run cannot see: those the interrupted run
        may have made after the checkpoint it resumes from (a round's noisy aggregate goes
        out in its evaluate messages and the next round's train messages before the next
        checkpoint is written; the devices may hold them). The server cannot tell how far
        the interrupted run got, so the caller gives an upper bound (``checkpoint-every``
        rounds); they are composed with the next release, whose record says
        ``dp_releases`` and ``dp_charged_on_resume``. ``num_releases`` is unused here
        (:class:`FSVRGDP` calibrates with it)."""
        if releases > 0:
            self._charged += int(releases)
            log(INFO, "client-level DP: %d releases after the checkpoint charged on resume",
                releases)

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


class FSVRGDP(ClientLevelDP):
    """The server half of client-level DP ``central`` for the FSVRG family (fsvrg-naive,
    dane, gd): every release a device's reply takes part in, clipped and noised.

    The releases (each a Gaussian release of noise multiplier z, accounted one by one):

    * ``gradient`` (every round, every method): device k's mean row gradient
      ``grad-sum_k / n_k`` at the ``w_t`` it was sent is clipped to L2 norm C. With
      ``weighting`` uniform (the default, Flower's) the server averages the clipped means
      over the K devices (a silent one adds 0) and adds N(0, (z C / K)^2): ``g`` is then
      the gradient of the devices' average loss ``(1/K) sum_k f_k``. With ``rows`` it
      weights them by ``n_k / n`` as the method does (``n`` the federation's, whoever
      replied: a fixed denominator) and adds N(0, (z C max_k n_k / n)^2), z times what one
      device can move ``g``; more noise when the devices' sizes differ, but a clip that
      never binds and z = 0 leave the run exactly (bit for bit) as without DP.
    * ``model`` (every round, fsvrg-naive and dane): device k's local model relative to
      the model it received, ``w_k - w_t``, clipped to C; the server averages over the K
      devices (a silent one adds ``w_t``, the zero update) and adds N(0, (z C / K)^2):
      exactly Flower's ``DifferentialPrivacyServerSideFixedClipping``.
    * ``gram`` (gd without a ``step``, once per power iteration in round 1's setup):
      ``gram-v_k / n_k`` clipped to C, weighted and noised as the gradient (at most
      ``GD_POWER_MAX_ITER`` releases; the stopping rule reads only released values).

    ``n_k`` are the row counts the federation weights devices by (discovery's
    ``n-train``, capped in robust mode): they are no secret of this mechanism (discovery
    sends them in the clear, as Flower's ``num-examples``); what the mechanism protects is
    what the rows say. With ``adaptive`` each stream has its own clip,
    moved after each of its releases (:meth:`ClientLevelDP.current_clip`).
    """

    STREAMS = ("gradient", "model", "gram")

    def __init__(self, settings: DPSettings, *, noise_seed: int | None = None) -> None:
        super().__init__(settings, noise_seed=noise_seed)
        self._pending: dict[str, Any] = {}

    def gradient_sum(self, grad_sums: list[np.ndarray], n: list[int], n_all: np.ndarray,
                     records: list[dict[str, Any]], num_releases: int,
                     stream: str = "gradient") -> np.ndarray:
        """The released sum of the replies' ``grad_sums`` (devices with ``n`` rows; the
        federation's row counts ``n_all``, whose total the caller divides by): each mean
        ``grad_sums[k] / n[k]`` clipped to the stream's clip C and weighted by ``n[k]``
        (``weighting`` rows: the array itself when it fits) or by ``sum(n_all) / K``
        (uniform: each device 1/K of the mean), in the order given, plus N(0, (z C
        w_max)^2) per coordinate (``w_max`` the largest weight); one release of
        ``stream`` accounted."""
        k = len(n_all)
        uniform = self.settings.weighting == "uniform"
        weights = [float(n_all.sum()) / k if uniform else float(m) for m in n]
        weight_max = float(n_all.sum()) / k if uniform else float(n_all.max())
        norms = [float(np.linalg.norm(g)) / max(int(m), 1)
                 for g, m in zip(grad_sums, n, strict=True)]
        clip_scales, std = self._one_release(stream, norms, k, weight_max, records,
                                             num_releases)
        total = np.zeros(grad_sums[0].shape if grad_sums else 0)
        for g, m, weight, clip_scale in zip(grad_sums, n, weights, clip_scales, strict=True):
            scale = clip_scale * (weight / max(int(m), 1)) if weight != m else clip_scale
            total += g if scale == 1.0 else g * scale
        return self.noisy(total, std)

    def local_models(self, w: np.ndarray, models: list[np.ndarray], num_sampled: int,
                     records: list[dict[str, Any]], num_releases: int
                     ) -> tuple[list[np.ndarray], float]:
        """The local models with ``w_k - w`` clipped to C (the model itself when it fits),
        then ``w`` for every silent device of the ``num_sampled``, and the std z C / K of
        the noise to add to their mean (:meth:`noisy`); one ``model`` release accounted."""
        norms = [float(np.linalg.norm(m - w)) for m in models]
        k = max(int(num_sampled), len(models), 1)
        scales, std = self._one_release("model", norms, k, 1.0 / k, records, num_releases)
        out = [m if scale == 1.0 else w + (m - w) * scale
               for m, scale in zip(models, scales, strict=True)]
        return out + [w.copy() for _ in range(k - len(models))], std

    def noisy(self, value: np.ndarray, std: float) -> np.ndarray:
        """``value`` plus N(0, std^2) per coordinate (``value`` itself when std is 0)."""
        return value + self._rng().normal(0.0, std, size=value.shape) if std > 0 else value

    def _one_release(self, stream: str, norms: list[float], num_sampled: int,
                     weight_max: float,
                 records: list[dict[str, Any]], num_releases: int) -> tuple[list[float], float]:
        """One release of ``stream``: each update's scale ``min(1, C / norm)``, the noise
        std ``z_update C weight_max`` (``weight_max``: the largest weight of one device's
        update in the released sum), the clip moved with adaptive clipping, and the
        release added to the round's pending record fields."""
        z = self.resolve_noise(num_releases)
        clip = self.current_clip([*records, self._pending], stream)
        adaptive, z_update = self._adaptive(clip, num_sampled) if self.settings.adaptive \
            else (None, z)
        scales = [1.0 if norm <= clip else clip / norm for norm in norms]
        std = z_update * clip * weight_max
        p = self._pending
        p["dp_noise_multiplier"] = z
        p["dp_releases"] = p.get("dp_releases", 0) + 1
        p["dp_clipped"] = p.get("dp_clipped", 0) + sum(
            norm > clip * (1 + CLIP_SLACK) for norm in norms)
        p[f"dp_clip_{stream}"] = clip
        p[f"dp_noise_std_{stream}"] = std
        if adaptive is not None:
            p[f"dp_unclipped_fraction_{stream}"] = adaptive.update(
                adaptive.fits(norms), num_sampled, self._rng())
            p[f"dp_clip_next_{stream}"] = adaptive.clip
        log(INFO, "client-level DP (%s): %d/%d clipped to %g, noise std %.4g", stream,
            sum(norm > clip for norm in norms), len(norms), clip, std)
        return scales, std

    def charge_after_checkpoint(self, releases: int, num_releases: int) -> None:
        """Account ``releases`` releases a resumed run cannot see: those the interrupted
        run made after the checkpoint it resumes from (its records died with it; the
        devices may have received them, e.g. a round's noisy gradient in its ``train``
        messages). The caller gives an upper bound (the server cannot tell how far the
        interrupted run got); they go into the next record's ``dp_releases`` and
        ``dp_charged_on_resume``."""
        if releases > 0:
            p = self._pending
            p["dp_noise_multiplier"] = self.resolve_noise(num_releases)
            p["dp_releases"] = p.get("dp_releases", 0) + int(releases)
            p["dp_charged_on_resume"] = int(releases)
            log(INFO, "client-level DP: %d releases after the checkpoint charged on resume",
                releases)

    def record_fields(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The privacy keys of a new record: the releases since the previous record
        (``dp_releases`` of noise multiplier ``dp_noise_multiplier``, ``dp_clipped``
        updates clipped, each stream's clip and noise std) and ``epsilon`` after them."""
        out, self._pending = self._pending, {}
        if not out:
            out = {"dp_noise_multiplier": None, "dp_releases": 0, "dp_clipped": None}
        account = self.accountant([*records, out])
        out["epsilon"] = account.epsilon()
        log(INFO, "client-level DP: epsilon=%.4g at delta=%g after %d releases",
            out["epsilon"], self.settings.delta, account.releases)
        return out

    def wire_config(self) -> dict[str, float]:
        """Nothing: only ``central`` (the devices do not clip their own replies)."""
        return {}


#: What client-level DP cannot make private in the FSVRG family, and why.
FSVRG_REFUSED = {
    "fsvrg": "its setup releases every device's feature counts exactly (the server's "
             "statistics phi and A, which it broadcasts every round, are built from them), "
             "and its aggregate weights updates by those statistics; no private release of "
             "them is built. Use fsvrg-naive, dane or gd",
    "cocoa-plus": "w must stay w(alpha) for the devices' dual variables: server-side "
                  "clipping would break it and the devices do not clip their own d-w yet. "
                  "Use fsvrg-naive, dane or gd",
}


def _enable_fsvrg_dp(strategy: Any, settings: DPSettings, noise_seed: int | None) -> Any:
    """:func:`enable_client_dp` for an :class:`~fmtl_flower.strategies.fsvrg.FSVRG`."""
    method = strategy.settings.method
    if method in FSVRG_REFUSED:
        raise ConfigError(f"dp.mechanism={settings.mechanism} cannot make {method} private "
                          f"honestly: {FSVRG_REFUSED[method]}")
    if method not in DP_FSVRG_METHODS:
        raise ConfigError(f"dp.mechanism={settings.mechanism} covers the FSVRG family's "
                          f"{', '.join(DP_FSVRG_METHODS)}; got method={method!r}")
    if settings.mechanism != "central":
        raise ConfigError(f"dp.mechanism={settings.mechanism} for {method}: the FSVRG family's "
                          "devices do not clip their own replies; use dp.mechanism=central "
                          "(the server clips each reply: the same guarantee, Flower's "
                          "server-side clipping)")
    privacy = FSVRGDP(settings, noise_seed=noise_seed)
    num_tasks = getattr(strategy, "num_tasks", None)
    if settings.adaptive and settings.noise_multiplier is not None and num_tasks:
        privacy._adaptive(float(settings.clip), int(num_tasks))  # refuse before the run
    strategy.privacy = privacy
    return strategy


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
    from .fsvrg import FSVRG  # noqa: PLC0415 (fsvrg imports this module's users)

    if isinstance(strategy, FSVRG):
        return _enable_fsvrg_dp(strategy, settings, noise_seed)
    method = getattr(getattr(strategy, "settings", None), "method", None)  # built or not
    if settings.weighting != "uniform":
        raise ConfigError(f"dp.weighting={settings.weighting} is the FSVRG family's; FedEM's "
                          "family averages the clipped updates uniformly (dp.weighting=uniform)")
    if not hasattr(strategy, "privacy") or method not in DP_CLIENT_LEVEL_METHODS + ("local",):
        raise ConfigError(f"dp.mechanism={settings.mechanism} covers "
                          f"{', '.join(DP_CLIENT_LEVEL_METHODS)} (and local, which releases "
                          f"nothing); got {type(strategy).__name__} method={method!r}")
    strategy.privacy = ClientLevelDP(settings, noise_seed=noise_seed)
    strategy.privacy._records = lambda: getattr(strategy, "records", [])
    return strategy


def from_flower(wrapper: Any) -> Any:
    """The strategy inside one of Flower's DP wrappers, with the same mechanism on.

    ``DifferentialPrivacyServerSideFixedClipping`` -> ``central``,
    ``...ClientSideFixedClipping`` -> ``client-clip`` (same noise multiplier and clip);
    ``...ServerSideAdaptiveClipping`` / ``...ClientSideAdaptiveClipping`` -> the same with
    ``adaptive``: initial clip, ``target_clipped_quantile`` as ``target_quantile``,
    ``clip_norm_lr`` as ``clip_learning_rate``, ``clipped_count_stddev``, and the noise
    multiplier z the wrapper was given (it keeps the update's, ``(z^-2 -
    (2 clipped_count_stddev)^-2)^(-1/2)``, from which z is recovered). The wrapper's
    ``num_sampled_clients`` is replaced by the strategy's own count of sampled devices
    each round. Flower's own adaptive loop counts the *clipped* updates where Andrew et
    al. count those that fit, so its clip runs away from the quantile (to 0 when most
    updates are clipped); the converted strategy follows the paper.

    Raises
    ------
    ValueError
        For anything but these four wrappers.
    ConfigError
        For a strategy or combination :func:`enable_client_dp` refuses.
    """
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    server_side = (DifferentialPrivacyServerSideFixedClipping,
                   DifferentialPrivacyServerSideAdaptiveClipping)
    adaptive = (DifferentialPrivacyServerSideAdaptiveClipping,
                DifferentialPrivacyClientSideAdaptiveClipping)
    if not isinstance(wrapper, server_side + adaptive
                      + (DifferentialPrivacyClientSideFixedClipping,)):
        raise ValueError("from_flower takes one of Flower's DifferentialPrivacy{Server,Client}"
                         "Side{Fixed,Adaptive}Clipping wrappers, got "
                         f"{type(wrapper).__name__}")
    mechanism = "central" if isinstance(wrapper, server_side) else "client-clip"
    if not isinstance(wrapper, adaptive):
        return enable_client_dp(wrapper.strategy, mechanism=mechanism,
                                noise_multiplier=float(wrapper.noise_multiplier),
                                clip=float(wrapper.clipping_norm))
    count_std = float(wrapper.clipped_count_stddev)
    z_update = float(wrapper.noise_multiplier)
    z = 0.0 if z_update == 0 else (z_update ** -2 + (2 * count_std) ** -2) ** -0.5
    return enable_client_dp(wrapper.strategy, mechanism=mechanism, noise_multiplier=z,
                            clip=float(wrapper.clipping_norm), adaptive=True,
                            target_quantile=float(wrapper.target_clipped_quantile),
                            clip_learning_rate=float(wrapper.clip_norm_lr),
                            clipped_count_stddev=count_std)
