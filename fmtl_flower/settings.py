"""Typed, validated settings of each strategy family: what its constructor takes.

One frozen dataclass per family -- :class:`MOCHASettings` (MOCHA, CoCoA, Mb-SDCA),
:class:`MbSGDSettings` (the Mb-SGD baseline), :class:`FedEMSettings`, :class:`OFMTLSettings`,
:class:`FSVRGSettings` -- each extending :class:`CommonSettings` (what every strategy shares:
seed, evaluation cadence, discovery and Flower's node knobs). Every field is checked in one
place, the dataclass's ``__post_init__``, and an error names the field's run-config key, e.g.
``mocha.theta (theta): must be < 1.0, got 1.0``.

A strategy takes its settings or the same names as keyword arguments::

    MOCHA(8, MOCHASettings(lam=1e-3, theta=0.3))   # or MOCHA(8, lam=1e-3, theta=0.3)

and :meth:`StrategySettings.from_run_config` builds them from a run config's dotted keys
(``mocha.theta``; Flower flattens ``[tool.flwr.app.config.mocha]`` into them, see
:mod:`fmtl_flower.config`). The run-config keys are declared here, once: each setting's, and
the run's own (:class:`RunKeys`: strategy, dataset, ...); :func:`check_known_keys` refuses any
other key, naming the closest valid one, unless an app lets its own keys through (``allow=``).

This module imports no Flower and no numerics: devices load it with the run config.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .families import CENTRALISED, FAMILIES

__all__ = [
    "CommonSettings",
    "ConfigError",
    "FedEMSettings",
    "FSVRGSettings",
    "MbSGDSettings",
    "MOCHASettings",
    "OFMTLSettings",
    "RunKeys",
    "SettingsHome",
    "StrategySettings",
    "apply_settings",
    "as_float",
    "as_int",
    "check_known_keys",
    "check_num_tasks",
    "run_config_keys",
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


def optional_integer(minimum: int = 0) -> Check:
    """None, or an int >= ``minimum``."""
    return lambda key, value: None if value is None else as_int(key, value, minimum)


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


def task_owner_pairs(key: str, value: Any) -> tuple[tuple[int, int], ...]:
    """Operator pins ``{task: node id}`` as sorted ``(task, node)`` pairs: a mapping, pairs,
    or the run config's ``"0:123,1:456"`` ("" or None: none); a task pinned twice is an
    error."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            pairs = [item.split(":") for item in value.split(",") if item.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError
        except ValueError:
            raise ConfigError(f"{key}: expected 'task:node,task:node,...', got "
                              f"{value!r}") from None
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        try:
            pairs = [tuple(pair) for pair in value]
        except TypeError:
            raise ConfigError(f"{key}: a mapping task -> node id, got {value!r}") from None
        if any(len(pair) != 2 for pair in pairs):
            raise ConfigError(f"{key}: a mapping task -> node id, got {value!r}")
    owners: dict[int, int] = {}
    for task, node in pairs:
        task_id = as_int(f"{key} (task)", task, 0)
        if task_id in owners:
            raise ConfigError(f"{key}: task {task_id} is pinned twice")
        owners[task_id] = as_int(f"{key} (node id of task {task_id})", node, 0)
    return tuple(sorted(owners.items()))


def task_owners_text(key: str, value: Any) -> str:
    """The run config's spelling of :func:`task_owner_pairs`: ``"0:123,1:456"`` ("" none)."""
    return ",".join(f"{task}:{node}" for task, node in task_owner_pairs(key, value))


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
    def from_run_config(cls, values: Mapping[str, Any], *, allow: Iterable[str] = (),
                        **derived: Any) -> StrategySettings:
        """The settings from run-config ``values`` (dotted keys, e.g. ``context.run_config``
        or ``RunConfig.to_dict()``): every field with a key takes that key's value (through
        its ``from_wire``); the fields without one come from ``derived`` or keep their
        defaults.

        Every key must be a run-config key of this package (any family's: an app's
        ``pyproject.toml`` may list them all); ``allow`` names your app's own keys and
        namespaces (``allow=["method", "myapp"]`` lets ``method`` and every ``myapp.*``
        through; :func:`check_known_keys`).

        Raises
        ------
        ConfigError
            On an unknown key, naming the closest valid one (``mocha.lamda``: did you mean
            ``mocha.lambda``?), or an invalid value, naming its key.
        """
        check_known_keys(values, allow)
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
    fraction_evaluate : float
        Fraction of the tasks evaluated in an evaluation round, for the methods that
        evaluate a sample (``fraction-evaluate``; 1.0: all; 0.0: none, as in Flower).
    min_evaluate_nodes : int
        Lower bound of the tasks evaluated per evaluation round (``min-evaluate-nodes``;
        0: none).
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
    task_owners : tuple of (int, int)
        Tasks pinned to a Flower node id (``task-owners``, e.g. ``"0:123,1:456"``; a mapping
        in Python): only that node (for a packed node: its physical node id) may hold the
        task; without a pin, a task claimed by two live nodes is held by neither
        (:mod:`fmtl_flower.strategies.discovery`).
    reply_poll_interval : float
        Seconds between two pulls of a round's missing replies on a deployment
        (``reply-poll-interval``, > 0; default 0.5). Flower's deployment grid pauses 3 s
        between pulls, so a round lasts a whole number of 3 s steps; the ServerApp and
        ``start`` pull at this interval instead (:mod:`fmtl_flower.polling`; one request to
        the SuperLink per pull; the simulation and in-process engines are unaffected).
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
    fraction_evaluate: float = setting(1.0, number(lo=0.0, hi=1.0), "fraction-evaluate")
    min_evaluate_nodes: int = setting(0, integer(0), "min-evaluate-nodes")
    train_metrics_aggr_fn: Callable[..., Any] | None = setting(None, callable_or_none)
    evaluate_metrics_aggr_fn: Callable[..., Any] | None = setting(None, callable_or_none)
    robust: bool = setting(True, boolean, "robust")
    max_weight_share: float = setting(0.25, number(lo=0.0, hi=1.0, lo_open=True),
                                      "max-weight-share")
    task_owners: tuple[tuple[int, int], ...] = setting((), task_owner_pairs, "task-owners",
                                                       wire_default="",
                                                       wire_check=task_owners_text)
    reply_poll_interval: float = setting(0.5, number(lo=0.0, lo_open=True),
                                         "reply-poll-interval")


