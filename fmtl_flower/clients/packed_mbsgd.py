"""Mb-SGD's stacked handler: one message serves every task a node hosts.

The stacking protocol ``"mb-sgd"`` of :mod:`fmtl_flower.packing`. Every slot is served exactly
as :class:`~fmtl_flower.clients.mbsgd.MbSGDClient` serves a one-task message (same checks,
same mini-batch gradient, same metrics), without a Message, Context or record per slot; the
device keeps no state.

Wire contract (the per-task one of :mod:`fmtl_flower.strategies.mbsgd`, stacked)
----------------------------------------------------------------------------------
``train`` / ``evaluate`` (server -> node): ``stack`` ConfigRecord (``protocol = "mb-sgd"``,
``slots``: K slot numbers, row i of every array is slot ``slots[i]``); ``config`` with the
shared ``server-round``, ``seed``, ``eval``; ``arrays`` with ``w`` float64 (K, d), ``task-id``
int64 (K,) and, for ``train``, ``budget`` int64 (K,), ``dropped`` bool (K,).

Reply: ``stack`` naming the k slots that succeeded, ``arrays`` with ``task-id``, ``round``,
``n-train`` int64 (k,), ``loss-mean`` float64 (k,), for ``train`` ``count`` int64 (k,) and
``grad`` float64 (k, d), and with ``eval`` ``test-errors``, ``test-n`` int64 (k,);
``stack-errors`` names the slots that failed and why (each fails only its task).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict

from ..core.baselines import mbsgd_local_gradient
from ..core.rng import coordinate_order
from ..packing import SlotFailed, each_slot, read_stacked_instruction, stacked_is_train
from .common import config_value, stacked_reply_arrays
from .mbsgd import MbSGDClient
from .mocha import loss_of
from .packed_mocha import PackedMOCHA

PROTOCOL = "mb-sgd"


class PackedMbSGD:
    """The ``"mb-sgd"`` stacking protocol's client side over an :class:`MbSGDClient`'s data
    loader (:func:`fmtl_flower.packing.packed_client_app`'s ``stacked``); the data are kept
    as :class:`~fmtl_flower.clients.packed_mocha.PackedMOCHA` keeps them."""

    protocol = PROTOCOL

    def __init__(self, client: MbSGDClient) -> None:
        self.client = client
        self._data = PackedMOCHA(client._data)

    def whoami(self, content: RecordDict, context: Context, slot: int, task_id: int
               ) -> RecordDict:
        """One slot's ``whoami`` reply (MOCHA's)."""
        return self._data.whoami(content, context, slot, task_id)

    def __call__(self, message: Message, context: Context,
                 slot_tasks: list[tuple[int, int | None]]
                 ) -> tuple[RecordDict, list[int], dict[int, str]]:
        train = stacked_is_train(message, "Mb-SGD")
        config, arrays, w_all = _read(message.content, len(slot_tasks), train)
        server_round = config_value(config, "server-round", int)
        seed = config_value(config, "seed", int) if train else 0
        if train and server_round < 1:
            raise ValueError(f"server-round must be >= 1, got {server_round}")
        evaluate = "eval" in config and config_value(config, "eval", bool)

        def work(i: int, slot: int, task_id: int) -> tuple[dict[str, Any], np.ndarray | None]:
            task = self._data._local_task(context, slot, task_id)
            if int(arrays["task-id"][i]) != task.task_id:
                raise SlotFailed(f"message for task {int(arrays['task-id'][i])} reached "
                                 f"the slot of task {task.task_id}")
            w = w_all[i]
            if w.shape != (task.dim,) or not np.all(np.isfinite(w)):
                raise SlotFailed(f"'w' must be finite float64 of shape ({task.dim},)")
            if train:
                budget = int(arrays["budget"][i])
                if not 0 <= budget <= task.n:
                    raise SlotFailed(f"budget must be in 0..n-train ({task.n}), got {budget}")
            metrics = MbSGDClient._metrics(task, w, config)
            metrics["round"] = server_round
            if not train:
                return metrics, None
            if bool(arrays["dropped"][i]) or budget == 0:
                grad, count = np.zeros(task.dim), 0
            else:
                order = coordinate_order(seed, task.task_id, server_round, task.n)
                grad, count = mbsgd_local_gradient(task.X, task.y, w, budget=budget,
                                                   order=order, loss=loss_of(config))
            metrics["count"] = int(count)
            return metrics, grad

        results, errors = each_slot(slot_tasks, work)
        rows = [metrics for _, (metrics, _) in results]
        ints = ["task-id", "round", "n-train"] + (["count"] if train else [])
        if evaluate:
            ints += ["test-errors", "test-n"]
        out = stacked_reply_arrays(rows, ints, ("loss-mean",), "grad" if train else None,
                                   [grad for _, (_, grad) in results], w_all.shape[1])
        return RecordDict({"arrays": out}), [slot for slot, _ in results], errors


def _read(content: RecordDict, k: int, train: bool
          ) -> tuple[ConfigRecord, dict[str, np.ndarray], np.ndarray]:
    vectors = {"task-id": np.int64, **({"budget": np.int64, "dropped": np.bool_} if train
                                       else {})}
    config, arrays = read_stacked_instruction(content, k, "Mb-SGD", vectors, ["w"])
    return config, arrays, arrays.pop("w")
