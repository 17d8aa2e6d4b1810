"""Which node serves which task: the ``whoami`` query shared by every strategy.

Flower node ids are random and change when a device restarts; strategies key everything by the
task id a node reports (design decision 6). :class:`TaskDirectory` keeps the two-way map,
asks new nodes ``whoami`` (reply: ConfigRecord ``info`` with int ``task-id`` in
0..num_tasks-1, ``n-train`` in 1..``max_n``, ``dim`` in 1..``max_dim``, the same on every
node, optional ``n-test`` in 0..``max_n``, optional ``num-classes`` in 1..``max_classes``
(FedEM's devices) and optional float ``max-row-norm``, the largest
Euclidean norm of a training row, finite, in 0..``max_row_norm``), forgets nodes that go
offline, and lets a restarted device (new node id) take its task over (logged with the
reason). A node whose task id lies outside 0..num_tasks-1 (a misconfigured device, or one of a
larger federation such as an OFMTL newcomer not yet admitted) is logged once
(``outside_level``, WARNING by default) and not asked again while it stays online.

Nobody takes another device's task (issue 25). A task claimed by two live nodes is held by
neither: when a second node claims a held task, both are asked again at once; a holder that no
longer answers for it (a hung device Flower still lists, or one restarted under a new id) is
gone and the new claimant takes over, as after a restart; if both answer, the task is
*contested* (logged at WARNING, naming both) and held by none until only one of them answers
for it (asked again every ``retry_failed`` seconds) or leaves. The operator can pin tasks to
node ids (:attr:`TaskDirectory.task_owners`, the strategies' ``task_owners`` setting, run-config
key ``task-owners``): only the pinned node (for a packed node: its physical node) may hold a
pinned task; any other claimant is excluded with that reason.

No single node fixes a run-wide fact, and a packed node is one node. ``dim`` is the configured
one when given; otherwise it is the value of a strict majority of the physical nodes, one
vote each however many slots they host (a node whose slots disagree has no vote): of the
nodes online, as soon as that many agree and their claims cover a strict majority of the
``num_tasks`` tasks; or, when a waiting discovery ends (or every task has answered) without
that, of the nodes that answered. Until then the answers wait and nothing is allocated from
them; a node reporting another ``dim`` than the one fixed, or sizes beyond the limits, is
excluded with one log line and not asked again while it stays online. The limits are checked
before anything is allocated from a reported size (and a packed node's slot count before its
slots exist: :class:`~fmtl_flower.packing.PackedGrid`'s ``max_slots_per_node``). FedEM's
``num-classes`` is decided by the strategy from one vote per physical node
(:meth:`TaskDirectory.classes_by_node`); a node reporting more is then excluded
(:meth:`TaskDirectory.cap_classes`). Likewise MOCHA's class list, from the optional
``classes`` (the distinct labels a device built with ``labels="auto"`` holds, a list of at
most ``max_classes`` ints, floats or strings of at most
:data:`~fmtl_flower.core.multiclass.MAX_CLASS_NAME` characters): one vote per physical node
(:meth:`TaskDirectory.labels_by_node`), decided by the strategy
(:func:`~fmtl_flower.core.multiclass.decide_classes`); the nodes it refuses and those whose
labels lie outside the decided list, now or when found later, are excluded
(:meth:`TaskDirectory.fix_labels`).

A waiting discovery (the first round) lasts at most its ``wait`` (the strategies bound it by
``start``'s ``timeout``). If fewer than ``min_tasks`` tasks (default: all of them) have a node
by then, it raises :class:`DiscoveryError` naming the missing task ids and the distinct reasons
(deduplicated, with their nodes) why nodes hold none: failed ``whoami``, exclusions, contests,
packed nodes refused; with ``min_tasks`` below ``num_tasks`` the run goes on with the tasks
found and logs the absent ones. It ends early (fail fast, issue 26) once every node online has
answered, at least one of them with an error or an exclusion, and no node came or went for
``fail_fast_after`` seconds (default 10: a failed node is asked again after ``retry_failed`` =
5 s, so at least twice). A node whose ``whoami`` fails, or does not answer within the query's
timeout, is logged once (again only when its reason changes); a failed one is asked again at
most every ``retry_failed`` seconds, not at every poll, a silent one at the next poll; the
same error (up to its numbers: :func:`reason_shape`) on many nodes is logged in full once,
then as one line counting the other nodes. Where the server knows the fix of a device's
error (:func:`suggested_fix`: labels 0/1 for a hinge model, a NumPyClient device, a task id
beyond ``num_tasks``, ...) or of too few nodes for the tasks, the log line and the
:class:`DiscoveryError` say it.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..core.multiclass import MAX_CLASS_NAME, canonical_classes

#: The longest device error reason kept and logged (a hostile node could fill the log).
MAX_REASON_CHARS = 2000


def error_reason(reply: Message) -> str:
    """An error reply's reason as text, cut at :data:`MAX_REASON_CHARS` characters."""
    text = str(reply.error.reason)
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


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
        Why each node that holds no task holds none: the last error of nodes whose
        ``whoami`` failed, and the reason of each excluded node (node id -> reason).
    distinct_reasons : dict of str to list of int
        The same, deduplicated: each distinct reason and the nodes that gave it.
    fixes : list of str
        What to change, where the server knows it (:func:`suggested_fix`; too few nodes for
        the tasks); also at the end of the message, after "To fix:".
    """

    #: At most this many distinct reasons are spelled out in the message.
    SHOWN_REASONS = 10

    def __init__(self, name: str, missing: list[int], found: int, required: int,
                 waited: float, reasons: dict[int, str]) -> None:
        self.missing, self.found, self.required = missing, found, required
        self.reasons = dict(reasons)
        self.distinct_reasons = distinct_reasons(reasons)
        message = (f"{name}: {found} of {found + len(missing)} tasks found within {waited:.0f} s"
                   f" ({required} required); missing task ids: {describe_tasks(missing)}")
        if reasons:
            message += (f"; {len(reasons)} node(s) failed whoami or were excluded, "
                        f"{len(self.distinct_reasons)} distinct reason(s): "
                        + describe_reasons(self.distinct_reasons, self.SHOWN_REASONS))
        self.fixes = suggested_fixes(self.distinct_reasons)
        if len(reasons) < len(missing):  # not even one node per missing task answered
            self.fixes.append(TOO_FEW_NODES_FIX.format(found=found, tasks=found + len(missing)))
        if self.fixes:
            message += ". To fix: " + " ".join(self.fixes)
        super().__init__(message)


#: The fix of a run with fewer nodes than tasks (DiscoveryError, when fewer nodes answered
#: than tasks are missing).
TOO_FEW_NODES_FIX = ("{found} node(s) hold a task but the run has {tasks} tasks: set num-tasks "
                     "(num_tasks=) to the number of SuperNodes, or set min-tasks (min_tasks=) "
                     "to run with the tasks found, or start a SuperNode for each missing task.")

#: (what a device's error says, the fix the server knows for it), for :func:`suggested_fix`.
KNOWN_FIXES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"labels must be in \{-1, 1\}"),
     "MOCHA, CoCoA, Mb-SDCA, Mb-SGD and OFMTL train on labels -1/+1: map the device's labels "
     "to -1/+1 in its loader (y = 2 * y - 1 for labels 0/1), or build a MOCHA ClientApp with "
     "make_mocha_client_app(load, labels=\"auto\") (it takes labels 0/1 as -1/+1, and "
     "MOCHA, CoCoA and Mb-SDCA take any K distinct labels, learned at discovery)."),
    (re.compile(r"labels must be in \{0, 1\}|labels outside|labels must be class ids"),
     "The FedEM family takes labels as class ids 0..C-1: map the device's labels to them, and "
     "leave the strategy's num_classes unset (learned from the devices at discovery), or set "
     "it to C."),
    (re.compile(r"Invalid message type: '?query\.whoami"),
     "The device's ClientApp has no query.whoami handler: a NumPyClient / "
     "ClientApp(client_fn=...) device, which start() serves through "
     "fmtl_flower.legacy.LegacyGrid unless the grid it was given is another wrapper: pass "
     "grid=LegacyGrid(grid) (inside any other wrapper), or run this project's ClientApp on "
     "the device."),
    (re.compile(r"task-id -?\d+ outside 0\.\.\d+"),
     "A device serves a task id beyond this run's tasks: set num-tasks (num_tasks=) to the "
     "federation's number of tasks, or fix the device's task-id / partition-id."),
    (re.compile(r"is claimed by \d+ live nodes"),
     "Two devices report the same task id: fix one device's task-id, or pin the task to one "
     "node with task-owners (task_owners=)."),
    (re.compile(r"features, the federation \d+"),
     "A device's data has another number of features than the federation's: fix its loader, "
     "or set dim if the majority is wrong."),
)


def suggested_fix(reason: str) -> str | None:
    """The fix the server knows for a device's error ``reason`` (:data:`KNOWN_FIXES`), else
    None."""
    for pattern, fix in KNOWN_FIXES:
        if pattern.search(reason):
            return fix
    return None


def suggested_fixes(grouped: Mapping[str, list[int]]) -> list[str]:
    """The distinct fixes of the distinct reasons ``grouped`` (in order of first reason)."""
    fixes: list[str] = []
    for reason in grouped:
        fix = suggested_fix(reason)
        if fix is not None and fix not in fixes:
            fixes.append(fix)
    return fixes


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width] + "..."


def reason_shape(reason: str) -> str:
    """``reason`` with its numbers blanked: the same error of several devices (``task 3
    (train): ... found 12 label(s)`` and ``task 5 (train): ... found 9 label(s)``) has one
    shape."""
    return _NUMBER.sub("#", reason)


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def distinct_reasons(reasons: dict[int, str]) -> dict[str, list[int]]:
    """``{reason: [nodes]}`` of a ``{node: reason}`` map, in order of each reason's first
    (smallest) node; reasons that differ only in their numbers (:func:`reason_shape`: the
    same error on devices of other tasks or sizes) are one, spelled as its first node's."""
    out: dict[str, list[int]] = {}
    first: dict[str, str] = {}  # shape -> the reason that spells it
    for node in sorted(reasons):
        spelled = first.setdefault(reason_shape(reasons[node]), reasons[node])
        out.setdefault(spelled, []).append(node)
    return out


