"""Which node serves which task: the ``whoami`` query shared by every strategy.

Flower node ids are random and change when a device restarts; strategies key everything by the
task id a node reports (design decision 6). :class:`TaskDirectory` keeps the two-way map,
asks new nodes ``whoami`` (reply: ConfigRecord ``info`` with int ``task-id`` in
0..num_tasks-1, ``n-train`` in 1..``max_n``, ``dim`` in 1..``max_dim``, the same on every
node, optional ``n-test`` in 0..``max_n`` and optional float ``max-row-norm``, the largest
Euclidean norm of a training row, finite, in 0..``max_row_norm``), forgets nodes that go
offline, lets a restarted device (new node id) take its task over (logged with the reason),
and refuses a second live node claiming a task (logged; asked again once the holder is gone).
A node whose task id lies outside 0..num_tasks-1 (a misconfigured device, or one of a larger
federation such as an OFMTL newcomer not yet admitted) is logged once (``outside_level``,
WARNING by default) and not asked again while it stays online.

No single node fixes a run-wide fact. ``dim`` is the configured one when given; otherwise it
is the value a majority agrees on: a strict majority of the federation's ``num_tasks`` tasks
as soon as that many report it, or, when a waiting discovery ends (or every task has
answered) without that, a strict majority of the tasks that answered. Until then the answers
wait; a node reporting another ``dim`` than the one fixed, or sizes beyond the limits, is
excluded with one log line and not asked again while it stays online. The limits are checked
before anything is allocated from a reported size.

A waiting discovery (the first round) lasts at most its ``wait`` (the strategies bound it by
``start``'s ``timeout``). If fewer than ``min_tasks`` tasks (default: all of them) have a node
by then, it raises :class:`DiscoveryError` naming the missing task ids; with ``min_tasks``
below ``num_tasks`` the run goes on with the tasks found and logs the absent ones. A node
whose ``whoami`` fails is logged once (again only when its reason changes) and asked again at
most every ``retry_failed`` seconds, not at every poll.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid


class ReplyError(ValueError):
    """A node's reply broke the wire contract."""


def describe_tasks(tasks: Iterable[int], shown: int = 20) -> str:
    """Task ids for a message: all of them when few, else the count, the first ``shown`` and
    the range."""
    ids = sorted(int(t) for t in tasks)
    if len(ids) <= shown:
        return ", ".join(map(str, ids))
    return (f"{len(ids)} tasks: {', '.join(map(str, ids[:shown]))}, ... "
            f"(ids {ids[0]}..{ids[-1]})")


class DiscoveryError(RuntimeError):
    """Fewer tasks than required found a node within the discovery time.

    Attributes
    ----------
    missing : list of int
        The task ids without a node.
    found, required : int
        Tasks found, and the ``min_tasks`` the run needed.
    reasons : dict of int to str
        The last error of nodes whose ``whoami`` failed (node id -> reason).
    """

    def __init__(self, name: str, missing: list[int], found: int, required: int,
                 waited: float, reasons: dict[int, str]) -> None:
        self.missing, self.found, self.required = missing, found, required
        self.reasons = dict(reasons)
        message = (f"{name}: {found} of {found + len(missing)} tasks found within {waited:.0f} s"
                   f" ({required} required); missing task ids: {describe_tasks(missing)}")
        if reasons:
            node, reason = next(iter(reasons.items()))
            message += f"; {len(reasons)} node(s) failed whoami, e.g. node {node}: {reason}"
        super().__init__(message)


class TooFewNodes(DiscoveryError):
    """Fewer nodes than ``min_available_nodes`` connected within the discovery time (a
    :class:`DiscoveryError`; ``missing`` is empty: no task could be asked yet)."""

    def __init__(self, name: str, online: int, required: int, waited: float) -> None:
        self.missing, self.found, self.required = [], online, required
        self.reasons: dict[int, str] = {}
        RuntimeError.__init__(self, f"{name}: {online} node(s) online after {waited:.0f} s, "
                              f"min_available_nodes = {required} required")


