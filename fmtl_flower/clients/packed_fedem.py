"""FedEM's stacked handler: one message trains (or evaluates) every task a node hosts.

The stacking protocol ``"fedem"`` of :mod:`fmtl_flower.packing`, served for FedEM and every
baseline of :mod:`fmtl_flower.strategies.fedem` (the ``method`` of the shared config). Every
slot is served by the same code as a one-task message (:meth:`FedEMClient.check_instruction`,
:meth:`~FedEMClient.train_task`, :meth:`~FedEMClient.evaluate_task`, the same choice of the
stored generation and the same rotation), without a Message, Context or record per slot: the
results are bit for bit those of unpacked runs, and a method added to those methods needs no
code here. The numpy models only: a :class:`~fmtl_flower.clients.fedem_torch.TorchFedEMClient`
is refused (torch runs stay one task per message).

Wire contract (the per-task one of :mod:`fmtl_flower.strategies.fedem`, stacked)
----------------------------------------------------------------------------------
``train`` / ``evaluate`` (server -> node): ``stack`` ConfigRecord (``protocol = "fedem"``,
``slots``: K slot numbers, row i of every array is slot ``slots[i]``); ``config`` with the
one-task config's values shared by every task (all but ``task-id`` and ``unseen``);
``arrays`` with ``components-0`` .. ``components-<G-1>`` float64 (M_g, P) (the distinct
sets of components the tasks are sent, each once; usually G = 1), ``components-of`` int64
(K,) (row i's set), ``task-id`` int64 (K,) and ``unseen`` bool (K,).

Reply: ``stack`` naming the k slots that succeeded (row i = slot ``slots[i]``); ``arrays``
with one vector (k,) per metric of the one-task reply (int64 for the int metrics: ``task-id``,
``round``, ``n-train`` and, for ``evaluate``, ``test-correct``, ``test-n``,
``em-iterations``; float64 for the others: ``train-loss`` and, for ``train``, ``e-step-s``,
``train-s``) and, for ``train``, ``components`` float64 (k, M, P), ``weights`` float64
(k, M) and ``responsibility`` float64 (k, M); ``stack-errors`` names the slots that failed
and why (each fails only its task).

Device state: one stacked record for all slots, ArrayRecord ``fedem.stack``: ``slots``
int64 (S,); per slot its two generations (newest first, as the one-task client's
``fedem.arrays`` / ``fedem.previous.arrays``): ``present`` bool (S, 2), ``rounds`` int64
(S, 2), ``signatures`` str (S, 2); their arrays flat in ``values`` float64, entry e being
array ``names[e]`` of generation ``entries[e, 1]`` of slot row ``entries[e, 0]``, at
``values[entries[e, 2]:]`` with shape ``entries[e, 3:5]`` (``entries[e, 4] = -1``: a
vector). With ``client-state-dir`` each task's state file is the one-task client's
(``fedem-task-<id>.npz``), read for a slot with nothing stored.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from ..checkpoint import write_state_file
from ..packing import SlotTaskCache, each_slot, read_stacked_instruction, stacked_is_train
from ..wire import from_array, to_array
from .common import config_value, state_file_for
from .fedem import (
    GENERATIONS,
    ClientData,
    FedEMClient,
    Generations,
    fresh_state,
    newest_before,
    read_generations_file,
    replaces_previous,
    state_file_content,
    state_signature,
    stored_state,
)

__all__ = ["PROTOCOL", "STATE", "PackedFedEM", "StackedGenerations"]

PROTOCOL = "fedem"
STATE = "fedem.stack"


class StackedGenerations:
    """The node's FedEM state for every slot it stored (``{slot: generations}``), decoded
    from (and encoded to) the stacked record ``fedem.stack``; an unusable record is as if
    nothing was stored (every slot starts afresh, as the one-task client does)."""

    def __init__(self, record: ArrayRecord | None) -> None:
        self.slots: dict[int, Generations] = {}
        if record is None:
            return
        try:
            self.slots = _decode(record)
        except (KeyError, TypeError, ValueError, IndexError):
            self.slots = {}

    def record(self) -> ArrayRecord:
        """The stacked record of every slot's generations."""
        order = sorted(self.slots)
        present = np.zeros((len(order), 2), dtype=bool)
        rounds = np.zeros((len(order), 2), dtype=np.int64)
        signatures = np.full((len(order), 2), "", dtype=object)
        entries: list[tuple[int, int, int, int, int]] = []
        names: list[str] = []
        values: list[np.ndarray] = []
        start = 0
        for j, slot in enumerate(order):
            for g, name in enumerate(GENERATIONS):
                if name not in self.slots[slot]:
                    continue
                arrays, info = self.slots[slot][name]
                present[j, g] = True
                rounds[j, g] = info["round"]
                signatures[j, g] = info["signature"]
                for key, array in arrays.items():
                    flat = np.asarray(array, dtype=np.float64).ravel()
                    shape = array.shape if array.ndim == 2 else (array.size, -1)
                    entries.append((j, g, start, shape[0], shape[1]))
                    names.append(key)
                    values.append(flat)
                    start += flat.size
        return ArrayRecord({
            "slots": to_array(np.array(order, dtype=np.int64)),
            "present": to_array(present), "rounds": to_array(rounds),
            "signatures": to_array(signatures.astype(str)),
            "entries": to_array(np.array(entries, dtype=np.int64).reshape(len(entries), 5)),
            "names": to_array(np.array(names, dtype=str)),
            "values": to_array(np.concatenate(values) if values else np.zeros(0))})


