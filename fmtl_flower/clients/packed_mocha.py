"""MOCHA's stacked handler: one message trains (or evaluates) every task a node hosts.

The stacking protocol ``"mocha"`` of :mod:`fmtl_flower.packing`, served for MOCHA and its
primal-dual baselines (CoCoA+, Mb-SDCA: the ``method`` of the same handlers). Every slot is
solved exactly as :class:`~fmtl_flower.clients.mocha.MOCHAClient` solves a one-task message
(same checks, same commit protocol, same local solver, same metrics), but without a Message,
Context or record per slot: the results are bit for bit those of unpacked runs.

Wire contract (the per-task one of :mod:`fmtl_flower.strategies.mocha`, stacked)
----------------------------------------------------------------------------------
``train`` / ``evaluate`` (server -> node): ``stack`` ConfigRecord (``protocol = "mocha"``,
``slots``: K slot numbers, row i of every array is slot ``slots[i]``); ``config`` ConfigRecord
with the values shared by every task (``server-round``, ``seed``, ``eval`` and, when set,
``checkpoint-round``, ``gamma``, ``method``, ``theta``, ``scale``, ``loss``); ``arrays``
ArrayRecord with ``w`` float64 (K, d), ``task-id`` int64 (K,), ``last-accepted-round`` int64 (K,),
``m-tt`` float64 (K,), ``sigma-prime`` float64 (K,) and, for ``train``, ``budget`` int64
(K,), ``dropped`` bool (K,). The seeding round's ``train`` (``start(initial_arrays=)``) also
holds ``seed-w`` and ``seed-b`` float64 (K, d), row i the one-task message's values for slot
``slots[i]``: each slot then runs the one-task client's seeding step
(:func:`~fmtl_flower.clients.dual_seed.seed_duals`) instead of its solver.

Reply: ``stack`` naming the k slots that succeeded (row i = slot ``slots[i]``), ``arrays``
with ``task-id``, ``round``, ``n-train``, ``state-ok`` int64 (k,), ``loss-mean``,
``dual-mean`` float64 (k,), for ``train`` ``steps`` int64 (k,) and ``delta-b`` float64
(k, d), and with ``eval`` ``test-errors``, ``test-n`` int64 (k,); ``stack-errors`` names
the slots that failed and why (each fails only its task).

Device state: one stacked record for all slots, ArrayRecord ``mocha.stack``: ``slots``
int64 (S,), ``offsets`` int64 (S + 1,), ``duals`` float64 (3, N) (slot ``slots[j]``'s
[committed alpha; pending d_alpha; stable alpha] in columns ``offsets[j]:offsets[j+1]``;
under record-level DP each slot's accepted noise e_t follows its alpha, as in the one-task
state, :func:`~fmtl_flower.clients.mocha.state_width`)
and ``meta`` int64 (S, 4) (``task-id``, ``committed-round``, ``pending-round``,
``stable-round``), ``data`` str (S,) (the fingerprint of the slot's training data, and of
the loss when it is not the hinge) and ``run`` str (S,) (the run the slot's state belongs
to: the messages' ``run-token``), reconciled per slot by
:func:`~fmtl_flower.clients.dual_state.reconcile`; with ``client-state-dir`` each task's
state file is the unpacked one (``mocha-task-<id>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from ..core.multiclass import Lifting
from ..core.record_dp import own_noise_free
from ..packing import (
    SlotFailed,
    SlotTaskCache,
    each_slot,
    read_stacked_instruction,
    stacked_is_train,
)
from ..wire import from_array, to_array
from .common import (
    DeviceData,
    LocalTask,
    config_value,
    run_token,
    stacked_reply_arrays,
    state_file_for,
)
from .dual_seed import check_seed_target, seed_duals
from .dual_state import (
    META_KEYS,
    DualState,
    encode,
    log_reconciled,
    read_usable_dual_file,
    reconcile,
    write_dual_file,
)
from .mocha import (
    BINARY,
    MOCHAClient,
    for_loss,
    loss_of,
    noise_seed_of,
    pending_change,
    release,
    split_state,
    state_width,
)

__all__ = ["INSTRUCTION_ARRAYS", "PROTOCOL", "STATE", "PackedMOCHA", "SlotFailed",
           "StackedState"]

PROTOCOL = "mocha"
STATE = "mocha.stack"

#: Per-task arrays of a stacked instruction: name -> (dtype, needed for train only).
INSTRUCTION_ARRAYS = {"task-id": (np.int64, False), "last-accepted-round": (np.int64, False),
                      "m-tt": (np.float64, False), "sigma-prime": (np.float64, False),
                      "budget": (np.int64, True), "dropped": (np.bool_, True)}


class StackedState:
    """The node's dual state for every slot it stored, decoded from (and encoded to) the
    stacked record ``key`` of ``context.state`` (``mocha.stack``, ``cocoa-plus.stack``).

    ``kind`` = (the state files' prefix, the method's name in log lines), e.g.
    ``("mocha", "MOCHA")``; ``state_dir``: the handler's default ``client-state-dir``.
    """

    def __init__(self, record: ArrayRecord | None, key: str = STATE,
                 kind: tuple[str, str] = ("mocha", "MOCHA"), state_dir: str | None = None
                 ) -> None:
        self.key, (self.prefix, self.name), self.state_dir = key, kind, state_dir
        self.slots: dict[int, tuple[np.ndarray, dict[str, int | str]]] = {}
        self._layout: tuple[list[int], np.ndarray, np.ndarray] | None = None
        if record is None:
            return
        try:
            slots = from_array(record["slots"])
            offsets = from_array(record["offsets"])
            duals = from_array(record["duals"])
            meta = from_array(record["meta"])
            data = from_array(record["data"])
            runs = from_array(record["run"]) if "run" in record else None
        except (KeyError, TypeError, ValueError):
            return  # unusable state: as if nothing was stored (the protocol restarts)
        s = slots.shape[0] if slots.ndim == 1 else -1
        if (s < 0 or offsets.shape != (s + 1,) or meta.shape != (s, 4) or duals.ndim != 2
                or data.shape != (s,) or data.dtype.kind != "U"
                or (runs is not None and (runs.shape != (s,) or runs.dtype.kind != "U"))
                or duals.shape[0] != 3 or duals.dtype != np.float64
                or (s and (offsets[0] != 0 or offsets[-1] != duals.shape[1]
                           or np.any(np.diff(offsets) < 0)))):
            return
        slot_list = [int(x) for x in slots]
        self._layout = (slot_list, offsets, duals)
        for j, slot in enumerate(slot_list):
            values: dict[str, int | str] = dict(zip(META_KEYS, (int(v) for v in meta[j]),
                                                    strict=True))
            values["data"] = str(data[j])
            if runs is not None and str(runs[j]):
                values["run"] = str(runs[j])
            self.slots[slot] = (duals[:, offsets[j]:offsets[j + 1]], values)

    @classmethod
    def of(cls, context: Context, key: str, kind: tuple[str, str], state_dir: str | None
           ) -> StackedState:
        """The stacked state kept under ``key`` in ``context.state`` (none kept: empty)."""
        return cls(context.state[key] if key in context.state else None, key, kind, state_dir)

    def reconcile(self, context: Context, slot: int, task: Any, last_accepted: int,
                  checkpoint_round: int, run: str | None = None, width: int | None = None
                  ) -> DualState:
        """The commit protocol (as :class:`~fmtl_flower.clients.dual_state.DualStore` applies
        it) over ``slot``'s stored state, else over ``task``'s state file; ``task`` has
        ``task_id``, ``n`` and ``fingerprint``; ``run``: the message's ``run-token``;
        ``width``: the tracked vector's length (default ``task.n``; under record-level DP
        n + d, :func:`~fmtl_flower.clients.mocha.state_width`)."""
        width = task.n if width is None else width
        stored = self.slots.get(slot)
        if stored is None:  # nothing stored for this slot: its state file, if any
            path = state_file_for(context, self.prefix, task.task_id, self.state_dir)
            if path is not None:
                stored = read_usable_dual_file(path, task.task_id, width, self.name)
        duals, meta = stored if stored is not None else (None, None)
        state = reconcile(duals, meta, task_id=task.task_id, n=width,
                          last_accepted=last_accepted, checkpoint_round=checkpoint_round,
                          fingerprint=task.fingerprint, run=run)
        log_reconciled(self.name, task.task_id, state, last_accepted)
        return state

    def commit(self, context: Context,
               kept: Sequence[tuple[int, int, np.ndarray, dict[str, int | str]]]) -> None:
        """Keep each ``(slot, task id, duals (3, n), meta)``, write its task's state file
        (with a ``client-state-dir``), then the stacked record (when a slot was kept)."""
        for slot, task_id, duals, meta in kept:
            self.slots[slot] = (duals, meta)
            path = state_file_for(context, self.prefix, task_id, self.state_dir)
            if path is not None:
                write_dual_file(path, duals, meta)
        if kept:
            context.state[self.key] = self.record()

    def record(self) -> ArrayRecord:
        """The stacked record of every slot's state."""
        order = sorted(self.slots)
        sizes = [self.slots[s][0].shape[1] for s in order]
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        duals = (np.concatenate([self.slots[s][0] for s in order], axis=1) if order
                 else np.zeros((3, 0)))
        meta = np.array([[self.slots[s][1][k] for k in META_KEYS] for s in order],
                        dtype=np.int64).reshape(len(order), 4)
        data = np.array([str(self.slots[s][1].get("data", "")) for s in order], dtype=str)
        runs = np.array([str(self.slots[s][1].get("run", "")) for s in order], dtype=str)
        return ArrayRecord({"slots": to_array(np.array(order, dtype=np.int64)),
                            "offsets": to_array(offsets), "duals": to_array(duals),
                            "meta": to_array(meta), "data": to_array(data),
                            "run": to_array(runs)})


