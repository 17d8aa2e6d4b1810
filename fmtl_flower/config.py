"""Run configuration: the keys of `flwr run --run-config` and `fmtl run --set`.

The keys are namespaced by strategy family, as ``pyproject.toml`` nests them
(``[tool.flwr.app.config.mocha]`` ``theta = 0.5`` reaches the apps as ``mocha.theta``; Flower
flattens nested tables into dotted keys): the common keys (``strategy``, ``dataset``,
``num-server-rounds``, ``seed``, ...) at the top, then ``mocha.*`` (MOCHA, CoCoA, Mb-SDCA,
Mb-SGD; OFMTL and the ``local``/``global`` SVMs read ``mocha.lambda`` and OFMTL the rest of
MOCHA's too), ``fedem.*`` (FedEM's family; ``local``/``global`` with a model other than svm),
``ofmtl.*`` and ``fsvrg.*``. One key has one meaning: Mb-SDCA's ``mocha.mb-sdca-beta`` and
Mb-SGD's ``mocha.mb-sgd-beta``, FedEM's ``fedem.local-epochs`` and the FSVRG family's
``fsvrg.local-epochs``, FSVRG's stepsize ``fsvrg.h`` and GD's/DANE's ``fsvrg.step``.

:class:`RunConfig` holds every key; :meth:`RunConfig.from_mapping` validates a mapping of raw
values (strings from the command line, or the typed values Flower passes in
``context.run_config``) and raises :class:`ConfigError` naming the key on a bad value, an
unknown key, or a key of another family than the run's strategy (naming the family it
belongs to). The flat names of the previous release (``theta``, ``lr``, ``beta``, ...) are
accepted for one release with a :class:`DeprecationWarning` per key. The strategies'
constructors take the typed settings of :mod:`fmtl_flower.settings`, which
:func:`settings_from_config` builds from a run config (the checks live there).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import settings as _settings
from .families import CENTRALISED, FAMILIES, Family, family_of_strategy, strategies_of
from .settings import (
    MODELS,
    SETTINGS_CLASSES,
    STRATEGIES,
    ConfigError,
    MOCHASettings,
    RunKeys,
    StrategySettings,
    as_float,
    as_int,
    check_known_keys,
    setting,
    strategy_name,
    unknown_key_message,
)

__all__ = [
    "ASYNC_MOCHA", "FEDERATED", "FEDEM_FAMILY", "FSVRG_FAMILY", "MOCHA_FAMILY", "MODELS",
    "STRATEGIES",
    "ConfigError", "RunConfig", "as_float", "as_int", "check_known_keys", "parse_set_options",
    "positive_int", "settings_from_config", "split_set_option", "unseen_tasks",
]

#: Strategies of MOCHA's primal-dual / primal family (one linear SVM per task).
MOCHA_FAMILY = strategies_of("mocha", "mb-sgd", "async-mocha")
#: Barrier-free MOCHA and its CoCoA baseline (:mod:`fmtl_flower.strategies.async_mocha`).
ASYNC_MOCHA = strategies_of("async-mocha")
#: Strategies of FedEM's family (``local`` joins it with a model other than ``svm``).
FEDEM_FAMILY = strategies_of("fedem")
#: Strategies of FSVRG's family (one global sparse logistic-regression model).
FSVRG_FAMILY = strategies_of("fsvrg")
FEDERATED = tuple(s for f in FAMILIES for s in f.strategies)

#: How errors name each run-config namespace, and which of them the centralised baselines
#: (``local``, ``global``) read. Which families read a namespace is theirs to say
#: (:attr:`fmtl_flower.families.Family.namespace` and ``reads``).
_NAMESPACE_TITLES = {"mocha": "MOCHA's family", "fedem": "FedEM's family", "ofmtl": "OFMTL",
                     "fsvrg": "FSVRG's family",
                     "dp": "differential privacy: client-level for FedEM's and FSVRG's "
                           "families, record-level for MOCHA's (fmtl_flower.strategies."
                           "privacy, record_dp; guide: privacy)"}
_CENTRALISED_READ = ("mocha", "fedem", "dp")


def _readers(namespace: str) -> tuple[str, ...]:
    """The ``strategy`` values whose runs read ``namespace``'s keys."""
    owners = tuple(s for f in FAMILIES if f.namespace == namespace for s in f.strategies)
    others = tuple(s for f in FAMILIES if namespace in f.reads for s in f.strategies)
    return owners + others + (CENTRALISED if namespace in _CENTRALISED_READ else ())


