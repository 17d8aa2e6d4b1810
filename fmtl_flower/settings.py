"""Typed, validated settings of each strategy family: what its constructor takes.

One frozen dataclass per family -- :class:`MochaSettings` (MOCHA, CoCoA, Mb-SDCA),
:class:`MbSgdSettings` (the Mb-SGD baseline), :class:`FedEMSettings`, :class:`OFMTLSettings`,
:class:`FsvrgSettings` -- each extending :class:`CommonSettings` (what every strategy shares:
seed, evaluation cadence, discovery and Flower's node knobs). Every field is checked in one
place, the dataclass's ``__post_init__``, and an error names the field's run-config key, e.g.
``mocha.theta (theta): must be < 1.0, got 1.0``.

A strategy takes its settings or the same names as keyword arguments::

    Mocha(8, MochaSettings(lam=1e-3, theta=0.3))   # or Mocha(8, lam=1e-3, theta=0.3)

and :meth:`StrategySettings.from_run_config` builds them from a run config's dotted keys
(``mocha.theta``; Flower flattens ``[tool.flwr.app.config.mocha]`` into them, see
:mod:`fmtl_flower.config`).

This module imports no Flower and no numerics: devices load it with the run config.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "CommonSettings",
    "ConfigError",
    "FedEMSettings",
    "FsvrgSettings",
    "MbSgdSettings",
    "MochaSettings",
    "OFMTLSettings",
    "StrategySettings",
    "apply_settings",
    "as_float",
    "as_int",
    "check_num_tasks",
]


class ConfigError(ValueError):
    """A run-config key (or a strategy setting) is unknown or its value is invalid."""


# ---------------------------------------------------------------------------- value checks


def as_int(key: str, value: Any, minimum: int | None = None) -> int:
    """``value`` (a string or a number) as an int, >= ``minimum``; a ConfigError naming ``key``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError
            out = int(value)
        elif isinstance(value, numbers.Integral):
            out = int(value)
        else:
            out = int(str(value).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {out}")
    return out


def as_float(key: str, value: Any, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False, hi_open: bool = False, finite: bool = True) -> float:
    """``value`` as a float in the given bounds; a ConfigError naming ``key``.

    ``nan`` is never a number; ``inf`` is refused unless ``finite=False``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        out = float(value) if isinstance(value, numbers.Real) else float(str(value).strip())
        if math.isnan(out) and not finite:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if finite and not math.isfinite(out):
        raise ConfigError(f"{key}: must be finite, got {value!r}")
    if lo is not None and (out < lo or (lo_open and out == lo)):
        raise ConfigError(f"{key}: must be {'>' if lo_open else '>='} {lo}, got {out}")
    if hi is not None and (out > hi or (hi_open and out == hi)):
        raise ConfigError(f"{key}: must be {'<' if hi_open else '<='} {hi}, got {out}")
    return out


Check = Callable[[str, Any], Any]


def integer(minimum: int = 0) -> Check:
    """An int >= ``minimum``."""
    return lambda key, value: as_int(key, value, minimum)


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, finite: bool = True) -> Check:
    """A float in the bounds (:func:`as_float`)."""
    return lambda key, value: as_float(key, value, lo, hi, lo_open, hi_open, finite)


def choice(*choices: str) -> Check:
    """One of ``choices``."""
    def check(key: str, value: Any) -> str:
        out = str(value).strip()
        if out not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(choices)}; got {value!r}")
        return out

    return check


def optional(check: Check) -> Check:
    """None, or what ``check`` accepts."""
    return lambda key, value: None if value is None else check(key, value)


def boolean(key: str, value: Any) -> bool:
    """A bool (also "true"/"false", "1"/"0", "yes"/"no" from the command line)."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def text(key: str, value: Any) -> str:
    """A non-empty string."""
    out = str(value).strip()
    if not out:
        raise ConfigError(f"{key}: must not be empty")
    return out


def callable_or_none(key: str, value: Any) -> Any:
    """None or a callable (the ``*_metrics_aggr_fn`` hooks; Python only)."""
    if value is not None and not callable(value):
        raise ConfigError(f"{key}: must be callable or None, got {value!r}")
    return value


def drop_probability(key: str, value: Any) -> float | tuple[float, ...]:
    """One drop-out probability in [0, 1), or one per task in [0, 1] (a tuple)."""
    if isinstance(value, str | numbers.Real):
        return as_float(key, value, lo=0.0, hi=1.0, hi_open=True)
    try:
        out = tuple(as_float(f"{key}[{i}]", p, lo=0.0, hi=1.0) for i, p in enumerate(value))
    except TypeError:
        raise ConfigError(f"{key}: a probability or one per task, got {value!r}") from None
    return out


def task_ids(key: str, value: Any) -> tuple[int, ...]:
    """Distinct task ids (ints >= 0), sorted."""
    return tuple(sorted({as_int(key, t, 0) for t in value}))


def zero_is_none(value: Any) -> Any:
    """Run-config value -> setting: 0 (or "") means unset (None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return None if not isinstance(value, str) and value == 0 else value


def setting(default: Any, check: Check, key: str | None = None, *,
            from_wire: Callable[[Any], Any] | None = None, wire_default: Any = ...,
            wire_check: Check | None = None, attr: str | None = None) -> Any:
    """A settings field: its default, its check and its run-config key (None: Python only or
    derived from other keys). The run config (:class:`fmtl_flower.config.RunConfig`) holds
    the key as attribute ``attr`` (default: the field's name) with ``wire_default`` and
    ``wire_check`` where the wire's spelling differs (e.g. 0 for "unset"); ``from_wire``
    turns the run-config value into the setting's."""
    return field(default=default, metadata={
        "check": check, "key": key, "from_wire": from_wire, "attr": attr,
        "wire_default": default if wire_default is ... else wire_default,
        "wire_check": wire_check or check})


def lambda_or_cv(key: str, value: Any) -> float | str:
    """lambda > 0, or ``cv`` (a cross-validation sweep by ``fmtl run``; run config only)."""
    if isinstance(value, str) and value.strip().lower() == "cv":
        return "cv"
    return as_float(key, value, lo=0.0, lo_open=True)


def optional_number(key: str, value: Any) -> float | None:
    """None for an unset key (None, or "" as the wire's default), else a float >= 0."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return as_float(key, value, lo=0.0)


# ---------------------------------------------------------------------------- the dataclasses


@dataclass(frozen=True)
class StrategySettings:
    """Base of the settings dataclasses: checks every field on construction."""

    #: The run-config namespace of the family (``mocha`` for ``mocha.theta``; "" common).
    NAMESPACE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = f.metadata["check"](self.label(f.name), value)
            object.__setattr__(self, f.name, checked)
        self._check_together()

    def _check_together(self) -> None:
        """Checks across fields (subclasses)."""

    @classmethod
    def label(cls, name: str) -> str:
        """How errors name field ``name``: its run-config key and the field."""
        key = cls.key_of(name)
        return f"{key} ({name})" if key else name

    @classmethod
    def key_of(cls, name: str) -> str | None:
        """The run-config key of field ``name`` (None: Python only or derived)."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.metadata["key"]
        raise KeyError(name)

    @classmethod
    def resolve(cls, settings: StrategySettings | None, kwargs: Mapping[str, Any]
                ) -> StrategySettings:
        """What a constructor was given: ``settings`` (default: the defaults) with
        ``kwargs`` on top; an unknown keyword is a TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; "
                            f"{cls.__name__} has {', '.join(sorted(names))}")
        if settings is None:
            return cls(**kwargs)
        if not isinstance(settings, cls):
            raise TypeError(f"settings must be a {cls.__name__}, got {type(settings).__name__}")
        return dataclasses.replace(settings, **kwargs) if kwargs else settings

    @classmethod
    def from_run_config(cls, values: Mapping[str, Any], **derived: Any) -> StrategySettings:
        """The settings from run-config ``values`` (dotted keys, e.g. ``RunConfig.to_dict()``):
        every field with a key takes that key's value (through its ``from_wire``); the
        fields without one come from ``derived`` or keep their defaults."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key, from_wire = f.metadata["key"], f.metadata["from_wire"]
            if key is not None and key in values:
                value = values[key]
                kwargs[f.name] = from_wire(value) if from_wire is not None else value
        kwargs.update(derived)
        return cls(**kwargs)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as a dict (shallow: callables and tuples as they are)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class CommonSettings(StrategySettings):
    """What every strategy shares.

    Attributes
    ----------
    seed : int
        The one seed of the run (``seed``).
    eval_every : int
        Rounds between test evaluations (``eval-every``; the final model is always evaluated).
    discovery_timeout : float
        Seconds the first round's discovery may wait for the tasks' nodes (``start``'s
        ``timeout`` bounds it too; a run config sets max(``round-timeout``, 60)).
    min_tasks : int or None
        Tasks discovery must find, else ``DiscoveryError`` (``min-tasks``; None or 0 on the
        wire: all of them).
    min_available_nodes : int
        Wait until at least this many nodes are connected (``min-available-nodes``; 0: no wait).
    fraction_train : float
        Fraction of the tasks sampled into a training round, for the methods that sample
        (``fraction-train``; 1.0: all).
    min_train_nodes : int
        Lower bound of the sampled tasks per training round (``min-train-nodes``; 0: none).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable or None
        Flower's aggregation of the replies' metrics into the ``Result`` (Python only).
    robust : bool
        Distrust what a device says about itself (``robust``, default True): the bounds a
        reply is checked against come from the federation (robust statistics across the
        tasks, :mod:`fmtl_flower.core.robust`) and operator limits, shared models are
        aggregated Byzantine-robustly, and a task whose updates are outliers is decoupled.
        False: every device is taken at its word (the behaviour before robust mode).
    max_weight_share : float
        With ``robust``, the largest share of the total weight any single device may carry
        in a weighted average (``max-weight-share``, in (0, 1]; a cap below 1/K for K
        devices acts as 1/K, equal weights).
    """

    seed: int = setting(0, integer(0), "seed")
    eval_every: int = setting(1, integer(1), "eval-every")
    discovery_timeout: float = setting(120.0, number(lo=0.0))
    min_tasks: int | None = setting(None, optional(integer(1)), "min-tasks",
                                    from_wire=zero_is_none, wire_default=0,
                                    wire_check=integer(0))
    min_available_nodes: int = setting(0, integer(0), "min-available-nodes")
    fraction_train: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True), "fraction-train")
    min_train_nodes: int = setting(0, integer(0), "min-train-nodes")
    train_metrics_aggr_fn: Callable[..., Any] | None = setting(None, callable_or_none)
    evaluate_metrics_aggr_fn: Callable[..., Any] | None = setting(None, callable_or_none)
    robust: bool = setting(True, boolean, "robust")
    max_weight_share: float = setting(0.25, number(lo=0.0, hi=1.0, lo_open=True),
                                      "max-weight-share")


