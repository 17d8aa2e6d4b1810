"""What the strategies over one linear model per task (MOCHA, Mb-SGD) share.

:class:`LinearTasks` is a mixin for :class:`~fmtl_flower.strategies.base.TaskStrategy`
subclasses whose task t sends and receives one model ``w_t`` (a column of W) and reports the
mean hinge loss at it: the final metrics round (``configure_evaluate`` /
``aggregate_evaluate``), the row-norm bound R_t of each task, the checks of a reply's loss and
test counts against it (one reply, or the rows of a stacked reply in vectorised form), and the
completion of a round record from the replies (primal, objective, test errors). The strategy
supplies the round's messages and replies through the hooks below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from ..metrics import error_summary
from .base import BOUND_SLACK, ReplyBoundary, check_bound, norm, reject_rows
from .discovery import ReplyError

__all__ = ["LinearTasks"]

#: Why a reply's ``loss-mean`` is bounded (in the reason of a rejection).
LOSS_BOUND = "1 + max-row-norm |w_t| >= hinge(y x^T w_t)"

Replies = dict[int, dict[str, Any]]


class LinearTasks:
    """Mixin: the final metrics round, row-norm bounds and record completion of a strategy
    with one linear model w_t per task.

    The class using it has the :class:`~fmtl_flower.strategies.base.TaskStrategy` attributes
    (``num_tasks``, ``num_rounds``, ``records``, ``directory``, ``on_round``,
    ``public_record``), a :class:`~fmtl_flower.strategies.base.ReplyBoundary` ``replies``,
    ``max_row_norm`` and ``_w_norm`` (|w_t| as sent this round), and implements
    :meth:`_final_instructions` and :meth:`_final_replies`.
    """

    num_tasks: int
    num_rounds: int | None
    records: list[dict[str, Any]]
    max_row_norm: float | None
    _w_norm: np.ndarray
    directory: Any
    on_round: Any
    public_record: Any
    replies: ReplyBoundary

    # ------------------------------------------------------------------ hooks
    def _final_instructions(self, server_round: int, grid: Grid) -> Iterable[Message]:
        """The messages of the final metrics round (every task, ``eval`` on, no budget)."""
        raise NotImplementedError

    def _final_replies(self, server_round: int, replies: Iterable[Message]) -> Replies:
        """The validated replies of the final metrics round, keyed by task."""
        raise NotImplementedError

    def _consistent_tasks(self, accepted: Replies) -> list[int]:
        """The replying tasks whose numbers describe the state the record is about."""
        return list(accepted)

    def _complete_dual(self, record: dict[str, Any], accepted: Replies, reg: float) -> None:
        """Fill the record's dual numbers, when the method has any (every task replied)."""

    # ------------------------------------------------------------------ final metrics round
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Nothing, except after the last round: the final metrics round over every task."""
        if self.num_rounds is None or server_round != self.num_rounds:
            return []
        return self._final_instructions(server_round, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Complete the final record from the metrics round."""
        if self.num_rounds is None or server_round != self.num_rounds:
            return None
        record = self._complete_record(server_round, self._final_replies(server_round, replies))
        return MetricRecord({k: float(v) for k, v in record.items()
                             if isinstance(v, int | float) and not isinstance(v, bool)})

    @property
    def _sent(self) -> dict[int, int]:
        """node -> task of the round's messages."""
        return self.replies.sent

    # ------------------------------------------------------------------ bounds
    def _row_norm(self, task: int) -> float:
        """R_t: the configured max-row-norm, else the task's report (NaN: none)."""
        if self.max_row_norm is not None:
            return self.max_row_norm
        return float(self.directory.row_norm[task])

    def _check_loss_and_tests(self, out: dict[str, Any], task: int) -> None:
        """A reply's ``loss-mean`` against 1 + R_t |w_t| and its ``test-errors`` /
        ``test-n``; ReplyError if broken."""
        bound = self._row_norm(task)
        if not math.isnan(bound):
            check_bound("loss-mean", out["loss-mean"], 1.0 + bound * float(self._w_norm[task]),
                        LOSS_BOUND)
        self._check_tests(out)

    def _check_tests(self, out: dict[str, Any]) -> None:
        """A reply's ``test-errors`` / ``test-n``: both or neither, 0 <= errors <= n <= the
        discovery limit ``max_n``; ReplyError if broken."""
        if out.get("test-n", 0) > self.directory.max_n:
            raise ReplyError(f"test-n {out['test-n']} above the limit {self.directory.max_n}")
        if ("test-errors" in out) != ("test-n" in out) or (
                "test-n" in out and not 0 <= out["test-errors"] <= out["test-n"]):
            raise ReplyError("test-errors/test-n inconsistent")

    def _row_norms(self, tasks: np.ndarray) -> np.ndarray:
        """R_t of ``tasks`` (NaN: none), as :meth:`_row_norm`."""
        if self.max_row_norm is not None:
            return np.full(len(tasks), self.max_row_norm)
        return self.directory.row_norm[tasks]

    def _loss_bound_rows(self, rows: Replies, tasks: np.ndarray,
                         bound: np.ndarray) -> dict[int, str]:
        """The replies of ``tasks`` (with R_t ``bound``) whose ``loss-mean`` is above
        1 + R_t |w_t| (|w_t| as sent, ``_w_norm``), with the reason; vectorised
        :meth:`_check_loss_and_tests` (no bound where R_t is NaN)."""
        loss = np.array([rows[t]["loss-mean"] for t in tasks.tolist()], dtype=np.float64)
        limit = 1.0 + bound * self._w_norm[tasks]
        bad = np.flatnonzero(~np.isnan(bound) & ~(loss <= limit * BOUND_SLACK))
        return {int(tasks[i]): f"loss-mean = {loss[i]:.6g} above its bound {limit[i]:.6g} "
                f"({LOSS_BOUND})" for i in bad.tolist()}

    def _reject_unbounded_rows(self, accepted: Replies, rejected: dict[int, str],
                               W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bounds of the module docstring, vectorised over the rows of a stacked reply
        (``accepted`` not empty): rows without R_t, or whose ``loss-mean`` is above
        1 + R_t |w_t|, move to ``rejected``. Returns the rows' tasks and their R_t."""
        tasks = np.fromiter(accepted, dtype=np.int64, count=len(accepted))
        bound = (np.full(len(tasks), self.max_row_norm) if self.max_row_norm is not None
                 else self.directory.row_norm[tasks])
        reject_rows(accepted, rejected, tasks, np.isnan(bound), "its device reported no "
                    "max-row-norm at discovery and the run configures none")
        loss = np.array([accepted.get(t, {}).get("loss-mean", 0.0) for t in tasks])
        w_norm = norm(W[:, tasks], axis=0)
        reject_rows(accepted, rejected, tasks, loss > (1.0 + bound * w_norm) * BOUND_SLACK,
                    "loss-mean above 1 + max-row-norm |w_t|")
        return tasks, bound

    # ------------------------------------------------------------------ records
    def _complete_record(self, k: int, accepted: Replies) -> dict[str, Any]:
        """Complete record k from the replies that describe state k: primal and objective
        (and the dual numbers) when every task replied consistently, else ``tasks_missing``
        says which did not; the test errors when evaluated. Passes it to ``on_round``."""
        record = self.records[k]
        consistent = self._consistent_tasks(accepted)
        missing = sorted(set(range(self.num_tasks)) - set(consistent))
        record["tasks_missing"] = missing
        reg = record.pop("_reg")
        if not missing:
            loss = np.array([accepted[t]["loss-mean"] for t in range(self.num_tasks)])
            record["primal"] = float(loss.sum()) + reg
            self._complete_dual(record, accepted, reg)
            record["objective"] = record["primal"] + record["objective_omega"]
        evaluated = [t for t in consistent if "test-n" in accepted[t]]
        if evaluated and not missing:
            errors = np.array([accepted[t]["test-errors"] for t in evaluated])
            counts = np.array([accepted[t]["test-n"] for t in evaluated])
            record.update(error_summary(errors, counts))
        if self.on_round is not None:
            self.on_round(self.public_record(record))
        return record