def _decode(record: ArrayRecord) -> dict[int, Generations]:
    slots = from_array(record["slots"])
    present = from_array(record["present"])
    rounds = from_array(record["rounds"])
    signatures = from_array(record["signatures"])
    entries = from_array(record["entries"])
    names = from_array(record["names"])
    values = from_array(record["values"])
    s = slots.shape[0] if slots.ndim == 1 else -1
    if (s < 0 or present.shape != (s, 2) or present.dtype != np.bool_
            or rounds.shape != (s, 2) or signatures.shape != (s, 2)
            or entries.ndim != 2 or entries.shape[1] != 5 or names.shape != entries.shape[:1]
            or values.dtype != np.float64 or values.ndim != 1):
        raise ValueError("fedem.stack: inconsistent shapes")
    out: dict[int, Generations] = {}
    for j, slot in enumerate(slots.tolist()):
        out[int(slot)] = {name: ({}, {"signature": str(signatures[j, g]),
                                      "round": int(rounds[j, g])})
                          for g, name in enumerate(GENERATIONS) if present[j, g]}
    order = slots.tolist()
    for (j, g, start, rows, cols), key in zip(entries.tolist(), names.tolist(), strict=True):
        size = rows * (cols if cols >= 0 else 1)
        if not (0 <= j < s and 0 <= g < 2 and present[j, g] and rows >= 0 and start >= 0
                and start + size <= values.size):
            raise ValueError("fedem.stack: an entry outside the values")
        flat = values[start:start + size]
        out[order[j]][GENERATIONS[g]][0][str(key)] = (flat.copy() if cols < 0
                                                      else flat.reshape(rows, cols).copy())
    return out