def describe_reasons(grouped: dict[str, list[int]], shown: int = 10, width: int = 300) -> str:
    """``[node 7] reason; [nodes 3, 4] other reason; ...`` for a message (at most ``shown``
    reasons, each cut at ``width`` characters)."""
    parts = []
    for reason, nodes in list(grouped.items())[:shown]:
        label = "node" if len(nodes) == 1 else "nodes"
        text = reason if len(reason) <= width else reason[:width] + "..."
        parts.append(f"[{label} {describe_tasks(nodes, shown=5)}] {text}")
    if len(grouped) > shown:
        parts.append(f"... and {len(grouped) - shown} more")
    return "; ".join(parts)


class TooFewNodes(DiscoveryError):
    """Fewer nodes than ``min_available_nodes`` connected within the discovery time (a
    :class:`DiscoveryError`; ``missing`` is empty: no task could be asked yet)."""

    def __init__(self, name: str, online: int, required: int, waited: float) -> None:
        self.missing, self.found, self.required = [], online, required
        self.reasons: dict[int, str] = {}
        self.distinct_reasons: dict[str, list[int]] = {}
        self.fixes = [f"Start {required - online} more SuperNode(s), or lower "
                      "min_available_nodes (min-available-nodes)."]
        RuntimeError.__init__(self, f"{name}: {online} node(s) online after {waited:.0f} s, "
                              f"min_available_nodes = {required} required. To fix: "
                              + self.fixes[0])


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