FORMULATION_NAMES = ("identity", "mean", "probabilistic", "clustered", "graphical")
SYS_HET_LEVELS = ("none", "low", "high")
SYS_HET_BASES = ("n_min", "n_t")
NETWORKS = ("wifi", "lte", "3g")
TIME_MODELS = ("physical", "reference")
SERVER_PATHS = ("auto", "dense", "factored")
#: The built-in losses of MOCHA's model family, the default first (the registry
#: :data:`fmtl_flower.core.losses.LOSSES` starts with exactly these; this module imports no
#: numerics unless a run names another loss, :func:`loss_name`).
LOSS_NAMES = ("hinge", "smoothed-hinge", "logistic", "squared")


def loss_name(key: str, value: Any) -> str:
    """One of :data:`LOSS_NAMES`, or a loss registered with
    :func:`fmtl_flower.core.losses.register_loss` (looked up only then)."""
    out = str(value).strip()
    if out in LOSS_NAMES:
        return out
    from .core.losses import LOSSES  # a registered loss: the registry is its one home

    if out not in LOSSES:
        raise ConfigError(f"{key}: must be one of {', '.join(LOSSES)}; got {value!r} (a loss "
                          "of your own: register it first, core.losses.register_loss)")
    return out
_POSITIVE = number(lo=0.0, lo_open=True)
_NONNEG = number(lo=0.0)
_UNIT_OPEN = number(lo=0.0, hi=1.0, lo_open=True, hi_open=True)


def loss_with_derivative(key: str, value: Any) -> str:
    """:func:`loss_name`, for a loss that defines ``derivative`` (Mb-SGD's step: the four
    built-in losses do; a registered one without it is a ConfigError)."""
    out = loss_name(key, value)
    if out not in LOSS_NAMES:
        from .core.losses import LOSSES, Loss  # a registered loss: the registry is its home

        if type(LOSSES[out]).derivative is Loss.derivative:
            raise ConfigError(f"{key}: the loss {out!r} defines no derivative, which "
                              "Mb-SGD's (sub)gradient step needs (core.losses.Loss)")
    return out


