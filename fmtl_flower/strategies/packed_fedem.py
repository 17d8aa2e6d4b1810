"""FedEM's stacked messages, server side: one message per packed node, replies read as arrays.

The ``"fedem"`` stacking protocol of :mod:`fmtl_flower.packing` (wire contract in
:mod:`fmtl_flower.clients.packed_fedem`), for FedEM and every baseline of
:class:`~fmtl_flower.strategies.fedem.FedEM` with a numpy model. :func:`stacked_message`
builds the message of one :class:`~fmtl_flower.packing.StackGroup` (each distinct set of
components once, the per-task ``task-id``, ``unseen`` and set index as vectors);
:func:`read_stacked_reply` decodes each of a stacked reply's arrays once (dtype and row count
checked per array, finiteness per column) and checks each row with the strategy's own checks
of a one-task reply, so a method's reply keys and checks are written once, in the strategy.
A malformed row or slot fails only its task.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from ..packing import StackGroup, stacked_content
from ..wire import from_array, to_array
from .packed_mocha import check_each_row, read_stacked_rows

PROTOCOL = "fedem"

#: ``(ints, numbers, optional numbers)``: the metric keys of a one-task reply.
ReplyKeys = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def stacked_message(group: StackGroup, message_type: str, server_round: int,
                    config: Mapping[str, Any], components: Sequence[tuple[Hashable, Any]],
                    unseen: np.ndarray) -> Message:
    """The stacked message of ``group``: ``config`` (the values every task shares), the
    components each task is sent (``components[i] = (key, Array)`` for ``group.tasks[i]``:
    tasks with one key share one Array, sent once) and the tasks' ids and ``unseen``
    flags."""
    tasks = np.asarray(group.tasks, dtype=np.int64)
    index: dict[Hashable, int] = {}
    arrays: dict[str, Any] = {}
    of = np.empty(len(tasks), dtype=np.int64)
    for i, (key, array) in enumerate(components):
        if key not in index:
            index[key] = len(index)
            arrays[f"components-{index[key]}"] = array
        of[i] = index[key]
    arrays.update({"components-of": to_array(of), "task-id": to_array(tasks),
                   "unseen": to_array(np.asarray(unseen[tasks], dtype=bool))})
    return Message(stacked_content(PROTOCOL, group.slots, config, arrays),
                   dst_node_id=group.node, message_type=message_type,
                   group_id=str(server_round))


def read_stacked_reply(reply: Message, group: StackGroup, keys: ReplyKeys,
                       row_arrays: tuple[str, ...],
                       check: Callable[[dict[str, Any], int], None]
                       ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)`` of ``group``'s stacked reply: the rows that pass
    ``check(row, task)`` (which raises on a bad row; ``row`` holds the metrics as Python
    numbers and each of ``row_arrays`` as its row, whose shape ``check`` checks) as
    ``{task: row}``, and ``{task: reason}`` for the tasks whose slot failed or whose row is
    invalid. A reply whose records are malformed rejects every task of the group."""
    ints, numbers, optional = keys

    def columns(k: int) -> dict[str, np.ndarray]:
        if k == 0:
            return {}
        if "arrays" not in reply.content or not isinstance(reply.content["arrays"],
                                                           ArrayRecord):
            raise ValueError("no 'arrays' record")
        record = reply.content["arrays"]
        out: dict[str, np.ndarray] = {}
        wanted = [(key, np.int64, False) for key in ints]
        wanted += [(key, np.float64, False) for key in (*numbers, *optional)]
        wanted += [(key, np.float64, True) for key in row_arrays]
        for key, dtype, rows in wanted:
            if key not in record:
                if key in optional:
                    continue
                raise ValueError(f"array {key!r} missing")
            try:
                values = from_array(record[key])
            except (TypeError, ValueError) as err:
                raise ValueError(f"array {key!r} unreadable: {err}") from None
            if values.dtype != dtype or (values.ndim < 2 if rows else values.ndim != 1) \
                    or values.shape[0] != k:
                what = f"({k}, ...)" if rows else f"({k},)"
                raise ValueError(f"array {key!r} must be {np.dtype(dtype)} of shape {what}, "
                                 f"got {values.dtype} {values.shape}")
            out[key] = values
        return out

    def problems(values: dict[str, np.ndarray], tasks: np.ndarray) -> list[str]:
        return check_each_row(values, tasks, row_arrays, check)

    return read_stacked_rows(reply, group, PROTOCOL, columns, problems, row_arrays)
