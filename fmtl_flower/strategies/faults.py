"""Which tasks the server still asks: consecutive failures, exclusion, probing, readmission.

A real fleet has devices that crash, hang or lose power. Waiting for them every round wastes
the round's deadline; forgetting them for good loses their data. :class:`TaskHealth` keeps,
per task, the number of consecutive rounds in which a message was sent and no valid reply came
(an error, a rejected reply, or silence until the deadline). After ``max_failures`` such rounds
the task is *excluded*: it gets no message, except a probe (the round's ordinary message)
every ``probe_every`` rounds; any valid reply, or the task's device reconnecting under a new
node id, readmits it at once. Every round a task does not take part in is recorded, so the
results say which task (and node) missed which rounds.

This module does not talk to Flower; the strategies call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log

__all__ = ["TaskHealth"]


class TaskHealth:
    """Consecutive failures, exclusion and probing of tasks.

    Parameters
    ----------
    num_tasks : int
    max_failures : int
        Consecutive failed rounds after which a task is excluded (0: never exclude).
    probe_every : int
        While excluded, a task is sent its round message every ``probe_every`` rounds
        (counted from its exclusion); >= 1.
    name : str
        Prefix of log lines.
    """

    def __init__(self, num_tasks: int, *, max_failures: int = 3, probe_every: int = 5,
                 name: str = "") -> None:
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0:
            raise ValueError(f"max_failures must be an int >= 0, got {max_failures!r}")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be an int >= 1, got {probe_every!r}")
        self.num_tasks = int(num_tasks)
        self.max_failures = max_failures
        self.probe_every = probe_every
        self.name = name
        self.consecutive = np.zeros(self.num_tasks, dtype=np.int64)
        self.excluded_since = np.zeros(self.num_tasks, dtype=np.int64)  # 0: not excluded
        self.missed: dict[int, list[int]] = {}
        self.events: list[dict[str, Any]] = []
        self._nodes: dict[int, int] = {}  # task -> node id it had when last asked

    @property
    def excluded(self) -> np.ndarray:
        """Boolean mask of the tasks excluded now."""
        return self.excluded_since > 0

    def select(self, server_round: int, task_to_node: dict[int, int]) -> dict[int, int]:
        """The tasks (task -> node) to message in ``server_round``: all reachable ones, but
        an excluded task only on its probe rounds, or at once if its node id changed (the
        device restarted and reconnected)."""
        if not self.excluded_since.any():  # no task excluded: every reachable one
            self._nodes.update(task_to_node)
            return dict(task_to_node)
        chosen = {}
        for task, node in task_to_node.items():
            since = int(self.excluded_since[task])
            if since and self._nodes.get(task) != node:
                self._nodes[task] = node  # the event names the node it is readmitted on
                self._readmit(server_round, task, "its device reconnected as node "
                              f"{node}")
                since = 0
            if since and (server_round - since) % self.probe_every != 0:
                continue
            chosen[task] = node
            self._nodes[task] = node
        return chosen

    def update(self, server_round: int, sent: Iterable[int], accepted: Iterable[int]) -> None:
        """Record the round: tasks ``sent`` a message, of which ``accepted`` replied validly.
        Tasks not accepted (sent or not) missed the round."""
        sent, accepted = set(map(int, sent)), set(map(int, accepted))
        if len(accepted) < self.num_tasks:
            for task in range(self.num_tasks):
                if task not in accepted:
                    self.missed.setdefault(task, []).append(int(server_round))
        answered = np.array(sorted(accepted), dtype=np.int64)
        self.consecutive[answered] = 0
        for task in answered[self.excluded_since[answered] > 0].tolist():
            self._readmit(server_round, task, "it answered a probe")
        for task in sorted(sent - accepted):
            self.consecutive[task] += 1
            if (self.max_failures and not self.excluded_since[task]
                    and self.consecutive[task] >= self.max_failures):
                self.excluded_since[task] = server_round
                self.events.append({"round": int(server_round), "task": task,
                                    "node": self._nodes.get(task), "event": "excluded"})
                log(WARNING, "%s round %d: task %d (node %s) excluded after %d consecutive "
                    "failed rounds; probed every %d rounds", self.name, server_round, task,
                    self._nodes.get(task), self.consecutive[task], self.probe_every)

    def _readmit(self, server_round: int, task: int, why: str) -> None:
        self.excluded_since[task] = 0
        self.consecutive[task] = 0
        self.events.append({"round": int(server_round), "task": int(task),
                            "node": self._nodes.get(task), "event": "readmitted"})
        log(INFO, "%s round %d: task %d readmitted: %s", self.name, server_round, task, why)

    def summary(self, task_to_node: dict[int, int]) -> dict[str, Any]:
        """For the results: missed rounds per task (with its node id), events, excluded now."""
        return {
            "missed_rounds": {str(t): r for t, r in sorted(self.missed.items())},
            "task_nodes": {str(t): int(n) for t, n in sorted(task_to_node.items())},
            "health_events": list(self.events),
            "tasks_excluded": [int(t) for t in np.flatnonzero(self.excluded)],
        }

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Arrays and JSON metadata to store in a checkpoint."""
        return ({"consecutive": self.consecutive, "excluded_since": self.excluded_since},
                {"missed": {str(t): r for t, r in self.missed.items()}, "events": self.events})

    def restore(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Inverse of :meth:`state` (node ids are not restored: devices reconnect anew)."""
        for key in ("consecutive", "excluded_since"):
            value = np.asarray(arrays[key])
            if value.shape != (self.num_tasks,) or value.dtype.kind not in "iu":
                raise ValueError(f"health array {key!r} must be int ({self.num_tasks},)")
            setattr(self, key, value.astype(np.int64))
        self.missed = {int(t): [int(r) for r in rounds] for t, rounds in meta["missed"].items()}
        self.events = list(meta["events"])