@dataclass(frozen=True)
class _PrimalDualSettings(CommonSettings):
    """MOCHA's formulation and systems settings, shared by MOCHA, CoCoA, Mb-SDCA and Mb-SGD.

    Attributes
    ----------
    lam : float
        Regularisation strength lambda > 0 (``mocha.lambda``; the run config may say ``cv``:
        5-fold cross-validation on the training split over 1e-5 ... 10, ``fmtl run`` only).
    omega : str
        Formulation of the MOCHA paper's appendix B (``mocha.omega``): ``identity`` (K =
        lambda m I: independent tasks), ``mean`` (eq. 11, needs ``lambda2``),
        ``probabilistic`` (eq. 14: Sigma = (W^T W + eps I)^1/2 / trace), ``clustered``
        (eq. 12, needs ``eta``, ``clusters``), ``graphical`` (eq. 15 without the l1 term on
        W, needs ``s2``, ``lambda2`` > 0: graphical lasso with every entry of Omega
        penalised, diagonal included; ``lambda2`` is the paper's lambda2, ``lambda`` twice
        the paper's lambda).
    omega_every : int
        Rounds between Omega-steps, 0: never; never after the last round
        (``mocha.omega-every``).
    omega_eps : float
        Eigenvalue perturbation of the Omega-step (``probabilistic``), relative to the
        largest eigenvalue, in (0, 1) (``mocha.omega-eps``).
    lam2 : float or None
        ``mean``'s weight of |W|_F^2 (> 0; twice the paper's eq. 11 lambda2) and
        ``graphical``'s weight of |Omega|_1 (> 0: without it the objective has no lower
        bound; equal to the paper's eq. 15 lambda2) (``mocha.lambda2``; "" on the wire:
        unset; 0 is a value, not "unset").
    s2, eta, clusters : float, float, int or None
        Formulation parameters (``mocha.s2``, ``mocha.eta``, ``mocha.clusters``; 0 on the
        wire: unset; ``s2`` unset = infinity); see :mod:`fmtl_flower.core.formulations`.
    local_frac : float
        Local coordinate steps per round, as a fraction of the device's n_t
        (``mocha.local-frac``).
    sys_het : {"none", "low", "high"}
        Budgets drawn from [0.9 n_min, n_min] (``low``) or [0.1 n_min, n_min] (``high``)
        each round (appendix E.3; ``mocha.sys-het``).
    sys_het_base : {"n_min", "n_t"}
        ``n_t``: the reference code's variant, fractions U(0.9, 1) / U(0.1, 1) of the
        device's own n_t (``mocha.sys-het-base``).
    drop_prob : float or tuple of float
        Probability that a device does no work in a round (Assumption 2): one in [0, 1), or
        one per task in [0, 1] (``mocha.drop-prob``).
    network : {"wifi", "lte", "3g"}
        The link of the estimated-time model (eq. 30), reported as ``estimated_time_s`` per
        round (``mocha.network``).
    time_model : {"physical", "reference"}
        Measured link latency and bandwidth, or the MOCHA code's 10/100/1000 cost units
        (``mocha.time-model``).
    max_row_norm : float or None
        The server's bound on the tasks' training-row norms against which dual updates are
        checked (``mocha.max-row-norm``; None or 0 on the wire: each device's own report at
        discovery).
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

    def _check_together(self) -> None:
        """Refuse a formulation whose objective has no lower bound."""
        if self.omega == "graphical" and self.lam2 == 0:
            raise ConfigError(
                f"{self.label('lam2')}: omega=graphical with lambda2 = 0 has no lower bound "
                "(at W = 0 the term -(lambda/2) d log det Omega goes to -inf as Omega grows; "
                "the run collapses W to 0); set lambda2 > 0, the penalty |Omega|_1 that "
                "bounds it")


@dataclass(frozen=True)
class MOCHASettings(_PrimalDualSettings):
    """MOCHA and the baselines that share its primal-dual machinery (CoCoA, Mb-SDCA).

    Attributes (besides :class:`_PrimalDualSettings`' and :class:`CommonSettings`')
    ---------------------------------------------------------------------------------
    method : {"mocha", "cocoa", "mb-sdca"}
        The local solver (the run config's ``strategy``).
    gamma : float
        Aggregation parameter in (0, 1] (appendix D.1): devices apply gamma times their
        update (``mocha.gamma``).
    theta : float
        CoCoA's relative local accuracy in (0, 1) (``mocha.theta``).
    beta : float
        Mb-SDCA's aggregation parameter > 0 (``mocha.mb-sdca-beta``).
    sigma_mode : {"global", "per-task", "spectral"}
        sigma' of Lemma 9 (``global``), per task (Remark 5, ``per-task``), or ``spectral``:
        lambda_max(D^-1/2 M D^-1/2), never above Lemma 9's (``mocha.sigma-mode``).
    clock_cycle : float or None
        Per-round deadline in seconds: budgets are cut to what each device can compute and
        send in time (``mocha.clock-cycle``; 0 on the wire: none).
    server_path : {"auto", "dense", "factored"}
        Keep M = K^-1 (OFMTL: Sigma) as an m x m matrix (``dense``) or as V diag(s) V^T + c I
        (``factored``, O(m d) memory); ``auto`` factors when m > 1000 and m > 2 d
        (``mocha.server-path``).
    min_replies : int
        A round counts only with at least this many valid replies; otherwise nothing is
        applied and devices roll back (``mocha.min-replies``).
    max_failures, probe_every : int
        Exclude a task after ``max_failures`` consecutive failed rounds (0: never) and probe
        it every ``probe_every`` rounds; it is readmitted when it answers or reconnects
        (``mocha.max-failures``, ``mocha.probe-every``).
    fit_intercept : bool
        Fit a (penalised) bias per task and class through a constant feature the devices
        append (``mocha.fit-intercept``; :mod:`fmtl_flower.core.multiclass`).
    intercept_scaling : float
        That feature's value > 0, as scikit-learn's liblinear ``intercept_scaling``: the
        larger, the less the bias is penalised (``mocha.intercept-scaling``).
    max_classes : int
        Most classes a run may learn from its devices' labels (devices built with
        ``labels="auto"``; a node claiming more is refused) (``mocha.max-classes``).
    loss : {"hinge", "smoothed-hinge", "logistic", "squared"} or a registered loss's name
        The loss l of the objective's per-task mean l(y x^T w_t) (``mocha.loss``): the SVM's
        hinge (the papers'), the hinge smoothed with gamma = 1 (Shalev-Shwartz & Zhang),
        log(1 + e^-z), or (1 - z)^2 / 2 = (y - x^T w)^2 / 2 (labels stay -1/+1); see
        :mod:`fmtl_flower.core.losses` (and its ``register_loss`` for another).
        Mb-SGD and OFMTL take only ``hinge``.
    concurrency, tau, latency_sigma : int or None, int or None, float
        Barrier-free MOCHA (``async-mocha``, ``async-cocoa``;
        :mod:`fmtl_flower.strategies.async_mocha`): the most requests in flight (None, 0 on
        the wire: every task), the staleness bound (None, 0 on the wire: unbounded while the
        tasks are uncoupled, then ``concurrency``) and the virtual clock's log-normal latency
        factor (0: deterministic) (``mocha.concurrency``, ``mocha.tau``,
        ``mocha.latency-sigma``).
    latency_persistence, offline_fraction, offline_mean_s : float
        The virtual clock's share of the latency's log-variance that is per device (0: every
        request drawn independently, 1: a slow device is slow on every request), and the
        devices' offline windows: the fraction of time offline (0: always online) and the
        mean offline window in virtual seconds (``mocha.latency-persistence``,
        ``mocha.offline-fraction``, ``mocha.offline-mean-s``;
        :func:`fmtl_flower.core.async_mocha.latency_factor`,
        :class:`~fmtl_flower.core.async_mocha.Availability`).
    sigma_prime_rule : {"stale-safe", "synchronous"}
        The barrier-free methods' sigma' (``mocha.sigma-prime-rule``;
        :data:`fmtl_flower.core.async_mocha.SIGMA_PRIME_RULES`).
    """

    method: str = setting("mocha", choice("mocha", "cocoa", "mb-sdca", "async-mocha",
                                          "async-cocoa"))
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
    # multi-class and intercept (issue 27 item 3 B, :mod:`fmtl_flower.core.multiclass`)
    fit_intercept: bool = setting(False, boolean, "mocha.fit-intercept")
    intercept_scaling: float = setting(1.0, _POSITIVE, "mocha.intercept-scaling")
    max_classes: int = setting(1000, integer(2), "mocha.max-classes")
    loss: str = setting("hinge", loss_name, "mocha.loss")
    concurrency: int | None = setting(None, optional(integer(1)), "mocha.concurrency",
                                      from_wire=zero_is_none, wire_default=0,
                                      wire_check=integer(0))
    tau: int | None = setting(None, optional(integer(1)), "mocha.tau", from_wire=zero_is_none,
                              wire_default=0, wire_check=integer(0))
    latency_sigma: float = setting(0.0, number(lo=0.0), "mocha.latency-sigma")
    latency_persistence: float = setting(0.0, number(lo=0.0, hi=1.0),
                                         "mocha.latency-persistence")
    offline_fraction: float = setting(0.0, number(lo=0.0, hi=1.0, hi_open=True),
                                      "mocha.offline-fraction")
    offline_mean_s: float = setting(60.0, _POSITIVE, "mocha.offline-mean-s")
    sigma_prime_rule: str = setting("stale-safe", choice("stale-safe", "synchronous"),
                                    "mocha.sigma-prime-rule")

    @property
    def formulation_options(self) -> dict[str, Any]:
        return {**super().formulation_options, "gamma": self.gamma}


@dataclass(frozen=True)
class MbSGDSettings(_PrimalDualSettings):
    """The Mb-SGD baseline (mini-batch subgradient steps on MOCHA's primal).

    Attributes (besides :class:`_PrimalDualSettings`' and :class:`CommonSettings`')
    ---------------------------------------------------------------------------------
    beta : float or None
        Mb-SGD's step scale: step beta / h in round h (``mocha.mb-sgd-beta``; None, 0 on
        the wire: 1 / lambda_min(K), the Pegasos step).
    schedule : {"inv", "inv_sqrt"}
        beta / h or beta / sqrt(h) (Python only).
    project : bool
        Project W onto the ball that holds the optimum (Python only).
    local_frac : float
        The mini-batch as a fraction of n_t, in (0, 1] (distinct samples).
    loss : {"hinge", "smoothed-hinge", "logistic", "squared"} or a registered loss's name
        The loss l (``mocha.loss``, as MOCHA's); a registered loss must define
        ``derivative``, Mb-SGD's step (:func:`loss_with_derivative`).
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
    loss: str = setting("hinge", loss_with_derivative, "mocha.loss")


@dataclass(frozen=True)
class FedEMSettings(CommonSettings):
    """FedEM and its baselines (FedAvg, FedProx, FedAvg+, clustered FL, local).

    Attributes (besides :class:`CommonSettings`')
    ----------------------------------------------
    method : str
        One of :data:`fmtl_flower.strategies.fedem.METHODS` (the run config's ``strategy``;
        the strategy checks it).
    num_components : int
        FedEM's M; clustered FL's models (``fedem.M``; default 4, chosen on a validation
        split of ``fedem-synthetic``, whose released labels add an 'always 0' component to
        the 3 of the mixture; FedAvg, FedProx, FedAvg+, pFedMe and local train one model
        whatever it says, CFL starts with one and splits).
    model : str
        ``logistic``, ``softmax``, ``mlp`` or ``torch`` (the run config's ``fedem.model``,
        ``auto`` resolved).
    num_classes : int or None
        Output classes (>= 2). None: learned at discovery from the nodes' reports (each
        its labels' largest class id + 1; one vote per physical node): the largest, in
        robust mode the largest within the federation's log-scale fence (a device above
        it is excluded, its reason says to set ``num_classes``); at least 2.
    hidden : int
        Hidden units of ``mlp`` (``fedem.hidden``).
    lr, batch_size, local_epochs : float, int, int
        The FedEM family's local SGD (``fedem.lr``, ``fedem.batch-size``,
        ``fedem.local-epochs``; the defaults 0.3, 128, 1 were tuned on a
        validation split, ``simulations/fedem_tune.py``).
    momentum, weight_decay : float
        torch's SGD rule, one optimiser state per component, kept on the device across
        rounds (``fedem.momentum``, ``fedem.weight-decay``).
    lr_schedule : {"constant", "multi-step"}
        ``multi-step``: x0.1 after rounds R/2 and 3R/4, the authors' scripts
        (``fedem.lr-schedule``).
    fraction : float
        Client sampling rate per round, in (0, 1] (``fedem.fraction``).
    aggregation : {"all", "sampled"}
        The authors' rule (sum over all clients of n_k/N theta_k, a client not sampled
        holding the old value) or ``sampled`` (average over the replying clients: unbiased
        under sampling) (``fedem.aggregation``).
    prox_mu : float
        FedProx's mu (``fedem.prox-mu``; > 0 for ``fedprox``, whose default 0.1 was tuned
        on a validation split; the other methods ignore it).
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
        pFedMe's lambda, inner learning rate, inner steps K per local step and server beta
        (Dinh et al.'s lambda, K and beta; ``fedem.pfedme-*``; ``lr`` is its eta,
        ``momentum`` unused).
    aggregator, trim : str, float
        With ``robust``, how each shared model's clipped updates are combined: ``trimmed-mean``
        (cutting floor(``trim`` x K) of the K contributors from each end of every
        coordinate, none below 1 / ``trim`` contributors), ``median`` or
        ``mean`` (``fedem.aggregator``, ``fedem.trim``;
        :func:`fmtl_flower.core.fedem.robust_aggregate_components`).
    """

    NAMESPACE: ClassVar[str] = "fedem"

    method: str = setting("fedem", text)
    num_components: int = setting(4, integer(1), "fedem.M")
    model: str = setting("logistic", choice("logistic", "softmax", "mlp", "torch"))
    num_classes: int | None = setting(None, optional_integer(2))
    hidden: int = setting(32, integer(1), "fedem.hidden")
    lr: float = setting(0.3, _POSITIVE, "fedem.lr")
    batch_size: int = setting(128, integer(1), "fedem.batch-size")
    local_epochs: int = setting(1, integer(1), "fedem.local-epochs")
    momentum: float = setting(0.9, number(lo=0.0, hi=1.0, hi_open=True), "fedem.momentum")
    weight_decay: float = setting(5e-4, _NONNEG, "fedem.weight-decay")
    lr_schedule: str = setting("constant", choice("constant", "multi-step"), "fedem.lr-schedule")
    fraction: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True), "fedem.fraction")
    aggregation: str = setting("all", choice("all", "sampled"), "fedem.aggregation")
    prox_mu: float = setting(0.1, _NONNEG, "fedem.prox-mu")
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
    loss : {"hinge", "smoothed-hinge", "logistic", "squared"} or a registered loss's name
        The loss of the MOCHA trainings and of every newcomer's subproblem (``mocha.loss``;
        :mod:`fmtl_flower.core.ofmtl`: the subproblem is strongly convex for any loss).
        Record-level DP is for the hinge only (:mod:`fmtl_flower.core.ofmtl_privacy`).
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
    loss: str = setting("hinge", loss_name, "mocha.loss")