def wait_for_nodes(grid: Grid, required: int, timeout: float, name: str,
                   poll: float = 0.2) -> int:
    """Wait until ``grid`` has at least ``required`` nodes (Flower's ``min_available_nodes``),
    at most ``timeout`` seconds; the number online, else :class:`TooFewNodes`."""
    started = time.monotonic()
    logged = -1
    while True:
        online = len(list(grid.get_node_ids()))
        if online >= required:
            return online
        waited = time.monotonic() - started
        if waited >= timeout:
            raise TooFewNodes(name, online, required, waited)
        if online != logged:  # once per change, not per poll
            log(INFO, "%s: waiting for nodes: %d connected, min_available_nodes = %d",
                name, online, required)
            logged = online
        time.sleep(min(poll, max(timeout - waited, 0.0)))


class OutsideTaskRange(ReplyError):
    """A node serves a task id outside this federation's 0..num_tasks-1."""


class BeyondLimits(ReplyError):
    """A node reports a size beyond the server's limits (``max_dim``, ``max_n``, ...)."""


#: Default limits on what a node may report at discovery (checked before any allocation).
MAX_DIM = 10_000_000
MAX_N = 1_000_000_000
MAX_ROW_NORM = 1e8


def read_metrics(reply: Message, *, ints: Iterable[str] = (), numbers: Iterable[str] = (),
                 optional_ints: Iterable[str] = (),
                 optional_numbers: Iterable[str] = ()) -> dict[str, Any]:
    """The reply's ``metrics`` values, typed and finite; :class:`ReplyError` naming the first
    missing or bad key. ``ints`` must be Python ints (not bools), ``numbers`` ints or floats;
    the optional ones are checked when present."""
    if "metrics" not in reply.content:
        raise ReplyError("no 'metrics' record")
    metrics = reply.content["metrics"]
    if not isinstance(metrics, MetricRecord):
        raise ReplyError(f"'metrics' must be a MetricRecord, got a {type(metrics).__name__}")
    metrics = dict(metrics.items())  # one read; plain-dict lookups below
    out: dict[str, Any] = {}
    for keys, integer, required in ((ints, True, True), (optional_ints, True, False),
                                    (numbers, False, True), (optional_numbers, False, False)):
        for key in keys:
            value = metrics.get(key)
            kind = type(value)  # the common case in one test; anything else looked at below
            if (kind is int or (kind is float and not integer)) and math.isfinite(value):
                out[key] = value
            elif key in metrics:
                out[key] = _metric_value(key, value, integer)
            elif required:
                raise ReplyError(f"metric {key!r} missing")
    return out


