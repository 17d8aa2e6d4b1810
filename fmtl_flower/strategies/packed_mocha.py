"""MOCHA's stacked messages, server side: one message per packed node, replies read as arrays.

The ``"mocha"`` stacking protocol of :mod:`fmtl_flower.packing` (wire contract in
:mod:`fmtl_flower.clients.packed_mocha`). :func:`stacked_message` builds the message of one
:class:`~fmtl_flower.packing.StackGroup` from the strategy's per-task vectors;
:func:`read_stacked_reply` checks a stacked reply in vectorised form (one test per key over all
rows) and returns the same per-task values that :meth:`MOCHA._parse_reply` returns for an
unpacked reply, or the reason a task's row (or the slot itself) was rejected: a malformed
slot fails only its task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from ..packing import STACK, StackGroup, read_stack, read_stack_errors, stacked_content
from ..wire import from_array, to_array

PROTOCOL = "mocha"

REPLY_INTS = ("task-id", "round", "n-train", "state-ok")
REPLY_NUMBERS = ("loss-mean", "dual-mean")


def stacked_message(group: StackGroup, message_type: str, server_round: int,
                    config: Mapping[str, Any], W: np.ndarray,
                    per_task: Mapping[str, np.ndarray], protocol: str = PROTOCOL) -> Message:
    """The stacked message of ``group``: ``config`` shared, ``w`` rows = W's columns of the
    group's tasks, and each of ``per_task`` (vectors over all tasks) cut to the group."""
    tasks = np.asarray(group.tasks, dtype=np.int64)
    arrays = {"w": to_array(W[:, tasks].T), "task-id": to_array(tasks)}
    for name, values in per_task.items():
        arrays[name] = to_array(values[tasks])
    return Message(stacked_content(protocol, group.slots, config, arrays),
                   dst_node_id=group.node, message_type=message_type,
                   group_id=str(server_round))