@dataclass(frozen=True)
class FSVRGSettings(CommonSettings):
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
        1/L, DANE's each device's 1/(4 L_max)). GD's L = sigma_max(X)^2 / (4n) + lambda,
        sigma_max of the pooled rows by power iteration on the pooled Gram operator before
        round 1 (until the estimate grows < 1 %, at most 10 round trips, counted in
        ``exchanges``); ``final`` records ``step``, ``L_estimate``, ``power_iterations``.
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


# ---------------------------------------------------------------------------- the run's own keys
# The run config's keys that are no strategy's setting. With the settings' keys above they are
# every run-config key: :class:`fmtl_flower.config.RunConfig` is built from both, and
# :func:`check_known_keys` checks a run config against both.

#: The run config's ``strategy`` values: every family's (:data:`fmtl_flower.families.FAMILIES`)
#: and the centralised baselines, as the package ships them.
STRATEGIES = (*(s for f in FAMILIES for s in f.strategies), *CENTRALISED)


def strategy_name(key: str, value: Any) -> str:
    """A ``strategy`` value: a registered family's (also one registered after import,
    :func:`~fmtl_flower.families.register_family`) or a centralised baseline."""
    served = (*(s for f in FAMILIES for s in f.strategies), *CENTRALISED)
    return choice(*served)(key, value)
