"""What every per-task strategy shares: its run loop, node directory, checkpoints, results.

Checkpoint and resume
---------------------
:meth:`TaskStrategy.enable_checkpoints` makes the strategy write its state after every
``every``-th round (and after the last) to a directory, atomically and without pickle
(:mod:`fmtl_flower.checkpoint`). With ``resume`` on, :meth:`TaskStrategy.start` first looks
for the newest checkpoint there and continues after its round: a resumed server is a new
Flower run, so node ids are discovered afresh and devices reconcile their own state with the
server's by each strategy's commit protocol. A checkpoint written with other settings (its
``fingerprint``: strategy, number of tasks, lambda, ...) is refused with an error naming the
difference. Randomness is derived from (seed, task, round) everywhere, so there is no RNG
state to store: a resumed run draws the same numbers as an uninterrupted one.

The run's identity
------------------
Devices that keep state between messages (MOCHA's and CoCoA+'s dual variables, in
``context.state`` and in ``client-state-dir`` files) must never adopt state written for
another run: two runs on the same devices can share a ``client-state-dir``. So every message
of those strategies' rounds carries the config entry ``run-token`` (str,
:data:`RUN_TOKEN_KEY`; :attr:`TaskStrategy.sent_identity`): a random token the server draws
when a run starts from round 1, then ``.`` and a digest of the settings' ``fingerprint``
(:meth:`TaskStrategy.run_identity`).
Devices store it with their state and treat state of another token as none stored
(:func:`fmtl_flower.clients.dual_state.reconcile`: the commit protocol's reset, logged). The
token is kept in every checkpoint, so a run resumed from one sends the same identity and its
devices' state is still adopted; a checkpoint without one (older files) gets a new token, and
its devices' state is reset.

Flower's strategy knobs
-----------------------
:class:`TaskStrategy` has Flower's usual knobs as attributes (settings, read from the
strategy's ``settings`` and updated there when assigned:
:class:`~fmtl_flower.settings.SettingsHome`; read when ``start`` runs):

``min_available_nodes`` (int, default 0)
    Before the first round's discovery, wait until the grid has at least this many nodes,
    within the discovery time (``discovery_timeout``, at most ``start``'s ``timeout``); else
    :class:`~fmtl_flower.strategies.discovery.DiscoveryError` naming how many were online.
``fraction_train`` (float in (0, 1], default 1.0) and ``min_train_nodes`` (int, default 0)
    For the strategies that sample devices per round (``samples_devices``): each training
    round trains ``max(1, floor(fraction_train * K), min_train_nodes)`` (at most K) of the K
    reachable tasks, drawn uniformly without replacement from the seeded stream
    ``train-sample`` of :mod:`fmtl_flower.core.rng` (FedEM: its ``fedem-sample`` stream). What
    an unsampled device does depends on the method (each strategy's docstring). A strategy
    that does not sample refuses other values with a ``ValueError``.
``fraction_evaluate`` (float in [0, 1], default 1.0) and ``min_evaluate_nodes`` (int, default 0)
    Flower's meaning, for the strategies that evaluate a sample of the devices
    (``samples_evaluation``: the FedEM family): an evaluation round evaluates
    ``max(floor(fraction_evaluate * K), min_evaluate_nodes)`` (at most K; none at 0.0) of the
    K known tasks, drawn from the seeded stream ``evaluate-sample``. MOCHA's family
    evaluates with the training replies, FSVRG and OFMTL every device: they refuse other
    values with a ``ValueError``.
``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` (callable or None, default None)
    None: the strategy's own metrics (the round's record). Otherwise called as Flower's
    ``FedAvg`` calls them, ``fn(contents, weighted_by_key) -> MetricRecord``, with one
    ``RecordDict({"metrics": MetricRecord})`` per task whose reply the trust boundary
    accepted (in task order; the reply's validated scalar metrics, also for the tasks of a
    stacked reply) and ``weighted_by_key`` = ``"n-train"`` (the devices' example count); its
    result replaces the strategy's own in ``Result.train_metrics_clientapp`` /
    ``evaluate_metrics_clientapp`` for that round. Not called when no reply was accepted.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import FLOWER_LOGGER, log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..checkpoint import check_fingerprint, read_checkpoint, write_checkpoint
from ..core.rng import evaluate_sample_rng, train_sample_rng
from ..legacy import detect_legacy
from ..polling import poll_replies
from ..settings import SettingsHome
from ..wire import metric_record, to_array
from .discovery import TaskDirectory, discover_num_tasks, suggested_fix, wait_for_nodes
from .records import KeepsRecords, public_record
from .repeated_errors import collapse_repeated_errors

#: The config entry of every round's messages naming the run (module docstring).
RUN_TOKEN_KEY = "run-token"

#: Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``:
#: ``fn(reply contents, weighted_by_key) -> MetricRecord``.
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


class NoValidReplies(RuntimeError):
    """Several rounds in a row every reply that arrived was an error or was rejected: the
    devices cannot run this configuration (the message names their most common reason)."""

    def __init__(self, name: str, rounds: int, reasons: dict[int, str]) -> None:
        self.reasons = dict(reasons)
        common = Counter(reasons.values()).most_common(1)
        reason, count = common[0] if common else ("no reply", 0)
        fix = suggested_fix(reason)
        super().__init__(f"{name}: no valid reply in {rounds} rounds in a row; {count} of "
                         f"{len(reasons)} tasks failed with: {reason}"
                         + (f". To fix: {fix}" if fix else ""))


#: What a strategy built with ``num_tasks=None`` but no ``min_available_nodes`` says.
NUM_TASKS_NEEDED = ("{name}: num_tasks=None takes the tasks of the nodes online once "
                    "min_available_nodes are (Flower's habit of sizing a run by its "
                    "SuperNodes): give min_available_nodes=N (run config: "
                    "min-available-nodes), or the number of tasks, num_tasks=M")


class SizedAtStart:
    """``num_tasks=None``: the strategy is built when ``start`` runs, for the tasks found.

    A family's constructor given ``num_tasks=None`` checks its settings, calls
    :meth:`build_at_start` and returns; ``start`` then calls :meth:`build_from_nodes`, which
    waits until ``min_available_nodes`` nodes are online, counts the distinct task ids they
    report (:func:`~fmtl_flower.strategies.discovery.discover_num_tasks`, as the project's
    ServerApp does when ``num-tasks`` is unset) and runs the constructor with that count.
    Attributes set on the strategy between construction and ``start`` (``enable_checkpoints``,
    a knob) are set again on the built one. Until then the attributes that depend on the
    task count do not exist: reading one is an AttributeError that says so.
    """

    #: The constructor still to run with the discovered number of tasks (None: built).
    _build_at_start: Callable[[int], None] | None = None

    def build_at_start(self, build: Callable[[int], None], settings: Any) -> None:
        """Defer ``build(num_tasks)`` (the family's constructor with its checked
        ``settings``) to :meth:`build_from_nodes`; a ValueError when ``settings`` has no
        ``min_available_nodes`` (nothing would say how many nodes to wait for)."""
        if not settings.min_available_nodes:
            raise ValueError(NUM_TASKS_NEEDED.format(name=type(self).__name__))
        self.num_tasks = None
        self.min_available_nodes = int(settings.min_available_nodes)
        self.discovery_timeout = float(settings.discovery_timeout)
        self._build_at_start = build
        self._as_deferred = dict(vars(self))

    def build_from_nodes(self, grid: Grid, timeout: float) -> bool:
        """Build a deferred strategy for the tasks online (class docstring), waiting at most
        ``min(discovery_timeout, timeout)`` seconds; False (nothing done) when it was built
        with a number of tasks. Raises what
        :func:`~fmtl_flower.strategies.discovery.discover_num_tasks` raises."""
        build = self._build_at_start
        if build is None:
            return False
        num_tasks = discover_num_tasks(grid, self.min_available_nodes,
                                       min(self.discovery_timeout, timeout),
                                       type(self).__name__)  # (raises: still deferred)
        before = self.__dict__.pop("_as_deferred")
        set_since = {key: value for key, value in vars(self).items()
                     if key not in before or before[key] is not value}
        self._build_at_start = None
        build(num_tasks)
        for key, value in set_since.items():
            setattr(self, key, value)
        return True

    def __getattr__(self, name: str) -> Any:
        """Only called for an attribute not found: on a strategy still to be built, say why."""
        if not name.startswith("__") and self.__dict__.get("_build_at_start") is not None:
            raise AttributeError(f"{type(self).__name__}.{name} exists once start() has built "
                                 "the strategy: num_tasks=None takes the tasks of the nodes "
                                 "online once min_available_nodes are")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class TaskStrategy(SettingsHome, SizedAtStart, KeepsRecords, Strategy):
    """Base of the strategies that keep one model per task (MOCHA and its baselines).

    Subclasses set ``directory`` (a :class:`TaskDirectory`), ``book`` (a
    :class:`~fmtl_flower.strategies.records.RoundRecords`: one record per state k = 0 .. R,
    ``records``, and which are still waiting for their devices' numbers) and
    ``ever_replied`` (bool per task) in their constructor.
    """

    directory: TaskDirectory
    ever_replied: np.ndarray
    num_rounds: int | None = None
    round_timeout: float = 120.0
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 1
    resume: bool = True
    #: Rounds in a row in which replies arrive but none is valid before ``start`` stops
    #: with :class:`NoValidReplies` (0: never stop).
    max_failed_rounds: int = 3
    resumed_from: int = 0  # round of the checkpoint this run continued from (0: none)
    run_token: str | None = None  # drawn by start, or restored from the checkpoint
    #: The run's identity as its messages send it (``run-token``; "" until ``start``).
    sent_identity: str = ""
    last_checkpoint_round: int = 0  # round of the newest checkpoint written or resumed from
    # Flower's knobs (module docstring): settings, read from ``settings`` (SettingsHome).
    min_available_nodes: int
    fraction_train: float
    min_train_nodes: int
    fraction_evaluate: float
    min_evaluate_nodes: int
    train_metrics_aggr_fn: MetricsAggrFn | None
    evaluate_metrics_aggr_fn: MetricsAggrFn | None
    #: Seconds between pulls of a deployment's replies (``reply-poll-interval``).
    reply_poll_interval: float
    #: The reply metric that counts a device's examples (Flower's ``weighted_by_key``).
    weighted_by_key: str = "n-train"
    #: Whether the strategy samples devices per round (honours ``fraction_train`` and
    #: ``min_train_nodes``); the others refuse values other than the defaults.
    samples_devices: bool = False
    #: Whether the strategy evaluates a sample of the devices (honours ``fraction_evaluate``
    #: and ``min_evaluate_nodes``); the others refuse values other than the defaults.
    samples_evaluation: bool = False

    @classmethod
    def for_run(cls, num_tasks: int, settings: Any,
                on_round: Callable[[dict[str, Any]], None] | None = None) -> TaskStrategy:
        """The strategy of a run (``fmtl run`` / ``flwr run``: the apps build every family's
        strategy this way) over ``num_tasks`` tasks with ``settings``; ``on_round`` gets
        every record."""
        return cls(num_tasks, settings, on_round=on_round)

    @property
    def display_name(self) -> str:
        """The method's name in log lines (FedEM's family: the method's, e.g. FedAvg)."""
        name = getattr(self, "name", None)
        return name if isinstance(name, str) and name else type(self).__name__

    @property
    def first_round(self) -> int:
        """The first round this run trains (1, or the one after the resumed checkpoint)."""
        return self.resumed_from + 1

    def start(self, grid: Grid, initial_arrays: ArrayRecord | Any = None, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run rounds up to ``num_rounds`` plus a final metrics round, as ``Strategy.start``
        does, after resuming from the newest checkpoint when enabled (the rounds it covers are
        not run again). A checkpoint is written after a round's train and evaluate phases.

        ``initial_arrays`` seeds the model where the method has one global start
        (:meth:`seed_model`: MOCHA and its baselines, Mb-SGD ``{"W": (d, m) or (d,)}``, FSVRG
        ``{"w": (d,)}``, FedEM ``model="torch"`` a state_dict); elsewhere a non-empty one is a
        ValueError. It may be an ``ArrayRecord`` (also Flower's ``ArrayRecord([W0])``: one
        unnamed array is the model), a numpy array or a dict of numpy arrays
        (:func:`as_array_record`). ``timeout`` bounds every exchange, the first round's
        discovery included (the strategy's ``discovery_timeout`` is lowered to it). Raises
        :class:`~fmtl_flower.strategies.discovery.DiscoveryError` (a ``RuntimeError``) when
        fewer than :attr:`min_tasks` tasks have a node by then; a ``ValueError`` at once
        unless ``num_rounds`` is an int >= 1 and ``timeout`` a number > 0
        (:func:`check_run_length`). NumPyClient devices are found and served through
        :func:`~fmtl_flower.legacy.detect_legacy` (unless ``grid`` is a wrapper already: then
        wrap it in ``LegacyGrid`` yourself). A Flower deployment grid pulls its replies every
        :attr:`reply_poll_interval` s (:func:`~fmtl_flower.polling.poll_replies`). A strategy
        built with ``num_tasks=None`` is first built for the tasks of the nodes online
        (:class:`SizedAtStart`). ``evaluate_fn`` is called as Flower's ``Strategy.start``
        calls it: ``evaluate_fn(0, initial_arrays)`` before round 1 (not again by a resumed
        run), then ``evaluate_fn(k, arrays)`` after round k's evaluation; its results are
        ``Result.evaluate_metrics_serverapp``."""
        num_rounds, timeout = check_run_length(num_rounds, timeout)
        collapse_repeated_errors()  # one line per repeated device traceback (Flower's, Ray)
        grid = poll_replies(grid, self.reply_poll_interval)  # a deployment's, not every 3 s
        grid = detect_legacy(grid)  # a NumPyClient device just works (issue 27)
        self.build_from_nodes(grid, timeout)  # num_tasks=None: the tasks online
        self.check_knobs()
        self.num_rounds, self.round_timeout = num_rounds, timeout
        if getattr(self, "discovery_timeout", None) is not None:  # timeout bounds discovery
            self.discovery_timeout = min(float(self.discovery_timeout), self.round_timeout)
        if self.checkpoint_dir is not None and self.resume:
            self._resume()
        if self.run_token is None:
            self.run_token = secrets.token_hex(8)
        self.sent_identity = self.run_identity()
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        result = Result()
        self._evaluations = []
        initial_arrays = as_array_record(initial_arrays)
        if initial_arrays is not None and self.first_round == 1:
            self.seed_model(initial_arrays)
        elif initial_arrays is not None:
            log(INFO, "%s: resumed from the checkpoint of round %d; initial_arrays not used",
                type(self).__name__, self.resumed_from)
        if self.min_available_nodes and self.first_round <= self.num_rounds:
            wait_for_nodes(grid, self.min_available_nodes,
                           float(getattr(self, "discovery_timeout", None) or timeout),
                           type(self).__name__)
        arrays = ArrayRecord() if initial_arrays is None else initial_arrays
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        started = time.time()
        if evaluate_fn is not None and self.first_round == 1:
            self._evaluate_initial(evaluate_fn, arrays, result)
        failed_rounds = 0
        for server_round in range(self.first_round, self.num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, self.num_rounds)
            boundary = getattr(self, "replies", None)
            if boundary is not None:
                boundary.last = None
            replies = grid.send_and_receive(
                as_taken_by(grid, with_config(
                    self.configure_train(server_round, arrays, train_config, grid),
                    train_config)),
                timeout=timeout)
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            drain(replies)
            last = getattr(boundary, "last", None)
            if self.train_metrics_aggr_fn is not None and last is not None and last.accepted:
                metrics = aggregate_with(self.train_metrics_aggr_fn, last.accepted,
                                         self.weighted_by_key)
            if last is not None and last.failed and not last.accepted:
                failed_rounds += 1
                if self.max_failed_rounds and failed_rounds >= self.max_failed_rounds:
                    raise NoValidReplies(type(self).__name__, failed_rounds, last.failed)
            elif last is not None and last.accepted:
                failed_rounds = 0
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
                result.train_metrics_clientapp[server_round] = metrics
            self._take_evaluations(result)  # evaluations that came with the train replies
            self._evaluate_phase(grid, server_round, arrays, evaluate_config, timeout, result,
                                 evaluate_fn)
            self.maybe_checkpoint(server_round)  # after the round's evaluation, if any
        if self.first_round > self.num_rounds:
            log(INFO, "the checkpoint is of the last round (%d): nothing left to run",
                self.resumed_from)
        log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
        if FLOWER_LOGGER.isEnabledFor(INFO):  # (formatting every round's metrics is costly)
            for line in io.StringIO(str(result)):
                log(INFO, "\t%s", line.strip("\n"))
        return result

    @staticmethod
    def _evaluate_initial(evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
                          arrays: ArrayRecord, result: Result) -> None:
        """Flower's centralized evaluation of the starting arrays: ``evaluate_fn(0,
        arrays)`` before round 1, its result under round 0 of
        ``result.evaluate_metrics_serverapp`` (as ``Strategy.start`` does; a resumed run
        evaluated round 0 when it first started)."""
        served = evaluate_fn(0, arrays)
        log(INFO, "Initial global evaluation results: %s", served)
        if served is not None:
            result.evaluate_metrics_serverapp[0] = served

    def _evaluate_phase(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                        config: ConfigRecord, timeout: float, result: Result,
                        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
                        ) -> None:
        boundary = getattr(self, "replies", None)
        if boundary is not None:
            boundary.last = None
        replies = grid.send_and_receive(
            as_taken_by(grid, with_config(
                self.configure_evaluate(server_round, arrays, config, grid), config)),
            timeout=timeout)
        metrics = self.aggregate_evaluate(server_round, replies)
        drain(replies)
        self._take_evaluations(result)
        if metrics is not None:
            log_round_summary(self.display_name, server_round, metrics)
        last = getattr(boundary, "last", None)
        if (metrics is not None and self.evaluate_metrics_aggr_fn is not None
                and last is not None and last.accepted):
            metrics = aggregate_with(self.evaluate_metrics_aggr_fn, last.accepted,
                                     self.weighted_by_key)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics
        if evaluate_fn is not None:
            served = evaluate_fn(server_round, arrays)
            if served is not None:
                result.evaluate_metrics_serverapp[server_round] = served

    # ------------------------------------------------------------------ Flower's knobs
    def check_knobs(self) -> None:
        """ValueError naming the first of Flower's knobs (module docstring) with a bad value,
        or one this strategy does not honour."""
        name = type(self).__name__
        for key in ("min_available_nodes", "min_train_nodes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be an int >= 0, got {value!r}")
        fraction = self.fraction_train
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
                or not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction_train must be a number in (0, 1], got {fraction!r}")
        if not self.samples_devices and (fraction != 1.0 or self.min_train_nodes):
            raise ValueError(f"{name} trains every device in every round; fraction_train and "
                             "min_train_nodes are for the strategies that sample devices "
                             f"(got fraction_train={fraction!r}, "
                             f"min_train_nodes={self.min_train_nodes!r})")
        for key in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
            value = getattr(self, key)
            if value is not None and not callable(value):
                raise ValueError(f"{key} must be callable or None, got {value!r}")
        check_evaluate_knobs(self, name)

    def train_sample_size(self, eligible: int) -> int:
        """How many of ``eligible`` tasks a training round samples: ``max(1, floor(
        fraction_train * eligible), min_train_nodes)``, at most ``eligible``."""
        if eligible <= 0:
            return 0
        count = max(1, math.floor(self.fraction_train * eligible), self.min_train_nodes)
        return min(count, eligible)

    def sample_train_tasks(self, eligible: Iterable[int], server_round: int,
                           seed: int) -> list[int]:
        """The tasks of ``eligible`` that train in ``server_round`` (all of them unless
        ``fraction_train`` < 1 or ``min_train_nodes`` cut them; sorted), drawn from the
        seeded stream ``train-sample`` (:mod:`fmtl_flower.core.rng`)."""
        ordered = sorted(map(int, eligible))
        count = self.train_sample_size(len(ordered))
        if count >= len(ordered):
            return ordered
        tasks = np.array(ordered, dtype=np.int64)
        rng = train_sample_rng(seed, server_round)
        return sorted(int(t) for t in rng.choice(tasks, size=count, replace=False))

    def sample_evaluate_tasks(self, eligible: Iterable[int], server_round: int,
                              seed: int) -> list[int]:
        """The tasks of ``eligible`` evaluated in ``server_round``, as Flower's ``FedAvg``
        counts them: ``max(floor(fraction_evaluate * K), min_evaluate_nodes)`` of the K
        (at most K; none when ``fraction_evaluate`` is 0), drawn from the seeded stream
        ``evaluate-sample`` (:mod:`fmtl_flower.core.rng`); sorted."""
        ordered = sorted(map(int, eligible))
        if self.fraction_evaluate == 0.0:
            return []
        count = max(math.floor(self.fraction_evaluate * len(ordered)), self.min_evaluate_nodes)
        if count >= len(ordered):
            return ordered
        rng = evaluate_sample_rng(seed, server_round)
        return sorted(int(t) for t in rng.choice(np.array(ordered, dtype=np.int64),
                                                 size=count, replace=False))

    def seed_model(self, initial_arrays: ArrayRecord) -> None:
        """Take ``start``'s ``initial_arrays`` as the model to start from (strategies with one
        global start override this); by default a ValueError: the method has none."""
        if len(initial_arrays) == 0:
            return
        raise ValueError(f"{type(self).__name__} has no single global start to seed: "
                         f"initial_arrays must be None or empty, got keys "
                         f"{sorted(initial_arrays)}")

    def report_evaluation(self, server_round: int, record: dict[str, Any],
                          accepted: dict[int, dict[str, Any]]) -> None:
        """Queue the evaluation of the state after ``server_round`` that arrived with a
        round's train replies (``accepted``): ``start`` puts it in
        ``Result.evaluate_metrics_clientapp[server_round]`` (the record's numbers, or
        ``evaluate_metrics_aggr_fn`` of the replies)."""
        if not hasattr(self, "_evaluations"):
            self._evaluations = []
        self._evaluations.append((server_round, record_metrics(record), dict(accepted)))

    def _take_evaluations(self, result: Result) -> None:
        queued = getattr(self, "_evaluations", None)
        if not queued:
            return
        for server_round, own, accepted in queued:
            log_round_summary(self.display_name, server_round, own)
            metrics = own
            if self.evaluate_metrics_aggr_fn is not None and accepted:
                metrics = aggregate_with(self.evaluate_metrics_aggr_fn, accepted,
                                         self.weighted_by_key)
            if metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = metrics
        queued.clear()

    # ------------------------------------------------------------------ checkpoints
    def enable_checkpoints(self, directory: str | Path, every: int = 1,
                           resume: bool = True) -> None:
        """Write a checkpoint after every ``every``-th round and the last; with ``resume``,
        continue from the newest one found in ``directory`` when the run starts."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be an int >= 1, got {every!r}")
        self.checkpoint_dir = Path(directory)
        self.checkpoint_every = every
        self.resume = bool(resume)

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The state after the current round: ``(arrays, JSON metadata)``. Strategies that
        support checkpoints override this and :meth:`restore_state`."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load a state written by :meth:`checkpoint_state`."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must have been written with to be resumed by this strategy."""
        return {"strategy": type(self).__name__, "num_tasks": int(len(self.ever_replied))}

    def run_identity(self) -> str:
        """The run's identity sent as ``run-token`` (module docstring): the run's token, then
        ``.`` and 16 hex digits of a digest of :meth:`fingerprint`."""
        settings = json.dumps(self.fingerprint(), sort_keys=True, default=str)
        digest = hashlib.blake2b(settings.encode(), digest_size=8).hexdigest()
        return f"{self.run_token}.{digest}"

    def maybe_checkpoint(self, server_round: int) -> Path | None:
        """Write a checkpoint if one is due after ``server_round``."""
        if self.checkpoint_dir is None:
            return None
        if server_round % self.checkpoint_every and server_round != self.num_rounds:
            return None
        arrays, meta = self.checkpoint_state()
        path = write_checkpoint(self.checkpoint_dir, server_round, arrays,
                                {**meta, "fingerprint": self.fingerprint(),
                                 "ever_replied": self.ever_replied.tolist(),
                                 "run_token": self.run_token})
        self.last_checkpoint_round = server_round
        log(INFO, "%s: checkpoint after round %d written to %s", type(self).__name__,
            server_round, path)
        return path

    def _resume(self) -> None:
        assert self.checkpoint_dir is not None
        checkpoint = read_checkpoint(self.checkpoint_dir)
        if checkpoint is None:
            log(INFO, "%s: no checkpoint in %s; starting from round 1", type(self).__name__,
                self.checkpoint_dir)
            return
        check_fingerprint(checkpoint, self.fingerprint())
        self.restore_state(checkpoint.arrays, checkpoint.meta)
        self.ever_replied = np.array(checkpoint.meta["ever_replied"], dtype=bool)
        token = checkpoint.meta.get("run_token")
        if isinstance(token, str) and token:
            self.run_token = token
        else:
            log(WARNING, "%s: %s keeps no run token (an older checkpoint): the devices' "
                "state is from another run for this one and is reset", type(self).__name__,
                checkpoint.path)
        self.resumed_from = self.last_checkpoint_round = checkpoint.server_round
        log(INFO, "%s: resumed from %s (state after round %d)", type(self).__name__,
            checkpoint.path, checkpoint.server_round)

    @property
    def min_tasks(self) -> int:
        """Tasks the first round's discovery must find, else
        :class:`~fmtl_flower.strategies.discovery.DiscoveryError` (default: all). Set it
        below ``num_tasks`` to run with the tasks that show up; ``results()["final"]`` then
        names the absent ones (``tasks_never_replied``)."""
        value = self.directory.min_tasks
        return self.directory.num_tasks if value is None else value

    @min_tasks.setter
    def min_tasks(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= self.directory.num_tasks:
            raise ValueError(f"min_tasks must be an int in 1..{self.directory.num_tasks}, "
                             f"got {value!r}")
        self.directory.min_tasks = value

    @property
    def task_owners(self) -> tuple[tuple[int, int], ...]:
        """The ``(task, node id)`` pairs pinned by the operator, as in the settings (the
        directory's :attr:`~fmtl_flower.strategies.discovery.TaskDirectory.task_owners`)."""
        return tuple(sorted(self.directory.task_owners.items()))

    @task_owners.setter
    def task_owners(self, value: Any) -> None:
        self.directory.task_owners = dict(value)

    @property
    def node_to_task(self) -> dict[int, int]:
        return self.directory.node_to_task

    @property
    def task_to_node(self) -> dict[int, int]:
        return self.directory.task_to_node

    @property
    def n_train(self) -> np.ndarray:
        return self.directory.n_train

    public_record = staticmethod(public_record)

    def results(self) -> dict[str, Any]:
        """``{"rounds": [...], "final": {...}}`` of the results contract (completed records)."""
        rounds = self.book.published()
        final = dict(rounds[-1]) if rounds else {}
        final["tasks_never_replied"] = sorted(int(t) for t in np.flatnonzero(~self.ever_replied))
        final["complete"] = bool(rounds) and not final.get("tasks_missing")
        return {"rounds": rounds, "final": final}


#: The key Flower gives the one array of ``ArrayRecord([W0])`` (a list of unnamed arrays).
UNNAMED_KEY = "0"


def as_array_record(initial_arrays: Any) -> ArrayRecord | None:
    """``start``'s ``initial_arrays`` as an ``ArrayRecord``: None and records as they are, a
    numpy array as ``ArrayRecord([array])`` (one unnamed array: the model, see
    :func:`initial_model`), a dict of numpy arrays (or Flower ``Array``) with each value an
    ``Array``, any other dict (a torch ``state_dict``) as Flower's ``ArrayRecord`` takes it.

    Raises
    ------
    TypeError
        For anything else, naming the accepted forms.
    """
    if initial_arrays is None or isinstance(initial_arrays, ArrayRecord):
        return initial_arrays
    if isinstance(initial_arrays, np.ndarray):
        return ArrayRecord([initial_arrays])
    if isinstance(initial_arrays, Mapping):
        values = list(initial_arrays.values())
        if all(isinstance(v, np.ndarray | Array) for v in values):
            return ArrayRecord({str(k): v if isinstance(v, Array) else to_array(v)
                                for k, v in initial_arrays.items()})
        try:
            return ArrayRecord(dict(initial_arrays))  # a torch state_dict
        except TypeError:
            pass
    raise TypeError("initial_arrays must be an ArrayRecord (ArrayRecord([W0]) or "
                    "ArrayRecord({'W': Array(W0)})), a numpy array or a dict of numpy arrays, "
                    f"got {type(initial_arrays).__name__}")


def check_run_length(num_rounds: Any, timeout: Any, *, no_rounds_ok: bool = False
                     ) -> tuple[int, float]:
    """``start``'s ``(num_rounds, timeout)`` as ``(int, float)``; a ValueError naming the
    argument unless ``num_rounds`` is an int >= 1 (>= 0 with ``no_rounds_ok``: OFMTL's 0,
    no cap) and ``timeout`` a finite number > 0 (a run of no rounds, or whose every exchange
    times out at once, would return an empty result without saying why)."""
    least = 0 if no_rounds_ok else 1
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int | np.integer) \
            or num_rounds < least:
        raise ValueError(f"num_rounds must be an int >= {least}, got {num_rounds!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.number) \
            or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return int(num_rounds), float(timeout)


def initial_model(initial_arrays: ArrayRecord, key: str, num_tasks: int | None,
                  name: str, dim: int | None = None) -> np.ndarray:
    """The model of ``start``'s ``initial_arrays``: exactly one array ``key`` (or one
    unnamed array, Flower's ``ArrayRecord([W0])``), of shape (d, num_tasks) or (d,) (one
    model for every task; only (d,) when ``num_tasks`` is None), finite, as float64;
    ValueError naming the expected key and shape otherwise. With ``dim``, d must equal it
    (else :func:`check_initial_dim` checks it once the nodes report d)."""
    shapes = "(d,)" if num_tasks is None else f"(d, {num_tasks}) or (d,)"
    keys = sorted(initial_arrays)
    if keys == [UNNAMED_KEY]:
        initial_arrays = ArrayRecord({key: initial_arrays[UNNAMED_KEY]})
    elif keys != [key]:
        raise ValueError(f"{name}: initial_arrays must hold exactly one array {key!r} of "
                         f"shape {shapes} (or one unnamed array: ArrayRecord([{key}0])), "
                         f"got keys {keys}")
    try:
        value = np.array(initial_arrays[key].numpy(), dtype=np.float64)
    except Exception as err:  # noqa: BLE001 - any undecodable array is the user's error
        raise ValueError(f"{name}: initial_arrays[{key!r}] is not a numeric array: "
                         f"{err}") from err
    ok = value.ndim == 1 or (num_tasks is not None and value.ndim == 2
                             and value.shape[1] == num_tasks)
    if not ok or value.shape[0] < 1:
        raise ValueError(f"{name}: initial_arrays[{key!r}] must have shape {shapes}, got "
                         f"{value.shape}")
    if not np.all(np.isfinite(value)):
        raise ValueError(f"{name}: initial_arrays[{key!r}] has non-finite values")
    if dim is not None:
        check_initial_dim(value, dim, key, name)
    return value


def check_initial_dim(value: np.ndarray, dim: int, key: str, name: str) -> None:
    """ValueError unless the initial model has ``dim`` rows (the nodes' feature count)."""
    if value.shape[0] != dim:
        raise ValueError(f"{name}: initial_arrays[{key!r}] has shape {value.shape}, but the "
                         f"nodes have dim = {dim} features (expected {dim} rows)")


def record_metrics(record: dict[str, Any]) -> MetricRecord:
    """The numbers of a round record (not its flags, lists or None values) as a MetricRecord."""
    return metric_record({k: float(v) for k, v in record.items()
                          if not k.startswith("_") and _is_number(v)})


def _is_number(value: Any) -> bool:
    """Whether a record value is a number (an int, float or numpy number; no bool)."""
    kind = type(value)
    if kind is float or kind is int:  # the common case in one test
        return True
    return isinstance(value, int | float | np.number) and not isinstance(value, bool | np.bool_)


def reply_records(accepted: dict[int, dict[str, Any]]) -> list[RecordDict]:
    """One ``RecordDict({"metrics": MetricRecord})`` per accepted reply (task order), with
    its validated scalar values: what Flower's metrics aggregation functions take."""
    out = []
    for values in accepted.values():
        scalars = {k: (int(v) if isinstance(v, int | np.integer) else float(v))
                   for k, v in values.items()
                   if isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)}
        out.append(RecordDict({"metrics": MetricRecord(scalars)}))
    return out