#: Largest task id :func:`discover_num_tasks` reads (a whoami reply beyond it is refused).
MAX_DISCOVERED_TASK_ID = 1_000_000


def discover_num_tasks(grid: Grid, min_available_nodes: int = 1, timeout: float = 120.0,
                       name: str = "discovery") -> int:
    """The number of tasks of a federation whose size is not configured (Flower's habit:
    as many tasks as SuperNodes): wait until ``min_available_nodes`` nodes (at least 1) are
    online, ask every node online ``whoami``, and count the distinct task ids they report.

    The count, not the largest id: a node cannot make the federation larger than the nodes
    that answered. The strategy built with it then discovers as usual: a node whose task id
    is not below the count is refused with that reason (and the fix: set ``num-tasks``).

    Raises
    ------
    TooFewNodes
        Fewer than ``min_available_nodes`` nodes connected within ``timeout`` seconds.
    DiscoveryError
        No node answered ``whoami`` with a task id (each node's reason listed).
    """
    started = time.monotonic()
    online = wait_for_nodes(grid, max(1, int(min_available_nodes)), timeout, name)
    nodes = sorted(grid.get_node_ids())
    asker = TaskDirectory(1, name)
    asker.num_tasks = MAX_DISCOVERED_TASK_ID + 1  # read_whoami's range; nothing allocated
    left = max(1.0, timeout - (time.monotonic() - started))
    answers = asker._ask(grid, nodes, left)
    tasks = {a["task-id"] for a in answers.values() if isinstance(a, dict)}
    if not tasks:
        raise DiscoveryError(name, [], 0, 1, time.monotonic() - started,
                             {n: str(a) for n, a in answers.items()})
    log(INFO, "%s: num_tasks = %d, the distinct task ids of the %d node(s) online (%d "
        "answered whoami with a task id)", name, len(tasks), online,
        sum(isinstance(a, dict) for a in answers.values()))
    return len(tasks)


class OutsideTaskRange(ReplyError):
    """A node serves a task id outside this federation's 0..num_tasks-1."""


class BeyondLimits(ReplyError):
    """A node reports a size beyond the server's limits (``max_dim``, ``max_n``, ...)."""


class WhoamiFailed(ReplyError):
    """A node answered ``whoami`` with an error, or not within the query's timeout."""


class NoAnswer(WhoamiFailed):
    """A node did not answer ``whoami`` within the query's timeout (asked again at the next
    poll: the query already waited for it)."""


@dataclass
class Contest:
    """A task claimed by several live nodes: ``claimants`` (node -> its whoami), the node
    that held it before (``holder``), when they were last asked (``asked``) and the set of
    claimants last logged (``logged``)."""

    holder: int
    claimants: dict[int, dict[str, Any]]
    asked: float = -math.inf
    logged: frozenset[int] = frozenset()


def _same_node(node: int) -> int:
    """The physical node of a node id on an unpacked grid: itself."""
    return node