FORMULATION_NAMES = ("identity", "mean", "probabilistic", "clustered", "graphical")
SYS_HET_LEVELS = ("none", "low", "high")
SYS_HET_BASES = ("n_min", "n_t")
NETWORKS = ("wifi", "lte", "3g")
TIME_MODELS = ("physical", "reference")
SERVER_PATHS = ("auto", "dense", "factored")
_POSITIVE = number(lo=0.0, lo_open=True)
_NONNEG = number(lo=0.0)
_UNIT_OPEN = number(lo=0.0, hi=1.0, lo_open=True, hi_open=True)


@dataclass(frozen=True)
class _PrimalDualSettings(CommonSettings):
    """MOCHA's formulation and systems settings, shared by MOCHA, CoCoA, Mb-SDCA and Mb-SGD.

    Attributes
    ----------
    lam : float
        Regularisation strength lambda > 0 (``mocha.lambda``).
    omega : str
        Formulation of the MOCHA paper's appendix B (``mocha.omega``).
    omega_every : int
        Rounds between Omega-steps, 0: never (``mocha.omega-every``).
    omega_eps : float
        Relative eigenvalue perturbation of the probabilistic Omega-step, in (0, 1).
    lam2, s2, eta, clusters : optional
        Formulation parameters (``mocha.lambda2``, ``mocha.s2``, ``mocha.eta``,
        ``mocha.clusters``; None: unset; on the wire 0 (s2, eta, clusters) or "" (lambda2)).
    local_frac, sys_het, sys_het_base, drop_prob
        Local work per round and systems heterogeneity (``mocha.local-frac``, ...).
        ``drop_prob`` is one probability in [0, 1) or one per task in [0, 1].
    network, time_model
        The estimated-time model (``mocha.network``, ``mocha.time-model``).
    max_row_norm : float or None
        The server's bound on the tasks' training-row norms (``mocha.max-row-norm``; None or
        0 on the wire: each device's reported one).
    """

    NAMESPACE: ClassVar[str] = "mocha"

    lam: float = setting(0.1, _POSITIVE, "mocha.lambda", wire_check=lambda_or_cv)
    omega: str = setting("probabilistic", choice(*FORMULATION_NAMES), "mocha.omega")
    omega_every: int = setting(10, integer(0), "mocha.omega-every")
    omega_eps: float = setting(1e-3, _UNIT_OPEN, "mocha.omega-eps")
    lam2: float | None = setting(None, optional(_NONNEG), "mocha.lambda2",
                                 from_wire=lambda v: None if v == "" else v,
                                 wire_check=optional_number, attr="lambda2")
    s2: float | None = setting(None, optional(_POSITIVE), "mocha.s2", from_wire=zero_is_none,
                               wire_default=0.0, wire_check=_NONNEG)
    eta: float | None = setting(None, optional(_POSITIVE), "mocha.eta", from_wire=zero_is_none,
                                wire_default=0.0, wire_check=_NONNEG)
    clusters: int | None = setting(None, optional(integer(1)), "mocha.clusters",
                                   from_wire=zero_is_none, wire_default=0,
                                   wire_check=integer(0))
    local_frac: float = setting(1.0, _POSITIVE, "mocha.local-frac")
    sys_het: str = setting("none", choice(*SYS_HET_LEVELS), "mocha.sys-het")
    sys_het_base: str = setting("n_min", choice(*SYS_HET_BASES), "mocha.sys-het-base")
    drop_prob: float | tuple[float, ...] = setting(0.0, drop_probability, "mocha.drop-prob")
    network: str = setting("lte", choice(*NETWORKS), "mocha.network")
    time_model: str = setting("physical", choice(*TIME_MODELS), "mocha.time-model")
    max_row_norm: float | None = setting(None, optional(_NONNEG), "mocha.max-row-norm",
                                         from_wire=zero_is_none, wire_default=0.0,
                                         wire_check=_NONNEG)

    @property
    def formulation_options(self) -> dict[str, Any]:
        """The options of :func:`fmtl_flower.core.formulations.make_formulation`."""
        return {"lam2": self.lam2, "s2": self.s2, "eta": self.eta, "k": self.clusters,
                "eps_rel": self.omega_eps}