#: The run config's ``model`` values.
MODELS = ("auto", "svm", "logistic", "softmax", "mlp")


def _skew(key: str, value: Any) -> float:
    """A size ratio > 1, or 0 for none."""
    out = as_float(key, value, lo=0.0)
    if 0.0 < out <= 1.0:
        raise ConfigError(f"{key}: a size ratio > 1 (or 0 for none), got {out}")
    return out


def _arrivals(key: str, value: Any) -> str:
    """"", ``shuffle`` or a permutation of the task indices, comma-separated."""
    out = str(value).strip()
    if out in ("", "shuffle"):
        return out
    try:
        order = [int(p) for p in out.split(",")]
    except ValueError:
        raise ConfigError(f"{key}: '', 'shuffle' or comma-separated task indices, got "
                          f"{value!r}") from None
    if sorted(order) != list(range(len(order))):
        raise ConfigError(f"{key}: must be a permutation of 0..{len(order) - 1}, got {out!r}")
    return ",".join(map(str, order))


def _string(key: str, value: Any) -> str:
    """Any string, stripped."""
    return str(value).strip()


@dataclass(frozen=True)
class RunKeys:
    """The run config's own keys: what the run is (strategy, dataset, rounds, sizes, files)
    rather than a strategy's setting. :class:`fmtl_flower.config.RunConfig` extends it with
    every setting's key.

    Attributes
    ----------
    strategy : str
        One of :data:`STRATEGIES` (``strategy``): ``mocha`` and its baselines, ``local`` and
        ``global`` (fitted centrally, through ``fmtl run`` only), FedEM's family, ``ofmtl``,
        FSVRG's family.
    dataset : str
        ``synthetic`` (30 related tasks in 3 clusters, 20 features, generated from the seed),
        ``small`` (29 tasks, the MOCHA reference code's toy data), ``eat-voc`` (4 tasks, the
        OFMTL reference code's), ``fedem-synthetic`` (the FedEM authors' generator),
        ``sparse-federated`` (FSVRG's), ``har``, ``vehicle``, ``gleam`` (local copies), or
        a ``.mat`` path.
    num_server_rounds : int
        Communication rounds (W-steps); ``--rounds`` in the CLI.
    test_frac : float
        Per-task stratified test fraction (0: train on everything).
    round_timeout : float
        Seconds to wait for replies; a late reply counts as a drop.
    skew : float
        Subsample the training sets so task sizes span this ratio (appendix E.2; 0: none).
    num_tasks, dim, samples_per_task : int
        Generator sizes for ``synthetic`` and ``sparse-federated`` (0: default;
        ``sparse-federated``: the median rows per device); ``num-tasks`` is also how many
        devices the server waits for (0: the distinct task ids of the nodes online once
        ``min-available-nodes`` are, when that is set; else the dataset's task count).
    results_file : str
        The ServerApp writes the results JSON there (useful with ``flwr run``).
    model : str
        ``svm``, ``logistic``, ``softmax``, ``mlp`` (``auto``: svm for ``local``/``global``
        on the MOCHA datasets, logistic for the FedEM family).
    generator : str
        ``fedem-synthetic``'s labels: ``released`` (the authors' row-offset bug, which the
        paper's numbers come from) or ``fixed``.
    n_test : int
        ``fedem-synthetic``'s test samples per device (0: 5000; another value changes the
        data stream, for quick tests).
    iid : bool
        ``sparse-federated``: the same rows reshuffled IID across the same device sizes.
    checkpoint_dir : str
        Write the server state there after every ``checkpoint-every`` rounds and resume from
        the newest checkpoint found (every federated strategy; OFMTL: after every event).
    checkpoint_every : int
        Rounds between checkpoints (the last round always gets one).
    client_state_dir : str
        MOCHA family and FedEM family devices also keep their local state in files there,
        so it survives a server restart; per device:
        ``--node-config "client-state-dir=..."``.
    tasks_per_node : int
        Task packing: one Flower node hosts K tasks and one message per node carries them
        all (simulation: node p hosts tasks pK..pK+K-1, so ceil(m/K) nodes; deployment:
        ``--node-config "task-ids='3,4,5'"``); results do not depend on K. 0 = automatic:
        ``fmtl run`` packs MOCHA's, FedEM's and FSVRG's families (in-process: K = min(m,
        1000); Ray: one node per core, K <= 1000) and says so in the run header; the
        others, and ``flwr run``, use 1.
    train_tasks_frac : float
        Tasks t >= floor(frac T) are unseen clients (FedEM family).
    arrivals : str
        OFMTL: the order in which the dataset's tasks join (``shuffle``: seeded; or a
        permutation ``3,0,2,1``; "": in order).
    """

    strategy: str = setting("mocha", strategy_name, "strategy")
    dataset: str = setting("synthetic", text, "dataset")
    num_server_rounds: int = setting(100, integer(1), "num-server-rounds")
    test_frac: float = setting(0.25, number(lo=0.0, hi=1.0, hi_open=True), "test-frac")
    round_timeout: float = setting(120.0, number(lo=0.0, lo_open=True), "round-timeout")
    skew: float = setting(0.0, _skew, "skew")
    num_tasks: int = setting(0, integer(0), "num-tasks")
    dim: int = setting(0, integer(0), "dim")
    samples_per_task: int = setting(0, integer(0), "samples-per-task")
    results_file: str = setting("", lambda k, v: str(v), "results-file")
    model: str = setting("auto", choice(*MODELS), "model")
    generator: str = setting("released", choice("released", "fixed"), "generator")
    n_test: int = setting(0, integer(0), "n-test")
    iid: bool = setting(False, boolean, "iid")
    checkpoint_dir: str = setting("", _string, "checkpoint-dir")
    checkpoint_every: int = setting(1, integer(1), "checkpoint-every")
    client_state_dir: str = setting("", _string, "client-state-dir")
    tasks_per_node: int = setting(0, integer(0), "tasks-per-node")
    # the family keys that are no strategy's setting
    train_tasks_frac: float = setting(1.0, number(lo=0.0, hi=1.0, lo_open=True),
                                      "fedem.train-tasks-frac")
    arrivals: str = setting("", _arrivals, "ofmtl.arrivals")