class PackedFedEM(SlotTaskCache):
    """The ``"fedem"`` stacking protocol's client side over a :class:`FedEMClient`'s data
    loader, model cache and per-task work (:func:`fmtl_flower.packing.packed_client_app`'s
    ``stacked``).

    Parameters
    ----------
    client : FedEMClient
        Serves every slot; not a torch client (ValueError: torch runs stay unpacked).
    """

    protocol = PROTOCOL

    def __init__(self, client: FedEMClient) -> None:
        from .fedem_torch import TorchFedEMClient  # (torch itself is not imported)

        if isinstance(client, TorchFedEMClient):
            raise ValueError("stacked FedEM messages serve the numpy models only: a torch "
                             "client runs one task per message (tasks-per-node=1)")
        super().__init__()
        self.client = client

    def whoami(self, content: RecordDict, context: Context, slot: int, task_id: int
               ) -> RecordDict:
        """One slot's ``whoami`` reply (:meth:`FedEMClient.whoami`'s), from the data kept
        for the slot (loaded once)."""
        data = self._data(context, task_id)
        return RecordDict({"info": ConfigRecord({
            "task-id": data.task_id, "n-train": data.n, "n-test": int(data.X_test.shape[0]),
            "dim": int(data.X.shape[1]), "num-classes": data.num_classes})})

    def __call__(self, message: Message, context: Context,
                 slot_tasks: list[tuple[int, int | None]]
                 ) -> tuple[RecordDict, list[int], dict[int, str]]:
        train = stacked_is_train(message, "FedEM")
        shared, components, of, task_ids, unseen = _read_instruction(message.content,
                                                                     len(slot_tasks))
        rnd = config_value(shared, "server-round", int)
        state = StackedGenerations(context.state[STATE] if STATE in context.state else None)
        client = self.client
        checked_sets: set[tuple[int, int]] = set()  # each set checked once per model

        def work(i: int, slot: int, task_id: int) -> tuple[Any, ...]:
            data = self._data(context, task_id)
            config = ChainMap({"task-id": task_ids[i], "unseen": unseen[i]}, shared)
            checked, method, model = client.check_instruction(config, components[of[i]], data,
                                                              checked_sets)
            generations = self._generations(context, state, slot, data)
            stored = self._stored(generations, method, checked, rnd + (0 if train else 1))
            if not train:
                return client.evaluate_task(data, config, checked, method, model, stored), None
            metrics, arrays, kept = client.train_task(data, config, checked, method, model,
                                                      stored)
            return metrics, arrays, data, _rotate(generations, kept, method, rnd)

        results, errors = each_slot(slot_tasks, work)
        content = RecordDict({"arrays": _reply_arrays([r for _, r in results], train)})
        if train:  # last: the state after every slot's work
            for slot, (_, _, data, generations) in results:
                state.slots[slot] = generations
                path = state_file_for(context, "fedem", data.task_id, client._state_dir)
                if path is not None:
                    write_state_file(path, *state_file_content(generations))
            if results:
                context.state[STATE] = state.record()
        return content, [slot for slot, _ in results], errors

    # -- one slot ---------------------------------------------------------------------------
    def _data(self, context: Context, task_id: int) -> ClientData:
        """The slot's validated data, loaded once per node, run and task."""
        return self.slot_task(context, task_id, self.client.read_client_data)

    def _generations(self, context: Context, state: StackedGenerations, slot: int,
                     data: ClientData) -> Generations:
        """The slot's stored generations; its state file's when the node stored none."""
        if slot in state.slots:
            return state.slots[slot]
        return read_generations_file(state_file_for(context, "fedem", data.task_id,
                                                    self.client._state_dir))

    @staticmethod
    def _stored(generations: Generations, method: str, components: np.ndarray, before: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(pi, momentum, own) as the one-task client chooses them."""
        newest = newest_before([generations[g][1]["round"] if g in generations else None
                                for g in GENERATIONS], before)
        if newest is None:
            return fresh_state(components)
        arrays, info = generations[GENERATIONS[newest]]
        return stored_state(info["signature"], arrays.get, method, components)


def _rotate(generations: Generations, kept: dict[str, np.ndarray], method: str, rnd: int
            ) -> Generations:
    """The generations after storing round ``rnd``'s state (the one-task client's rule)."""
    new: Generations = {"latest": (kept, {"signature": state_signature(method,
                                                                        kept["momentum"]),
                                          "round": rnd})}
    latest = generations.get("latest")
    if latest is not None and replaces_previous(latest[1]["round"], rnd):
        new["previous"] = latest
    elif "previous" in generations:
        new["previous"] = generations["previous"]
    return new


def _read_instruction(content: RecordDict, k: int
                      ) -> tuple[dict[str, Any], list[np.ndarray], list[int], list[Any],
                                 list[Any]]:
    """The shared config (a dict), the sets of components, each row's set and the per-task
    ``task-id`` and ``unseen`` (Python values) of a stacked message; ValueError (the whole
    message fails) when its records are malformed."""
    config, vectors = read_stacked_instruction(
        content, k, "FedEM", {"components-of": np.int64, "task-id": np.int64,
                              "unseen": np.bool_})
    record = content["arrays"]
    sets = sum(1 for name in record if name.startswith("components-")) - 1
    if not all(f"components-{g}" in record for g in range(sets)):
        raise ValueError("stacked FedEM message: components sets must be components-0 .. "
                         f"components-{sets - 1}")
    of, task_ids, unseen = (vectors[name].tolist() for name in vectors)
    if any(not 0 <= g < sets for g in of):
        raise ValueError(f"'components-of' must index the {sets} components sets")
    components = [from_array(record[f"components-{g}"]) for g in range(sets)]
    return dict(config.items()), components, of, task_ids, unseen


def _reply_arrays(rows: list[tuple[Any, ...]], train: bool) -> ArrayRecord:
    """Every metric as a vector (int64 when an int in every row, else float64) and, for
    ``train``, every reply array stacked."""
    out: dict[str, Any] = {}
    metrics: list[Mapping[str, Any]] = [r[0] for r in rows]
    for key in metrics[0] if metrics else ():
        column = [m[key] for m in metrics]
        ints = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in column)
        out[key] = to_array(np.array(column, dtype=np.int64 if ints else np.float64))
    if train and rows:
        for key in rows[0][1]:
            out[key] = to_array(np.stack([r[1][key] for r in rows]))
    return ArrayRecord(out)