#: Default limits on what a node may report at discovery (checked before any allocation).
MAX_DIM = 10_000_000
MAX_N = 1_000_000_000
MAX_ROW_NORM = 1e8
#: Largest ``num-classes`` a node may report (FedEM's devices: the classes of their labels).
MAX_CLASSES = 1000


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
    max_classes : int
        Largest ``num-classes`` a node may report.

    Attributes
    ----------
    node_to_task, task_to_node : dict[int, int]
    n_train : ndarray of shape (num_tasks,), int64
        Training-set size each task reported (0: not seen yet).
    row_norm : ndarray of shape (num_tasks,), float64
        The ``max-row-norm`` each task reported (NaN: not reported).
    num_classes : ndarray of shape (num_tasks,), int64
        The ``num-classes`` each task reported (0: not reported; :meth:`classes_by_node`).
    dim : int or None
        The feature dimension: configured, or agreed by a majority (see the module docstring).
    task_owners : dict[int, int]
        Tasks pinned by the operator to a (physical) Flower node id.
    contested : dict[int, list[int]]
        Tasks claimed by several live nodes, held by none, and their claimants.
    """

    def __init__(self, num_tasks: int, name: str, *, dim: int | None = None,
                 max_dim: int = MAX_DIM, max_n: int = MAX_N,
                 max_row_norm: float = MAX_ROW_NORM, max_classes: int = MAX_CLASSES) -> None:
        self.num_tasks = int(num_tasks)
        self.max_classes = int(max_classes)
        self.classes_fix = ""  # what to do about too many classes (:meth:`cap_classes`)
        self.name = name
        self.max_dim, self.max_n = int(max_dim), int(max_n)
        self.max_row_norm = float(max_row_norm)
        if dim is not None and not 1 <= int(dim) <= self.max_dim:
            raise ValueError(f"dim must be in 1..{self.max_dim}, got {dim!r}")
        self.node_to_task: dict[int, int] = {}
        self.task_to_node: dict[int, int] = {}
        self.n_train = np.zeros(self.num_tasks, dtype=np.int64)
        self.row_norm = np.full(self.num_tasks, np.nan)
        self.num_classes = np.zeros(self.num_tasks, dtype=np.int64)
        #: task -> the labels its device holds (MOCHA's ``classes``; :meth:`labels_by_node`)
        self.labels: dict[int, tuple[Any, ...]] = {}
        #: The run's class list once decided (:meth:`fix_labels`); None: not yet, or no vote.
        self.allowed_labels: frozenset[Any] | None = None
        self.dim: int | None = None if dim is None else int(dim)
        self._owners: dict[int, int] = {}  # task -> the physical node pinned to it
        self._contested: dict[int, Contest] = {}  # task -> its live claimants, held by none
        self._outside: dict[int, str] = {}  # node -> why its task id is not this federation's
        self._excluded: dict[int, str] = {}  # node -> why it disagrees with the run or limits
        self._candidates: dict[int, dict[str, Any]] = {}  # node -> whoami, dim not fixed yet
        self._gone: dict[int, int] = {}  # task -> node it had when that node went offline
        self._failed: dict[int, tuple[float, str]] = {}  # node -> (when, reason) of its failure
        self._reported: dict[str, set[int]] = {}  # reason shape -> nodes that gave it
        self._repeats: dict[str, list[int]] = {}  # reason shape -> nodes not logged yet
        self._spelled: dict[str, str] = {}  # reason shape -> its first spelling
        self._physical: Callable[[int], int] = _same_node  # node id -> its physical node
        self._refusals: Callable[[], dict[int, str]] = dict  # the grid's refused nodes
        self.outside_level = WARNING
        #: Tasks a waiting discovery must find (None: all ``num_tasks``).
        self.min_tasks: int | None = None
        #: Seconds before a node whose whoami failed (or a contested task's claimants) is
        #: asked again.
        self.retry_failed = 5.0
        #: Seconds a waiting discovery goes on once every node online has answered, at least
        #: one of them with an error or an exclusion, and no node came or went (then it ends,
        #: raising :class:`DiscoveryError` if too few tasks were found); None: never early.
        self.fail_fast_after: float | None = 10.0

    # ------------------------------------------------------------------ operator pins
    @property
    def task_owners(self) -> dict[int, int]:
        """``{task: node id}``: tasks pinned to a Flower node id (of the physical node, for a
        packed node). Only that node may hold the task; any other claim is excluded with its
        reason. A device whose node id changes must be pinned again."""
        return dict(self._owners)

    @task_owners.setter
    def task_owners(self, owners: Mapping[int, int] | None) -> None:
        checked: dict[int, int] = {}
        for task, node in dict(owners or {}).items():
            if isinstance(task, bool) or not isinstance(task, int | np.integer) \
                    or not 0 <= task < self.num_tasks:
                raise ValueError(f"task_owners: task {task!r} is not in 0..{self.num_tasks - 1}")
            if isinstance(node, bool) or not isinstance(node, int | np.integer) or node < 0:
                raise ValueError(f"task_owners: task {task}: node id {node!r} is not an int >= 0")
            checked[int(task)] = int(node)
        self._owners = checked

    @property
    def contested(self) -> dict[int, list[int]]:
        return {t: sorted(c.claimants) for t, c in self._contested.items()}

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, *, wait: float = 0.0, query_timeout: float = 60.0,
                 settle: bool = True) -> None:
        """Map new node ids to tasks, waiting up to ``wait`` seconds for every task; with
        ``settle``, end by fixing ``dim`` from the answers if they have a majority
        (:meth:`settle`; pass False to keep waiting for a majority of the federation)."""
        started = time.monotonic()
        deadline = started + wait
        self._physical = getattr(grid, "physical_node", _same_node)
        self._refusals = getattr(grid, "refusals", dict)
        seen: set[int] | None = None
        quiet_since = started  # the online nodes have not changed since
        while True:
            online = set(grid.get_node_ids())
            if not wait and self._unchanged(online):
                break  # every node online is a known task's, and nothing waits: no change
            self._forget_offline(online)
            now = time.monotonic()
            if online != seen:
                seen, quiet_since = online, now
            resting = {n for n, (when, _) in self._failed.items()
                       if now - when < self.retry_failed}
            unknown = sorted(online - set(self.node_to_task) - self._claimants()
                             - set(self._outside) - set(self._excluded)
                             - set(self._candidates) - resting)
            timeout = min(query_timeout, max(deadline - now, 1.0)) if wait else query_timeout
            if unknown:
                self._query(grid, unknown, online, timeout)
            self._check_contests(grid, online, timeout)
            answered = {c["task-id"] for c in self._candidates.values()}
            if (len(self.task_to_node) >= self.num_tasks or len(answered) >= self.num_tasks
                    or time.monotonic() >= deadline):
                break
            if self._nothing_to_wait_for(online, quiet_since):
                log(WARNING, "%s: every node online has answered, %d with an error or "
                    "excluded, and none came or went for %.0f s: discovery ends early",
                    self.name, len(self._why_not_held(online)), self.fail_fast_after)
                break
            time.sleep(0.2)
        if settle:
            self.settle(online)
            self._check_contests(grid, online, query_timeout)
        if wait and len(self.task_to_node) < self.num_tasks:
            self._end_of_wait(started, online)

    def _unchanged(self, online: set[int]) -> bool:
        """Whether every node online holds its known task and nothing waits."""
        return (len(online) == len(self.node_to_task) == len(self.task_to_node)
                and not (self._contested or self._outside or self._excluded
                         or self._candidates or self._failed)
                and online.issuperset(self.node_to_task))

    def _forget_offline(self, online: set[int]) -> None:
        """Drop what is known of the nodes that are no longer online."""
        for node in [n for n in self.node_to_task if n not in online]:
            task = self.node_to_task.pop(node)
            if self.task_to_node.get(task) == node:
                del self.task_to_node[task]
                self._gone[task] = node
        for contest in self._contested.values():
            for node in [n for n in contest.claimants if n not in online]:
                del contest.claimants[node]
        self._outside = {n: r for n, r in self._outside.items() if n in online}
        self._excluded = {n: r for n, r in self._excluded.items() if n in online}
        self._candidates = {n: c for n, c in self._candidates.items() if n in online}
        self._failed = {n: f for n, f in self._failed.items() if n in online}
        self._reported = {r: n & online for r, n in self._reported.items() if n & online}
        self._spelled = {r: t for r, t in self._spelled.items() if r in self._reported}

    def _claimants(self) -> set[int]:
        return {n for contest in self._contested.values() for n in contest.claimants}

    def _why_not_held(self, online: set[int]) -> dict[int, str]:
        """``{node: reason}`` of the online nodes that failed whoami or were excluded, and of
        the physical nodes the grid refused (a packed node's slots query)."""
        reasons = {n: r for n, (_, r) in self._failed.items() if n in online}
        reasons.update({n: r for n, r in self._excluded.items() if n in online})
        reasons.update({n: r for n, r in self._outside.items() if n in online})
        for task, contest in self._contested.items():
            claimants = contest.claimants
            for node in claimants:
                reasons[node] = (f"task {task} is claimed by {len(claimants)} live nodes "
                                 f"({describe_tasks(claimants)}): held by none")
        reasons.update(self._refusals())
        return reasons

    def _nothing_to_wait_for(self, online: set[int], quiet_since: float) -> bool:
        """Fail fast: every node online has answered (holds a task, failed, was excluded or
        contests a task), at least one did not hold, and no node came or went for
        ``fail_fast_after`` seconds."""
        if self.fail_fast_after is None:
            return False
        if time.monotonic() - quiet_since < self.fail_fast_after:
            return False
        settled = (set(self.node_to_task) | self._claimants() | set(self._outside)
                   | set(self._excluded) | set(self._candidates) | set(self._failed))
        return online <= settled and bool(self._why_not_held(online))

    def _end_of_wait(self, started: float, online: set[int]) -> None:
        """After a waiting discovery: :class:`DiscoveryError` if fewer than ``min_tasks``
        tasks have a node, else a warning naming the absent ones."""
        missing = sorted(set(range(self.num_tasks)) - set(self.task_to_node))
        required = self.num_tasks if self.min_tasks is None else self.min_tasks
        waited = time.monotonic() - started
        if len(self.task_to_node) < required:
            raise DiscoveryError(self.name, missing, len(self.task_to_node), required, waited,
                                 self._why_not_held(online))
        log(WARNING, "%s: %d of %d tasks found after %.0f s (min_tasks %d); running "
            "without task ids %s", self.name, len(self.task_to_node), self.num_tasks,
            waited, required, describe_tasks(missing))

    def settle(self, online: set[int] | None = None) -> None:
        """Fix ``dim`` from the answers so far if a strict majority of the physical nodes that
        answered agree (the end of a waiting discovery); otherwise log that they disagree."""
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
        """Fix ``dim`` if one value has the votes of a strict majority of the physical nodes
        (one vote each, however many slots they host): of those online, with a strict
        majority of the tasks among their claims; or, when ``final``, of those that
        answered."""
        if self.dim is not None or not self._candidates:
            return
        dims: dict[int, set[int]] = defaultdict(set)  # physical node -> the dims it reports
        tasks: dict[int, set[int]] = defaultdict(set)  # physical node -> the tasks it claims
        for node, info in self._candidates.items():
            dims[self._physical(node)].add(info["dim"])
            tasks[self._physical(node)].add(info["task-id"])
        votes = Counter(next(iter(d)) for d in dims.values() if len(d) == 1)
        if not votes:
            if final:
                log(WARNING, "%s: no node's slots agree on dim; set dim in the configuration",
                    self.name)
            return
        (value, count), = votes.most_common(1)
        voters = [p for p, d in dims.items() if d == {value}]
        claimed = set().union(*(tasks[p] for p in voters))
        physical_online = {self._physical(n) for n in online}
        early = 2 * count > len(physical_online) and 2 * len(claimed) > self.num_tasks
        if early or (final and 2 * count > len(dims)):
            self.dim = int(value)
            log(INFO, "%s: dim = %d, reported by %d of the %d nodes that answered (%d tasks "
                "claimed)", self.name, value, count, len(dims), len(claimed))
            candidates, self._candidates = self._candidates, {}
            for node, info in sorted(candidates.items()):
                self._admit(node, info, online)
        elif final:
            log(WARNING, "%s: the %d nodes that answered disagree on dim (%s) and no value has "
                "a majority; set dim in the configuration", self.name, len(dims),
                ", ".join(f"{v}: {c} nodes" for v, c in votes.most_common()))

    def _ask(self, grid: Grid, nodes: list[int], timeout: float
             ) -> dict[int, dict[str, Any] | Exception]:
        """Send ``whoami`` to ``nodes``: each node's checked answer, or the exception that
        says what was wrong with it (:class:`WhoamiFailed` for an error reply or no answer)."""
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n,
                        message_type=f"{MessageType.QUERY}.whoami") for n in nodes]
        asked = set(nodes)
        out: dict[int, dict[str, Any] | Exception] = {}
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            try:
                node = reply.metadata.src_node_id
                if node not in asked or node in out:
                    continue  # not an answer to this query, or a second one
                if reply.has_error():
                    out[node] = WhoamiFailed(error_reason(reply))
                    continue
                out[node] = self.read_whoami(reply)
            except ReplyError as err:
                out[node] = err
            except Exception as err:  # noqa: BLE001 - any malformed reply is only logged
                out[node] = ReplyError(f"{type(err).__name__}: {err}")
        for node in asked - set(out):
            out[node] = NoAnswer("no answer to whoami within the query's timeout")
        return out

    def _query(self, grid: Grid, nodes: list[int], online: set[int], timeout: float) -> None:
        answers = sorted(self._ask(grid, nodes, timeout).items())
        for node, answer in answers:
            if isinstance(answer, Exception):
                self._refuse(node, answer)
        self._log_repeats()
        for node, answer in answers:
            if isinstance(answer, Exception):
                continue
            self._failed.pop(node, None)
            if self.dim is None:
                self._candidates[node] = answer
            else:
                self._admit(node, answer, online)
        self._vote(online, final=False)

    def _refuse(self, node: int, err: Exception) -> None:
        """Log why ``node``'s whoami answer is not taken, once per reason, and remember it."""
        if isinstance(err, OutsideTaskRange):
            log(self.outside_level, "%s: node %s: bad whoami reply: %s; not part of this "
                "federation, not asked again while online", self.name, node, err)
            self._outside[node] = str(err)
        elif isinstance(err, BeyondLimits):
            self._exclude(node, str(err))
        else:
            reason = str(err)
            if self._failed.get(node, (0.0, None))[1] != reason:  # once per reason
                self._log_failure(node, err)
            # a node that failed rests retry_failed s; one that did not answer does not
            self._failed[node] = (-math.inf if isinstance(err, NoAnswer) else time.monotonic(),
                                  reason)

    def _log_failure(self, node: int, err: Exception) -> None:
        """Log a node's failed whoami, with its fix when known: the first node of each
        reason (:func:`reason_shape`) in full; the next ones are counted and logged in one
        line after the query (:meth:`_log_repeats`), not a traceback per device."""
        reason = str(err)
        nodes = self._reported.setdefault(reason_shape(reason), set())
        self._spelled.setdefault(reason_shape(reason), reason)
        if nodes - {node}:
            self._repeats.setdefault(reason_shape(reason), []).append(node)
        else:
            what = "whoami failed on node {}: " if isinstance(err, WhoamiFailed) \
                else "node {}: bad whoami reply: "
            fix = suggested_fix(reason)
            log(WARNING, "%s: %s%s (asked again every %.0f s, logged again only if the "
                "reason changes)%s", self.name, what.format(node), reason, self.retry_failed,
                f". To fix: {fix}" if fix else "")
        nodes.add(node)

    def _log_repeats(self) -> None:
        """One line per reason that more nodes gave since the last call (:meth:`_log_failure`)."""
        for shape, nodes in self._repeats.items():
            first = min(self._reported.get(shape, set()) - set(nodes), default=None)
            log(WARNING, "%s: %d more node(s) failed whoami with the reason logged for node %s "
                "(%s): %s", self.name, len(nodes), first,
                _cut(self._spelled.get(shape, shape), 100),
                describe_tasks(nodes, shown=10))
        self._repeats = {}

    def _exclude(self, node: int, reason: str) -> None:
        """Exclude ``node`` while it stays online, for ``reason`` (logged, and kept for
        :class:`DiscoveryError`)."""
        log(WARNING, "%s: node %s excluded: %s; not asked again while online", self.name, node,
            reason)
        self._excluded[node] = reason

    def _admit(self, node: int, info: dict[str, Any], online: set[int]) -> None:
        """Give ``node`` its task if it agrees with the run's ``dim``, the operator did not
        pin the task to another node and no other live node claims it."""
        task = info["task-id"]
        if info["dim"] != self.dim:
            log(WARNING, "%s: node %s (task %d) has %d features, the federation %d; "
                "excluded, not asked again while online", self.name, node, task, info["dim"],
                self.dim)
            self._excluded[node] = f"task {task}: {info['dim']} features, the federation " \
                                   f"{self.dim}"
            return
        owner = self._owners.get(task)
        if owner is not None:
            if self._physical(node) != owner:
                self._exclude(node, f"claims task {task}, which task-owners pins to node "
                              f"{owner}")
                return
            self._hold(node, task, info, "its pinned node")
            return
        if task in self._contested:
            self._contested[task].claimants[node] = info
            return
        holder = self.task_to_node.get(task)
        if holder is None or holder == node or holder not in online:
            self._hold(node, task, info, f"node {holder} went offline")
            return
        # two live claimants: neither holds the task until the other is gone (both are asked
        # again at once: a holder that no longer answers is gone, as after a restart)
        held = {"task-id": task, "dim": self.dim, "n-train": int(self.n_train[task])}
        if not np.isnan(self.row_norm[task]):
            held["max-row-norm"] = float(self.row_norm[task])
        if self.num_classes[task]:
            held["num-classes"] = int(self.num_classes[task])
        if task in self.labels:
            held["classes"] = self.labels[task]
        self._release(task)
        self._contested[task] = Contest(holder, {holder: held, node: info})

    def _release(self, task: int) -> None:
        node = self.task_to_node.pop(task)
        self.node_to_task.pop(node, None)

    def _hold(self, node: int, task: int, info: dict[str, Any], why: str) -> None:
        old = self.task_to_node.get(task)
        if old is not None and old != node:
            log(INFO, "%s: task %d moved from node %s to node %s (%s)", self.name, task, old,
                node, why)
            self._release(task)
        elif task in self._gone and self._gone[task] != node:
            log(INFO, "%s: task %d rejoined on node %s (its node %s went offline)", self.name,
                task, node, self._gone[task])
        self._gone.pop(task, None)
        self.task_to_node[task] = node
        self.node_to_task[node] = task
        self.n_train[task] = info["n-train"]
        self.row_norm[task] = info.get("max-row-norm", np.nan)
        self.num_classes[task] = info.get("num-classes", 0)
        if "classes" in info:
            self.labels[task] = info["classes"]
        else:
            self.labels.pop(task, None)

    def _check_contests(self, grid: Grid, online: set[int], timeout: float) -> None:
        """Ask the claimants of each contested task again (at once for a new contest, then
        every ``retry_failed`` seconds): a claimant that no longer answers with the task
        drops out; the task goes to the last one left; while two or more are left, none
        holds it (logged once per set of claimants, naming them)."""
        now = time.monotonic()
        due = [t for t, c in self._contested.items() if now - c.asked >= self.retry_failed]
        nodes = sorted({n for t in due for n in self._contested[t].claimants if n in online})
        answers = self._ask(grid, nodes, timeout) if nodes else {}
        for task in due:
            contest = self._contested[task]
            contest.asked = time.monotonic()
            for node in list(contest.claimants):
                answer = answers.get(node)
                if isinstance(answer, dict) and answer["task-id"] == task \
                        and answer["dim"] == self.dim:
                    contest.claimants[node] = answer
                    continue
                del contest.claimants[node]
                if isinstance(answer, Exception):
                    self._refuse(node, answer)
        self._log_repeats()
        for task in list(self._contested):
            self._settle_contest(task)

    def _settle_contest(self, task: int) -> None:
        """Log a contest whose claimants changed; end it when one claimant or none is left
        (the task goes to that one)."""
        contest = self._contested[task]
        claimants = contest.claimants
        if len(claimants) > 1:
            if contest.logged != frozenset(claimants):
                log(WARNING, "%s: task %d is claimed by %d live nodes (%s): held by none "
                    "until only one of them answers for it, or task-owners pins it",
                    self.name, task, len(claimants), describe_tasks(claimants))
                contest.logged = frozenset(claimants)
            return
        del self._contested[task]
        if not claimants:
            return
        (node, info), = claimants.items()
        if node != contest.holder:
            log(INFO, "%s: task %d moved from node %s to node %s: node %s stopped answering "
                "for it or went offline", self.name, task, contest.holder, node, contest.holder)
        self._hold(node, task, info, "the other claimants stopped answering or left")

    def classes_by_node(self) -> dict[int, int]:
        """``{physical node: the most classes its held tasks reported}`` (``num-classes``:
        FedEM's devices, from their labels), of the nodes that reported any: one vote per
        physical node however many slots it hosts; the strategy decides the run's value
        from the votes (no single node fixes it)."""
        votes: dict[int, int] = {}
        for task, node in self.task_to_node.items():
            if self.num_classes[task]:
                physical = self._physical(node)
                votes[physical] = max(votes.get(physical, 0), int(self.num_classes[task]))
        return votes

    def cap_classes(self, limit: int, fix: str) -> None:
        """Lower ``max_classes`` to ``limit`` (the run's decided classes): the nodes holding a
        task that reported more are excluded now, later ones at their whoami; each reason
        ends with ``fix``."""
        self.max_classes = min(self.max_classes, int(limit))
        self.classes_fix = fix
        for task, node in sorted(self.task_to_node.items()):
            if self.num_classes[task] > self.max_classes:
                self._release(task)
                self._exclude(node, f"task {task}: num-classes {self.num_classes[task]} above "
                              f"the run's {self.max_classes}; {fix}")

    def labels_by_node(self) -> dict[int, tuple[Any, ...]]:
        """``{physical node: the sorted union of the labels its held tasks reported}``
        (``classes``: MOCHA's devices built with ``labels="auto"``), of the nodes that
        reported any: one vote per physical node however many slots it hosts (none for a
        node whose slots mix strings and numbers); the strategy
        decides the run's class list from the votes
        (:func:`~fmtl_flower.core.multiclass.decide_classes`)."""
        votes: dict[int, set[Any]] = {}
        for task, node in self.task_to_node.items():
            if task in self.labels:
                votes.setdefault(self._physical(node), set()).update(self.labels[task])
        out = {}
        for node, vote in votes.items():
            try:
                out[node] = canonical_classes(vote)
            except ValueError:  # a packed node whose slots mix strings and numbers: no vote
                continue
        return out

    def fix_labels(self, classes: Iterable[Any], refused: Mapping[int, str], fix: str) -> None:
        """Fix the run's class list: the physical nodes in ``refused`` and the holders of a
        task whose labels lie outside ``classes`` are excluded now (reasons ending with
        ``fix``), a node found later whose labels do at its whoami."""
        self.allowed_labels = frozenset(classes)
        self.classes_fix = fix
        for task, node in sorted(self.task_to_node.items()):
            why = refused.get(self._physical(node))
            outside = sorted(set(self.labels.get(task, ())) - self.allowed_labels, key=str)
            if why is None and outside:
                why = f"labels {outside[:5]} outside the run's classes"
            if why is not None:
                self._release(task)
                self._exclude(node, f"task {task}: {why}; {fix}")

    def _read_labels(self, value: Any) -> tuple[Any, ...]:
        """A whoami's ``classes``: a list of at most ``max_classes`` distinct labels (ints,
        floats or strings of at most MAX_CLASS_NAME characters), within the run's class
        list once it is fixed."""
        if not isinstance(value, list) or not value:
            raise ReplyError(f"'classes' must be a non-empty list, got {type(value).__name__}")
        if len(value) > self.max_classes:
            raise BeyondLimits(f"{len(value)} classes above the limit {self.max_classes}")
        if any(isinstance(v, str) and len(v) > MAX_CLASS_NAME for v in value) or any(
                isinstance(v, bytes | bool) for v in value):
            raise ReplyError(f"'classes' must hold numbers or strings of at most "
                             f"{MAX_CLASS_NAME} characters")
        try:
            labels = canonical_classes(value)
        except ValueError as err:
            raise ReplyError(f"'classes': {err}") from None
        if self.allowed_labels is not None and not self.allowed_labels.issuperset(labels):
            outside = sorted(set(labels) - self.allowed_labels, key=str)
            raise BeyondLimits(f"labels {outside[:5]} outside the run's classes; "
                               f"{self.classes_fix}")
        return labels

    def _read_classes(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReplyError(f"'num-classes' must be an int >= 1, got {value!r}")
        if value > self.max_classes:
            raise BeyondLimits(f"num-classes {value} above the limit {self.max_classes}"
                               + (f"; {self.classes_fix}" if self.classes_fix else ""))
        return value

    def read_whoami(self, reply: Message) -> dict[str, Any]:
        """The checked ``info`` of a whoami reply: ``task-id``, ``n-train``, ``dim`` and, when
        reported, ``n-test``, ``num-classes``, ``classes`` and ``max-row-norm``;
        :class:`ReplyError` if
        malformed, :class:`OutsideTaskRange` / :class:`BeyondLimits` as their names say."""
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
        if "num-classes" in info:
            values["num-classes"] = self._read_classes(info["num-classes"])
        if "classes" in info:
            values["classes"] = self._read_labels(info["classes"])
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
