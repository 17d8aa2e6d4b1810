"""The FSVRG family's stacked handler: one message serves every task a node hosts.

The stacking protocol ``"fsvrg"`` of :mod:`fmtl_flower.packing`, served for FSVRG, naive
FSVRG, GD, DANE and CoCoA+ (the ``method`` of the same handlers). Every slot is served exactly
as :class:`~fmtl_flower.clients.fsvrg.FSVRGClient` serves a one-task message (same checks,
same local solver, same commit protocol, same metrics; its own code is called), but without a
Message, Context or record per slot: the results are bit for bit those of unpacked runs.

Wire contract (the per-task one of :mod:`fmtl_flower.strategies.fsvrg`, stacked)
----------------------------------------------------------------------------------
Every exchange (``query.fsvrg_stats``, ``query.fsvrg_gram``, ``query.fsvrg_gradient``,
``train``, ``evaluate``; server -> node): ``stack`` ConfigRecord (``protocol = "fsvrg"``,
``slots``: K slot numbers, row i of every array is slot ``slots[i]``); ``config``
ConfigRecord with the one-task message's config values but ``task-id`` and
``last-accepted-round`` (the values every task shares: ``server-round``, ``seed``, ``method``,
``lam``, ``eval``, ``h``, ``mu``, ``epochs``, ``step``, ``n``, ``sigma-prime``,
``checkpoint-round`` as the exchange has them); ``arrays`` ArrayRecord with ``task-id`` int64
(K,), for CoCoA+'s ``train`` and ``evaluate`` ``last-accepted-round`` int64 (K,), and the
exchange's global vectors ONCE, float64 (d,) each, as in the one-task message (``v`` for the
Gram query; ``w``; ``g``; ``phi``).

Reply: ``stack`` naming the k slots that succeeded (row i = slot ``slots[i]``), ``arrays``
with the one-task reply's metrics as vectors, int64 (k,) (``task-id``, ``n-train``; but for
the two setup queries ``round``; CoCoA+ ``state-ok``; with ``eval`` ``test-errors``,
``test-n``) and float64 (k,) (``loss-sum``, ``sq-norm-sum``; CoCoA+ ``dual-sum``), and the
one-task reply's array as a (k, d) matrix: ``counts`` int64, ``gram-v``, ``grad-sum``,
``w-local`` or ``d-w`` float64 (``evaluate``: none). ``stack-errors`` names the slots that
failed and why (each fails only its task).

Device state (CoCoA+): one stacked record for all slots, ArrayRecord ``cocoa-plus.stack``,
laid out as MOCHA's ``mocha.stack``
(:class:`~fmtl_flower.clients.packed_mocha.StackedState`: ``slots``, ``offsets``, ``duals``
(3, N), ``meta`` (S, 4), ``data``), reconciled per slot by
:func:`~fmtl_flower.clients.dual_state.reconcile`; with ``client-state-dir`` each task's
state file is the unpacked one (``cocoa-plus-task-<id>``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from ..core.fsvrg import local_gram_product
from ..packing import SlotFailed, SlotTaskCache, each_slot, read_stacked_instruction
from ..strategies.packed_fsvrg import MESSAGE_TYPES, reply_keys
from ..wire import from_array
from .common import config_value, protocol_rounds, stacked_reply_arrays
from .dual_state import (
    DualState,
    encode,
)
from .fsvrg import LOCAL_METHODS, FSVRGClient, SparseLocalTask
from .packed_mocha import StackedState

__all__ = ["PROTOCOL", "STATE", "PackedFSVRG"]

PROTOCOL = "fsvrg"
STATE = "cocoa-plus.stack"
STATS, GRAM, GRADIENT = (MESSAGE_TYPES[k] for k in ("stats", "gram", "gradient"))
KINDS = tuple(MESSAGE_TYPES.values())
#: The global (d,) vectors a stacked message may carry (each once, for every slot).
SHARED_VECTORS = ("w", "g", "phi", "v")


class PackedFSVRG(SlotTaskCache):
    """The ``"fsvrg"`` stacking protocol's client side over an :class:`FSVRGClient`'s data
    loader, local solvers and state directory (:func:`fmtl_flower.packing.packed_client_app`'s
    ``stacked``).

    Parameters
    ----------
    client : FSVRGClient
        Its ``load_data``, ``task_id`` and ``state_dir`` serve every slot.
    """

    protocol = PROTOCOL

    def __init__(self, client: FSVRGClient) -> None:
        super().__init__()
        self.client = client

    def whoami(self, content: RecordDict, context: Context, slot: int, task_id: int
               ) -> RecordDict:
        """One slot's ``whoami`` reply (:meth:`FSVRGClient.whoami`'s), from the data this
        handler keeps for the slot (loaded once)."""
        task = self._local_task(context, task_id)
        return RecordDict({"info": ConfigRecord({"task-id": task.task_id, "n-train": task.n,
                                                 "n-test": int(task.X_test.shape[0]),
                                                 "dim": task.dim})})

    def __call__(self, message: Message, context: Context,
                 slot_tasks: list[tuple[int, int | None]]
                 ) -> tuple[RecordDict, list[int], dict[int, str]]:
        kind = message.metadata.message_type
        if kind not in KINDS:
            raise ValueError(f"stacked FSVRG messages are {KINDS}, not {kind!r}")
        content = message.content
        if "config" not in content or not isinstance(content["config"], ConfigRecord):
            raise ValueError("stacked FSVRG message needs a 'config' ConfigRecord")
        shared = dict(content["config"].items())
        method = shared.get("method")
        cocoa = kind in (MessageType.TRAIN, MessageType.EVALUATE) and method == "cocoa-plus"
        vectors: dict[str, Any] = {"task-id": np.int64}
        if cocoa:
            vectors["last-accepted-round"] = np.int64
        _, per_task = read_stacked_instruction(content, len(slot_tasks), "FSVRG", vectors)
        task_ids = per_task["task-id"].tolist()
        last_accepted = per_task["last-accepted-round"].tolist() if cocoa else None
        globals_ = _SharedVectors(content["arrays"])
        evaluate = "eval" in shared and config_value(shared, "eval", bool)
        state = (StackedState.of(context, STATE, ("cocoa-plus", "CoCoA+"),
                                 self.client.state_dir) if cocoa else None)

        def work(i: int, slot: int, task_id: int) -> tuple[Any, ...]:
            task = self._local_task(context, task_id)
            config = {**shared, "task-id": task_ids[i]}
            if last_accepted is not None:
                config["last-accepted-round"] = last_accepted[i]
            if config_value(config, "task-id", int) != task.task_id:
                raise SlotFailed(f"message for task {task_ids[i]} reached the slot of task "
                                 f"{task.task_id}")
            vector = globals_.checker(task.dim)
            if kind == STATS:
                return {"task-id": task.task_id, "n-train": task.n}, task.counts, None
            if kind == GRAM:
                u = local_gram_product(task.X, vector("v"))
                return {"task-id": task.task_id, "n-train": task.n}, u, None
            if kind == GRADIENT:
                return (*FSVRGClient._loss_metrics(task, config, vector("w")), None)
            if kind == MessageType.EVALUATE and not cocoa:
                return FSVRGClient._loss_metrics(task, config, vector("w"))[0], None, None
            if kind == MessageType.TRAIN:
                train_method = config_value(config, "method", str)
                if train_method not in LOCAL_METHODS:
                    raise SlotFailed(f"method must be one of {LOCAL_METHODS}, got "
                                     f"{train_method!r}")
                if not cocoa:
                    return (*FSVRGClient.local_model(task, config, train_method, vector),
                            None)

            def reconcile() -> DualState:  # CoCoA+: the commit protocol, after the checks
                assert state is not None
                return state.reconcile(context, slot, task, *protocol_rounds(config))

            if kind == MessageType.EVALUATE:
                metrics, reconciled = FSVRGClient.cocoa_evaluate(task, config, vector,
                                                                 reconcile)
                return metrics, None, encode(reconciled, task.task_id, None, -1,
                                             task.fingerprint)
            metrics, reconciled, d_alpha, d_w = FSVRGClient.cocoa_train(task, config, vector,
                                                                        reconcile)
            return metrics, d_w, encode(reconciled, task.task_id, d_alpha,
                                        int(metrics["round"]), task.fingerprint)

        results, errors = each_slot(slot_tasks, work)
        ints, floats, matrix = reply_keys(kind, cocoa, evaluate)
        out = stacked_reply_arrays([r[0] for _, r in results], ints, floats, matrix,
                                   [r[1] for _, r in results], globals_.dim,
                                   np.int64 if matrix == "counts" else np.float64)
        if state is not None:  # last: the state after every slot
            state.commit(context, [(slot, int(metrics["task-id"]), duals, meta)
                                   for slot, (metrics, _, (duals, meta)) in results])
        return RecordDict({"arrays": out}), [slot for slot, _ in results], errors

    # -- one slot ---------------------------------------------------------------------------
    def _local_task(self, context: Context, task_id: int) -> SparseLocalTask:
        """The slot's validated data, loaded once per node, run and task."""
        return self.slot_task(context, task_id, self.client._build_task)


class _SharedVectors:
    """The global (d,) vectors of a stacked message, each decoded once and checked per slot
    as the one-task handler checks its message's (:meth:`FSVRGClient._vector`)."""

    def __init__(self, record: Any) -> None:
        self._record = record
        self._decoded: dict[str, tuple[np.ndarray, bool]] = {}
        self.dim = 0

    def get(self, key: str) -> tuple[np.ndarray, bool]:
        if key not in self._decoded:
            if key not in self._record:
                raise SlotFailed(f"FSVRG message lacks array {key!r}")
            v = from_array(self._record[key])
            v.flags.writeable = False  # one array for every slot: none may change it
            finite = v.dtype == np.float64 and bool(np.all(np.isfinite(v)))
            self._decoded[key] = (v, finite)
        return self._decoded[key]

    def checker(self, dim: int) -> Callable[[str], np.ndarray]:
        def vector(key: str) -> np.ndarray:
            v, finite = self.get(key)
            if v.dtype != np.float64 or v.shape != (dim,) or not finite:
                raise SlotFailed(f"{key!r} must be finite float64 of shape ({dim},), "
                                 f"got {v.dtype} {v.shape}")
            self.dim = dim
            return v
        return vector