# ---------------------------------------------------------------------------- differential privacy
#: ``dp.mechanism`` values: none, client-level DP with server-side clipping (``central``) or
#: device-side clipping (``client-clip``), record-level DP on the device (``record``).
DP_MECHANISMS = ("none", "central", "client-clip", "record")
#: The strategies whose shared model client-level DP protects (FedEM's family).
DP_CLIENT_LEVEL_METHODS = ("fedem", "fedavg", "fedprox", "fedavg-ft", "pfedme")
#: The FSVRG-family methods client-level DP protects (``central``: fsvrg's feature
#: statistics, the gradients, local models and GD's Gram products; ``client-clip``:
#: cocoa-plus's d-w; :class:`fmtl_flower.strategies.privacy.FSVRGDP`).
DP_FSVRG_METHODS = ("fsvrg", "fsvrg-naive", "dane", "gd", "cocoa-plus")
#: The default L2 clip of fsvrg's one setup release of each device's feature statistics
#: (``dp.stats-clip``; :meth:`fmtl_flower.strategies.privacy.FSVRGDP.feature_stats`).
DP_STATS_CLIP = 20.0
#: ``dp.sampling`` values: the strategy's fixed-size sample, no amplification claimed
#: (``fixed``), or Poisson sampling with amplification (``poisson``; FedEM's family).
DP_SAMPLING = ("fixed", "poisson")


def _blank_or(check: Check) -> Check:
    """The run config's spelling of an optional number: "" (unset), else what ``check``
    takes."""
    def out(key: str, value: Any) -> Any:
        if value is None or (isinstance(value, str) and not value.strip()):
            return ""
        return check(key, value)
    return out


def _blank_to_none(value: Any) -> Any:
    """Run-config value -> setting: "" means unset (None); 0 stays 0."""
    return None if value is None or (isinstance(value, str) and not value.strip()) else value


