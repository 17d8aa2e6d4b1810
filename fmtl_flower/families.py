"""The algorithm families: one :class:`Family` entry each, the one place that says what a
family is called and where its halves live.

The apps (:mod:`fmtl_flower.apps.common`: strategy, ClientApp, handlers, stacked handlers),
the CLI, automatic packing and the run config (its ``strategy`` values, namespaces and
settings) read :data:`FAMILIES` instead of branching on names, so adding a family is one
entry here (``docs/architecture.md``, "Where to add things").

This module holds names only and imports nothing of the package: an entry names its
strategy, handlers and ClientApp factory as ``"module:attribute"`` with the module relative
to the package (``"strategies.mocha:MOCHA"``), or absolute for a family outside it
(``"my_package.toy:ToyStrategy"``); :mod:`fmtl_flower.apps.common`, the top layer, imports
them when a run first needs them. So a MOCHA device still never imports FedEM's code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family", "family_named", "family_of_strategy", "register_family",
           "strategies_of"]

#: The run-derived values a family's settings class may take besides its run-config keys
#: (:func:`fmtl_flower.config.settings_from_config` computes them).
SETTINGS_ARGUMENTS = ("method", "model", "num_classes", "unseen_tasks", "mocha_rounds",
                      "arrival_timeout")
#: The run-derived keyword arguments a family's handlers and ClientApp factory may take.
CLIENT_OPTIONS = ("state_dir", "labels")


@dataclass(frozen=True)
class Family:
    """One algorithm family: its names, its halves and its settings.

    Attributes
    ----------
    name : str
        The family's name; also its stacking protocol when it has a stacked handler
        (:mod:`fmtl_flower.packing`), and the handlers' key on a device.
    strategies : tuple of str
        The run config's ``strategy`` values (and ``fmtl run`` names) it serves; the first
        is the family's own method.
    namespace : str
        The prefix of its run-config keys (``mocha`` for ``mocha.lambda``).
    strategy : str
        Its server half, a ``Strategy`` subclass: ``"module:Class"``.
    client : str
        Its device handlers (``whoami``, ``train``, ``evaluate``): ``"module:Class"``.
    client_app : str
        The factory of its one-family ClientApp: ``"module:function"``.
    settings : str
        Its settings class: a name in :mod:`fmtl_flower.settings`, or ``"module:Class"``
        (absolute) for a family outside the package.
    reads : tuple of str
        Other namespaces whose keys its runs read (OFMTL reads ``mocha.*``).
    stacked : str or None
        The stacked handler over its handlers (several tasks per node), ``"module:Class"``;
        None: one task per node.
    app_attribute : str or None
        The attribute of the ClientApp ``client_app`` builds that holds its handlers (how
        a ClientApp given to ``fmtl`` is recognised for packing).
    messages : tuple of (str, str, str)
        Messages beyond ``query.whoami``, ``train`` and ``evaluate``: ``(kind, name,
        handler method)``, e.g. ``("query", "fsvrg_stats", "stats")``.
    settings_arguments : tuple of str
        Which of :data:`SETTINGS_ARGUMENTS` its settings class takes.
    client_options : tuple of str
        Which of :data:`CLIENT_OPTIONS` its handlers and ``client_app`` take.
    """

    name: str
    strategies: tuple[str, ...]
    namespace: str
    strategy: str
    client: str
    client_app: str
    settings: str
    reads: tuple[str, ...] = ()
    stacked: str | None = None
    app_attribute: str | None = None
    messages: tuple[tuple[str, str, str], ...] = ()
    settings_arguments: tuple[str, ...] = ()
    client_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for value in (self.strategy, self.client, self.client_app,
                      *(() if self.stacked is None else (self.stacked,))):
            module, colon, attribute = value.partition(":")
            if not (module and colon and attribute):
                raise ValueError(f"family {self.name!r}: {value!r} is not 'module:attribute'")
        unknown = (set(self.settings_arguments) - set(SETTINGS_ARGUMENTS)) \
            | (set(self.client_options) - set(CLIENT_OPTIONS))
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown arguments {sorted(unknown)}")
        if not self.strategies:
            raise ValueError(f"family {self.name!r} serves no strategy")

    @property
    def stacks(self) -> bool:
        """Whether its messages stack (packed nodes pay)."""
        return self.stacked is not None


#: Every family, in the order the run config lists their strategies.
FAMILIES: list[Family] = [
    Family("mocha", ("mocha", "cocoa", "mb-sdca"), "mocha",
           "strategies.mocha:MOCHA", "clients.mocha:MOCHAClient",
           "clients.mocha:make_mocha_client_app", "MOCHASettings",
           reads=("dp",), stacked="clients.packed_mocha:PackedMOCHA",
           app_attribute="mocha_client", settings_arguments=("method",),
           client_options=("state_dir", "labels")),
    Family("mb-sgd", ("mb-sgd",), "mocha",
           "strategies.mbsgd:MbSGD", "clients.mbsgd:MbSGDClient",
           "clients.mbsgd:make_mbsgd_client_app", "MbSGDSettings",
           stacked="clients.packed_mbsgd:PackedMbSGD", app_attribute="mbsgd_client"),
    Family("async-mocha", ("async-mocha", "async-cocoa"), "mocha",
           "strategies.async_mocha:AsyncMOCHA", "clients.async_mocha:AsyncMOCHAClient",
           "clients.async_mocha:make_async_mocha_client_app", "MOCHASettings",
           app_attribute="async_mocha_client", settings_arguments=("method",),
           client_options=("state_dir", "labels")),
    Family("fedem", ("fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "cfl", "pfedme",
                     "ifca"), "fedem",
           "strategies.fedem:FedEM", "clients.fedem:FedEMClient",
           "clients.fedem:make_fedem_client_app", "FedEMSettings",
           reads=("dp",), stacked="clients.packed_fedem:PackedFedEM",
           app_attribute="fedem_client",
           settings_arguments=("method", "model", "num_classes", "unseen_tasks"),
           client_options=("state_dir",)),
    Family("ofmtl", ("ofmtl",), "ofmtl",
           "strategies.ofmtl:OFMTL", "clients.ofmtl:OFMTLClient",
           "clients.ofmtl:make_ofmtl_client_app", "OFMTLSettings", reads=("mocha",),
           messages=(("train", "ofmtl", "newcomer"), ("evaluate", "ofmtl", "evaluate_model")),
           settings_arguments=("mocha_rounds", "arrival_timeout")),
    Family("fsvrg", ("fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane"), "fsvrg",
           "strategies.fsvrg:FSVRG", "clients.fsvrg:FSVRGClient",
           "clients.fsvrg:make_fsvrg_client_app", "FSVRGSettings",
           reads=("dp",), stacked="clients.packed_fsvrg:PackedFSVRG",
           app_attribute="fsvrg_client",
           messages=(("query", "fsvrg_stats", "stats"), ("query", "fsvrg_gram", "gram"),
                     ("query", "fsvrg_gradient", "gradient")),
           settings_arguments=("method",), client_options=("state_dir",)),
]

#: The centralised baselines: ``strategy`` values that are no federation (``local`` with a
#: model other than svm is FedEM's local baseline, :func:`family_of_strategy`).
CENTRALISED = ("local", "global")


def family_named(name: str) -> Family:
    """The family called ``name``; KeyError naming the families otherwise."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no family {name!r}; the families are "
                   f"{', '.join(f.name for f in FAMILIES)}")