@dataclass(frozen=True)
class MochaSettings(_PrimalDualSettings):
    """MOCHA and the baselines that share its primal-dual machinery (CoCoA, Mb-SDCA).

    Attributes (besides :class:`_PrimalDualSettings`' and :class:`CommonSettings`')
    ---------------------------------------------------------------------------------
    method : {"mocha", "cocoa", "mb-sdca"}
        The local solver (the run config's ``strategy``).
    gamma : float
        Aggregation parameter in (0, 1] (appendix D.1; ``mocha.gamma``).
    theta : float
        CoCoA's relative local accuracy in (0, 1) (``mocha.theta``).
    beta : float
        Mb-SDCA's aggregation parameter > 0 (``mocha.mb-sdca-beta``).
    sigma_mode : {"global", "per-task", "spectral"}
    clock_cycle : float or None
        Per-round deadline in seconds (``mocha.clock-cycle``; 0 on the wire: none).
    server_path : {"auto", "dense", "factored"}
        M = K^-1 kept as an m x m matrix or factored (``mocha.server-path``).
    min_replies : int
        A round counts only with at least this many valid replies (``mocha.min-replies``).
    max_failures, probe_every : int
        Exclude a task after ``max_failures`` consecutive failed rounds (0: never) and probe
        it every ``probe_every`` rounds (``mocha.max-failures``, ``mocha.probe-every``).
    """

    method: str = setting("mocha", choice("mocha", "cocoa", "mb-sdca"))
    gamma: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True), "mocha.gamma")
    theta: float = setting(0.5, _UNIT_OPEN, "mocha.theta")
    beta: float = setting(1.0, _POSITIVE, "mocha.mb-sdca-beta", attr="mbsdca_beta")
    sigma_mode: str = setting("global", choice("global", "per-task", "spectral"),
                              "mocha.sigma-mode")
    clock_cycle: float | None = setting(None, optional(_POSITIVE), "mocha.clock-cycle",
                                        from_wire=zero_is_none, wire_default=0.0,
                                        wire_check=_NONNEG)
    server_path: str = setting("auto", choice(*SERVER_PATHS), "mocha.server-path")
    min_replies: int = setting(1, integer(0), "mocha.min-replies")
    max_failures: int = setting(3, integer(0), "mocha.max-failures")
    probe_every: int = setting(5, integer(1), "mocha.probe-every")

    @property
    def formulation_options(self) -> dict[str, Any]:
        return {**super().formulation_options, "gamma": self.gamma}