@dataclass(frozen=True)
class DPSettings(StrategySettings):
    """Differential privacy (``dp.*``; :mod:`fmtl_flower.strategies.privacy`, the guide
    ``docs/guides/privacy.md``).

    Attributes
    ----------
    mechanism : {"none", "central", "client-clip", "record"}
        ``central``: the server clips each device's update (relative to the model it sent
        it) to L2 norm ``clip`` and adds Gaussian noise to the aggregate (Flower's
        ``DifferentialPrivacyServerSideFixedClipping``); ``client-clip``: the devices clip
        their own update and the server clips again and adds the noise (Flower's
        ``DifferentialPrivacyClientSideFixedClipping`` with ``fixedclipping_mod``); both
        for FedEM's family (fedem, fedavg, fedprox, fedavg-ft, pfedme); for the FSVRG
        family ``central`` (fsvrg, fsvrg-naive, dane, gd: every release of a round, fsvrg's
        feature statistics once) and ``client-clip`` (cocoa-plus: the devices scale their
        dual step) (:class:`fmtl_flower.strategies.privacy.FSVRGDP`). ``record``:
        record-level DP on the device for MOCHA's family (methods mocha, cocoa, mb-sdca): each
        device clips its rows to norm ``clip`` and adds Gaussian noise of std
        z * 2 ``clip`` / n_t to its delta-b (:mod:`fmtl_flower.strategies.record_dp`),
        and for OFMTL (the same in its MOCHA trainings, output perturbation of a
        newcomer's model: :mod:`fmtl_flower.strategies.ofmtl_privacy`) (``dp.mechanism``).
    noise_multiplier : float or None
        z >= 0: the noise on the mean of the K sampled devices' clipped updates has
        standard deviation z * ``clip`` / K (with ``sampling`` poisson z * ``clip`` /
        (q N)) (``dp.noise-multiplier``; "" unset). Give it or ``epsilon``, not both.
    epsilon : float or None
        A target epsilon > 0 at ``delta`` for the whole run: the smallest noise multiplier
        whose ``num-server-rounds`` releases cost at most that (RDP accountant;
        ``dp.epsilon``; ``inf``: no noise; "" unset).
    delta : float
        The delta of the reported (epsilon, delta) guarantee, in (0, 1) (``dp.delta``).
    clip : float or None
        The clipping norm C > 0 of a device's update (all its components together); with
        ``record``, of each training row; with ``adaptive`` the initial one (``dp.clip``;
        0 unset).
    adaptive : bool
        Adaptive clipping (Andrew et al. 2021, Flower's ``...AdaptiveClipping`` wrappers):
        after each release the clip moves geometrically towards the ``target_quantile``
        quantile of the update norms, from a noisy count of the updates that fit
        (``dp.adaptive``).
    target_quantile : float
        The quantile of the update norms the adaptive clip tracks, in [0, 1] (the
        fraction of updates meant to fit under it; Flower's ``target_clipped_quantile``;
        ``dp.target-quantile``).
    clip_learning_rate : float
        The geometric update's rate > 0 (Flower's ``clip_norm_lr``;
        ``dp.clip-learning-rate``).
    clipped_count_stddev : float or None
        The std >= 0 of the noise on the count of updates that fit (Flower's
        ``clipped_count_stddev``; "" unset: K / 20, K the devices sampled); the update's
        noise multiplier becomes ``(z^-2 - (2 clipped_count_stddev)^-2)^(-1/2)`` so that
        the pair costs z (``dp.clipped-count-stddev``).
    weighting : {"uniform", "rows"}
        How the FSVRG family's gradient (and GD's Gram products) weights a device under DP
        (``dp.weighting``): ``uniform`` (Flower's: each device's clipped mean counts 1/K,
        noise z C / K; the gradient is then that of the devices' average loss) or ``rows``
        (the method's own n_k / n; noise z C max_k n_k / n; without noise and clipping the
        run is the one without DP, bit for bit). FedEM's family is always uniform.
    sampling : {"fixed", "poisson"}
        How FedEM's family samples a round's devices under client-level DP
        (``dp.sampling``). ``fixed`` (default): the strategy's fixed-size sample without
        replacement, averaged over the K sampled, accounted with no amplification.
        ``poisson``: each training device joins independently with probability q = the
        train fraction (from the server's secret randomness), the sum of clipped updates
        is divided by the fixed q N (N the training devices) and the rounds are accounted
        as Poisson-subsampled Gaussian releases (amplification by sampling; add/remove-one
        device). Not for ``record`` or the FSVRG family
        (:mod:`fmtl_flower.strategies.privacy`).
    stats_clip : float
        ``fsvrg`` only: the L2 norm each device's feature statistics ``[p_k; r_k phi_k]`` are
        clipped to in the one setup release (default 20, about the square root of the
        number of features a device of ``sparse-federated`` has; ``dp.stats-clip``).
    omega_debias : bool
        ``record`` only: MOCHA's ``probabilistic`` Omega-step learns from W^T W minus the
        known expected Gram matrix of the noise in W (projected to PSD;
        :func:`fmtl_flower.core.record_dp.debiased_gram`) instead of W^T W
        (``dp.omega-debias``).
    """

    NAMESPACE: ClassVar[str] = "dp"

    mechanism: str = setting("none", choice(*DP_MECHANISMS), "dp.mechanism",
                             attr="dp_mechanism")
    noise_multiplier: float | None = setting(
        None, optional(number(lo=0.0)), "dp.noise-multiplier", from_wire=_blank_to_none,
        wire_default="", wire_check=_blank_or(number(lo=0.0)), attr="dp_noise_multiplier")
    epsilon: float | None = setting(
        None, optional(number(lo=0.0, lo_open=True, finite=False)), "dp.epsilon",
        from_wire=_blank_to_none, wire_default="",
        wire_check=_blank_or(number(lo=0.0, lo_open=True, finite=False)), attr="dp_epsilon")
    delta: float = setting(1e-5, number(lo=0.0, hi=1.0, lo_open=True, hi_open=True),
                           "dp.delta", attr="dp_delta")
    clip: float | None = setting(None, optional(number(lo=0.0, lo_open=True)), "dp.clip",
                                 from_wire=zero_is_none, wire_default=0.0,
                                 wire_check=number(lo=0.0), attr="dp_clip")
    adaptive: bool = setting(False, boolean, "dp.adaptive", attr="dp_adaptive")
    target_quantile: float = setting(0.5, number(lo=0.0, hi=1.0), "dp.target-quantile",
                                     attr="dp_target_quantile")
    clip_learning_rate: float = setting(0.2, number(lo=0.0, lo_open=True),
                                        "dp.clip-learning-rate", attr="dp_clip_learning_rate")
    clipped_count_stddev: float | None = setting(
        None, optional(number(lo=0.0)), "dp.clipped-count-stddev", from_wire=_blank_to_none,
        wire_default="", wire_check=_blank_or(number(lo=0.0)),
        attr="dp_clipped_count_stddev")
    weighting: str = setting("uniform", choice("uniform", "rows"), "dp.weighting",
                             attr="dp_weighting")
    sampling: str = setting("fixed", choice(*DP_SAMPLING), "dp.sampling",
                            attr="dp_sampling")
    omega_debias: bool = setting(False, boolean, "dp.omega-debias", attr="dp_omega_debias")
    stats_clip: float = setting(DP_STATS_CLIP, number(lo=0.0, lo_open=True), "dp.stats-clip",
                                attr="dp_stats_clip")

    @property
    def enabled(self) -> bool:
        """Whether a mechanism is on."""
        return self.mechanism != "none"

    def _check_together(self) -> None:
        knobs = [k for k in ("noise_multiplier", "epsilon", "clip") if getattr(self, k) is not None]
        knobs += ["adaptive"] if self.adaptive else []
        knobs += ["weighting"] if self.weighting != "uniform" else []
        knobs += ["sampling"] if self.sampling != "fixed" else []
        knobs += ["omega_debias"] if self.omega_debias else []
        knobs += ["stats_clip"] if self.stats_clip != DP_STATS_CLIP else []
        if self.omega_debias and self.mechanism not in ("none", "record"):
            raise ConfigError(f"{self.label('omega_debias')} is record-level DP's "
                              f"(dp.mechanism=record), not {self.mechanism}'s")
        if self.clipped_count_stddev is not None and not self.adaptive:
            raise ConfigError(f"{self.label('clipped_count_stddev')} set without "
                              f"{self.label('adaptive')}=true")
        if not self.enabled:
            if knobs:
                raise ConfigError(f"{', '.join(self.label(k) for k in knobs)} set with "
                                  "dp.mechanism=none: choose a mechanism (central, client-clip, "
                                  "record)")
            return
        if self.clip is None:
            raise ConfigError(f"dp.mechanism={self.mechanism} needs {self.label('clip')} > 0")
        if (self.noise_multiplier is None) == (self.epsilon is None):
            raise ConfigError(f"dp.mechanism={self.mechanism} needs exactly one of "
                              f"{self.label('noise_multiplier')} and {self.label('epsilon')}")
        if self.sampling != "fixed" and self.mechanism == "record":
            raise ConfigError(f"dp.sampling={self.sampling} is client-level DP's (central, "
                              "client-clip); record-level DP releases every round a device "
                              "is sent work, with no amplification: use dp.sampling=fixed")


#: The settings dataclasses with run-config keys, in the order RunConfig adds their keys.
SETTINGS_CLASSES: tuple[type[StrategySettings], ...] = (
    CommonSettings, MOCHASettings, MbSGDSettings, FedEMSettings, OFMTLSettings, FSVRGSettings,
    DPSettings)