def read_stacked_reply(reply: Message, group: StackGroup, server_round: int,
                       n_train: np.ndarray, dim: int, with_delta: bool, max_n: int
                       ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)``: the valid rows of ``group``'s stacked reply as
    ``{task: values}`` (the values :meth:`MOCHA._parse_reply` gives, ``delta-b`` a row of
    the stacked array) and ``{task: reason}`` for the tasks whose slot failed or whose row
    is invalid (``max_n``: the discovery limit on ``test-n``). A reply whose records are
    malformed rejects every task of the group; a task absent from both (its slot not in the
    reply) did not reply."""
    return read_stacked_rows(
        reply, group, PROTOCOL,
        lambda k: _reply_columns(reply.content, k, dim, with_delta),
        lambda values, tasks: _row_problems(values, tasks, server_round, n_train, with_delta,
                                            max_n),
        ("delta-b",) if with_delta else ())


def read_stacked_rows(reply: Message, group: StackGroup, protocol: str,
                      columns: Callable[[int], dict[str, np.ndarray]],
                      problems: Callable[[dict[str, np.ndarray], np.ndarray], list[str]],
                      row_arrays: tuple[str, ...] = ()
                      ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """``(accepted, rejected)`` of a stacked reply of ``protocol``: ``columns(k)`` reads
    and shapes its arrays (ValueError: the whole reply is malformed), ``problems(values,
    tasks)`` gives each row's rejection reason ("" if valid); the arrays named in
    ``row_arrays`` are 2-D and each accepted task gets its row, the others are vectors and
    each task gets its element as a Python number."""
    task_of_slot = dict(zip(group.slots, group.tasks, strict=True))
    try:
        found, slots = read_stack(reply.content)
        errors = read_stack_errors(reply.content)
        if found != protocol:
            raise ValueError(f"protocol {found!r}, expected {protocol!r}")
        strangers = [s for s in [*slots, *errors] if s not in task_of_slot]
        if strangers or set(slots) & set(errors):
            raise ValueError(f"slots {strangers or sorted(set(slots) & set(errors))} not "
                             "asked for or both replied and failed")
        values = columns(len(slots))
    except ValueError as err:
        return {}, {t: f"malformed stacked reply: {err}" for t in group.tasks}
    rejected = {task_of_slot[s]: f"slot failed on the device: {r}" for s, r in errors.items()}
    tasks = np.array([task_of_slot[s] for s in slots], dtype=np.int64)
    bad = problems(values, tasks)
    accepted: dict[int, dict[str, Any]] = {}
    lists = {k: v.tolist() for k, v in values.items() if k not in row_arrays}
    for i, task in enumerate(tasks.tolist()):
        if bad[i]:
            rejected[task] = bad[i]
            continue
        row = {k: v[i] for k, v in lists.items()}
        for key in row_arrays:
            row[key] = values[key][i]
        accepted[task] = row
    return accepted, rejected


def check_each_row(values: dict[str, np.ndarray], tasks: np.ndarray,
                   row_arrays: Sequence[str], check: Callable[[dict[str, Any], int], Any]
                   ) -> list[str]:
    """Per row of a stacked reply's ``values``, the reason it is rejected ("" when valid): a
    non-finite metric (the first, in ``values``' order), else whatever ``check(row, task)``
    raises, ``row`` holding the metrics as Python numbers and each of ``row_arrays`` as its
    row (the strategy's own checks of a one-task reply: written once, in the strategy)."""
    scalars = [key for key in values if key not in row_arrays]
    finite = {key: np.isfinite(values[key]).tolist() for key in scalars}
    lists = {key: values[key].tolist() for key in scalars}
    out = []
    for i, task in enumerate(tasks.tolist()):
        bad = [key for key in scalars if not finite[key][i]]
        if bad:
            out.append(f"metric {bad[0]!r} is not finite")
            continue
        row = {key: lists[key][i] for key in scalars}
        row.update((key, values[key][i]) for key in row_arrays)
        try:
            check(row, task)
        except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
            out.append(str(err) or type(err).__name__)
            continue
        out.append("")
    return out


def _reply_columns(content: RecordDict, k: int, dim: int, with_delta: bool
                   ) -> dict[str, np.ndarray]:
    """The reply's arrays, typed and shaped (ValueError names the first bad one)."""
    optional = ["test-errors", "test-n"] + ([] if with_delta else ["steps"])
    required = [*REPLY_INTS, *REPLY_NUMBERS] + (["steps", "delta-b"] if with_delta else [])
    return reply_columns(content, k, dim, required, optional, REPLY_NUMBERS, ("delta-b",))


def reply_columns(content: RecordDict, k: int, dim: int, required: Sequence[str],
                  optional: Sequence[str], floats: Sequence[str], matrices: Sequence[str],
                  int_matrices: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The ``arrays`` of a stacked reply with k rows: ``floats`` float64 (k,), ``matrices``
    float64 (k, dim), ``int_matrices`` int64 (k, dim), the others int64 (k,); ValueError
    names the first missing or bad one (``optional`` ones may be absent), and
    test-errors/test-n come together."""
    if "arrays" not in content:
        raise ValueError("no 'arrays' record")
    record = content["arrays"]
    out: dict[str, np.ndarray] = {}
    for key in [*required, *optional]:
        if key not in record:
            if key in required:
                raise ValueError(f"array {key!r} missing")
            continue
        try:
            values = from_array(record[key])
        except (TypeError, ValueError) as err:
            raise ValueError(f"array {key!r} unreadable: {err}") from None
        shape = (k, dim) if key in (*matrices, *int_matrices) else (k,)
        dtype = np.float64 if key in (*floats, *matrices) else np.int64
        if values.dtype != dtype or values.shape != shape:
            raise ValueError(f"array {key!r} must be {np.dtype(dtype)} of shape {shape}, got "
                             f"{values.dtype} {values.shape}")
        out[key] = values
    if ("test-errors" in out) != ("test-n" in out):
        raise ValueError("test-errors/test-n inconsistent")
    return out


def test_count_problems(values: dict[str, np.ndarray], problems: list[str], max_n: int) -> None:
    """Give the rows whose ``test-n`` is above the discovery limit ``max_n``, then those whose
    ``test-errors`` is outside 0..``test-n``, their reason in ``problems`` (a row keeps its
    first): the checks and reasons of a one-task reply's
    :meth:`~fmtl_flower.strategies.linear_tasks.LinearTasks._check_tests`."""
    if "test-n" not in values:
        return
    count, errors = values["test-n"], values["test-errors"]
    for i in np.flatnonzero(count > max_n).tolist():
        if not problems[i]:
            problems[i] = f"test-n {count[i]} above the limit {max_n}"
    for i in np.flatnonzero((errors < 0) | (errors > count)).tolist():
        if not problems[i]:
            problems[i] = "test-errors/test-n inconsistent"


def _row_problems(values: dict[str, np.ndarray], tasks: np.ndarray, server_round: int,
                  n_train: np.ndarray, with_delta: bool, max_n: int) -> list[str]:
    """Per row, the reason it is rejected ("" when valid): the checks of
    :meth:`MOCHA._parse_reply`, one vectorised test per check."""
    k = len(tasks)
    problems = [""] * k

    def flag(mask: np.ndarray, reason: str) -> None:
        for i in np.flatnonzero(mask):
            if not problems[i]:
                problems[i] = reason

    for key in REPLY_NUMBERS:
        flag(~np.isfinite(values[key]), f"metric {key!r} is not finite")
    if "steps" in values:
        flag(values["steps"] < 0, "steps must be >= 0")
    flag(~np.isin(values["state-ok"], (0, 1)), "state-ok must be 0 or 1")
    flag((values["task-id"] != tasks) | (values["round"] != server_round),
         f"reply for another task or round, expected round {server_round}")
    flag(values["n-train"] != n_train[tasks], "n-train differs from the task's")
    test_count_problems(values, problems, max_n)
    if with_delta:
        flag(~np.all(np.isfinite(values["delta-b"]), axis=1), "'delta-b' has non-finite values")
    return problems


def is_stacked(message: Message) -> bool:
    """Whether ``message`` (a reply) is a stacked one."""
    return not message.has_error() and STACK in message.content
