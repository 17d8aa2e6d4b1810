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

Accounting (:class:`~fmtl_flower.core.privacy.GaussianAccountant`, RDP), by ``dp.sampling``:

``fixed`` (the default). Each round that aggregates is one Gaussian release of sensitivity
C / K with noise z C / K. The devices are sampled as a fixed-size subset without
replacement (``fraction``), drawn from the run's ``seed`` (which the devices are sent), so
no amplification by sampling is claimed: the epsilon reported is that of the full-
participation Gaussian mechanism composed over the releases (conservative when
``fraction`` < 1). Strictly, the neighbouring federations of this guarantee keep the same
devices and differ in one device's update being replaced by the zero update (what a device
that drops sends): the sample, drawn before any data is seen, is then the same in both,
and each sample's release is a Gaussian mechanism of sensitivity C / K.

``poisson`` (amplification by sampling, DP-FedAvg of McMahan et al. 2018, *Learning
differentially private recurrent language models*). Each of the N training devices (the
strategy's ``num_tasks`` minus the held-out ones: a fixed, public number) joins the round
independently with probability q = the train fraction, drawn from the server's operating-
system entropy (never the ``seed``: a sample the devices or an observer could predict
amplifies nothing); a device not online, not sampled or silent adds the zero update. The
aggregate is the sum of the clipped updates over the **fixed** q N, not over the sample's
size (the fixed-denominator estimator: the sample's size is random and depends on who is in
the federation), plus N(0, (z C / (q N))^2). A round that samples nobody, or hears from
nobody, still releases (the noise around the current model): whether anyone took part must
not show. Each round is one ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` of
dp-accounting's RDP accountant, for the add/remove-one-device adjacency (a federation with
one device more or less; N and q N are public constants). It holds while the sample stays
secret: the server must not publish which devices trained (the records' ``num_sampled`` /
``num_replies`` are the server's own), and each device knows only whether it was sampled.
(Against an adversary who sees the sample, the unamplified epsilon of ``fixed`` at the same
z still holds: given the sample, each round is a Gaussian release of sensitivity C / (q N)
with noise z C / (q N).) ``min_train_nodes`` (which would change the sample's law) is refused.

Why Flower's fixed-size sample gets no amplified account: dp-accounting's
``SampledWithoutReplacementDpEvent`` (Wang, Balle and Kasiviswanathan 2019, Thm 27) holds
for the replace-one adjacency (N public, one device's data swapped for another's), under
which one device moves the sum of clipped updates by up to 2 C: the event must be composed
with noise multiplier z / 2, and at z = 1 over 50 rounds it gives epsilon 47 at q = 0.1
and 129 at q = 0.3 against 57 without amplification (add/remove) and 5.9 with Poisson
sampling (``benchmarks/dp_sampling_epsilon.py``): nothing gained, for a weaker adjacency and
a sample that would have to leave the seeded stream too. So it is not offered.

The unit of privacy is the **task** (the device a task id names), in both modes: a packed
node hosting several tasks has each task sampled, clipped and accounted on its own; if one
owner's data spans k of them, that owner's guarantee is k-fold group privacy, which is not
computed (no node-level mode is offered).

Every round record carries ``epsilon`` (at ``delta``), so ``final`` does; with ``poisson``
also ``dp_sampling_rate`` (q) and ``dp_expected_sampled`` (q N). A resumed run rebuilds the
account from the checkpoint's records (``dp_noise_multiplier`` and ``dp_sampling_rate`` of
each release; a checkpoint resumes only with the same ``dp.sampling``).

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

from ..core.fsvrg import FeatureStats
from ..core.privacy import (
    CLIP_SLACK,
    COUNT_STDDEV_PER_DEVICE,
    AdaptiveClip,
    GaussianAccountant,
    adaptive_noise_params,
    check_sampling_rate,
    clip_update,
    geometric_clip_update,
    noise_multiplier_for_epsilon,
)
from ..settings import (
    DP_CLIENT_LEVEL_METHODS,
    DP_FSVRG_METHODS,
    DP_STATS_CLIP,
    ConfigError,
    DPSettings,
)

#: The default clip of fsvrg's ``stats`` release (:meth:`FSVRGDP.feature_stats`,
#: ``dp.stats-clip``): the L2 norm of a device's ``[p_k; r_k phi_k]``, about the square root
#: of the number of features it has (``sparse-federated``, seed 0, K = 1000: median 17,
#: 90th percentile 28; looked at once, on seed 0, before any run with noise).
STATS_CLIP = DP_STATS_CLIP


class ClientLevelDP:
    """The server half of client-level DP for a FedEM-family strategy.

    Parameters
    ----------
    settings : DPSettings
        ``mechanism`` ``central`` or ``client-clip``, ``clip``, and ``noise_multiplier``
        or a target ``epsilon`` at ``delta`` for the run; ``sampling`` ``fixed`` or
        ``poisson`` (the module docstring).
    noise_seed : int, optional
        Tests only: a seeded noise stream (anyone knowing it can remove the noise, and,
        with ``poisson``, predict the sample).
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
        #: Record fields not yet in a record: :meth:`charge_after_checkpoint`'s charge
        #: (``dp_charged_on_resume``, folded into the next release) and, for
        #: :class:`FSVRGDP`, the releases since the previous record.
        self._pending: dict[str, Any] = {}
        self._records: Any = lambda: []  # the strategy's records (bound by enable_client_dp)
        self.sampling_rate = 1.0  # q of the rounds' Poisson sample (poisson; 1: fixed)
        self.expected_count: float | None = None  # q N, the fixed denominator (poisson)
        self._described = False

    @property
    def poisson(self) -> bool:
        """Whether the devices are Poisson-sampled (``dp.sampling=poisson``)."""
        return self.settings.sampling == "poisson"

    def sample(self, eligible: Any, rate: float, population: int,
               min_train_nodes: int = 0) -> list[int]:
        """``dp.sampling=poisson``: the round's devices, each of ``eligible`` (task ids)
        independently with probability ``rate`` (from the server's secret randomness,
        :meth:`_rng`), sorted; the release divides by ``rate * population``.

        Parameters
        ----------
        eligible : iterable of int
            The training tasks online (a training task not online is never sampled: it
            adds the zero update, as a silent one does).
        rate : float
            q in (0, 1], the train fraction.
        population : int
            N >= 1, the federation's training tasks (a public constant of the run).
        min_train_nodes : int
            The strategy's; must be 0 (raising the sample's size breaks its law).

        Raises
        ------
        ConfigError
            For ``min_train_nodes`` > 0, a rate outside (0, 1] or ``population`` < 1.
        """
        if min_train_nodes:
            raise ConfigError(f"dp.sampling=poisson samples each device independently; "
                              f"min_train_nodes={min_train_nodes} would change the sample's "
                              "law (and void its amplification): leave it 0")
        try:
            q = check_sampling_rate(float(rate))
        except ValueError as err:
            raise ConfigError(f"dp.sampling=poisson: the train fraction is q, {err}") from err
        if int(population) < 1:
            raise ConfigError(f"dp.sampling=poisson needs training devices, got {population}")
        self.sampling_rate, self.expected_count = q, q * int(population)
        ordered = np.array(sorted(int(t) for t in eligible), dtype=np.int64)
        included = self._rng().random(ordered.size) < q
        return [int(t) for t in ordered[included]]

    def describe(self) -> str:
        """One line saying which sampling and accounting the releases use."""
        if self.poisson:
            return (f"client-level DP: Poisson sampling, each training device joins a round "
                    f"with probability q={self.sampling_rate:g} (server's secret randomness); "
                    f"clipped updates summed over the fixed qN={self.expected_count:g}; "
                    "accounting: RDP of PoissonSampledDpEvent(q, Gaussian(z)) per round, "
                    "add/remove-one-device adjacency (amplification by sampling)")
        return ("client-level DP: the strategy's fixed-size sample, clipped updates averaged "
                "over the K sampled; accounting: RDP of Gaussian(z) per release, no "
                "amplification by sampling")
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
        count_std = s.clipped_count_stddev
        if self.poisson and self.expected_count is not None:  # a data-independent default
            num_sampled = max(1, math.ceil(self.expected_count))
            if count_std is None:
                count_std = self.expected_count * COUNT_STDDEV_PER_DEVICE
        try:
            count_std, z_update = adaptive_noise_params(
                float(self.noise_multiplier or 0.0), int(num_sampled), count_std)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        return AdaptiveClip(clip, s.target_quantile, s.clip_learning_rate, count_std), z_update

    def resolve_noise(self, num_releases: int) -> float:
        """The noise multiplier: as given, or the smallest meeting the target epsilon over
        ``num_releases`` releases (computed once)."""
        if self.noise_multiplier is None:
            eps = float(self.settings.epsilon)
            self.noise_multiplier = 0.0 if math.isinf(eps) else noise_multiplier_for_epsilon(
                eps, self.settings.delta, int(num_releases),
                sampling_rate=self.sampling_rate if self.poisson else 1.0)
            log(INFO, "client-level DP: noise multiplier %.4f for epsilon=%g at delta=%g "
                "over %d releases%s", self.noise_multiplier, eps, self.settings.delta,
                num_releases, f" Poisson-sampled at q={self.sampling_rate:g}"
                if self.poisson else "")
        return self.noise_multiplier

    def accountant(self, records: list[dict[str, Any]]) -> GaussianAccountant:
        """The account of the releases in ``records`` (a record with releases holds their
        ``dp_noise_multiplier``, with ``poisson`` their ``dp_sampling_rate`` (absent: 1,
        no amplification) and, when more than one, their number ``dp_releases``): the
        records are the state, so a resumed run resumes it. With adaptive clipping a
        release and its noisy count are one release of noise multiplier z (Andrew et al.,
        Thm. 1; as Flower accounts them)."""
        account = GaussianAccountant(delta=self.settings.delta)
        for record in records:
            z = record.get("dp_noise_multiplier")
            if z is not None:
                account.compose(float(z), float(record.get("dp_sampling_rate") or 1.0),
                                steps=int(record.get("dp_releases") or 1))
        return account

    def aggregate(self, current: np.ndarray, returned: list[np.ndarray], num_sampled: int,
                  records: list[dict[str, Any]], num_rounds: int) -> np.ndarray:
        """``current`` plus the noisy mean of the clipped updates ``returned - current`` over
        the ``num_sampled`` devices sampled (a dropped one adds 0), and the release
        accounted. With ``poisson`` the sum is divided by the fixed q N of the round's
        :meth:`sample` instead, the noise std is z C / (q N) and the release is accounted
        as Poisson-subsampled at q (``returned`` may be empty: the release is then the
        noise around ``current``).

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
        if self.poisson and self.expected_count is None:
            raise RuntimeError("dp.sampling=poisson: sample() draws the round's devices "
                               "before its release")
        if not self._described:
            self._described = True
            log(INFO, "%s", self.describe())
        z = self.resolve_noise(num_rounds)
        k = max(int(num_sampled), len(returned), 1)
        denominator = self.expected_count if self.poisson else k
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
        std = z_update * clip / denominator
        noise = rng.normal(0.0, std, size=current.shape) if std > 0 else 0.0
        account = self.accountant(records)
        charged = self._take_charge()
        account.compose(z, self.sampling_rate if self.poisson else 1.0, steps=1 + charged)
        self._release = {"epsilon": account.epsilon(), "dp_noise_multiplier": z,
                         "dp_noise_std": std, "dp_clipped": clipped}
        if self.poisson:
            self._release.update(dp_sampling_rate=self.sampling_rate,
                                 dp_expected_sampled=self.expected_count)
        if charged:
            self._release.update(dp_releases=1 + charged, dp_charged_on_resume=charged)
        if adaptive is not None:  # the clip moves on the noisy count of updates that fit
            self._release["dp_clip"] = clip
            fits = adaptive.fits(norms, self.settings.mechanism == "client-clip")
            self._release["dp_unclipped_fraction"] = (
                self._poisson_unclipped_fraction(adaptive, fits, k, rng) if self.poisson
                else adaptive.update(fits, k, rng))
            self._release["dp_clip_next"] = adaptive.clip
        log(INFO, "client-level DP: %d/%d updates clipped to %g, noise std %.4g, "
            "epsilon=%.4g at delta=%g after %d releases", clipped, len(returned), clip,
            std, self._release["epsilon"], self.settings.delta, account.releases)
        return current + total / denominator + noise

    def _poisson_unclipped_fraction(self, adaptive: AdaptiveClip, fits: np.ndarray,
                                    num_sampled: int, rng: np.random.Generator) -> float:
        """``poisson``: Andrew et al.'s noisy fraction of updates that fit, with the fixed
        denominator q N, and the clip moved by it. The released count is centred,
        ``sum over the sampled of (b_i - 1/2) + N(0, sigma_b^2)`` (b_i = 1 for an update
        that fits; a silent device's zero update fits): its sensitivity is 1/2 whatever
        the sample's size, which stays secret (the plain count, or the centred one plus
        |S| / 2, would reveal it), and over the sample its mean is q sum_i (b_i - 1/2),
        so ``1/2 + (centred count) / (q N)`` estimates the federation's fraction without
        bias."""
        fits = np.asarray(fits, dtype=bool)
        sampled = max(int(num_sampled), fits.size)
        unclipped = int(np.count_nonzero(fits)) + sampled - fits.size
        noise = rng.normal(0.0, adaptive.count_stddev) if adaptive.count_stddev > 0 else 0.0
        fraction = 0.5 + (unclipped - 0.5 * sampled + noise) / float(self.expected_count)
        adaptive.clip = geometric_clip_update(adaptive.clip, fraction,
                                              adaptive.target_quantile,
                                              adaptive.learning_rate)
        return float(fraction)

    def fingerprint(self) -> list[Any]:
        """The settings a checkpoint must share to be resumed by this run (the account
        composes on the checkpoint's releases)."""
        s = self.settings
        out = [s.mechanism, s.clip, s.noise_multiplier, s.epsilon, s.delta]
        if s.adaptive:
            out += [s.target_quantile, s.clip_learning_rate, s.clipped_count_stddev]
        out += [s.sampling] if s.sampling != "fixed" else []  # fixed: as before the key
        return out + ([s.weighting] if s.weighting != "uniform" else [])

    def wire_config(self) -> dict[str, float]:
        """What the train messages add: ``dp-clip`` (the norm each device clips its own
        update to: the current one with adaptive clipping) with ``client-clip``; nothing
        with ``central``."""
        if self.settings.mechanism != "client-clip":
            return {}
        return {"dp-clip": self.current_clip(self._records())}

    def charge_after_checkpoint(self, releases: int) -> None:
        """Account ``releases`` releases a resumed run cannot see: those the interrupted run
        may have made after the checkpoint it resumes from (a round's noisy aggregate goes
        out in its evaluate messages and the next round's train messages before the next
        checkpoint is written; the devices may hold them). The server cannot tell how far
        the interrupted run got, so the caller gives an upper bound (``checkpoint-every``
        rounds times the releases of a round). They are composed with the next release,
        whose record says ``dp_releases`` and ``dp_charged_on_resume`` (the one mechanism
        of both classes: a pending charge, :meth:`_take_charge`)."""
        if releases > 0:
            self._pending["dp_charged_on_resume"] = \
                int(self._pending.get("dp_charged_on_resume", 0)) + int(releases)
            log(INFO, "client-level DP: %d releases after the checkpoint charged on resume",
                releases)

    def _take_charge(self) -> int:
        """The pending charge of :meth:`charge_after_checkpoint` (0: none), now cleared."""
        return int(self._pending.pop("dp_charged_on_resume", 0))

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
    """The server half of client-level DP for the FSVRG family (``central`` for fsvrg,
    fsvrg-naive, dane, gd; ``client-clip`` for cocoa-plus): every release a device's reply
    takes part in, clipped and noised.

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
    * ``stats`` (fsvrg, once, in round 1's setup: :meth:`feature_stats`): device k's
      presence vector ``p_k = [n_k^j > 0]`` and frequencies ``phi_k = n_k^j / n_k``, one
      vector ``[p_k; r_k phi_k]`` (``r_k``: 1 uniform, ``n_k / max_k n_k`` rows) clipped to
      :attr:`stats_clip` and summed, plus N(0, (z stats_clip)^2) per coordinate: the
      server's ``omega`` (devices with feature j) and ``phi`` are its halves (``phi``
      divided by the weights), clamped to ``[floor, K]`` and ``[0, 1]`` (``floor``:
      ``max(1, z stats_clip)`` when noised, so ``a = K / omega <= K / floor``). ``A`` and
      the ``phi`` broadcast every round are post-processing of this one release.
    * ``model`` for fsvrg (every round: :meth:`mean_update`): ``w_k - w_t`` clipped to C,
      weighted (uniform 1/K, rows ``n_k / n``), plus N(0, (z C w_max)^2); the server's
      ``w_t + A (...)`` is post-processing of it.
    * ``d_w`` (cocoa-plus, every round, ``client-clip``: :meth:`dual_step_sum`): each
      device scales its dual step so that ``|d-w_k| <= C`` (``dp-clip`` in the train
      messages), the server clips again (a no-op for an honest device) and adds
      N(0, (z C)^2) to the sum (CoCoA+ adds the ``d_w_k``: sensitivity C).

    ``n_k`` are the row counts the federation weights devices by (discovery's
    ``n-train``, capped in robust mode): they are no secret of this mechanism (discovery
    sends them in the clear, as Flower's ``num-examples``); what the mechanism protects is
    what the rows say. With ``adaptive`` each stream has its own clip,
    moved after each of its releases (:meth:`ClientLevelDP.current_clip`).
    """

    STREAMS = ("gradient", "model", "gram", "stats", "d_w")

    def __init__(self, settings: DPSettings, *, noise_seed: int | None = None) -> None:
        super().__init__(settings, noise_seed=noise_seed)
        self.stats_clip = float(settings.stats_clip)  # checked by DPSettings

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

    def mean_update(self, w: np.ndarray, models: list[np.ndarray], n: list[int],
                    n_all: np.ndarray, records: list[dict[str, Any]], num_releases: int
                    ) -> np.ndarray:
        """fsvrg's ``model`` release: ``sum_k weight_k clip(w_k - w) + noise``, the
        weights 1/K (uniform) or ``n_k / n`` (rows; ``n`` the federation's, a fixed
        denominator), the noise N(0, (z C w_max)^2) per coordinate (``w_max`` 1/K or
        ``max_k n_k / n``). The caller's ``w + a * mean_update`` is post-processing; with a
        clip no update reaches and z = 0 it is :func:`~fmtl_flower.core.fsvrg.
        fsvrg_aggregate` bit for bit (rows)."""
        k = len(n_all)
        uniform = self.settings.weighting == "uniform"
        sizes = [1 if uniform else int(m) for m in n]
        denominator = k if uniform else int(n_all.sum())
        weight_max = 1.0 / k if uniform else float(n_all.max()) / denominator
        norms = [float(np.linalg.norm(m - w)) for m in models]
        scales, std = self._one_release("model", norms, k, weight_max, records, num_releases)
        total = np.zeros_like(w)
        for model, size, scale in zip(models, sizes, scales, strict=True):
            total += size * ((model - w) if scale == 1.0 else (model - w) * scale)
        return self.noisy(total / denominator, std)

    def feature_stats(self, counts: list[np.ndarray], n: list[int], n_all: np.ndarray,
                      records: list[dict[str, Any]], num_releases: int) -> FeatureStats:
        """fsvrg's ``stats`` release (class docstring): the :class:`~fmtl_flower.core.
        fsvrg.FeatureStats` (float ``n_j`` and ``omega``) built from one noisy sum of the
        devices' clipped ``[p_k; r_k phi_k]`` (``counts``: the replies' ``n_k^j``, ``n``
        their row counts, ``n_all`` the federation's). With z = 0, ``weighting`` rows and a
        :attr:`stats_clip` no device reaches, exactly the statistics without DP."""
        k, n_total = len(n_all), int(n_all.sum())
        uniform = self.settings.weighting == "uniform"
        n_max = float(n_all.max())
        ratios = [1.0 if uniform else float(m) / n_max for m in n]
        norms = [math.sqrt(float(np.count_nonzero(c)) + float(np.sum((r * c / max(m, 1)) ** 2)))
                 for c, m, r in zip(counts, n, ratios, strict=True)]
        scales, std = self._one_release("stats", norms, k, 1.0, records, num_releases,
                                        clip=self.stats_clip)
        omega, freq = np.zeros(len(counts[0])), np.zeros(len(counts[0]))
        for c, m, scale in zip(counts, n, scales, strict=True):
            omega += (c > 0) if scale == 1.0 else (c > 0) * scale
            # rows: in row units (r_k phi_k n_max = n_k^j); uniform: frequencies
            part = c if not uniform else c / max(int(m), 1)
            freq += part if scale == 1.0 else part * scale
        omega = self.noisy(omega, std)
        freq = self.noisy(freq, std if uniform else std * n_max)
        floor = max(1.0, std) if std > 0 else 0.0
        n_j = freq / k * n_total if uniform else freq
        return FeatureStats(num_nodes=k, n=n_total, n_j=np.clip(n_j, 0.0, float(n_total)),
                            omega=np.clip(omega, floor, float(k)))

    def dual_step_sum(self, d_ws: list[np.ndarray], num_sampled: int,
                      records: list[dict[str, Any]], num_releases: int,
                      clip: float | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """cocoa-plus's ``d_w`` release: each ``d_w_k`` clipped to C (the devices clipped
        them already: a no-op for an honest one, up to rounding) and their noisy sum
        (N(0, (z C)^2) per coordinate; CoCoA+ adds them, so one device moves the sum by at
        most C). C is ``clip``, the ``dp-clip`` the round's messages were sent with (None:
        the stream's current clip; adaptive clipping moves on from it). Returns the clipped
        ``d_w_k`` (the server's ledger of each device's share of ``w(alpha)``) and the
        released sum."""
        norms = [float(np.linalg.norm(d)) for d in d_ws]
        scales, std = self._one_release("d_w", norms, max(int(num_sampled), 1), 1.0, records,
                                        num_releases, clip=clip, adaptive=True)
        clipped = [d if scale == 1.0 else d * scale for d, scale in zip(d_ws, scales,
                                                                          strict=True)]
        total = np.zeros(clipped[0].shape if clipped else 0)
        for d in clipped:
            total += d
        return clipped, self.noisy(total, std)

    def noisy(self, value: np.ndarray, std: float) -> np.ndarray:
        """``value`` plus N(0, std^2) per coordinate (``value`` itself when std is 0)."""
        return value + self._rng().normal(0.0, std, size=value.shape) if std > 0 else value

    def _one_release(self, stream: str, norms: list[float], num_sampled: int,
                     weight_max: float, records: list[dict[str, Any]], num_releases: int,
                     clip: float | None = None, adaptive: bool = False
                     ) -> tuple[list[float], float]:
        """One release of ``stream``: each update's scale ``min(1, C / norm)``, the noise
        std ``z_update C weight_max`` (``weight_max``: the largest weight of one device's
        update in the released sum), the clip moved with adaptive clipping, and the
        release added to the round's pending record fields. A given ``clip`` is fixed
        (no adaptive clipping: the ``stats`` release happens once) unless ``adaptive``
        (a clip the devices were sent, which adaptive clipping moves on from)."""
        z = self.resolve_noise(num_releases)
        fixed = clip is not None and not adaptive
        if clip is None:
            clip = self.current_clip([*records, self._pending], stream)
        adaptive_clip, z_update = self._adaptive(clip, num_sampled) \
            if self.settings.adaptive and not fixed else (None, z)
        scales = [1.0 if norm <= clip else clip / norm for norm in norms]
        std = z_update * clip * weight_max
        p = self._pending
        p["dp_noise_multiplier"] = z
        p["dp_releases"] = p.get("dp_releases", 0) + 1
        p["dp_clipped"] = p.get("dp_clipped", 0) + self._count_clipped(norms, clip)
        p[f"dp_clip_{stream}"] = clip
        p[f"dp_noise_std_{stream}"] = std
        if adaptive_clip is not None:
            p[f"dp_unclipped_fraction_{stream}"] = adaptive_clip.update(
                adaptive_clip.fits(norms, self.settings.mechanism == "client-clip"),
                num_sampled, self._rng())
            p[f"dp_clip_next_{stream}"] = adaptive_clip.clip
        log(INFO, "client-level DP (%s): %d/%d clipped to %g, noise std %.4g", stream,
            sum(norm > clip for norm in norms), len(norms), clip, std)
        return scales, std

    def _count_clipped(self, norms: list[float], clip: float) -> int:
        """The updates clipped: above the clip (within :data:`CLIP_SLACK`), or with
        ``client-clip`` also those a device clipped to it (on it within the slack)."""
        if self.settings.mechanism == "client-clip":
            return sum(norm >= clip * (1 - CLIP_SLACK) for norm in norms)
        return sum(norm > clip * (1 + CLIP_SLACK) for norm in norms)

    def record_fields(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The privacy keys of a new record: the releases since the previous record
        (``dp_releases`` of noise multiplier ``dp_noise_multiplier``, ``dp_clipped``
        updates clipped, each stream's clip and noise std) and ``epsilon`` after them."""
        charged = self._take_charge()
        out, self._pending = self._pending, {}
        if charged and out.get("dp_releases"):  # composed with this record's releases
            out.update(dp_releases=out["dp_releases"] + charged, dp_charged_on_resume=charged)
        elif charged:  # nothing released since the previous record: it waits
            self._pending["dp_charged_on_resume"] = charged
        if not out.get("dp_releases"):
            out = {"dp_noise_multiplier": None, "dp_releases": 0, "dp_clipped": None}
        account = self.accountant([*records, out])
        out["epsilon"] = account.epsilon()
        log(INFO, "client-level DP: epsilon=%.4g at delta=%g after %d releases",
            out["epsilon"], self.settings.delta, account.releases)
        return out

    def wire_config(self) -> dict[str, float]:
        """``client-clip`` (cocoa-plus): ``dp-clip``, the norm each device scales its
        ``d-w`` (and its dual step with it) to; nothing with ``central``."""
        if self.settings.mechanism != "client-clip":
            return {}
        return {"dp-clip": self.current_clip([*self._records(), self._pending], "d_w")}


#: The mechanism each FSVRG-family method takes under client-level DP, and why not the other.
FSVRG_MECHANISMS = {
    "fsvrg": "central",
    "fsvrg-naive": "central",
    "dane": "central",
    "gd": "central",
    "cocoa-plus": "client-clip",
}
FSVRG_WRONG_MECHANISM = {
    "central": "its devices do not clip their own replies; use dp.mechanism=central (the "
               "server clips each reply: the same guarantee, Flower's server-side clipping)",
    "client-clip": "w must stay w(alpha), the devices' dual variables' image: a server that "
                   "clipped a d-w the device did not would make them differ, so the device "
                   "scales its own dual step (and d-w with it) to the clip it is sent; use "
                   "dp.mechanism=client-clip",
}


def _enable_fsvrg_dp(strategy: Any, settings: DPSettings, noise_seed: int | None) -> Any:
    """:func:`enable_client_dp` for an :class:`~fmtl_flower.strategies.fsvrg.FSVRG`."""
    method = strategy.settings.method
    if method not in DP_FSVRG_METHODS:
        raise ConfigError(f"dp.mechanism={settings.mechanism} covers the FSVRG family's "
                          f"{', '.join(DP_FSVRG_METHODS)}; got method={method!r}")
    needed = FSVRG_MECHANISMS[method]
    if settings.mechanism != needed:
        raise ConfigError(f"dp.mechanism={settings.mechanism} for {method}: "
                          f"{FSVRG_WRONG_MECHANISM[needed]}")
    if method == "cocoa-plus" and settings.weighting != "uniform":
        raise ConfigError("dp.weighting=rows for cocoa-plus: CoCoA+ adds the devices' d-w "
                          "(their 1/(lambda n) is in d-w already); leave dp.weighting uniform")
    privacy = FSVRGDP(settings, noise_seed=noise_seed)
    privacy._records = lambda: getattr(strategy, "records", [])
    num_tasks = getattr(strategy, "num_tasks", None)
    if settings.adaptive and settings.noise_multiplier is not None and num_tasks:
        privacy._adaptive(float(settings.clip), int(num_tasks))  # refuse before the run
    strategy.privacy = privacy
    return strategy


def enable_client_dp(strategy: Any, settings: DPSettings | None = None, *,
                     noise_seed: int | None = None, **kwargs: Any) -> Any:
    """``strategy`` (a FedEM-family or FSVRG-family strategy) with client-level DP on;
    returns it.

    ``settings`` (or ``DPSettings`` keywords: ``mechanism="central", clip=1.0,
    noise_multiplier=1.1``); mechanism ``none`` leaves the strategy as it is.
    (``stats_clip``, ``dp.stats-clip``: fsvrg's setup release's clip,
    :meth:`FSVRGDP.feature_stats`.)

    Raises
    ------
    ConfigError
        For ``record`` on anything but MOCHA's family (:func:`~.record_dp.enable_record_dp`);
        for a method whose shared models DP does not cover (clustered / ifca, cfl: their
        per-cluster averages have data-dependent counts), or invalid settings; for
        ``sampling="poisson"`` on the FSVRG family or with ``min_train_nodes`` > 0.
    """
    settings = DPSettings.resolve(settings, kwargs)
    if not settings.enabled:
        return strategy
    from .ofmtl import OFMTL  # noqa: PLC0415 (ofmtl imports this module's users)

    if isinstance(strategy, OFMTL):  # record-level only: its devices are MOCHA's
        from .ofmtl_privacy import enable_ofmtl_record_dp  # noqa: PLC0415

        return enable_ofmtl_record_dp(strategy, settings)
    if settings.mechanism == "record":  # MOCHA's family, on the device
        from .record_dp import enable_record_dp  # noqa: PLC0415

        return enable_record_dp(strategy, settings)
    from .fsvrg import FSVRG  # noqa: PLC0415 (fsvrg imports this module's users)

    if isinstance(strategy, FSVRG) and settings.sampling != "fixed":
        raise ConfigError(f"dp.sampling={settings.sampling} is for FedEM's family; the FSVRG "
                          "family's releases are accounted without sampling: use "
                          "dp.sampling=fixed")
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
    if settings.sampling == "poisson" and getattr(strategy, "min_train_nodes", 0):
        raise ConfigError(f"dp.sampling=poisson samples each device independently; "
                          f"min_train_nodes={strategy.min_train_nodes} would change the "
                          "sample's law (and void its amplification): leave it 0")
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