@dataclass(frozen=True)
class MbSgdSettings(_PrimalDualSettings):
    """The Mb-SGD baseline (mini-batch subgradient steps on MOCHA's primal).

    Attributes (besides :class:`_PrimalDualSettings`' and :class:`CommonSettings`')
    ---------------------------------------------------------------------------------
    beta : float or None
        Step scale: step beta / h in round h (``mocha.mb-sgd-beta``; None, 0 on the wire:
        1 / lambda_min(K), the Pegasos choice).
    schedule : {"inv", "inv_sqrt"}
        beta / h or beta / sqrt(h) (Python only).
    project : bool
        Project W onto the ball that holds the optimum (Python only).
    local_frac : float
        The mini-batch as a fraction of n_t, in (0, 1] (distinct samples).
    """

    omega: str = setting("identity", choice(*FORMULATION_NAMES), "mocha.omega")
    omega_every: int = setting(0, integer(0), "mocha.omega-every")
    local_frac: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True), "mocha.local-frac",
                                from_wire=lambda v: min(float(v), 1.0))
    beta: float | None = setting(None, optional(_POSITIVE), "mocha.mb-sgd-beta",
                                 from_wire=zero_is_none, wire_default=1.0, wire_check=_NONNEG,
                                 attr="mbsgd_beta")
    schedule: str = setting("inv", choice("inv", "inv_sqrt"))
    project: bool = setting(True, boolean)


