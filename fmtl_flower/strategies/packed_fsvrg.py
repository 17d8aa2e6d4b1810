"""The FSVRG family's stacked messages, server side: one message per packed node and exchange,
replies read as arrays.

The ``"fsvrg"`` stacking protocol of :mod:`fmtl_flower.packing` (wire contract in
:mod:`fmtl_flower.clients.packed_fsvrg`). :func:`stacked_message` builds the message of one
:class:`~fmtl_flower.packing.StackGroup` (the exchange's global vectors once, the task ids and
per-task values as vectors); :func:`read_stacked_reply` checks a stacked reply's records,
types, shapes and finiteness over all rows at once, then gives each row, as the values
:meth:`Fsvrg._parse_reply` reads from a one-task reply, to the strategy's own per-reply
checks: a malformed slot or row fails only its task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, Message, MessageType

from ..packing import StackGroup, stacked_content
from ..wire import from_array, to_array
from .packed_mocha import read_stacked_rows, reply_columns

__all__ = ["MESSAGE_TYPES", "PROTOCOL", "read_stacked_reply", "reply_keys", "stacked_message"]

PROTOCOL = "fsvrg"
#: The message type of each of the strategy's exchanges (its ``kind``).
MESSAGE_TYPES = {"stats": f"{MessageType.QUERY}.fsvrg_stats",
                 "gram": f"{MessageType.QUERY}.fsvrg_gram",
                 "gradient": f"{MessageType.QUERY}.fsvrg_gradient",
                 "train": MessageType.TRAIN, "evaluate": MessageType.EVALUATE}
_TEST_KEYS = ("test-errors", "test-n")


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
        ints += list(_TEST_KEYS)
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
                       dim: int, check: Callable[[dict[str, Any], int], dict[str, Any]]
                       ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)`` of ``group``'s stacked reply (see
    :func:`fmtl_flower.strategies.packed_mocha.read_stacked_rows`): each row that passes the
    vectorised checks becomes the dict a one-task reply gives (Python ints and floats, the
    matrix's row as a (d,) array) and goes through ``check(row, task)``, which returns the
    accepted values or raises (its message is the row's rejection reason)."""
    ints, floats, matrix = reply_keys(message_type, cocoa, False)
    optional = list(_TEST_KEYS) if floats else []
    parsed: dict[int, dict[str, Any]] = {}

    def columns(k: int) -> dict[str, np.ndarray]:
        out = reply_columns(reply.content, k, dim, [*ints, *floats], optional, floats, ())
        if matrix is not None:
            out[matrix] = _matrix(reply.content["arrays"], matrix, k, dim)
        return out

    def problems(values: dict[str, np.ndarray], tasks: np.ndarray) -> list[str]:
        reasons = [""] * len(tasks)
        for key in floats:
            for i in np.flatnonzero(~np.isfinite(values[key])).tolist():
                reasons[i] = reasons[i] or f"metric {key!r} is not finite"
        if matrix is not None and matrix != "counts":
            finite = np.isfinite(values[matrix]).all(axis=1)
            for i in np.flatnonzero(~finite).tolist():
                reasons[i] = reasons[i] or f"{matrix!r} has non-finite values"
        lists = {key: v.tolist() for key, v in values.items() if key != matrix}
        for i, task in enumerate(tasks.tolist()):
            if reasons[i]:
                continue
            row: dict[str, Any] = {key: v[i] for key, v in lists.items()}
            if matrix is not None:
                row[matrix] = values[matrix][i]
            try:
                parsed[task] = check(row, task)
            except Exception as err:  # noqa: BLE001 - the row's rejection reason
                reasons[i] = str(err) or type(err).__name__
        return reasons

    accepted, rejected = read_stacked_rows(reply, group, PROTOCOL, columns, problems,
                                           (matrix,) if matrix is not None else ())
    return {task: parsed[task] for task in accepted}, rejected


def _matrix(record: Any, key: str, k: int, dim: int) -> np.ndarray:
    """The reply's (k, d) matrix ``key`` (int64 ``counts``, float64 otherwise); ValueError
    names what is wrong (the whole reply is malformed)."""
    if key not in record:
        raise ValueError(f"array {key!r} missing")
    try:
        values = from_array(record[key])
    except (TypeError, ValueError) as err:
        raise ValueError(f"array {key!r} unreadable: {err}") from None
    dtype = np.int64 if key == "counts" else np.float64
    shape_ok = values.ndim == 2 and values.shape[0] == k and (k == 0 or values.shape[1] == dim)
    if values.dtype != dtype or not shape_ok:
        raise ValueError(f"array {key!r} must be {np.dtype(dtype)} of shape ({k}, {dim}), got "
                         f"{values.dtype} {values.shape}")
    return values
