"""Mb-SGD's stacked messages, server side: one message per packed node, replies as arrays.

The ``"mb-sgd"`` stacking protocol of :mod:`fmtl_flower.packing` (wire contract in
:mod:`fmtl_flower.clients.packed_mbsgd`). :func:`read_stacked_reply` checks a stacked reply in
vectorised form and returns the per-task values :meth:`MbSGD._parse_reply` returns for an
unpacked reply, or why a task's row (or slot) was rejected: a malformed slot fails only its
task.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Message

from ..packing import StackGroup
from .packed_mocha import read_stacked_rows, reply_columns, test_count_problems

PROTOCOL = "mb-sgd"


def read_stacked_reply(reply: Message, group: StackGroup, server_round: int,
                       n_train: np.ndarray, dim: int, with_grad: bool,
                       budgets: np.ndarray, dropped: np.ndarray, max_n: int
                       ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)`` of ``group``'s stacked reply (see
    :func:`fmtl_flower.strategies.packed_mocha.read_stacked_rows`; ``max_n``: the discovery
    limit on ``test-n``)."""
    required = ["task-id", "round", "n-train", "loss-mean"] + (
        ["count", "grad"] if with_grad else [])

    def columns(k: int) -> dict[str, np.ndarray]:
        return reply_columns(reply.content, k, dim, required, ["test-errors", "test-n"],
                             ("loss-mean",), ("grad",))

    def problems(values: dict[str, np.ndarray], tasks: np.ndarray) -> list[str]:
        out = [""] * len(tasks)

        def flag(mask: np.ndarray, reason: str) -> None:
            for i in np.flatnonzero(mask):
                if not out[i]:
                    out[i] = reason

        flag(~np.isfinite(values["loss-mean"]), "metric 'loss-mean' is not finite")
        flag((values["task-id"] != tasks) | (values["round"] != server_round),
             f"reply for another task or round, expected round {server_round}")
        flag(values["n-train"] != n_train[tasks], "n-train differs from the task's")
        flag(values["loss-mean"] < 0, "loss-mean must be >= 0")
        test_count_problems(values, out, max_n)
        if with_grad:
            limit = np.where(dropped[tasks], 0, budgets[tasks])
            flag((values["count"] < 0) | (values["count"] > limit),
                 "count outside 0..budget (0 when dropped)")
            grad = values["grad"]
            flag(~np.all(np.isfinite(grad), axis=1), "'grad' has non-finite values")
            flag((values["count"] == 0) & np.any(grad != 0.0, axis=1),
                 "'grad' must be zero when count is 0")
        return out

    return read_stacked_rows(reply, group, PROTOCOL, columns, problems,
                             ("grad",) if with_grad else ())
