"""The device side of the dual commit protocol (design decision 4), shared by MOCHA's and
CoCoA+'s handlers.

A device keeps, for its task, ``duals`` float64 (3, n) = [committed alpha; pending d_alpha;
stable alpha] and the rounds ``committed-round``, ``pending-round`` and ``stable-round``
(-1: none). Every message carries ``last-accepted-round`` L (the newest round whose reply from
this task the server applied) and, when the server writes checkpoints, ``checkpoint-round`` C.

On receipt, :func:`reconcile` commits the pending change if its round is L and drops it
otherwise. If the committed round is then not L, the device goes back to its stable copy when
that copy is of round L (the server resumed from a checkpoint), else restarts from alpha = 0
and says so (``state-ok = 0``; the server then resets the task). Afterwards the newest
committed state not after C becomes the stable copy. So the device's alpha and the server's
view of it never drift apart, whatever is lost, reverted or restarted.

Functions over numpy arrays and plain dicts; the handlers keep the result in
``context.state`` and, with a ``client-state-dir``, in a state file
(:mod:`fmtl_flower.checkpoint`), which :func:`load_into_context` reads back into an empty
``context.state``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log

from ..checkpoint import CheckpointError, read_state_file, write_state_file
from ..wire import to_array

__all__ = ["DualState", "encode", "load_into_context", "read_dual_file", "reconcile",
           "write_dual_file"]

META_KEYS = ("task-id", "committed-round", "pending-round", "stable-round")


@dataclass
class DualState:
    """The reconciled state: alpha to start from, its round, whether it survived (``ok``),
    and the stable copy ``(alpha, round)`` to keep (or None)."""

    alpha: np.ndarray
    committed: int
    ok: bool
    stable: tuple[np.ndarray, int] | None


def reconcile(duals: np.ndarray | None, meta: Mapping[str, Any] | None, *, task_id: int,
              n: int, last_accepted: int, checkpoint_round: int = -1) -> DualState:
    """Apply the protocol to the stored ``duals`` (3, n) and ``meta`` (None: nothing stored).

    Stored state of another task or shape counts as nothing stored.
    """
    alpha, committed, stable = np.zeros(n), 0, None
    if (duals is not None and meta is not None and meta.get("task-id", -1) == task_id
            and duals.shape == (3, n)):
        alpha, committed = duals[0], int(meta["committed-round"])
        pending_round = int(meta["pending-round"])
        if pending_round >= 0 and pending_round == last_accepted:
            alpha, committed = alpha + duals[1], pending_round
        stable_round = int(meta.get("stable-round", -1))
        if stable_round >= 0:
            stable = (duals[2], stable_round)
    if committed != last_accepted:
        if stable is None or stable[1] != last_accepted:
            return DualState(np.zeros(n), 0, False, None)
        alpha, committed = stable  # back to the server's checkpoint
    if 0 <= checkpoint_round and committed <= checkpoint_round:
        stable = (alpha, committed)
    return DualState(alpha, committed, True, stable)


def encode(state: DualState, task_id: int, pending: np.ndarray | None,
           pending_round: int) -> tuple[np.ndarray, dict[str, int]]:
    """``(duals (3, n), meta)`` to store after a message (``pending``: this round's change)."""
    n = state.alpha.shape[0]
    duals = np.empty((3, n))
    duals[0] = state.alpha
    duals[1] = 0.0 if pending is None else pending
    duals[2] = 0.0 if state.stable is None else state.stable[0]
    meta = {"task-id": int(task_id), "committed-round": int(state.committed),
            "pending-round": int(pending_round) if pending is not None else -1,
            "stable-round": -1 if state.stable is None else int(state.stable[1])}
    return duals, meta


def write_dual_file(path: Path, duals: np.ndarray, meta: Mapping[str, int]) -> None:
    """Keep the state in a file as well (atomic, no pickle)."""
    write_state_file(path, {"duals": duals}, dict(meta))


def read_dual_file(path: Path, task_id: int, n: int
                   ) -> tuple[np.ndarray, dict[str, int]] | None:
    """The state kept in ``path`` if it is this task's and well formed; None if there is no
    file. Raises :class:`~fmtl_flower.checkpoint.CheckpointError` naming what is wrong."""
    if not path.exists():
        return None
    arrays, meta = read_state_file(path)
    try:
        duals = arrays["duals"]
        values = {k: int(meta[k]) for k in META_KEYS}
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: missing or bad entry ({err})") from None
    if values["task-id"] != task_id or duals.dtype != np.float64 or duals.shape != (3, n) \
            or not np.all(np.isfinite(duals)):
        raise CheckpointError(f"{path}: not this task's state (task {values['task-id']}, "
                              f"shape {duals.shape})")
    return duals, values


def load_into_context(context: Context, path: Path | None, keys: tuple[str, str],
                      task_id: int, n: int, name: str) -> None:
    """Put the state kept in ``path`` (if any, and usable) into ``context.state`` under
    ``keys`` = (arrays record, meta record); an unusable file is logged and ignored (the
    protocol then restarts the task from alpha = 0)."""
    if path is None:
        return
    try:
        stored = read_dual_file(path, task_id, n)
    except CheckpointError as err:
        log(WARNING, "%s task %d: state file unusable (%s); starting from alpha = 0", name,
            task_id, err)
        return
    if stored is not None:
        context.state[keys[0]] = ArrayRecord({"duals": to_array(stored[0])})
        context.state[keys[1]] = ConfigRecord(stored[1])