def _metric_value(key: str, value: Any, integer: bool) -> Any:
    """A metric of :func:`read_metrics` that is not plainly an int or a finite float."""
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ReplyError(f"metric {key!r} must be an int, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyError(f"metric {key!r} is not a number: {value!r}")
    if not math.isfinite(value):
        raise ReplyError(f"metric {key!r} is not finite: {value!r}")
    return value


def arrays_of(reply: Message) -> ArrayRecord | None:
    """The reply's ``arrays`` record (None if absent); :class:`ReplyError` if it is another
    kind of record."""
    if "arrays" not in reply.content:
        return None
    arrays = reply.content["arrays"]
    if not isinstance(arrays, ArrayRecord):
        raise ReplyError(f"'arrays' must be an ArrayRecord, got a {type(arrays).__name__}")
    return arrays


def check_task_and_round(values: dict[str, Any], task: int, server_round: int,
                         round_key: str = "round") -> None:
    """:class:`ReplyError` unless the reply is for ``task`` and ``server_round``."""
    if values["task-id"] != task or values[round_key] != server_round:
        raise ReplyError(f"reply for task {values['task-id']} {round_key} {values[round_key]}, "
                         f"expected task {task} {round_key} {server_round}")


class TaskDirectory:
    """Two-way node id <-> task id map, kept up to date by ``whoami`` queries.

    Parameters
    ----------
    num_tasks : int
        Task ids are 0 .. num_tasks - 1.
    name : str
        Prefix of log lines (the strategy's name).
    dim : int, optional
        The feature dimension, when the configuration fixes it (None: by majority).
    max_dim, max_n : int
        Largest ``dim`` and ``n-train`` / ``n-test`` a node may report.
    max_row_norm : float
        Largest ``max-row-norm`` a node may report.

    Attributes
    ----------
    node_to_task, task_to_node : dict[int, int]
    n_train : ndarray of shape (num_tasks,), int64
        Training-set size each task reported (0: not seen yet).
    row_norm : ndarray of shape (num_tasks,), float64
        The ``max-row-norm`` each task reported (NaN: not reported).
    dim : int or None
        The feature dimension: configured, or agreed by a majority (see the module docstring).
    """

    def __init__(self, num_tasks: int, name: str, *, dim: int | None = None,
                 max_dim: int = MAX_DIM, max_n: int = MAX_N,
                 max_row_norm: float = MAX_ROW_NORM) -> None:
        self.num_tasks = int(num_tasks)
        self.name = name
        self.max_dim, self.max_n = int(max_dim), int(max_n)
        self.max_row_norm = float(max_row_norm)
        if dim is not None and not 1 <= int(dim) <= self.max_dim:
            raise ValueError(f"dim must be in 1..{self.max_dim}, got {dim!r}")
        self.node_to_task: dict[int, int] = {}
        self.task_to_node: dict[int, int] = {}
        self.n_train = np.zeros(self.num_tasks, dtype=np.int64)
        self.row_norm = np.full(self.num_tasks, np.nan)
        self.dim: int | None = None if dim is None else int(dim)
        self._duplicates: dict[int, int] = {}  # node -> task it claims while another holds it
        self._outside: set[int] = set()  # nodes whose task id is outside 0..num_tasks-1
        self._excluded: set[int] = set()  # nodes that disagree with the run or its limits
        self._candidates: dict[int, dict[str, Any]] = {}  # node -> whoami, dim not fixed yet
        self._gone: dict[int, int] = {}  # task -> node it had when that node went offline
        self._failed: dict[int, tuple[float, str]] = {}  # node -> (when, reason) of its failure
        self.outside_level = WARNING
        #: Tasks a waiting discovery must find (None: all ``num_tasks``).
        self.min_tasks: int | None = None
        #: Seconds before a node whose whoami failed is asked again.
        self.retry_failed = 5.0

    def discover(self, grid: Grid, *, wait: float = 0.0, query_timeout: float = 60.0,
                 settle: bool = True) -> None:
        """Map new node ids to tasks, waiting up to ``wait`` seconds for every task; with
        ``settle``, end by fixing ``dim`` from the answers if they have a majority
        (:meth:`settle`; pass False to keep waiting for a majority of the federation)."""
        started = time.monotonic()
        deadline = started + wait
        while True:
            online = set(grid.get_node_ids())
            if (not wait and len(online) == len(self.node_to_task) == len(self.task_to_node)
                    and not (self._duplicates or self._outside or self._excluded
                             or self._candidates or self._failed)
                    and online.issuperset(self.node_to_task)):
                break  # every node online is a known task's, and nothing waits: no change
            for node in [n for n in self.node_to_task if n not in online]:
                task = self.node_to_task.pop(node)
                if self.task_to_node.get(task) == node:
                    del self.task_to_node[task]
                    self._gone[task] = node
            for node in [n for n in self._duplicates if n not in online
                         or self.task_to_node.get(self._duplicates[n]) not in online]:
                del self._duplicates[node]  # gone, or its task is free again: ask anew
            self._outside &= online
            self._excluded &= online
            self._candidates = {n: c for n, c in self._candidates.items() if n in online}
            now = time.monotonic()
            self._failed = {n: f for n, f in self._failed.items() if n in online}
            resting = {n for n, (when, _) in self._failed.items()
                       if now - when < self.retry_failed}
            unknown = sorted(online - set(self.node_to_task) - set(self._duplicates)
                             - self._outside - self._excluded - set(self._candidates) - resting)
            if unknown:
                left = deadline - now
                self._query(grid, unknown, online,
                            min(query_timeout, max(left, 1.0)) if wait else query_timeout)
            answered = {c["task-id"] for c in self._candidates.values()}
            if (len(self.task_to_node) >= self.num_tasks or len(answered) >= self.num_tasks
                    or time.monotonic() >= deadline):
                break
            time.sleep(0.2)
        if settle:
            self.settle(online)
        if wait and len(self.task_to_node) < self.num_tasks:
            missing = sorted(set(range(self.num_tasks)) - set(self.task_to_node))
            required = self.num_tasks if self.min_tasks is None else self.min_tasks
            waited = time.monotonic() - started
            if len(self.task_to_node) < required:
                raise DiscoveryError(self.name, missing, len(self.task_to_node), required,
                                     waited, {n: r for n, (_, r) in self._failed.items()})
            log(WARNING, "%s: %d of %d tasks found after %.0f s (min_tasks %d); running "
                "without task ids %s", self.name, len(self.task_to_node), self.num_tasks,
                waited, required, describe_tasks(missing))

    def settle(self, online: set[int] | None = None) -> None:
        """Fix ``dim`` from the answers so far if a strict majority of the tasks that answered
        agree (the end of a waiting discovery); otherwise log that they disagree."""
        self._vote(online if online is not None else set(self._candidates), final=True)

    def fix_dim(self, dim: int) -> None:
        """Fix ``dim`` (known from elsewhere: a checkpoint, a trained model) and settle the
        answers waiting for it; nothing to do if it is fixed already."""
        if self.dim is None:
            self.dim = int(dim)
            candidates, self._candidates = self._candidates, {}
            for node, info in sorted(candidates.items()):
                self._admit(node, info, set(candidates))

    def _vote(self, online: set[int], final: bool) -> None:
        if self.dim is not None or not self._candidates:
            return
        per_task: dict[int, int] = {}
        for info in self._candidates.values():
            per_task.setdefault(info["task-id"], info["dim"])
        votes = Counter(per_task.values())
        (value, count), = votes.most_common(1)
        if 2 * count > self.num_tasks or (final and 2 * count > len(per_task)):
            self.dim = int(value)
            log(INFO, "%s: dim = %d, reported by %d of the %d tasks that answered", self.name,
                value, count, len(per_task))
            candidates, self._candidates = self._candidates, {}
            for node, info in sorted(candidates.items()):
                self._admit(node, info, online)
        elif final:
            log(WARNING, "%s: the %d tasks that answered disagree on dim (%s) and no value has "
                "a majority; set dim in the configuration", self.name, len(per_task),
                ", ".join(f"{v}: {c} tasks" for v, c in votes.most_common()))

    def _query(self, grid: Grid, nodes: list[int], online: set[int], timeout: float) -> None:
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n,
                        message_type=f"{MessageType.QUERY}.whoami") for n in nodes]
        asked = set(nodes)
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            node = None
            try:
                node = reply.metadata.src_node_id
                if node not in asked:
                    continue  # not an answer to this query
                if reply.has_error():
                    reason = str(reply.error.reason)
                    if self._failed.get(node, (0.0, None))[1] != reason:  # once per reason
                        log(WARNING, "%s: whoami failed on node %s: %s (asked again every "
                            "%.0f s, logged again only if the reason changes)", self.name,
                            node, reason, self.retry_failed)
                    self._failed[node] = (time.monotonic(), reason)
                    continue
                info = self.read_whoami(reply)
            except OutsideTaskRange as err:
                log(self.outside_level, "%s: node %s: bad whoami reply: %s; not part of this "
                    "federation, not asked again while online", self.name, node, err)
                self._outside.add(node)
                continue
            except BeyondLimits as err:
                log(WARNING, "%s: node %s excluded: %s; not asked again while online",
                    self.name, node, err)
                self._excluded.add(node)
                continue
            except Exception as err:  # noqa: BLE001 - any malformed reply is only logged
                reason = err if isinstance(err, ReplyError) else f"{type(err).__name__}: {err}"
                log(WARNING, "%s: node %s: bad whoami reply: %s", self.name, node, reason)
                continue
            asked.discard(node)
            self._failed.pop(node, None)
            if self.dim is None:
                self._candidates[node] = info
            else:
                self._admit(node, info, online)
        self._vote(online, final=False)

    def _admit(self, node: int, info: dict[str, Any], online: set[int]) -> None:
        """Give ``node`` its task, if it agrees with the run's ``dim`` and the task is free."""
        task = info["task-id"]
        if info["dim"] != self.dim:
            log(WARNING, "%s: node %s (task %d) has %d features, the federation %d; "
                "excluded, not asked again while online", self.name, node, task, info["dim"],
                self.dim)
            self._excluded.add(node)
            return
        old = self.task_to_node.get(task)
        if old is not None and old != node:
            if old in online:
                log(WARNING, "%s: node %s claims task %d, which node %s (online) holds; "
                    "ignored while that node is online", self.name, node, task, old)
                self._duplicates[node] = task
                return
            log(INFO, "%s: task %d moved from node %s to node %s: node %s went offline and "
                "the task's device answered as node %s", self.name, task, old, node, old, node)
            self.node_to_task.pop(old, None)
        elif task in self._gone and self._gone[task] != node:
            log(INFO, "%s: task %d rejoined on node %s (its node %s went offline)", self.name,
                task, node, self._gone[task])
        self._gone.pop(task, None)
        self.task_to_node[task] = node
        self.node_to_task[node] = task
        self.n_train[task] = info["n-train"]
        self.row_norm[task] = info.get("max-row-norm", np.nan)

    def read_whoami(self, reply: Message) -> dict[str, Any]:
        """The checked ``info`` of a whoami reply: ``task-id``, ``n-train``, ``dim`` and, when
        reported, ``n-test`` and ``max-row-norm``; :class:`ReplyError` if malformed,
        :class:`OutsideTaskRange` / :class:`BeyondLimits` as their names say."""
        if "info" not in reply.content:
            raise ReplyError("no 'info' record")
        info = reply.content["info"]
        values: dict[str, Any] = {}
        for key in ("task-id", "n-train", "dim", "n-test"):
            value = info[key] if key in info else None
            if value is None and key == "n-test":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ReplyError(f"{key!r} must be an int, got {value!r}")
            values[key] = value
        if not 0 <= values["task-id"] < self.num_tasks:
            raise OutsideTaskRange(f"task-id {values['task-id']} outside "
                                   f"0..{self.num_tasks - 1}")
        if values["n-train"] < 1 or values["dim"] < 1 or values.get("n-test", 0) < 0:
            raise ReplyError("n-train and dim must be >= 1, n-test >= 0")
        if values["dim"] > self.max_dim:
            raise BeyondLimits(f"dim {values['dim']} above the limit {self.max_dim}")
        for key in ("n-train", "n-test"):
            if values.get(key, 0) > self.max_n:
                raise BeyondLimits(f"{key} {values[key]} above the limit {self.max_n}")
        if "max-row-norm" in info:
            norm = info["max-row-norm"]
            if isinstance(norm, bool) or not isinstance(norm, int | float) or not (
                    math.isfinite(norm) and norm >= 0):
                raise ReplyError(f"'max-row-norm' must be a finite number >= 0, got {norm!r}")
            if norm > self.max_row_norm:
                raise BeyondLimits(f"max-row-norm {norm:g} above the limit "
                                   f"{self.max_row_norm:g}")
            values["max-row-norm"] = float(norm)
        return values