def family_of_strategy(strategy: str, model_family: str = "svm") -> Family | None:
    """The family serving the run config's ``strategy`` (``local`` with a model other than
    svm: FedEM's local baseline); None for a centralised baseline."""
    if strategy == "local" and model_family != "svm":
        return family_named("fedem")
    for family in FAMILIES:
        if strategy in family.strategies:
            return family
    return None


def strategies_of(*names: str) -> tuple[str, ...]:
    """The ``strategy`` values of the families ``names``, in registry order."""
    return tuple(s for f in FAMILIES if f.name in names for s in f.strategies)


def register_family(family: Family) -> None:
    """Add ``family`` (a family outside the package, or a test's) to :data:`FAMILIES`;
    ValueError when its name or one of its strategies is taken. The run config's
    ``strategy`` values are fixed when :mod:`fmtl_flower.config` is first imported: a
    family registered later is served by the Python API (:mod:`fmtl_flower.apps.common`'s
    factories with a ``RunConfig`` of a registered family's strategy), not by ``fmtl run``."""
    taken = {f.name for f in FAMILIES}
    served = {s for f in FAMILIES for s in f.strategies} | set(CENTRALISED)
    if family.name in taken or served & set(family.strategies):
        raise ValueError(f"family {family.name!r}: its name or a strategy of "
                         f"{family.strategies} is taken")
    FAMILIES.append(family)