def run_config_keys() -> list[str]:
    """Every run-config key, once, in :class:`fmtl_flower.config.RunConfig`'s order: the
    run's own (:class:`RunKeys`), then each settings dataclass's."""
    keys = [f.metadata["key"] for f in dataclasses.fields(RunKeys)]
    for cls in SETTINGS_CLASSES:
        keys += [f.metadata["key"] for f in dataclasses.fields(cls)
                 if f.metadata["key"] is not None and f.metadata["key"] not in keys]
    return keys


def allowed_by(key: str, allow: Iterable[str]) -> bool:
    """Whether ``allow`` lets ``key`` pass: an entry equal to it, or its namespace (the entry
    ``myapp`` or ``myapp.`` allows ``myapp.lr``, ``myapp.data.path``, ...)."""
    return any(key == entry or key.startswith(entry.rstrip(".") + ".") for entry in allow)


def closest_key(key: str) -> str | None:
    """The valid run-config key nearest ``key`` (difflib; same namespace first), or None."""
    keys = run_config_keys()
    namespace = key.partition(".")[0] if "." in key else ""
    same = [k for k in keys if (k.partition(".")[0] if "." in k else "") == namespace]
    for candidates in (same, keys):
        match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if match:
            return match[0]
    return None


def unknown_key_message(key: str) -> str:
    """``unknown run-config key 'mocha.lamda' (did you mean mocha.lambda?)``."""
    near = closest_key(key)
    return f"unknown run-config key {key!r}" + (f" (did you mean {near}?)" if near else "")


def check_known_keys(keys: Iterable[str], allow: Iterable[str] = ()) -> None:
    """A :class:`ConfigError` for the first of ``keys`` that is no run-config key of this
    package (:func:`run_config_keys`, every family's) and not let through by ``allow``
    (:func:`allowed_by`: your app's own keys or namespaces), naming the closest valid key.

    Raises
    ------
    ConfigError
        ``unknown run-config key 'mocha.lamda' (did you mean mocha.lambda?)``, with how to
        allow an app's own key.
    """
    known = set(run_config_keys())
    namespaces = {k.partition(".")[0] for k in known if "." in k}  # mocha, fedem, ...
    allow = tuple(allow)
    for key in keys:
        if key in known or allowed_by(key, allow):
            continue
        namespace = key.partition(".")[0]
        if namespace in namespaces and "." in key:  # this package's own namespace
            raise ConfigError(unknown_key_message(key))
        raise ConfigError(f"{unknown_key_message(key)}; if it is your app's own key, let it "
                          f"through with allow=[{namespace!r}]")


def drop_prob_of(value: float | Sequence[float]) -> Any:
    """A settings ``drop_prob`` as the systems functions take it (a float or an array)."""
    if isinstance(value, tuple):
        import numpy as np

        return np.asarray(value, dtype=np.float64)
    return value


def check_num_tasks(num_tasks: Any, minimum: int = 1) -> int:
    """A strategy's ``num_tasks``: an int >= ``minimum`` (a ValueError otherwise; for None,
    one that says how to learn it from the federation)."""
    if num_tasks is None:
        raise ValueError("num_tasks=None: a strategy needs its number of tasks when built; "
                         "learn it from the nodes online first, as Flower sizes a run by its "
                         "SuperNodes: num_tasks = fmtl_flower.discover_num_tasks(grid, "
                         "min_available_nodes=...) in your ServerApp (this project's apps do "
                         "so when num-tasks is 0 and min-available-nodes is set)")
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, numbers.Integral | float) \
            or int(num_tasks) != num_tasks or num_tasks < minimum:
        raise ValueError(f"num_tasks must be an integer >= {minimum}, got {num_tasks!r}")
    return int(num_tasks)


@functools.cache
def _field_names(settings_class: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(settings_class))


@functools.cache
def _home_elsewhere(cls: type, name: str) -> bool:
    """Whether ``cls`` has a data descriptor (a property) ``name``: a value kept elsewhere
    (``min_tasks`` and ``task_owners`` live in the strategy's task directory)."""
    attribute = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
    return hasattr(attribute, "__set__")


class SettingsHome:
    """Mixin: a strategy's ``settings`` are the one home of its settings values.

    ``strategy.lam`` reads ``strategy.settings.lam``; ``strategy.lam = 0.2`` replaces
    ``strategy.settings`` with a copy holding 0.2 (not checked there: as before, ``start``
    and the round logic check what they use), so the two never disagree. Exceptions:

    * a field the strategy derives its own value of, named in :attr:`derived_settings`
      (FSVRG's ``lam`` = 1/n when unset, FedEM's ``model`` object, MOCHA's per-task
      ``drop_prob``): the derived value is an attribute of the strategy, the setting keeps
      what was configured;
    * a field the class has a property for (``min_tasks``, ``task_owners``): the property's
      home (the task directory) holds it; :func:`apply_settings` sets it once.
    """

    #: Settings fields whose value the strategy derives and keeps as its own attribute.
    derived_settings: ClassVar[frozenset[str]] = frozenset()

    def _is_setting(self, name: str) -> bool:
        settings = self.__dict__.get("settings")
        return (settings is not None and name in _field_names(type(settings))
                and name not in self.derived_settings
                and not _home_elsewhere(type(self), name))

    def __getattr__(self, name: str) -> Any:
        """Only called for an attribute not found: a setting is read from ``settings``."""
        if self._is_setting(name):
            return getattr(self.__dict__["settings"], name)
        fallback = getattr(super(), "__getattr__", None)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if self._is_setting(name):
            settings = copy.copy(self.__dict__["settings"])
            object.__setattr__(settings, name, value)  # a copy: shared settings stay as they are
            name, value = "settings", settings
        super().__setattr__(name, value)


def apply_settings(strategy: Any, settings: StrategySettings) -> None:
    """Make ``settings`` the strategy's settings: a :class:`SettingsHome` strategy reads its
    values from them (only the fields it keeps elsewhere, ``min_tasks`` when given and
    ``task_owners``, are set through their properties); any other object gets every field
    as an attribute."""
    home = isinstance(strategy, SettingsHome)
    if home:
        strategy.settings = settings
    for name, value in settings.as_kwargs().items():
        if name == "min_tasks" and value is None:
            continue  # a strategy's property checks it against its task count
        if not home or _home_elsewhere(type(strategy), name) \
                or name in strategy.derived_settings:  # its starting value
            setattr(strategy, name, value)