def aggregate_with(fn: MetricsAggrFn, accepted: dict[int, dict[str, Any]],
                   weighted_by_key: str) -> MetricRecord:
    """``fn(reply_records(accepted), weighted_by_key)``; a TypeError unless it returns a
    MetricRecord."""
    metrics = fn(reply_records(accepted), weighted_by_key)
    if not isinstance(metrics, MetricRecord):
        raise TypeError(f"the metrics aggregation function {fn!r} returned a "
                        f"{type(metrics).__name__}, not a MetricRecord")
    return metrics


def with_config(messages: Iterable[Message], extra: ConfigRecord) -> Iterable[Message]:
    """``messages`` with the entries of ``extra`` (``start``'s ``train_config`` /
    ``evaluate_config``) added to each one's ``config`` record, so that they reach the
    ClientApp in every message (lazily: a generator stays one). An entry that the wire
    contract already sets to another value is an error naming the key."""
    if not extra:
        return messages
    items = list(extra.items())

    def merged() -> Iterable[Message]:
        for message in messages:
            if "config" in message.content:
                config = message.content["config"]
                for key, value in items:
                    if key in config and config[key] != value:
                        raise ValueError(f"config entry {key!r} is part of the strategy's "
                                         "wire contract; choose another name")
                    config[key] = value
            yield message

    return merged()


