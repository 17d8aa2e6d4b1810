"""The FSVRG family's stacked messages, server side: one message per packed node and exchange,
replies read as arrays.

The ``"fsvrg"`` stacking protocol of :mod:`fmtl_flower.packing` (wire contract in
:mod:`fmtl_flower.clients.packed_fsvrg`). :func:`stacked_message` builds the message of one
:class:`~fmtl_flower.packing.StackGroup` (the exchange's global vectors once, the task ids and
per-task values as vectors); :func:`read_stacked_reply` checks a stacked reply's records,
types and shapes over all rows at once, then gives each row, as the values
:meth:`FSVRG._parse_reply` reads from a one-task reply, to the strategy's own per-reply
checks: a malformed slot or row fails only its task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, Message, MessageType

from ..packing import StackGroup, stacked_content
from ..wire import to_array
from .packed_mocha import check_each_row, read_stacked_rows, reply_columns

__all__ = ["MESSAGE_TYPES", "PROTOCOL", "TEST_KEYS", "read_stacked_reply", "reply_keys",
           "stacked_message"]

PROTOCOL = "fsvrg"
#: The message type of each of the strategy's exchanges (its ``kind``).
MESSAGE_TYPES = {"stats": f"{MessageType.QUERY}.fsvrg_stats",
                 "gram": f"{MessageType.QUERY}.fsvrg_gram",
                 "gradient": f"{MessageType.QUERY}.fsvrg_gradient",
                 "train": MessageType.TRAIN, "evaluate": MessageType.EVALUATE}
#: The optional metrics of a reply to a message that asked for test errors.
TEST_KEYS = ("test-errors", "test-n")


def reply_keys(message_type: str, cocoa: bool, evaluate: bool
               ) -> tuple[list[str], list[str], str | None]:
    """``(int vectors, float vectors, matrix or None)`` of a stacked reply to a
    ``message_type`` message (``cocoa``: CoCoA+'s ``train`` / ``evaluate``; ``evaluate``: the
    message asked for test errors, ``test-errors`` / ``test-n``)."""
    if message_type in (MESSAGE_TYPES["stats"], MESSAGE_TYPES["gram"]):
        return (["task-id", "n-train"], [],
                "counts" if message_type == MESSAGE_TYPES["stats"] else "gram-v")
    ints = ["task-id", "round", "n-train"]
    if message_type == MessageType.TRAIN and not cocoa:
        return ints, [], "w-local"
    floats = ["loss-sum", "sq-norm-sum"]
    if cocoa:
        ints.append("state-ok")
        floats.append("dual-sum")
    if evaluate:
        ints += list(TEST_KEYS)
    matrix = {MESSAGE_TYPES["gradient"]: "grad-sum", MessageType.TRAIN: "d-w"}.get(message_type)
    return ints, floats, matrix


def stacked_message(group: StackGroup, message_type: str, config: Mapping[str, Any],
                    arrays: Mapping[str, Array], per_task: Mapping[str, np.ndarray]) -> Message:
    """The stacked message of ``group``: ``config`` and the encoded global ``arrays`` once,
    ``task-id`` and each of ``per_task`` (vectors over all tasks) cut to the group's tasks."""
    tasks = np.asarray(group.tasks, dtype=np.int64)
    out = dict(arrays)
    out["task-id"] = to_array(tasks)
    for name, values in per_task.items():
        out[name] = to_array(np.asarray(values, dtype=np.int64)[tasks])
    return Message(stacked_content(PROTOCOL, group.slots, config, out),
                   dst_node_id=group.node, message_type=message_type)


def read_stacked_reply(reply: Message, group: StackGroup, message_type: str, cocoa: bool,
                       dim: int, check: Callable[[dict[str, Any], int], Any]
                       ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)`` of ``group``'s stacked reply (see
    :func:`fmtl_flower.strategies.packed_mocha.read_stacked_rows`): the arrays are read with
    :func:`~fmtl_flower.strategies.packed_mocha.reply_columns` (the matrix too), and each row,
    as the values a one-task reply gives (Python ints and floats, the matrix's row as a (d,)
    array), goes through ``check(row, task)`` (raises on a bad row: its message is the row's
    rejection reason; :func:`~fmtl_flower.strategies.packed_mocha.check_each_row`), after the
    finiteness of its metrics and of its float row."""
    ints, floats, matrix = reply_keys(message_type, cocoa, False)
    optional = list(TEST_KEYS) if floats else []
    rows = () if matrix is None else (matrix,)
    counts = matrix == "counts"

    def columns(k: int) -> dict[str, np.ndarray]:
        return reply_columns(reply.content, k, dim, [*ints, *floats, *rows], optional, floats,
                             () if counts else rows, rows if counts else ())

    def check_row(row: dict[str, Any], task: int) -> None:
        if rows and not counts and not np.all(np.isfinite(row[matrix])):
            raise ValueError(f"{matrix!r} has non-finite values")
        check(row, task)

    return read_stacked_rows(reply, group, PROTOCOL, columns,
                             lambda values, tasks: check_each_row(values, tasks, rows,
                                                                  check_row), rows)