@dataclass(frozen=True)
class FedEMSettings(CommonSettings):
    """FedEM and its baselines (FedAvg, FedProx, FedAvg+, clustered FL, local).

    Attributes (besides :class:`CommonSettings`')
    ----------------------------------------------
    method : str
        One of :data:`fmtl_flower.strategies.fedem.METHODS` (the run config's ``strategy``;
        the strategy checks it).
    num_components : int
        FedEM's M (``fedem.M``).
    model : str
        ``logistic``, ``softmax``, ``mlp`` or ``torch`` (the run config's ``fedem.model``,
        ``auto`` resolved).
    num_classes, hidden : int
        Output classes (>= 2; from the data) and ``mlp``'s hidden units (``fedem.hidden``).
    lr, batch_size, local_epochs, momentum, weight_decay, lr_schedule
        The local solver (``fedem.lr``, ``fedem.batch-size``, ``fedem.local-epochs``, ...).
    fraction, aggregation
        The authors' client sampling rate in (0, 1] and aggregation (``fedem.fraction``,
        ``fedem.aggregation``).
    prox_mu : float
        FedProx's mu (``fedem.prox-mu``; > 0 for ``fedprox``).
    finetune_epochs : int
        FedAvg+'s fine-tuning epochs (``fedem.finetune-epochs``).
    unseen_tasks : tuple of int
        Held-out tasks (the run config's ``fedem.train-tasks-frac``).
    pi_floor, max_abs_param : float
        Floor of the mixture weights; bound of any parameter's magnitude (Python only).
    max_update_ratio : float
        A reply's component may move at most this times max(|model|, 1)
        (``fedem.max-update-ratio``).
    cfl_eps1, cfl_eps2 : float
        CFL's split thresholds: mean and largest client update norm (``fedem.cfl-eps1``,
        ``fedem.cfl-eps2``; the FedEM authors' 0.4 and 1.6).
    pfedme_lambda, pfedme_lr, pfedme_steps, pfedme_beta : float, float, int, float
        pFedMe's lambda, inner learning rate, inner steps K and server beta
        (``fedem.pfedme-*``; ``lr`` is its eta).
    aggregator, trim : str, float
        With ``robust``, how each shared model's clipped updates are combined: ``trimmed-mean``
        (cutting ``trim`` of the weight from each end of every coordinate), ``median`` or
        ``mean`` (``fedem.aggregator``, ``fedem.trim``;
        :func:`fmtl_flower.core.fedem.robust_aggregate_components`).
    """

    NAMESPACE: ClassVar[str] = "fedem"

    method: str = setting("fedem", text)
    num_components: int = setting(3, integer(1), "fedem.M", wire_default=4)
    model: str = setting("logistic", choice("logistic", "softmax", "mlp", "torch"))
    num_classes: int = setting(2, integer(2))
    hidden: int = setting(32, integer(1), "fedem.hidden")
    lr: float = setting(0.05, _POSITIVE, "fedem.lr", wire_default=0.3)
    batch_size: int = setting(128, integer(1), "fedem.batch-size")
    local_epochs: int = setting(1, integer(1), "fedem.local-epochs")
    momentum: float = setting(0.9, number(lo=0.0, hi=1.0, hi_open=True), "fedem.momentum")
    weight_decay: float = setting(5e-4, _NONNEG, "fedem.weight-decay")
    lr_schedule: str = setting("constant", choice("constant", "multi-step"), "fedem.lr-schedule")
    fraction: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True), "fedem.fraction")
    aggregation: str = setting("all", choice("all", "sampled"), "fedem.aggregation")
    prox_mu: float = setting(0.0, _NONNEG, "fedem.prox-mu", wire_default=0.1)
    finetune_epochs: int = setting(1, integer(0), "fedem.finetune-epochs")
    unseen_tasks: tuple[int, ...] = setting((), task_ids)
    pi_floor: float = setting(1e-6, _POSITIVE)
    max_abs_param: float = setting(1e6, _POSITIVE)
    max_update_ratio: float = setting(1e4, _POSITIVE, "fedem.max-update-ratio")
    cfl_eps1: float = setting(0.4, _NONNEG, "fedem.cfl-eps1")
    cfl_eps2: float = setting(1.6, _NONNEG, "fedem.cfl-eps2")
    pfedme_lambda: float = setting(15.0, _POSITIVE, "fedem.pfedme-lambda")
    pfedme_lr: float = setting(0.05, _POSITIVE, "fedem.pfedme-lr")
    pfedme_steps: int = setting(5, integer(1), "fedem.pfedme-steps")
    pfedme_beta: float = setting(1.0, _POSITIVE, "fedem.pfedme-beta")
    aggregator: str = setting("trimmed-mean", choice("trimmed-mean", "median", "mean"),
                              "fedem.aggregator")
    trim: float = setting(0.2, number(lo=0.0, hi=0.5, hi_open=True), "fedem.trim")

    def _check_together(self) -> None:
        if self.method == "fedprox" and not self.prox_mu > 0:
            raise ConfigError(f"{self.label('prox_mu')}: fedprox needs prox_mu > 0")