def drain(replies: Iterable[Message]) -> None:
    """Let a streaming grid (the in-process engine's) deliver the messages whose replies the
    strategy did not read, as Flower delivers every message; other grids: nothing to do."""
    finish = getattr(replies, "drain", None)
    if callable(finish):
        finish()


def as_taken_by(grid: Grid, messages: Iterable[Message]) -> Iterable[Message]:
    """A round's messages as ``grid`` can take them: as they are (possibly a generator, made
    one at a time) for a grid that declares ``streams_messages`` (the in-process engine's
    grid, the packing adapter: one pass, delivering as it goes); a list for the others
    (Flower's ``HttpGrid.push_messages`` iterates them twice: checks, then sends)."""
    if getattr(grid, "streams_messages", False):
        return messages
    return list(messages)


def check_evaluate_knobs(strategy: Any, name: str) -> None:
    """ValueError naming ``fraction_evaluate`` / ``min_evaluate_nodes`` (Flower's meaning)
    when out of range, or when ``strategy`` does not evaluate a sample of the devices
    (``samples_evaluation``) and they are not at their defaults (1.0, 0)."""
    fraction, least = strategy.fraction_evaluate, strategy.min_evaluate_nodes
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
            or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction_evaluate must be a number in [0, 1], got {fraction!r}")
    if isinstance(least, bool) or not isinstance(least, int) or least < 0:
        raise ValueError(f"min_evaluate_nodes must be an int >= 0, got {least!r}")
    if not getattr(strategy, "samples_evaluation", False) and (fraction != 1.0 or least):
        raise ValueError(f"{name} evaluates every device (its evaluation comes with the "
                         "training replies, or on the server); fraction_evaluate and "
                         "min_evaluate_nodes are for the strategies that evaluate a sample "
                         f"(FedEM's family) (got fraction_evaluate={fraction!r}, "
                         f"min_evaluate_nodes={least!r})")


