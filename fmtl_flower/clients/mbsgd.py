"""ClientApp handlers of mini-batch SGD (the MOCHA paper's Mb-SGD baseline) on one device.

The wire contract (keys, shapes, dtypes) is documented in :mod:`fmtl_flower.strategies.mbsgd`.
Mb-SGD is a primal method: the device keeps no state between rounds (nothing in
``context.state``). In every round it receives its model w_t, reports the mean loss at w_t
(the hinge's, or the loss the config's ``loss`` names) and sends the *sum* of the loss's
(sub)gradients at w_t over a mini-batch of ``budget``
distinct samples, visited in the order ``coordinate_order(seed, task_id, server_round, n)``
(:func:`fmtl_flower.core.baselines.mbsgd_local_gradient`); the server divides by the count
and adds the regulariser's gradient.

Data loading, validation and the ``whoami`` reply are MOCHA's
(:class:`fmtl_flower.clients.mocha.MOCHAClient`): the same loaders and node configs serve
both strategies.

Build an Mb-SGD ClientApp over your own data with :func:`make_mbsgd_client_app`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..core.baselines import mbsgd_local_gradient
from ..core.rng import coordinate_order
from ..wire import array_record, metric_record, record_dict
from .common import (
    DataLoader,
    LocalTask,
    TaskIdFn,
    client_app_for,
    config_value,
    default_task_id,
    eval_metrics,
    read_instruction,
)
from .mocha import MOCHAClient, loss_of

__all__ = ["MbSGDClient", "default_task_id", "make_mbsgd_client_app"]


class MbSGDClient:
    """Mb-SGD's device-side handlers over a user-supplied data loader.

    Parameters
    ----------
    load_data : callable
        ``load_data(context)`` returns ``(X, y)`` or ``(X, y, X_test, y_test)``: samples as
        rows, labels in {-1, +1}. Called once per node and run, then cached (the loader
        contract of :func:`fmtl_flower.clients.mocha.make_mocha_client_app`).
    task_id : callable, optional
        ``task_id(context) -> int``; default :func:`default_task_id`.
    """

    def __init__(self, load_data: DataLoader, task_id: TaskIdFn | None = None) -> None:
        self._data = MOCHAClient(load_data, task_id)

    # -- data -------------------------------------------------------------------------------
    def local_task(self, context: Context) -> LocalTask:
        """The node's validated task data (loaded once per node and run)."""
        return self._data.local_task(context)

    # -- handlers ---------------------------------------------------------------------------
    def whoami(self, msg: Message, context: Context) -> Message:
        """Reply with the task id and the sizes the server needs (MOCHA's reply, no data)."""
        return self._data.whoami(msg, context)

    def train(self, msg: Message, context: Context) -> Message:
        """Report the loss at w_t and send the summed hinge subgradient over a mini-batch."""
        task = self.local_task(context)
        config, w = self._read_instruction(msg, task)
        server_round = config_value(config, "server-round", int)
        budget = config_value(config, "budget", int)
        seed = config_value(config, "seed", int)
        dropped = config_value(config, "dropped", bool)
        if server_round < 1:
            raise ValueError(f"server-round must be >= 1, got {server_round}")
        if not 0 <= budget <= task.n:
            raise ValueError(f"budget must be in 0..n-train ({task.n}): a mini-batch is a set "
                             f"of distinct samples; got {budget}")
        metrics = self._metrics(task, w, config)
        if dropped or budget == 0:
            grad, count = np.zeros(task.dim), 0
        else:
            order = coordinate_order(seed, task.task_id, server_round, task.n)
            grad, count = mbsgd_local_gradient(task.X, task.y, w, budget=budget, order=order,
                                               loss=loss_of(config))
        metrics["round"] = server_round
        metrics["count"] = int(count)
        reply = record_dict({"arrays": array_record({"grad": grad}),
                             "metrics": metric_record(metrics)})
        return Message(reply, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Report the mean hinge loss (and with ``eval``, the test errors) at w_t."""
        task = self.local_task(context)
        config, w = self._read_instruction(msg, task)
        metrics = self._metrics(task, w, config)
        metrics["round"] = config_value(config, "server-round", int)
        return Message(record_dict({"metrics": metric_record(metrics)}), reply_to=msg)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _read_instruction(msg: Message, task: LocalTask) -> tuple[dict[str, Any], np.ndarray]:
        return read_instruction(msg, task, "Mb-SGD")[:2]

    @staticmethod
    def _metrics(task: LocalTask, w: np.ndarray,
                 config: Mapping[str, Any]) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "task-id": task.task_id,
            "n-train": task.n,
            "loss-mean": loss_of(config).mean_value(task.X, task.y, w),
        }
        out.update(eval_metrics(task, w, config))
        return out


def make_mbsgd_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None) -> ClientApp:
    """Build a ready Mb-SGD ClientApp over your own data.

    Parameters
    ----------
    load_data : callable
        ``load_data(context) -> (X, y)`` or ``(X, y, X_test, y_test)`` for this node.
    task_id : callable, optional
        ``task_id(context) -> int``; default: node config ``task-id``, else ``partition-id``.

    Examples
    --------
    >>> app = make_mbsgd_client_app(lambda ctx: my_arrays(ctx.node_config["partition-id"]))
    """
    client = MbSGDClient(load_data, task_id)
    app = client_app_for(client)
    app.mbsgd_client = client  # type: ignore[attr-defined]  # for tests and introspection
    return app