@dataclass(frozen=True)
class OFMTLSettings(CommonSettings):
    """OFMTL: MOCHA (probabilistic formulation) over the first tasks, then newcomers.

    OFMTL trains MOCHA, so it reads MOCHA's ``mocha.lambda``, ``mocha.omega-every``,
    ``mocha.omega-eps``, ``mocha.local-frac`` and ``mocha.server-path``; its own keys are
    ``ofmtl.*``. ``eval_every`` and the node knobs of :class:`CommonSettings` do not apply.

    Attributes (besides :class:`CommonSettings`')
    ----------------------------------------------
    initial_tasks : int
        Tasks that train MOCHA first (``ofmtl.initial-tasks``; 0 on the wire: 1).
    mocha_rounds : int
        MOCHA rounds per training (the run config's ``num-server-rounds``).
    outer, inner : int
        A newcomer's outer (Sigma) and inner (SDCA) iterations (``ofmtl.outer``,
        ``ofmtl.inner``).
    newcomer_frac : float
        A newcomer's SDCA steps per inner iteration as a fraction of its n
        (``ofmtl.newcomer-frac``).
    retrain_ratio : float
        Retrain MOCHA when newcomers since the last training reach this multiple of its
        tasks (``ofmtl.retrain-ratio``; inf: never).
    arrival_timeout, round_timeout : float
        Seconds a newcomer's reply / a MOCHA round may take (the run config's
        ``round-timeout``).
    max_attempts : int
        Tries of a newcomer before it is given up (Python only).
    """

    NAMESPACE: ClassVar[str] = "ofmtl"

    initial_tasks: int = setting(1, integer(1), "ofmtl.initial-tasks",
                                 from_wire=lambda v: v or 1, wire_default=0,
                                 wire_check=integer(0))
    lam: float = setting(0.1, _POSITIVE, "mocha.lambda")
    mocha_rounds: int = setting(100, integer(1))
    omega_every: int = setting(10, integer(0), "mocha.omega-every")
    local_frac: float = setting(1.0, _POSITIVE, "mocha.local-frac")
    omega_eps: float = setting(1e-3, _UNIT_OPEN, "mocha.omega-eps")
    outer: int = setting(10, integer(1), "ofmtl.outer")
    inner: int = setting(100, integer(1), "ofmtl.inner")
    newcomer_frac: float = setting(0.5, _POSITIVE, "ofmtl.newcomer-frac")
    retrain_ratio: float = setting(1.5, number(lo=0.0, lo_open=True, finite=False),
                                   "ofmtl.retrain-ratio")
    arrival_timeout: float = setting(120.0, _NONNEG)
    max_attempts: int = setting(3, integer(1))
    round_timeout: float = setting(120.0, _POSITIVE, "round-timeout")
    server_path: str = setting("auto", choice(*SERVER_PATHS), "mocha.server-path")