class PackedMOCHA(SlotTaskCache):
    """The ``"mocha"`` stacking protocol's client side over a :class:`MOCHAClient`'s data
    loader and local solver (:func:`fmtl_flower.packing.packed_client_app`'s ``stacked``).

    Parameters
    ----------
    client : MOCHAClient
        Its ``load_data``, ``task_id`` and ``state_dir`` serve every slot.
    """

    protocol = PROTOCOL

    def __init__(self, client: MOCHAClient) -> None:
        super().__init__()
        self.client = client

    def __call__(self, message: Message, context: Context,
                 slot_tasks: list[tuple[int, int | None]]
                 ) -> tuple[RecordDict, list[int], dict[int, str]]:
        train = stacked_is_train(message, "MOCHA")
        config, vectors, w = _read_stacked_instruction(message.content, len(slot_tasks), train)
        seeds = _read_seed_rows(message.content, len(slot_tasks)) if train else None
        # Python numbers (the values a one-task message's ConfigRecord holds), read once
        arrays: dict[str, list[Any]] = {k: v.tolist() for k, v in vectors.items()}
        arrays["finite"] = np.isfinite(w).all(axis=1).tolist()
        server_round = config_value(config, "server-round", int)
        seed = config_value(config, "seed", int) if train else 0
        evaluate = "eval" in config and config_value(config, "eval", bool)
        method = config_value(config, "method", str) if "method" in config else "mocha"
        checkpoint_round = (config_value(config, "checkpoint-round", int)
                            if "checkpoint-round" in config else -1)
        state = StackedState.of(context, STATE, ("mocha", "MOCHA"), self.client._state_dir)

        lifting = Lifting.from_config(config)

        def work(i: int, slot: int, task_id: int) -> tuple[Any, ...]:
            task = self._local_task(context, slot, task_id, lifting)
            return task, *self._slot(context, state, slot, task, config, arrays, w, i,
                                     server_round, checkpoint_round, seed, method, evaluate,
                                     train, seeds)

        results, errors = each_slot(slot_tasks, work)
        rows = [r[1] for _, r in results]
        deltas = [r[2] for _, r in results] if train else []
        ints = ["task-id", "round", "n-train", "state-ok"] + (["steps"] if train else [])
        if evaluate:
            ints += ["test-errors", "test-n"]
        content = RecordDict({"arrays": stacked_reply_arrays(
            rows, ints, ("loss-mean", "dual-mean"), "delta-b" if train else None, deltas,
            w.shape[1])})
        state.commit(context, [(slot, task.task_id, duals, meta)  # last: after every slot
                               for slot, (task, _, _, duals, meta) in results])
        return content, [slot for slot, _ in results], errors

    def whoami(self, content: RecordDict, context: Context, slot: int, task_id: int
               ) -> RecordDict:
        """One slot's ``whoami`` reply (:meth:`MOCHAClient.whoami`'s), from the data this
        handler keeps for the slot's training (loaded once)."""
        data = self._device_data(context, task_id)
        return RecordDict({"info": ConfigRecord(self.client.whoami_info(data, context))})

    # -- one slot ---------------------------------------------------------------------------
    def _slot(self, context: Context, state: StackedState, slot: int, task: LocalTask,
              config: ConfigRecord, arrays: dict[str, list[Any]], w_all: np.ndarray, i: int,
              server_round: int, checkpoint_round: int, seed: int, method: str,
              evaluate: bool, train: bool,
              seeds: tuple[np.ndarray, np.ndarray] | None = None
              ) -> tuple[dict[str, Any], np.ndarray | None, np.ndarray, dict[str, int | str]]:
        """One task's work, as :meth:`MOCHAClient.train` / ``evaluate`` do it (``seeds``:
        the seeding round's stacked ``seed-w`` / ``seed-b``)."""
        if arrays["task-id"][i] != task.task_id:
            raise SlotFailed(f"message for task {arrays['task-id'][i]} reached the slot "
                             f"of task {task.task_id}")
        task = for_loss(task, loss_of(config))  # the dual state is bound to the loss too
        task = self.client.dp_task(task, config)  # record-level DP: rows clipped
        w = w_all[i]
        if w.shape != (task.dim,) or not arrays["finite"][i]:
            raise SlotFailed(f"'w' must be finite float64 of shape ({task.dim},)")
        last_accepted = arrays["last-accepted-round"][i]
        if train:
            budget = arrays["budget"][i]
            m_tt = arrays["m-tt"][i]
            sigma_p = arrays["sigma-prime"][i]
            if not (math.isfinite(m_tt) and math.isfinite(sigma_p)):
                raise SlotFailed("m-tt and sigma-prime must be finite")
            if budget < 0 or m_tt <= 0 or sigma_p <= 0:
                raise SlotFailed(f"invalid budget/m-tt/sigma-prime: {budget}, {m_tt}, "
                                 f"{sigma_p}")
            if last_accepted >= server_round:
                raise SlotFailed("last-accepted-round must precede server-round in a train "
                                 "message")
        if not 0 <= last_accepted <= server_round:
            raise SlotFailed(f"last-accepted-round {last_accepted} outside 0..server-round "
                             f"({server_round})")
        reconciled = state.reconcile(context, slot, task, last_accepted, checkpoint_round,
                                     run_token(config), state_width(task, config))
        alpha, noise = split_state(reconciled.alpha, task)
        model = w if noise.size == 0 else own_noise_free(w, arrays["m-tt"][i], noise)
        metrics = MOCHAClient._metrics(task, w, alpha, config, reconciled.ok, model)
        metrics["round"] = server_round
        if not train:
            duals, meta = encode(reconciled, task.task_id, None, -1, task.fingerprint)
            return metrics, None, duals, meta
        target = None if seeds is None else check_seed_target(seeds[0][i], seeds[1][i],
                                                              task.dim)
        if arrays["dropped"][i] or budget == 0:
            d_alpha, d_b, steps = np.zeros(task.n), np.zeros(task.dim), 0
        elif target is not None and "dp-clip" in config:
            raise SlotFailed("record-level DP does not cover the seeding round")
        elif target is not None:  # the seeding round: no solver, the one-task seed step
            d_alpha, d_b, steps = seed_duals(task, alpha, *target, m_tt=m_tt,
                                             seed=seed, server_round=server_round,
                                             loss=loss_of(config))
        else:
            d_alpha, d_b, steps = MOCHAClient._local_update(
                method, task, alpha, w, config, budget, m_tt, sigma_p, seed, server_round)
        metrics["steps"] = steps
        released = release(task, d_b, config, steps, server_round, noise_seed_of(context),
                           w=w, m_tt=m_tt, sigma_p=sigma_p)
        duals, meta = encode(reconciled, task.task_id,
                             pending_change(d_alpha, released, d_b, noise), server_round,
                             task.fingerprint)
        return metrics, released, duals, meta

    def _local_task(self, context: Context, slot: int, task_id: int,
                    lifting: Lifting = BINARY) -> LocalTask:
        """The slot's validated data as ``lifting`` makes it, loaded once per node, run and
        task."""
        return self.client.prepared_task(self._device_data(context, task_id), context, lifting)

    def _device_data(self, context: Context, task_id: int) -> DeviceData:
        """The slot's checked data, labels as loaded, loaded once per node, run and task."""
        return self.slot_task(context, task_id, self.client._load_device_data)


def _read_stacked_instruction(content: RecordDict, k: int, train: bool
                              ) -> tuple[ConfigRecord, dict[str, np.ndarray], np.ndarray]:
    """The shared config, the per-task vectors and the (K, d) models of a stacked message;
    ValueError (the whole message fails) when its records are malformed."""
    config, arrays = read_stacked_instruction(
        content, k, "MOCHA", {name: dtype for name, (dtype, train_only)
                              in INSTRUCTION_ARRAYS.items() if train or not train_only}, ["w"])
    return config, arrays, arrays.pop("w")


def _read_seed_rows(content: RecordDict, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The seeding round's ``(seed-w, seed-b)`` rows of a stacked train message (None when it
    does not seed); ValueError (the whole message fails) when one is missing or malformed."""
    record = content["arrays"]
    if "seed-w" not in record and "seed-b" not in record:
        return None
    _, rows = read_stacked_instruction(content, k, "MOCHA", {}, ["seed-w", "seed-b"])
    return rows["seed-w"], rows["seed-b"]
