"""Run config -> Flower objects: the ServerApp and ClientApp of every strategy over a named dataset.

These factories serve ``flwr run .`` (config read from ``context.run_config``) and the
``fmtl`` CLI (config baked in, so it reaches Ray workers too).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from collections.abc import Callable
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from ..clients.common import default_task_id
from ..config import (
    ASYNC_MOCHA,
    FEDERATED,
    ConfigError,
    RunConfig,
    settings_from_config,
)
from ..core import jit
from ..engine import GridWrapper, InProcessGrid
from ..families import FAMILIES, Family, family_named
from ..legacy import detect_legacy
from ..packing import MAX_SLOTS_PER_NODE, PackedGrid, packed_client_app, tasks_of_node
from ..polling import poll_replies

if TYPE_CHECKING:  # the strategies, the other clients and the datasets load on first use
    from ..data import MultiTaskDataset
    from ..strategies.fedem import FedEM
    from ..strategies.fsvrg import FSVRG
    from ..strategies.mbsgd import MbSGD
    from ..strategies.mocha import MOCHA
    from ..strategies.ofmtl import OFMTL

ResultsCallback = Callable[[dict[str, Any]], None]


def config_from_context(context: Context, config: RunConfig | None) -> RunConfig:
    """The baked-in config if any, else the run config Flower passes (strict: a key that is
    no run-config key is a ConfigError naming the closest valid one; another family's keys
    at their defaults are read past, as this project's pyproject.toml lists them all)."""
    if config is not None:
        return config
    return RunConfig.from_mapping(dict(context.run_config), foreign_defaults=True)


def dataset_for(cfg: RunConfig) -> MultiTaskDataset:
    """The dataset named by ``cfg`` (cached per process; arrays read-only)."""
    from ..data.registry import load_dataset_cached

    name, options = _dataset_arguments(cfg)
    return load_dataset_cached(name, **dict(options))


def _dataset_arguments(cfg: RunConfig) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The dataset name and the loader's keyword arguments ``cfg`` names (hashable: the key
    of the per-process caches of the dataset and of its label mode)."""
    from ..data.registry import FEDEM_SYNTHETIC, SPARSE_FEDERATED

    extra: dict[str, Any] = {}
    if cfg.dataset == FEDEM_SYNTHETIC:
        extra = {"generator": cfg.generator, "n_test": cfg.n_test or None}
    if cfg.dataset == SPARSE_FEDERATED:
        extra = {"iid": cfg.iid}
    options = dict(seed=cfg.seed, test_frac=cfg.test_frac, num_tasks=cfg.num_tasks or None,
                   dim=cfg.dim or None, samples_per_task=cfg.samples_per_task or None,
                   skew=cfg.skew or None, **extra)
    return cfg.dataset, tuple(options.items())


def dataset_task_of(cfg: RunConfig, num_tasks: int, task_id: int) -> int:
    """Which dataset task task id ``task_id`` serves: OFMTL's order of arrival, identity
    otherwise (O(1), as a client asks at every load).

    ``arrivals=""``: task order; ``"shuffle"``: a permutation drawn from the seed; a list:
    that permutation (it must cover every task).
    """
    if not 0 <= task_id < num_tasks:
        raise IndexError(f"task id {task_id} outside 0..{num_tasks - 1}")
    if cfg.strategy != "ofmtl" or not cfg.arrivals:
        return task_id
    return _permutation(cfg.arrivals, cfg.seed, num_tasks)[task_id]


@functools.lru_cache(maxsize=8)
def _permutation(arrivals: str, seed: int, num_tasks: int) -> tuple[int, ...]:
    if arrivals == "shuffle":
        from ..core.rng import arrival_permutation

        return tuple(int(t) for t in arrival_permutation(seed, num_tasks))
    order = tuple(int(t) for t in arrivals.split(","))
    if len(order) != num_tasks:
        raise ConfigError(f"arrivals: a permutation of the {num_tasks} tasks, got "
                          f"{len(order)} entries")
    return order


def is_federated(cfg: RunConfig) -> bool:
    """Whether ``cfg`` runs as a Flower federation (else a centralised baseline)."""
    return cfg.family is not None


def make_client_app(config: RunConfig | None = None) -> ClientApp:
    """ClientApp whose node serves task ``task-id`` / ``partition-id`` of the dataset.

    With ``config`` given, the app of that strategy (Mb-SGD's or the primal-dual one);
    without (``flwr run``), an app that picks the handlers from ``context.run_config``.
    """

    def load(context: Context) -> tuple[np.ndarray, ...]:
        cfg = config_from_context(context, config)
        data = dataset_for(cfg)
        task = data.task(dataset_task_of(cfg, data.num_tasks, default_task_id(context)))
        return task.X_train, task.y_train, task.X_test, task.y_test

    def tasks_for(context: Context) -> list[int]:
        cfg = config_from_context(context, config)
        return tasks_of_node(context.node_config, cfg.tasks_per_node,
                             cfg.num_tasks or dataset_for(cfg).num_tasks)

    if config is not None:
        app = _client_app_of(config, load)
        if config.tasks_per_node <= 1:  # 0 (automatic) is resolved by `fmtl run`; here 1
            return app
        stacked = _stacked_handler(app)  # MOCHA's, Mb-SGD, FedEM's, FSVRG's: stacked messages
        if stacked is None:
            return packed_client_app(app, tasks_for)
        return packed_client_app(app, tasks_for, {stacked.protocol: stacked},
                                 {"query.whoami": stacked.whoami})
    handlers = _LazyHandlers(load)
    app = ClientApp()
    app.query("whoami")(lambda msg, ctx: handlers.of(ctx).whoami(msg, ctx))
    app.train()(lambda msg, ctx: handlers.of(ctx).train(msg, ctx))
    app.evaluate()(lambda msg, ctx: handlers.of(ctx).evaluate(msg, ctx))
    for family in FAMILIES:  # each family's own messages (OFMTL's newcomers, FSVRG's queries)
        for kind, name, method in family.messages:
            getattr(app, kind)(name)(handlers.serving(family.name, method))
    # packed messages when tasks-per-node > 1: the families with a stacked handler
    return packed_client_app(app, tasks_for, {f.name: handlers.stacked(f.name)
                                              for f in FAMILIES if f.stacks})


def load(spec: str) -> Any:
    """The object a family entry names (:class:`~fmtl_flower.families.Family`):
    ``"module:attribute"``, the module relative to this package when its first part is one
    of the package's (``"strategies.mocha:MOCHA"``), absolute otherwise; imported on first
    use."""
    module, _, attribute = spec.partition(":")
    if (_PACKAGE_ROOT / module.partition(".")[0]).is_dir() \
            or (_PACKAGE_ROOT / f"{module}.py").is_file():
        module = f"{_PACKAGE}.{module}"
    return getattr(importlib.import_module(module), attribute)


_PACKAGE = __package__.rpartition(".")[0]  # fmtl_flower
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def stacked_handler_of(protocol: str, client: Any) -> Any:
    """The stacked handler of ``protocol`` (a family's name) over ``client`` (its
    family's handlers); ValueError when ``client`` serves another family."""
    family = family_named(protocol)
    if family.stacked is None or not isinstance(client, load(family.client)):
        raise ValueError(f"a stacked {protocol} message in a run of another strategy")
    return load(family.stacked)(client)


def _stacked_handler(app: ClientApp) -> Any:
    """The stacked handler (:mod:`fmtl_flower.packing`) over ``app``'s handlers, if its
    strategy has one."""
    for family in FAMILIES:
        if family.stacks and family.app_attribute and hasattr(app, family.app_attribute):
            return stacked_handler_of(family.name, getattr(app, family.app_attribute))
    return None


def _client_options(family: Family, config: RunConfig) -> dict[str, Any]:
    """The run-derived keyword arguments ``family``'s handlers and ClientApp take."""
    options = {"state_dir": lambda: config.client_state_dir or None,
               "labels": lambda: mocha_labels(config)}
    return {name: options[name]() for name in family.client_options}


class _LazyHandlers:
    """The handlers of each strategy family, each built (and its modules imported) the first
    time a message of a run of that family arrives: a MOCHA device never imports FedEM's,
    FSVRG's or Mb-SGD's code (nor scipy), a ClientApp process serves only what it is sent."""

    def __init__(self, load_data: Callable[[Context], tuple[np.ndarray, ...]]) -> None:
        self._load = load_data
        self._clients: dict[Any, Any] = {}

    def of(self, context: Context) -> Any:
        """The handlers serving ``context.run_config``'s strategy."""
        cfg = config_from_context(context, None)
        family = cfg.family
        if family is None:
            raise ConfigError(f"strategy={cfg.strategy} is a centralised baseline, not a "
                              "federation: no device handlers serve it")
        return self.get(family.name, "labels" in family.client_options
                        and mocha_labels(cfg) or None)

    def serving(self, family: str, method: str) -> Callable[[Any, Context], Any]:
        """A message handler calling ``method`` of ``family``'s handlers."""
        return lambda message, context: getattr(self.get(family), method)(message, context)

    def stacked(self, protocol: str) -> Callable[..., Any]:
        """The stacked handler of ``protocol`` (a family with one, :mod:`fmtl_flower.packing`)
        over the run's handlers, built on first use."""
        def handle(message: Any, context: Context, slot_tasks: Any) -> Any:
            client = self.of(context)
            key = ("stacked", protocol, id(client))
            packed = self._clients.get(key)
            if packed is None:
                packed = self._clients[key] = stacked_handler_of(protocol, client)
            return packed(message, context, slot_tasks)

        return handle

    def get(self, family: str, labels: str | None = None) -> Any:
        """The handlers of ``family`` (a name of :data:`~fmtl_flower.families.FAMILIES`),
        built once (once per ``labels`` mode for a family whose handlers take it,
        :func:`mocha_labels`)."""
        key = family if labels is None else (family, labels)
        client = self._clients.get(key)
        if client is None:
            extra = {} if labels is None else {"labels": labels}
            client = self._clients[key] = load(family_named(family).client)(self._load,
                                                                            **extra)
        return client


def _client_app_of(config: RunConfig, load_data: Callable[[Context], tuple[np.ndarray, ...]]
                   ) -> ClientApp:
    """The ClientApp of ``config.strategy``'s family's handlers over ``load_data``."""
    family = config.family
    if family is None:
        raise ConfigError(f"strategy={config.strategy} is a centralised baseline, not a "
                          "federation: it has no ClientApp")
    return load(family.client_app)(load_data, **_client_options(family, config))


def mocha_labels(cfg: RunConfig) -> str:
    """The label mode of MOCHA's devices in a run of ``cfg``: ``"auto"`` (K classes agreed
    at discovery, :mod:`fmtl_flower.core.multiclass`) when the dataset holds more than two
    distinct labels (``digits-dirichlet``), else ``"pm1"`` as before (binary runs unchanged;
    lazy and sparse datasets are not scanned). Scanned once per dataset and process: the
    lazy ClientApp asks at every message."""
    return _label_mode(*_dataset_arguments(cfg))


@functools.lru_cache(maxsize=8)
def _label_mode(name: str, options: tuple[tuple[str, Any], ...]) -> str:
    """:func:`mocha_labels` of the dataset ``name`` loaded with ``options``."""
    from ..data import MultiTaskDataset
    from ..data.lazy import LazyFederatedDataset
    from ..data.registry import load_dataset_cached

    data = load_dataset_cached(name, **dict(options))
    if not isinstance(data, MultiTaskDataset) or isinstance(data, LazyFederatedDataset):
        return "pm1"
    labels: set[Any] = set()
    for task in data.tasks:
        labels.update(np.unique(task.y_train).tolist())
        labels.update(np.unique(task.y_test).tolist())
        if len(labels) > 2:
            return "auto"
    return "pm1"


def strategy_from_config(cfg: RunConfig, num_tasks: int,
                         on_round: Callable[[dict[str, Any]], None] | None = None,
                         num_classes: int | None = None
                         ) -> MOCHA | MbSGD | FedEM | OFMTL | FSVRG:
    """The strategy configured by ``cfg``: its class (:func:`strategy_class`) built from the
    settings of the run config (:func:`fmtl_flower.config.settings_from_config`), with
    checkpoints on when ``checkpoint-dir`` is set. ``on_round`` gets every record (OFMTL:
    every event's)."""
    settings = settings_from_config(cfg, num_tasks, num_classes)
    cls = strategy_class(cfg)
    # every strategy of the package has for_run; a registered family's own class may not
    for_run = getattr(cls, "for_run", None)
    strategy = (for_run(num_tasks, settings, on_round) if for_run is not None
                else cls(num_tasks, settings, on_round=on_round))
    if cfg.dp_mechanism != "none":  # dp.*: strategies/privacy.py routes it to the family's
        from ..settings import DPSettings
        from ..strategies.privacy import enable_client_dp

        enable_client_dp(strategy, DPSettings.from_run_config(cfg.to_dict(every_family=True)))
    if cfg.checkpoint_dir:  # every N rounds (OFMTL: after every event; async: N x m replies)
        strategy.enable_checkpoints(cfg.checkpoint_dir, every=cfg.checkpoint_every)
    return strategy


def strategy_class(cfg: RunConfig) -> type:
    """The strategy class of ``cfg.strategy``'s family (imported on first use)."""
    family = cfg.family
    if family is None:
        raise ConfigError(f"strategy={cfg.strategy} is a centralised baseline, not a "
                          "federation: it has no strategy class")
    return load(family.strategy)


def build_results(cfg: RunConfig, strategy: MOCHA | MbSGD | FedEM | OFMTL | FSVRG
                  ) -> dict[str, Any]:
    """The results contract: ``{"config", "rounds", "final"}``, plus ``health`` (missed
    rounds per task, exclusions) where the strategy tracks it, and ``privacy`` (record-level
    DP: every device's epsilon, the noise multiplier, clip and delta)."""
    out = strategy.results()
    results = {"config": cfg.to_dict(), "rounds": out["rounds"], "final": out["final"]}
    for key in ("health", "privacy"):
        if key in out:
            results[key] = out[key]
    return results


#: ``kernels`` of a deployment's results: each device runs its own ``FMTL_KERNELS`` (default
#: ``auto``), which the server cannot see.
DEVICE_KERNELS = "device"


def engine_of(grid: Grid) -> str:
    """The engine a ServerApp runs on, by its grid (wrappers such as PackedGrid looked
    through): ``inprocess`` (:class:`fmtl_flower.engine.InProcessGrid`), ``ray`` (Flower's
    simulation engine, whose grid is flwr's ``InMemoryGrid``) or ``deployment`` (a SuperLink's
    grid, or any other)."""
    while isinstance(grid, GridWrapper):
        grid = grid.inner
    if isinstance(grid, InProcessGrid):
        return "inprocess"
    return "ray" if type(grid).__name__ == "InMemoryGrid" else "deployment"


def kernels_of(engine: str) -> str:
    """The results' ``kernels``: a simulation's choice (:func:`fmtl_flower.core.jit.
    simulation_choice`, what its ClientApps run), or :data:`DEVICE_KERNELS` on a deployment."""
    return DEVICE_KERNELS if engine == "deployment" else jit.simulation_choice()[0]


def write_results(path: str | os.PathLike[str], results: dict[str, Any]) -> None:
    """Write results JSON atomically (write then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=_json_default))
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def server_num_tasks(cfg: RunConfig, grid: Grid) -> int:
    """The ServerApp's number of tasks: ``num-tasks`` when set; else, with
    ``min-available-nodes`` set, the tasks of the nodes online once that many are
    (:func:`~fmtl_flower.strategies.discovery.discover_num_tasks`: Flower's habit of sizing
    a run by its SuperNodes); else the named dataset's task count."""
    if cfg.num_tasks:
        return cfg.num_tasks
    if cfg.min_available_nodes:
        from ..strategies.discovery import discover_num_tasks

        return discover_num_tasks(grid, cfg.min_available_nodes,
                                  max(cfg.round_timeout, 60.0), cfg.strategy)
    return dataset_for(cfg).num_tasks


def make_server_app(config: RunConfig | None = None,
                    on_round: Callable[[dict[str, Any]], None] | None = None,
                    on_done: ResultsCallback | None = None) -> ServerApp:
    """The ServerApp of ``cfg.strategy``: waits for the tasks, runs the rounds, reports results.

    The number of tasks is ``num-tasks`` when set, else that of the nodes online once
    ``min-available-nodes`` are (when set), else the named dataset's task count
    (:func:`server_num_tasks`).
    With ``results-file`` set, the results JSON is written there; besides what
    :func:`build_results` gives it holds ``engine`` (:func:`engine_of`), ``kernels``
    (:func:`kernels_of`) and ``wall_time_s`` (the ServerApp's, discovery included).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        started = time.perf_counter()
        engine = engine_of(grid)
        cfg = config_from_context(context, config)
        if not is_federated(cfg):
            raise ConfigError(f"strategy={cfg.strategy} with model={cfg.model_family} is a "
                              "centralised baseline: run it with `fmtl run`; a Flower "
                              f"federation runs one of {FEDERATED} (or local with a model "
                              "other than svm)")
        grid = poll_replies(grid, cfg.reply_poll_interval)  # a deployment's: not every 3 s
        if cfg.tasks_per_node > 1:  # one message per node carries all of its tasks
            grid = PackedGrid(grid, query_timeout=max(cfg.round_timeout, 60.0),
                              max_slots_per_node=max(MAX_SLOTS_PER_NODE, cfg.tasks_per_node))
        grid = detect_legacy(grid)  # before counting tasks: NumPyClient devices answer too
        num_tasks = server_num_tasks(cfg, grid)
        strategy = strategy_from_config(cfg, num_tasks, on_round)
        if cfg.strategy in ASYNC_MOCHA and engine == "deployment":
            strategy.clock = "wall"  # barrier-free MOCHA keeps real time on a deployment
        rounds = 0 if cfg.strategy == "ofmtl" else cfg.num_server_rounds  # OFMTL: until all join
        strategy.start(grid=grid, num_rounds=rounds, timeout=cfg.round_timeout)
        results = build_results(cfg, strategy)
        results.update(engine=engine, kernels=kernels_of(engine),
                       wall_time_s=time.perf_counter() - started)
        final = results["final"]
        log(INFO, "%s finished: primal=%s test_error=%s accuracy_mean=%s", cfg.strategy,
            final.get("primal"), final.get("test_error"), final.get("accuracy_mean"))
        if cfg.results_file:
            write_results(cfg.results_file, results)
        if on_done is not None:
            on_done(results)

    return app
