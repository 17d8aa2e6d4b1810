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

The state is bound to the data and to the run: it records a fingerprint of the device's
training data (:func:`data_fingerprint`, meta ``data``) and the run's identity (the
messages' ``run-token``, meta ``run``: a token the server draws for the run and keeps in its
checkpoints, and a digest of its settings, :mod:`fmtl_flower.strategies.base`). State kept
for other data (a device restarted with another dataset of the same size) or written by
another run (two runs sharing a ``client-state-dir``) counts as nothing stored, so the task
restarts from alpha = 0 and the server resets b_t, as for a lagging state. A message with
L = 0 (the server holds nothing of the task: a new run reusing a ``client-state-dir``, or a
task the server reset) starts clean without counting as a reset.

Functions over numpy arrays and plain dicts; :class:`DualStore` keeps the result in
``context.state`` and, with a ``client-state-dir``, in a state file
(:mod:`fmtl_flower.checkpoint`), which :func:`load_into_context` reads back into an empty
``context.state`` (MOCHA's and CoCoA+'s handlers each hold one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log

from ..checkpoint import CheckpointError, read_state_file, write_state_file
from ..wire import (
    array_record,
    config_record,
    from_array,
    refill_arrays,
    refill_config,
    to_array,
)
from .common import data_fingerprint, protocol_rounds, state_file_for  # noqa: F401 (re-exported)

__all__ = ["DualState", "DualStore", "data_fingerprint", "encode", "load_into_context",
           "log_reconciled", "read_dual_file", "reconcile", "write_dual_file"]

META_KEYS = ("task-id", "committed-round", "pending-round", "stable-round")


@dataclass
class DualState:
    """The reconciled state: alpha to start from, its round, whether it survived (``ok``),
    the stable copy ``(alpha, round)`` to keep (or None), why a stored state was not
    used (``note``: ``""``, ``"new run"``, ``"other run"``, ``"data changed"`` or
    ``"lagging"``) and the run it now belongs to (``run``: the message's ``run-token``,
    None when the message carried none)."""

    alpha: np.ndarray
    committed: int
    ok: bool
    stable: tuple[np.ndarray, int] | None
    note: str = ""
    run: str | None = None


def reconcile(duals: np.ndarray | None, meta: Mapping[str, Any] | None, *, task_id: int,
              n: int, last_accepted: int, checkpoint_round: int = -1,
              fingerprint: str | None = None, run: str | None = None) -> DualState:
    """Apply the protocol to the stored ``duals`` (3, n) and ``meta`` (None: nothing stored).

    Stored state of another task or shape, or (``fingerprint`` given) of other data (``meta``
    ``"data"``), or (``run`` given: the message's ``run-token``) of another run (``meta``
    ``"run"``; state without one is another run's too), counts as nothing stored.
    ``last_accepted = 0`` (the server holds nothing of this task: b_t = 0, a new run or a
    reset) starts clean from alpha = 0 with ``ok`` set, whatever is stored: alpha = 0 is
    what the server holds, so this is no reset.
    """
    alpha, committed, stable, note = np.zeros(n), 0, None, ""
    usable = (duals is not None and meta is not None and meta.get("task-id", -1) == task_id
              and duals.shape == (3, n))
    if usable and fingerprint is not None and meta.get("data", "") != fingerprint:
        usable, note = False, "data changed"
    if usable and last_accepted == 0:
        if int(meta["committed-round"]) != 0 or int(meta["pending-round"]) >= 0:
            note = "new run"
        usable = False
    if usable and run is not None and meta.get("run", "") != run:
        usable, note = False, "other run"
    if usable:
        alpha, committed = duals[0], int(meta["committed-round"])
        pending_round = int(meta["pending-round"])
        if pending_round >= 0 and pending_round == last_accepted:
            alpha, committed = alpha + duals[1], pending_round
        stable_round = int(meta.get("stable-round", -1))
        if stable_round >= 0:
            stable = (duals[2], stable_round)
    if committed != last_accepted:
        if stable is None or stable[1] != last_accepted:
            return DualState(np.zeros(n), 0, False, None, note or "lagging", run)
        alpha, committed = stable  # back to the server's checkpoint
    if 0 <= checkpoint_round and committed <= checkpoint_round:
        stable = (alpha, committed)
    return DualState(alpha, committed, True, stable, note, run)


def log_reconciled(name: str, task_id: int, state: DualState, last_accepted: int) -> None:
    """One log line when a stored state was not resumed, with the reason."""
    if state.note == "new run":
        log(INFO, "%s task %d: new run (the server holds nothing of this task); the stored "
            "state is from another run and is not used: starting clean", name, task_id)
    elif state.note == "other run":
        log(WARNING, "%s task %d: the stored state was written by another run (another "
            "run-token: a client-state-dir shared by two runs, or another server); not used: "
            "restarting from alpha = 0 (the server resets this task)", name, task_id)
    elif state.note == "data changed":
        log(WARNING, "%s task %d: the stored state belongs to other training data; "
            "restarting from alpha = 0%s", name, task_id,
            "" if state.ok else " (the server resets this task)")
    elif state.note == "lagging":
        log(WARNING, "%s task %d: no stored state of round %d (the server's last accepted "
            "round); restarting from alpha = 0 (the server resets this task)", name, task_id,
            last_accepted)


def encode(state: DualState, task_id: int, pending: np.ndarray | None,
           pending_round: int, fingerprint: str | None = None
           ) -> tuple[np.ndarray, dict[str, int | str]]:
    """``(duals (3, n), meta)`` to store after a message (``pending``: this round's change;
    ``fingerprint``: of the data the state belongs to, kept as meta ``"data"``; the
    state's run, when it has one, as meta ``"run"``)."""
    n = state.alpha.shape[0]
    duals = np.empty((3, n))
    duals[0] = state.alpha
    duals[1] = 0.0 if pending is None else pending
    duals[2] = 0.0 if state.stable is None else state.stable[0]
    meta: dict[str, int | str] = {"task-id": int(task_id), "committed-round": int(state.committed),
            "pending-round": int(pending_round) if pending is not None else -1,
            "stable-round": -1 if state.stable is None else int(state.stable[1])}
    if fingerprint is not None:
        meta["data"] = fingerprint
    if state.run is not None:
        meta["run"] = state.run
    return duals, meta


def write_dual_file(path: Path, duals: np.ndarray, meta: Mapping[str, int | str]) -> None:
    """Keep the state in a file as well (atomic, no pickle)."""
    write_state_file(path, {"duals": duals}, dict(meta))


def read_usable_dual_file(path: Path, task_id: int, n: int, name: str
                          ) -> tuple[np.ndarray, dict[str, Any]] | None:
    """:func:`read_dual_file`, with an unusable file logged (``name``: the method in the log
    line) and read as none (the protocol then restarts the task from alpha = 0)."""
    try:
        return read_dual_file(path, task_id, n)
    except CheckpointError as err:
        log(WARNING, "%s task %d: state file unusable (%s); starting from alpha = 0", name,
            task_id, err)
        return None


def read_dual_file(path: Path, task_id: int, n: int
                   ) -> tuple[np.ndarray, dict[str, int | str]] | None:
    """The state kept in ``path`` if it is this task's and well formed; None if there is no
    file. Raises :class:`~fmtl_flower.checkpoint.CheckpointError` naming what is wrong."""
    if not path.exists():
        return None
    arrays, meta = read_state_file(path)
    try:
        duals = arrays["duals"]
        values: dict[str, int | str] = {k: int(meta[k]) for k in META_KEYS}
        for key in ("data", "run"):
            if key in meta:
                values[key] = str(meta[key])
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
    stored = read_usable_dual_file(path, task_id, n, name)
    if stored is not None:
        context.state[keys[0]] = ArrayRecord({"duals": to_array(stored[0])})
        context.state[keys[1]] = ConfigRecord(stored[1])


class DualStore:
    """A device's dual state in ``context.state`` (records ``<prefix>.arrays``: ``duals``,
    and ``<prefix>.meta``) and, with a ``client-state-dir``, in its state file
    ``<dir>/<prefix>-task-<id>.npz``; the protocol applied by :meth:`reconcile`.

    Parameters
    ----------
    prefix : str
        ``"mocha"`` or ``"cocoa-plus"``: the records' and the state file's names.
    name : str
        The method named in log lines (``"MOCHA"``, ``"CoCoA+"``).
    state_dir : str, optional
        The default ``client-state-dir`` (None: the node's or run's config, else none).
    """

    def __init__(self, prefix: str, name: str, state_dir: str | None = None) -> None:
        self.prefix, self.name, self.state_dir = prefix, name, state_dir
        self.arrays_key, self.meta_key = f"{prefix}.arrays", f"{prefix}.meta"
        # Decoded duals by node: (record written, its Array, that Array's bytes, decoded).
        # Used only while context.state still holds those very objects (in-process engines);
        # any replacement of the record, the Array or its bytes falls back to decoding.
        self._decoded: dict[tuple[int, int], tuple[ArrayRecord, Any, bytes, np.ndarray]] = {}

    def reconcile(self, context: Context, task_id: int, n: int, fingerprint: str,
                  config: Mapping[str, Any]) -> DualState:
        """The protocol over the stored state (read from the state file when
        ``context.state`` holds none) and the message's rounds; logs a state not resumed."""
        last_accepted, checkpoint_round, run = protocol_rounds(config)
        stored = dict(context.state.items())  # one read; plain-dict lookups below
        if self.meta_key not in stored:
            load_into_context(context, self._file(context, task_id),
                              (self.arrays_key, self.meta_key), task_id, n, self.name)
            stored = dict(context.state.items())
        duals = meta = None
        if self.meta_key in stored and self.arrays_key in stored:
            meta = dict(stored[self.meta_key].items())
            duals = self._stored_duals(context, stored[self.arrays_key])
        state = reconcile(duals, meta, task_id=task_id, n=n, last_accepted=last_accepted,
                          checkpoint_round=checkpoint_round, fingerprint=fingerprint,
                          run=run)
        log_reconciled(self.name, task_id, state, last_accepted)
        return state

    def write(self, context: Context, task_id: int, fingerprint: str, state: DualState,
              pending: np.ndarray | None, pending_round: int) -> None:
        """Keep the reconciled state and this message's change ``pending`` (of round
        ``pending_round``). The records written by the previous message are refilled in place
        (:func:`~fmtl_flower.wire.refill_config`, :func:`~fmtl_flower.wire.refill_arrays`:
        afterwards they hold exactly the new ``duals`` and meta, nothing else)."""
        duals, meta = encode(state, task_id, pending, pending_round, fingerprint)
        duals.setflags(write=False)
        stored = dict(context.state.items())
        array = to_array(duals)  # encoded once
        record = stored.get(self.arrays_key)
        if type(record) is ArrayRecord:
            refill_arrays(record, {"duals": array})
        else:
            record = array_record({"duals": array})
            context.state[self.arrays_key] = record
        old = stored.get(self.meta_key)
        if type(old) is ConfigRecord:
            refill_config(old, meta, handed_over=True)  # encode's fresh ints and str
        else:
            context.state[self.meta_key] = config_record(meta)
        if len(self._decoded) > 4096:
            self._decoded.clear()
        self._decoded[(int(context.run_id), int(context.node_id))] = (record, array,
                                                                      array.data, duals)
        path = self._file(context, task_id)
        if path is not None:
            write_dual_file(path, duals, meta)

    def _stored_duals(self, context: Context, record: Any) -> np.ndarray | None:
        if not isinstance(record, ArrayRecord):
            return None
        cached = self._decoded.get((int(context.run_id), int(context.node_id)))
        if cached is not None and cached[0] is record:
            array = record.get("duals")
            if array is cached[1] and array.data is cached[2]:
                return cached[3]
        if "duals" not in record:
            return None
        duals = from_array(record["duals"])
        return duals if duals.dtype == np.float64 else None

    def _file(self, context: Context, task_id: int) -> Path | None:
        return state_file_for(context, self.prefix, task_id, self.state_dir)