#: The numbers of a round's record shown in its summary line (key, label, format), in order.
SUMMARY_KEYS = (("test_error", "test error", ".4f"), ("accuracy_mean", "accuracy", ".4f"),
                ("accuracy_bottom_decile", "bottom-10% accuracy", ".4f"),
                ("gap", "gap", ".3e"), ("train_loss", "train loss", ".5f"),
                ("objective", "objective", ".6e"))


def round_summary(metrics: Mapping[str, Any]) -> str:
    """The round's main numbers in words (:data:`SUMMARY_KEYS`; the gap also relative to
    the primal), then its reply count: ``test error 0.1339, gap 4.680e-02 (relative
    2.13e-02), ..., 4 replies``."""
    parts = []
    for key, label, spec in SUMMARY_KEYS:
        value = metrics.get(key)
        if not _is_number(value) or key == "objective" and "gap" in metrics:
            continue
        text = f"{label} {format(value, spec)}"
        primal = metrics.get("primal")
        if key == "gap" and _is_number(primal) and primal:
            text += f" (relative {value / primal:.2e})"
        parts.append(text)
    replies = metrics.get("num_replies")
    if _is_number(replies):
        parts.append(f"{int(replies)} replies")
    return ", ".join(parts)


def log_round_summary(name: str, server_round: int, metrics: Mapping[str, Any]) -> None:
    """Log one line with the evaluated round's main numbers (:func:`round_summary`), if it
    has any (issue 27: the per-round log showed only reply counts)."""
    if FLOWER_LOGGER.isEnabledFor(INFO):
        line = round_summary(metrics)
        if line:
            log(INFO, "\t└──> %s round %d: %s", name, server_round, line)
