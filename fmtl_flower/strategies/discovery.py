"""Which node serves which task: the ``whoami`` query shared by every strategy.

Flower node ids are random and change when a device restarts; strategies key everything by the
task id a node reports (design decision 6). :class:`TaskDirectory` keeps the two-way map,
asks new nodes ``whoami`` (reply: ConfigRecord ``info`` with int ``task-id`` in
0..num_tasks-1, ``n-train`` >= 1, ``dim`` >= 1, the same on every node), forgets nodes that go
offline, lets a restarted device (new node id) take its task over, and refuses a second live
node claiming a task (logged; asked again once the holder is gone). A node whose task id lies
outside 0..num_tasks-1 (a misconfigured device, or one of a larger federation such as an
OFMTL newcomer not yet admitted) is logged once (``outside_level``, WARNING by default) and
not asked again while it stays online.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid


class ReplyError(ValueError):
    """A node's reply broke the wire contract."""


class OutsideTaskRange(ReplyError):
    """A node serves a task id outside this federation's 0..num_tasks-1."""


def read_metrics(reply: Message, *, ints: Iterable[str] = (), numbers: Iterable[str] = (),
                 optional_ints: Iterable[str] = (),
                 optional_numbers: Iterable[str] = ()) -> dict[str, Any]:
    """The reply's ``metrics`` values, typed and finite; :class:`ReplyError` naming the first
    missing or bad key. ``ints`` must be Python ints (not bools), ``numbers`` ints or floats;
    the optional ones are checked when present."""
    if "metrics" not in reply.content:
        raise ReplyError("no 'metrics' record")
    metrics = reply.content["metrics"]
    out: dict[str, Any] = {}
    int_keys = [*ints, *optional_ints]
    required = {*ints, *numbers}
    for key in [*int_keys, *numbers, *optional_numbers]:
        if key not in metrics:
            if key in required:
                raise ReplyError(f"metric {key!r} missing")
            continue
        value = metrics[key]
        if key in int_keys:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ReplyError(f"metric {key!r} must be an int, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ReplyError(f"metric {key!r} is not a number: {value!r}")
        if not math.isfinite(value):
            raise ReplyError(f"metric {key!r} is not finite: {value!r}")
        out[key] = value
    return out


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

    Attributes
    ----------
    node_to_task, task_to_node : dict[int, int]
    n_train : ndarray of shape (num_tasks,), int64
        Training-set size each task reported (0: not seen yet).
    dim : int or None
        The feature dimension, fixed by the first valid reply.
    """

    def __init__(self, num_tasks: int, name: str) -> None:
        self.num_tasks = int(num_tasks)
        self.name = name
        self.node_to_task: dict[int, int] = {}
        self.task_to_node: dict[int, int] = {}
        self.n_train = np.zeros(self.num_tasks, dtype=np.int64)
        self.dim: int | None = None
        self._duplicates: dict[int, int] = {}  # node -> task it claims while another holds it
        self._outside: set[int] = set()  # nodes whose task id is outside 0..num_tasks-1
        self.outside_level = WARNING

    def discover(self, grid: Grid, *, wait: float = 0.0, query_timeout: float = 60.0) -> None:
        """Map new node ids to tasks, waiting up to ``wait`` seconds for every task."""
        deadline = time.monotonic() + wait
        while True:
            online = set(grid.get_node_ids())
            for node in [n for n in self.node_to_task if n not in online]:
                task = self.node_to_task.pop(node)
                if self.task_to_node.get(task) == node:
                    del self.task_to_node[task]
            for node in [n for n in self._duplicates if n not in online
                         or self.task_to_node.get(self._duplicates[n]) not in online]:
                del self._duplicates[node]  # gone, or its task is free again: ask anew
            self._outside &= online
            unknown = sorted(online - set(self.node_to_task) - set(self._duplicates)
                             - self._outside)
            if unknown:
                self._query(grid, unknown, online, query_timeout)
            if len(self.task_to_node) >= self.num_tasks or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if wait and len(self.task_to_node) < self.num_tasks:
            missing = sorted(set(range(self.num_tasks)) - set(self.task_to_node))
            log(WARNING, "%s: %d of %d tasks found after %.0f s; missing task ids %s", self.name,
                len(self.task_to_node), self.num_tasks, wait, missing[:20])

    def _query(self, grid: Grid, nodes: list[int], online: set[int], timeout: float) -> None:
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n,
                        message_type=f"{MessageType.QUERY}.whoami") for n in nodes]
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(WARNING, "%s: whoami failed on node %s: %s", self.name, node,
                    reply.error.reason)
                continue
            try:
                task, n_train, dim = self.read_whoami(reply)
            except OutsideTaskRange as err:
                log(self.outside_level, "%s: node %s: bad whoami reply: %s; not part of this "
                    "federation, not asked again while online", self.name, node, err)
                self._outside.add(node)
                continue
            except ReplyError as err:
                log(WARNING, "%s: node %s: bad whoami reply: %s", self.name, node, err)
                continue
            if self.dim is None:
                self.dim = dim
            elif dim != self.dim:
                log(WARNING, "%s: node %s (task %d) has %d features, the federation %d; "
                    "ignored", self.name, node, task, dim, self.dim)
                continue
            old = self.task_to_node.get(task)
            if old is not None and old != node:
                if old in online:
                    log(WARNING, "%s: node %s claims task %d, which node %s (online) holds; "
                        "ignored while that node is online", self.name, node, task, old)
                    self._duplicates[node] = task
                    continue
                log(INFO, "%s: task %d moved from node %s to node %s", self.name, task, old,
                    node)
                self.node_to_task.pop(old, None)
            self.task_to_node[task] = node
            self.node_to_task[node] = task
            self.n_train[task] = n_train

    def read_whoami(self, reply: Message) -> tuple[int, int, int]:
        """(task id, n-train, dim) of a whoami reply; :class:`ReplyError` if malformed."""
        if "info" not in reply.content:
            raise ReplyError("no 'info' record")
        info = reply.content["info"]
        values = {}
        for key in ("task-id", "n-train", "dim"):
            value = info[key] if key in info else None
            if isinstance(value, bool) or not isinstance(value, int):
                raise ReplyError(f"{key!r} must be an int, got {value!r}")
            values[key] = value
        if not 0 <= values["task-id"] < self.num_tasks:
            raise OutsideTaskRange(f"task-id {values['task-id']} outside "
                                   f"0..{self.num_tasks - 1}")
        if values["n-train"] < 1 or values["dim"] < 1:
            raise ReplyError("n-train and dim must be >= 1")
        return values["task-id"], values["n-train"], values["dim"]
