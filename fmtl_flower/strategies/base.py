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

Flower's strategy knobs
-----------------------
:class:`TaskStrategy` has Flower's usual knobs as attributes (class-level defaults that a
constructor or settings object may override; read when ``start`` runs):

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

import io
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import FLOWER_LOGGER, log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..checkpoint import check_fingerprint, read_checkpoint, write_checkpoint
from ..core.rng import train_sample_rng
from ..packing import StackGroup
from ..wire import metric_record
from .discovery import ReplyError, TaskDirectory, wait_for_nodes

#: ``parse_stack(reply, group) -> ({task: values}, {task: reason})``: a stacked reply's rows.
StackParser = Callable[[Message, StackGroup], tuple[dict[int, dict[str, Any]], dict[int, str]]]
#: ``check_rows({task: parsed}) -> {task: reason}``: vectorised checks over accepted replies.
RowsCheck = Callable[[dict[int, dict[str, Any]]], dict[int, str]]
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
        super().__init__(f"{name}: no valid reply in {rounds} rounds in a row; {count} of "
                         f"{len(reasons)} tasks failed with: {reason}")


class TaskStrategy(Strategy):
    """Base of the strategies that keep one model per task (MOCHA and its baselines).

    Subclasses set ``directory`` (a :class:`TaskDirectory`), ``records`` (one dict per state
    k = 0 .. R; a record still waiting for its devices' numbers holds the key ``_reg``) and
    ``ever_replied`` (bool per task) in their constructor.
    """

    directory: TaskDirectory
    records: list[dict[str, Any]]
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
    last_checkpoint_round: int = 0  # round of the newest checkpoint written or resumed from
    # Flower's knobs (module docstring): class-level defaults, overridden per instance.
    min_available_nodes: int = 0
    fraction_train: float = 1.0
    min_train_nodes: int = 0
    train_metrics_aggr_fn: MetricsAggrFn | None = None
    evaluate_metrics_aggr_fn: MetricsAggrFn | None = None
    #: The reply metric that counts a device's examples (Flower's ``weighted_by_key``).
    weighted_by_key: str = "n-train"
    #: Whether the strategy samples devices per round (honours ``fraction_train`` and
    #: ``min_train_nodes``); the others refuse values other than the defaults.
    samples_devices: bool = False

    @property
    def first_round(self) -> int:
        """The first round this run trains (1, or the one after the resumed checkpoint)."""
        return self.resumed_from + 1

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
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
        ValueError. ``timeout`` bounds every exchange, the first round's discovery included
        (the strategy's ``discovery_timeout`` is lowered to it). Raises
        :class:`~fmtl_flower.strategies.discovery.DiscoveryError` (a ``RuntimeError``) when
        fewer than :attr:`min_tasks` tasks have a node by then."""
        self.check_knobs()
        self.num_rounds = int(num_rounds)
        self.round_timeout = float(timeout)
        if getattr(self, "discovery_timeout", None) is not None:  # timeout bounds discovery
            self.discovery_timeout = min(float(self.discovery_timeout), self.round_timeout)
        if self.checkpoint_dir is not None and self.resume:
            self._resume()
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        result = Result()
        self._evaluations = []
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

    def maybe_checkpoint(self, server_round: int) -> Path | None:
        """Write a checkpoint if one is due after ``server_round``."""
        if self.checkpoint_dir is None:
            return None
        if server_round % self.checkpoint_every and server_round != self.num_rounds:
            return None
        arrays, meta = self.checkpoint_state()
        path = write_checkpoint(self.checkpoint_dir, server_round, arrays,
                                {**meta, "fingerprint": self.fingerprint(),
                                 "ever_replied": self.ever_replied.tolist()})
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
    def node_to_task(self) -> dict[int, int]:
        return self.directory.node_to_task

    @property
    def task_to_node(self) -> dict[int, int]:
        return self.directory.task_to_node

    @property
    def n_train(self) -> np.ndarray:
        return self.directory.n_train

    @staticmethod
    def public_record(record: dict[str, Any]) -> dict[str, Any]:
        """A record without internal fields."""
        return {k: v for k, v in record.items() if not k.startswith("_")}

    def results(self) -> dict[str, Any]:
        """``{"rounds": [...], "final": {...}}`` of the results contract (completed records)."""
        rounds = [self.public_record(r) for r in self.records if "_reg" not in r]
        final = dict(rounds[-1]) if rounds else {}
        final["tasks_never_replied"] = sorted(int(t) for t in np.flatnonzero(~self.ever_replied))
        final["complete"] = bool(rounds) and not final.get("tasks_missing")
        return {"rounds": rounds, "final": final}


def initial_model(initial_arrays: ArrayRecord, key: str, num_tasks: int | None,
                  name: str, dim: int | None = None) -> np.ndarray:
    """The model of ``start``'s ``initial_arrays``: exactly one array ``key``, of shape
    (d, num_tasks) or (d,) (one model for every task; only (d,) when ``num_tasks`` is None),
    finite, as float64; ValueError naming the expected key and shape otherwise. With ``dim``,
    d must equal it (else :func:`check_initial_dim` checks it once the nodes report d)."""
    shapes = "(d,)" if num_tasks is None else f"(d, {num_tasks}) or (d,)"
    keys = sorted(initial_arrays)
    if keys != [key]:
        raise ValueError(f"{name}: initial_arrays must hold exactly one array {key!r} of "
                         f"shape {shapes}, got keys {keys}")
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


# ---------------------------------------------------------------------------- trust boundary
#: Relative slack of every bound a reply is checked against (the devices' rounding).
BOUND_SLACK = 1.0 + 1e-6


def norm(values: np.ndarray, axis: int | None = None) -> Any:
    """Euclidean norm (of a vector, or along ``axis``); inf where it overflows, without a
    warning."""
    with np.errstate(over="ignore", invalid="ignore"):
        if axis is None and values.ndim == 1:
            return math.sqrt(float(np.dot(values, values)))
        return np.linalg.norm(values, axis=axis)


def check_bound(what: str, size: float, limit: float, why: str, *args: Any) -> None:
    """:class:`ReplyError` unless ``size <= limit`` (with :data:`BOUND_SLACK`); the reason
    ``why % args`` is formatted only then."""
    if not size <= limit * BOUND_SLACK:
        raise ReplyError(f"{what} = {size:.6g} above its bound {limit:.6g} ({why % args})")


def guarded(step: Callable[[], None], objects: Iterable[Any],
            check: Callable[[], bool]) -> str | None:
    """Run a server step that replaces attributes of ``objects``; if it raises or ``check()``
    fails afterwards, put every attribute back as it was and return the reason (None: the
    step stands). The steps guarded this way assign new arrays, never write into them, so a
    shallow copy of the attributes is the snapshot."""
    objects = list(objects)
    saved = [dict(vars(obj)) for obj in objects]
    try:
        step()
        reason = None if check() else "it left non-finite values"
    except Exception as err:  # noqa: BLE001 - a failed step is undone, not fatal
        reason = f"{type(err).__name__}: {err}"
    if reason is not None:
        for obj, attributes in zip(objects, saved, strict=True):
            vars(obj).clear()
            vars(obj).update(attributes)
    return reason


def all_finite(*arrays: np.ndarray) -> bool:
    """Whether every value of every array is finite."""
    return all(bool(np.isfinite(a).all()) for a in arrays)


@dataclass
class RoundReplies:
    """What one exchange's replies came to, as :meth:`ReplyBoundary.read` found them.

    Attributes
    ----------
    accepted : dict[int, dict]
        The parsed replies that passed every check, keyed by task, in task order (so sums
        over them do not depend on the order the replies arrived in).
    failed : dict[int, str]
        Tasks that were sent a message and answered with an error or a rejected reply, with
        the reason.
    """

    accepted: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def arrived(self) -> int:
        """Replies that arrived from tasks the exchange was sent to (accepted or not)."""
        return len(self.accepted) + len(self.failed)


class ReplyBoundary:
    """The trust boundary every strategy reads its nodes' replies through.

    A strategy registers each message it sends with :meth:`track` and reads the replies with
    :meth:`read`, giving a ``parse(reply, task)`` function that decodes and checks one reply
    and raises on anything wrong with it. The boundary

    * ties every reply to the message it answers (``reply_to_message_id``), so an error reply
      made by the SuperLink for a node that died is logged with the task and the real node it
      was sent to, and its cause;
    * ignores a reply to no message of this exchange and a reply from another node than the
      one its message went to (neither counts against the task), rejects a reply whose
      message type differs from its message's, and rejects a second reply for a task (the
      first is kept, whether it was accepted or rejected);
    * runs ``parse`` inside the boundary: *any* exception it raises (a :class:`ReplyError`,
      or whatever decoding a hostile payload throws) becomes a logged rejection of that reply,
      counted as a drop, and never leaves :meth:`read`. ``parse`` must not change the
      strategy's state; the caller applies the accepted replies afterwards.

    Parameters
    ----------
    name : str
        Prefix of the log lines (the strategy's name).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: dict[int, int] = {}  # node -> task of the current exchange
        self.last: RoundReplies | None = None  # the newest exchange read
        self._by_id: dict[str, tuple[int, int, str]] = {}  # message id -> (task, node, type)
        self._pending: list[tuple[int, int, Message]] = []  # sent, id not indexed yet
        self._stacks: list[tuple[StackGroup, Message]] = []  # stacked messages sent

    def begin(self) -> None:
        """Start a new exchange: forget the messages of the previous one."""
        self.sent = {}
        self._by_id = {}
        self._pending = []
        self._stacks: list[tuple[StackGroup, Message]] = []

    def track_stack(self, group: StackGroup, message: Message) -> Message:
        """Register a stacked ``message`` (one message for the tasks of ``group`` on one
        packed node, :mod:`fmtl_flower.packing`) as part of this exchange."""
        self.sent.update(zip(group.virtual, group.tasks, strict=True))
        self._stacks.append((group, message))
        return message

    def _match_stack(self, message_id: str) -> tuple[StackGroup, str] | None:
        for group, message in self._stacks:
            if message.metadata.message_id == message_id:
                return group, message.metadata.message_type
        return None

    def track(self, task: int, node: int, message: Message) -> Message:
        """Register ``message`` (to ``node``, for ``task``) as part of this exchange."""
        self.sent[node] = task
        self._pending.append((task, node, message))
        return message

    def _match(self, message_id: str) -> tuple[int, int, str] | None:
        """The (task, node, message type) of the sent message ``message_id``, if any.

        Message ids are given when a message is pushed, so the sent messages are indexed
        lazily (each once)."""
        found = self._by_id.get(message_id)
        if found is None and self._pending:
            waiting = []
            for task, node, message in self._pending:
                mid = message.metadata.message_id
                if mid:
                    self._by_id[mid] = (task, node, message.metadata.message_type)
                else:
                    waiting.append((task, node, message))
            self._pending = waiting
            found = self._by_id.get(message_id)
        return found

    def read(self, where: str, replies: Iterable[Message],
             parse: Callable[[Message, int], dict[str, Any]],
             on_accept: Callable[[int], None] | None = None,
             parse_stack: StackParser | None = None,
             check_rows: RowsCheck | None = None) -> RoundReplies:
        """Check and parse ``replies``; see the class docstring.

        Parameters
        ----------
        where : str
            What the exchange is, for the log (``"round 3"``, ``"setup"``).
        replies : iterable of Message
        parse : callable
            ``parse(reply, task) -> dict``; raises on a bad reply.
        on_accept : callable, optional
            Called with the task of each accepted reply.
        parse_stack : callable, optional
            ``parse_stack(reply, group) -> (accepted, rejected)`` for the reply to a stacked
            message (:meth:`track_stack`): the valid rows ``{task: values}`` and the
            rejected ones ``{task: reason}``. Each row is then one task's reply: a rejected
            row, or a task the reply has no row for, fails only that task; an error reply,
            or anything ``parse_stack`` raises, fails every task of the message.
        check_rows : callable, optional
            ``check_rows({task: parsed}) -> {task: reason}``: checks run once over all the
            replies ``parse`` accepted (vectorised bounds), after every reply was read; each
            task it names is rejected as if ``parse`` had raised (anything it raises rejects
            them all); and over each stacked reply's rows that ``parse_stack`` accepted, a
            row it names rejected like a row ``parse_stack`` rejects (anything it raises
            fails every task of that message).
        """
        out = RoundReplies()
        accepted: dict[int, dict[str, Any]] = {}
        singles: dict[int, int] = {}  # task -> node of the replies parse accepted
        for reply in replies:
            try:
                meta = reply.metadata
                stack = self._match_stack(meta.reply_to_message_id) if self._stacks else None
                match = None if stack is not None else self._match(meta.reply_to_message_id)
                src = meta.src_node_id
            except Exception as err:  # noqa: BLE001 - a malformed reply object
                log(WARNING, "%s %s: malformed reply ignored: %s", self.name, where,
                    _reason(err))
                continue
            if stack is not None:
                self._read_stack(where, reply, stack, parse_stack, check_rows, accepted, out,
                                 on_accept)
                continue
            if match is None:
                cause = f": {reply.error.reason}" if _has_error(reply) else ""
                log(WARNING, "%s %s: reply from node %s answers no message of this exchange; "
                    "ignored%s", self.name, where, src, cause)
                continue
            task, node, message_type = match
            error = _has_error(reply)
            if src != node and not error:  # (the SuperLink makes error replies)
                log(WARNING, "%s %s: reply for task %d from node %s, but its message went to "
                    "node %s; ignored", self.name, where, task, src, node)
                continue
            if task in accepted or task in out.failed:
                log(WARNING, "%s %s: second reply for task %d (node %s) rejected; the first "
                    "is kept", self.name, where, task, node)
                continue
            if error:
                reason = str(reply.error.reason)
                log(WARNING, "%s %s: task %d: node %s failed: %s", self.name, where, task,
                    node, reason)
                out.failed[task] = reason
                continue
            try:
                if meta.message_type != message_type:
                    raise ReplyError(f"message type {meta.message_type!r}, expected "
                                     f"{message_type!r}")
                parsed = parse(reply, task)
            except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
                reason = _reason(err)
                log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                    where, task, node, reason)
                out.failed[task] = reason
                continue
            accepted[task] = parsed
            singles[task] = node
        if check_rows is not None and singles:
            self._check_rows(where, check_rows, singles, accepted, out)
        if on_accept is not None:
            for task in singles:
                if task in accepted:
                    on_accept(task)
        out.accepted = dict(sorted(accepted.items()))
        silent = sorted(set(self.sent.values()) - set(accepted) - set(out.failed))
        self.last = out  # what the exchange came to (TaskStrategy.start stops a dead run)
        if silent:
            names = ", ".join(str(t) for t in silent[:20]) + (", ..." if len(silent) > 20 else "")
            log(WARNING, "%s %s: no reply from task%s %s within the timeout; counted as "
                "dropped", self.name, where, "s" if len(silent) > 1 else "", names)
        return out


    def _check_rows(self, where: str, check_rows: RowsCheck, singles: dict[int, int],
                    accepted: dict[int, dict[str, Any]], out: RoundReplies) -> None:
        """Reject the replies among ``singles`` that ``check_rows`` names (read's docstring)."""
        try:
            rejected = check_rows({task: accepted[task] for task in singles})
        except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
            rejected = dict.fromkeys(singles, _reason(err))
        for task, reason in rejected.items():
            if task in singles and accepted.pop(task, None) is not None:
                log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                    where, task, singles[task], reason)
                out.failed[task] = reason

    def _read_stack(self, where: str, reply: Message, stack: tuple[StackGroup, str],
                    parse_stack: StackParser | None, check_rows: RowsCheck | None,
                    accepted: dict[int, dict[str, Any]], out: RoundReplies,
                    on_accept: Callable[[int], None] | None) -> None:
        """The rows of the reply to a stacked message, each as one task's reply (``parse_stack``
        then ``check_rows``: :meth:`read`)."""
        group, message_type = stack
        src = reply.metadata.src_node_id
        if src != group.node and not _has_error(reply):
            log(WARNING, "%s %s: reply for tasks %s from node %s, but their message went to "
                "node %s; ignored", self.name, where, group.tasks, src, group.node)
            return
        fresh = [t for t in group.tasks if t not in accepted and t not in out.failed]
        if len(fresh) < len(group.tasks):
            log(WARNING, "%s %s: second reply for tasks %s (node %s) rejected; the first is "
                "kept", self.name, where, sorted(set(group.tasks) - set(fresh)), group.node)
        rows: dict[int, dict[str, Any]] = {}
        if _has_error(reply):
            rejected = {t: str(reply.error.reason) for t in group.tasks}
            log(WARNING, "%s %s: tasks %s: node %s failed: %s", self.name, where,
                group.tasks, group.node, reply.error.reason)
        else:
            try:
                if reply.metadata.message_type != message_type:
                    raise ReplyError(f"message type {reply.metadata.message_type!r}, expected "
                                     f"{message_type!r}")
                if parse_stack is None:
                    raise ReplyError("a stacked reply where none was expected")
                rows, rejected = parse_stack(reply, group)
                if check_rows is not None and rows:
                    for task, reason in check_rows(rows).items():
                        if rows.pop(task, None) is not None:
                            rejected[task] = reason
            except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
                rows, rejected = {}, {t: _reason(err) for t in group.tasks}
            for task, reason in rejected.items():
                if task in fresh:
                    log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                        where, task, group.node, reason)
        for task in fresh:
            if task in rows:
                accepted[task] = rows[task]
                if on_accept is not None:
                    on_accept(task)
            elif task in rejected:
                out.failed[task] = rejected[task]


def _has_error(reply: Message) -> bool:
    try:
        return bool(reply.has_error())
    except Exception:  # noqa: BLE001 - a reply without a readable error is not an error reply
        return False


def _reason(err: BaseException) -> str:
    """A rejection reason: the message of a ReplyError, else the exception's type and text."""
    if isinstance(err, ReplyError):
        return str(err)
    text = str(err)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