@dataclass(frozen=True)
class FsvrgSettings(CommonSettings):
    """FSVRG and its baselines (naive FSVRG, GD, CoCoA+, DANE) on one global model.

    Attributes (besides :class:`CommonSettings`')
    ----------------------------------------------
    method : {"fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane"}
        The run config's ``strategy``.
    lam : float or None
        L2 weight (None: the paper's 1/n; Python only).
    h : float or None
        FSVRG's and naive FSVRG's stepsize h (``fsvrg.h``; None, 0 on the wire: 16 for
        fsvrg; fsvrg-naive needs one).
    step : float or None
        GD's step and DANE's local SVRG step (``fsvrg.step``; None, 0 on the wire: GD's
        1/L, DANE's 1/(4 L_max)).
    mu : float
        DANE's proximal parameter >= 0 (``fsvrg.dane-mu``).
    local_epochs : int
        CoCoA+'s SDCA passes and DANE's SVRG epochs (``fsvrg.local-epochs``).
    max_update_ratio : float
        A reply's model may move at most this times max(|w|, 1) (``fsvrg.max-update-ratio``).
    """

    NAMESPACE: ClassVar[str] = "fsvrg"

    method: str = setting("fsvrg", choice("fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane"))
    lam: float | None = setting(None, optional(_POSITIVE))
    h: float | None = setting(None, optional(_POSITIVE), "fsvrg.h", from_wire=zero_is_none,
                              wire_default=0.0, wire_check=_NONNEG)
    step: float | None = setting(None, optional(_POSITIVE), "fsvrg.step",
                                 from_wire=zero_is_none, wire_default=0.0, wire_check=_NONNEG)
    mu: float = setting(0.0, _NONNEG, "fsvrg.dane-mu", attr="dane_mu")
    local_epochs: int = setting(1, integer(1), "fsvrg.local-epochs", attr="fsvrg_local_epochs")
    max_update_ratio: float = setting(1e4, _POSITIVE, "fsvrg.max-update-ratio",
                                      attr="fsvrg_max_update_ratio")

    def _check_together(self) -> None:
        if self.method == "fsvrg-naive" and self.h is None:
            raise ConfigError(f"{self.label('h')}: fsvrg-naive needs an explicit stepsize h "
                              "(no default)")


def drop_prob_of(value: float | Sequence[float]) -> Any:
    """A settings ``drop_prob`` as the systems functions take it (a float or an array)."""
    if isinstance(value, tuple):
        import numpy as np

        return np.asarray(value, dtype=np.float64)
    return value


def check_num_tasks(num_tasks: Any, minimum: int = 1) -> int:
    """A strategy's ``num_tasks``: an int >= ``minimum`` (a ValueError otherwise)."""
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, numbers.Integral | float) \
            or int(num_tasks) != num_tasks or num_tasks < minimum:
        raise ValueError(f"num_tasks must be an integer >= {minimum}, got {num_tasks!r}")
    return int(num_tasks)


def apply_settings(strategy: Any, settings: StrategySettings) -> None:
    """Set every field of ``settings`` as an attribute of ``strategy`` (what its round logic
    reads), ``min_tasks`` only when given (a strategy's property checks it against its
    task count)."""
    for name, value in settings.as_kwargs().items():
        if name != "min_tasks" or value is not None:
            setattr(strategy, name, value)