def namespaces() -> dict[str, tuple[tuple[str, ...], str]]:
    """Each namespace: the strategies that read it, and how errors name it."""
    out = {}
    for namespace, title in _NAMESPACE_TITLES.items():
        owners = tuple(s for f in FAMILIES if f.namespace == namespace for s in f.strategies)
        readers = _readers(namespace)
        also = [s for s in readers if s not in owners]
        listed = ", ".join(owners) + (f"; also read by {', '.join(also)}" if also and owners
                                      else ", ".join(also))
        out[namespace] = (readers, f"{title} ({listed})")
    return out


#: The families' namespaces: the strategies that read them, and how errors name them
#: (those of the families the package ships; :func:`namespaces` for the current ones).
NAMESPACES: dict[str, tuple[tuple[str, ...], str]] = namespaces()


def positive_int(key: str, value: Any) -> int:
    """``value`` as an int >= 1 (:func:`as_int`); the reproductions' ``OPTIONS`` parser."""
    return as_int(key, value, 1)


@dataclass(frozen=True)
class _RunConfigKeys(RunKeys):
    """Every run-config key (the key, dotted and kebab-case, in each field's metadata).

    The common keys: ``strategy`` (one of :data:`STRATEGIES`), ``dataset`` (``synthetic``,
    ``small``, ``eat-voc``, ``fedem-synthetic``, ``sparse-federated`` or a ``.mat`` path),
    ``num-server-rounds``, ``seed``, ``test-frac``, ``eval-every``, ``round-timeout``, ``skew``,
    ``num-tasks`` / ``dim`` / ``samples-per-task`` (generator sizes; ``num-tasks`` is also
    how many tasks the server waits for), ``results-file``, ``model`` (``auto``: logistic for
    the FedEM family and on ``fedem-synthetic``, else svm), ``generator`` / ``n-test``
    (``fedem-synthetic``), ``iid`` (``sparse-federated``), ``checkpoint-dir`` /
    ``checkpoint-every``, ``client-state-dir``, ``tasks-per-node`` (task packing, 0:
    automatic in ``fmtl run``, 1 in a Flower app), and Flower's ``min-tasks`` (0: all),
    ``min-available-nodes``, ``fraction-train``, ``min-train-nodes``, ``fraction-evaluate``,
    ``min-evaluate-nodes`` (:class:`~fmtl_flower.settings.CommonSettings`).

    The family keys are the settings of :mod:`fmtl_flower.settings` (documented there), with
    the wire's spellings of "unset": 0 for ``mocha.s2``, ``mocha.eta``, ``mocha.clusters``,
    ``mocha.clock-cycle``, ``mocha.max-row-norm``, ``mocha.mb-sgd-beta`` (the Pegasos step),
    ``fsvrg.h``, ``fsvrg.step``; "" for ``mocha.lambda2``; ``mocha.lambda`` may be ``cv``
    (5-fold cross-validation by ``fmtl run``). Besides them: ``fedem.train-tasks-frac``
    (tasks t >= floor(frac T) are unseen clients), ``ofmtl.arrivals`` ("", ``shuffle`` or a
    permutation ``3,0,2,1``: the order in which the tasks join).

    Its fields are :class:`fmtl_flower.settings.RunKeys`' (the run's own keys) and, added
    below, every setting's with a key.
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            key = f.metadata["key"]
            object.__setattr__(self, f.name, f.metadata["check"](key, getattr(self, f.name)))

    if TYPE_CHECKING:  # the attributes added from the settings (:func:`_setting_fields`)
        def __getattr__(self, name: str) -> Any: ...

    @property
    def model_family(self) -> str:
        """The model family ``model`` resolves to for this strategy."""
        if self.model != "auto":
            return self.model
        if self.strategy in ("local", "global") and self.dataset != "fedem-synthetic":
            return "svm"  # the MOCHA paper's baselines
        return "logistic"

    @property
    def family(self) -> Family | None:
        """The family serving this run (:mod:`fmtl_flower.families`); None for a
        centralised baseline."""
        return family_of_strategy(self.strategy, self.model_family)

    @property
    def is_fedem_family(self) -> bool:
        """Whether the run uses FedEM's strategy and clients."""
        family = self.family
        return family is not None and family.name == "fedem"

    @classmethod
    def keys(cls) -> list[str]:
        """The run-config keys, in declaration order."""
        return [f.metadata["key"] for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: RunConfig | None = None,
                     ignore_unknown: bool = False, foreign_defaults: bool = False
                     ) -> RunConfig:
        """Validate ``values`` on top of ``base`` (default: the defaults).

        Parameters
        ----------
        values : mapping
            Run-config keys (dotted) and raw values; a deprecated flat name (``theta``) is
            read as its key (``mocha.theta``) with a :class:`DeprecationWarning`.
        base : RunConfig, optional
            The values not given.
        ignore_unknown : bool
            Skip unknown keys (an app's own keys in ``context.run_config``) instead of
            raising.
        foreign_defaults : bool
            Accept keys of another family than ``strategy``'s when they hold their default
            (a ``pyproject.toml`` lists every family's defaults); otherwise any such key is
            an error naming the family it belongs to.

        Raises
        ------
        ConfigError
            On an unknown key, a bad value, a key given twice (old and new name) or a key of
            another family, naming the key.
        """
        base = base or cls()
        by_key = {f.metadata["key"]: f for f in dataclasses.fields(cls)}
        strategy = strategy_name("strategy", values.get("strategy", base.strategy))
        parsed: dict[str, Any] = {}
        for raw_key, raw in values.items():
            key = _current_key(raw_key, strategy)
            if key not in by_key:
                if ignore_unknown:
                    continue
                raise ConfigError(f"{unknown_key_message(raw_key)}; known keys: "
                                  f"{', '.join(sorted(by_key))}")
            if key in parsed:
                raise ConfigError(f"{key} given twice (once as its deprecated name "
                                  f"{_FLAT.get(key, key)!r})")
            f = by_key[key]
            if key != raw_key:
                warnings.warn(f"run-config key {raw_key!r} is deprecated; use {key!r} (in "
                              f"pyproject.toml: [tool.flwr.app.config.{key.split('.')[0]}])",
                              DeprecationWarning, stacklevel=2)
            if not _reads(strategy, key):
                _foreign(key, strategy, raw, f, foreign_defaults)
            parsed[key] = f.metadata["check"](key, raw)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
        fields.update({by_key[key].name: value for key, value in parsed.items()})
        return cls(**fields)

    def to_dict(self, *, every_family: bool = False) -> dict[str, Any]:
        """The run-config keys of this run's strategy and their values (for results JSON
        and ``--run-config``); ``every_family``: every key."""
        return {f.metadata["key"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if every_family or _reads(self.strategy, f.metadata["key"])}


def _setting_fields() -> list[tuple[str, Any, Any]]:
    """The run config's fields of the settings with a run-config key: one per key (the first
    family that declares it), named by the setting's ``attr`` (default its name), with its
    wire default and check."""
    explicit = {f.metadata["key"] for f in dataclasses.fields(_RunConfigKeys)}
    out: list[tuple[str, Any, Any]] = []
    for cls in SETTINGS_CLASSES:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["key"] is None or meta["key"] in explicit:
                continue
            explicit.add(meta["key"])
            out.append((meta["attr"] or f.name, Any,
                        setting(meta["wire_default"], meta["wire_check"], meta["key"])))
    return out


RunConfig = dataclasses.make_dataclass("RunConfig", _setting_fields(), bases=(_RunConfigKeys,),
                                       frozen=True)
RunConfig.__module__ = __name__  # pickled into Ray workers by its name
RunConfig.__doc__ = _RunConfigKeys.__doc__


def _reads(strategy: str, key: str) -> bool:
    """Whether a run of ``strategy`` reads ``key`` (common keys: always)."""
    namespace, dot, _ = key.partition(".")
    return not dot or strategy in _readers(namespace)


def _foreign(key: str, strategy: str, raw: Any, f: dataclasses.Field,
             defaults_ok: bool) -> None:
    """A key of another family than ``strategy``'s: an error naming that family, unless
    ``defaults_ok`` and it holds its default."""
    if defaults_ok:
        try:
            if f.metadata["check"](key, raw) == f.default:
                return
        except ConfigError:
            pass
    family = namespaces()[key.partition(".")[0]][1]
    raise ConfigError(f"{key} belongs to {family}; strategy={strategy} does not read it "
                      "(remove it, or set it for a run of that family)")


def _by_strategy(fsvrg: str, other: str) -> Callable[[str], str]:
    return lambda strategy: fsvrg if strategy in FSVRG_FAMILY else other


#: The flat names of the previous release that now have one key per meaning.
_SPLIT_KEYS: dict[str, Callable[[str], str]] = {
    "beta": lambda s: "mocha.mb-sgd-beta" if s == "mb-sgd" else "mocha.mb-sdca-beta",
    "local-epochs": _by_strategy("fsvrg.local-epochs", "fedem.local-epochs"),
    "max-update-ratio": _by_strategy("fsvrg.max-update-ratio", "fedem.max-update-ratio"),
    "step-size": lambda s: "fsvrg.step" if s in ("gd", "dane") else "fsvrg.h",
}
#: Dotted key -> its flat name of the previous release (the one-to-one renames).
_FLAT: dict[str, str] = {
    f.metadata["key"]: f.metadata["key"].partition(".")[2]
    for f in dataclasses.fields(RunConfig) if "." in f.metadata["key"]
} | {"fsvrg.dane-mu": "dane-mu"}
_FLAT = {key: flat for key, flat in _FLAT.items()
         if flat not in _SPLIT_KEYS and key not in ("mocha.mb-sdca-beta", "mocha.mb-sgd-beta",
                                                    "fsvrg.h", "fsvrg.step")}
_DOTTED = {flat: key for key, flat in _FLAT.items()}


def _current_key(key: str, strategy: str) -> str:
    """``key``, or the key a deprecated flat name stands for in a run of ``strategy``."""
    if key in _SPLIT_KEYS:
        return _SPLIT_KEYS[key](strategy)
    return _DOTTED.get(key, key)


def unseen_tasks(cfg: RunConfig, num_tasks: int) -> list[int]:
    """The held-out tasks: t >= floor(train-tasks-frac * T) (the FedEM generator's rule)."""
    first = int(cfg.train_tasks_frac * num_tasks)
    if first < 1:
        raise ConfigError(f"fedem.train-tasks-frac={cfg.train_tasks_frac} leaves no training "
                          f"task among {num_tasks}")
    return list(range(first, num_tasks))


def settings_from_config(cfg: RunConfig, num_tasks: int, num_classes: int | None = None
                         ) -> StrategySettings:
    """The settings of ``cfg.strategy``'s constructor, from the run config.

    Every setting with a run-config key takes it (through the field's wire conversion);
    the rest come from the common keys: the method from ``strategy``, the discovery timeout
    max(``round-timeout``, 60 s), FedEM's model from ``model`` and its unseen tasks from
    ``fedem.train-tasks-frac``, OFMTL's MOCHA rounds from ``num-server-rounds``.

    Raises
    ------
    ConfigError
        ``mocha.lambda=cv`` (a sweep run by ``fmtl run`` before a federation starts), an svm
        model for the FedEM family, or an invalid setting (naming its key).
    """
    family = cfg.family
    if family is not None and family.name == "fedem" and cfg.model_family == "svm":
        raise ConfigError(f"strategy={cfg.strategy} trains logistic, softmax or mlp "
                          "models, not svm (model=auto picks logistic)")
    if cfg.lam == "cv" and cfg.strategy in _readers("mocha"):
        raise ConfigError("mocha.lambda=cv is a cross-validation sweep run by `fmtl run` "
                          "before the federation starts; a ServerApp needs a number "
                          "(e.g. mocha.lambda=1e-3)")
    derived: dict[str, Callable[[], Any]] = {
        "method": lambda: cfg.strategy, "model": lambda: cfg.model_family,
        "num_classes": lambda: num_classes,
        "unseen_tasks": lambda: unseen_tasks(cfg, num_tasks),
        "mocha_rounds": lambda: cfg.num_server_rounds,
        "arrival_timeout": lambda: cfg.round_timeout}
    cls = MOCHASettings if family is None else _settings_class(family.settings)
    arguments = ("method",) if family is None else family.settings_arguments
    return cls.from_run_config(cfg.to_dict(every_family=True),
                               discovery_timeout=max(cfg.round_timeout, 60.0),
                               **{name: derived[name]() for name in arguments})


def _settings_class(name: str) -> type[StrategySettings]:
    """A family's settings class: a name in :mod:`fmtl_flower.settings`, or
    ``"module:Class"`` for a family outside the package."""
    if ":" not in name:
        return getattr(_settings, name)
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def split_set_option(pair: str) -> tuple[str, str]:
    """``"key=value"`` (one ``--set`` option) as ``(key, value)``, both stripped."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
    return key.strip(), value.strip()


def parse_set_options(pairs: list[str]) -> dict[str, str]:
    """Turn ``["key=value", ...]`` (``--set`` options) into a dict, with clear errors."""
    return dict(split_set_option(pair) for pair in pairs)
