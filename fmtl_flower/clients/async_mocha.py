"""ClientApp handlers of barrier-free MOCHA: MOCHA's device with the per-reply commit.

The wire contract is documented in :mod:`fmtl_flower.strategies.async_mocha`. The device is
MOCHA's (:class:`~fmtl_flower.clients.mocha.MochaClient`: the same data loading, validation
and ``whoami``); its ``train`` runs the protocol of
:class:`fmtl_flower.core.async_mocha.AsyncDevice`: commit the pending step scaled by the
factor the server applied (``confirm-gamma``) if ``confirm-id`` names it, else discard it;
restart from alpha = 0 when the committed state is not the server's; evaluate the loss at the
``w`` received; run SDCA; keep the step pending; reply ``delta-b`` and the change of the
conjugate term. The message's optional ``loss`` (``hinge`` when absent) and lifting
(``classes``, ``intercept-scaling``) are synchronous MOCHA's
(:mod:`fmtl_flower.clients.mocha`). The state lives in ``context.state`` (ArrayRecord
``async-mocha.arrays``:
``alpha``, ``pending``; ConfigRecord ``async-mocha.meta``: ``task-id``, ``committed-id`` (-1:
restarted from alpha = 0, not confirmed yet), ``loss`` (state of another loss is not resumed),
``pending-id``, -1 for none; ``stable-id`` and array ``stable``: the stable copy, the
newest committed state not after the ``keep-id`` of the server's newest checkpoint, to go
back to when the server resumes from it). State files (``client-state-dir``) are not supported yet.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..core.async_mocha import AsyncDevice, Request
from ..core.losses import Loss
from ..wire import array_record, config_record, from_array, metric_record, record_dict, reply
from .common import (
    DataLoader,
    LocalTask,
    TaskIdFn,
    client_app_for,
    config_value,
    eval_metrics,
    lifting_of,
    read_instruction,
)
from .mocha import MochaClient, loss_of

STATE_ARRAYS = "async-mocha.arrays"
STATE_META = "async-mocha.meta"


def _device(task: LocalTask, context: Context, loss: Loss) -> AsyncDevice:
    """The task's :class:`AsyncDevice` for ``loss`` with the state kept in ``context.state``
    (fresh when there is none, or it is another task's, size's or loss's)."""
    device = AsyncDevice(task.task_id, task.X, task.y, loss)
    if STATE_META not in context.state or STATE_ARRAYS not in context.state:
        return device
    meta = dict(context.state[STATE_META].items())
    arrays = {k: from_array(v) for k, v in context.state[STATE_ARRAYS].items()}
    if meta.get("task-id") != task.task_id or arrays.get("alpha", np.zeros(0)).shape != (task.n,) \
            or meta.get("loss", "hinge") != loss.name:
        return device
    device.alpha = arrays["alpha"].copy()
    device.committed_id = int(meta["committed-id"])
    if "stable" in arrays and int(meta.get("stable-id", -1)) >= 0:
        device.stable = (int(meta["stable-id"]), arrays["stable"].copy())
    if int(meta["pending-id"]) >= 0:
        device.pending = (int(meta["pending-id"]), arrays["pending"].copy())
    return device


def _keep(device: AsyncDevice, context: Context) -> None:
    pending_id, pending = device.pending if device.pending is not None else (
        -1, np.zeros_like(device.alpha))
    context.state[STATE_ARRAYS] = array_record({"alpha": device.alpha, "pending": pending,
                                                "stable": device.stable[1]})
    context.state[STATE_META] = config_record({"task-id": device.task,
                                               "committed-id": device.committed_id,
                                               "pending-id": pending_id,
                                               "stable-id": device.stable[0],
                                               "loss": device.loss.name})


class AsyncMochaClient(MochaClient):
    """MOCHA's device (data, ``whoami``) with barrier-free MOCHA's ``train`` and
    ``evaluate``; arguments as :class:`~fmtl_flower.clients.mocha.MochaClient`."""

    def train(self, msg: Message, context: Context) -> Message:
        """Commit or discard, evaluate the loss at w, run SDCA, keep the step pending."""
        task = self.local_task(context, lifting_of(msg))
        config, w, _ = read_instruction(msg, task, "AsyncMocha")
        loss = loss_of(config)
        request = Request(
            task=task.task_id, request_id=config_value(config, "request-id", int),
            count=config_value(config, "count", int), version=0, w=w,
            m_tt=config_value(config, "m-tt", float),
            sigma_prime=config_value(config, "sigma-prime", float),
            budget=config_value(config, "budget", int), seed=config_value(config, "seed", int),
            confirm_id=config_value(config, "confirm-id", int),
            confirm_gamma=config_value(config, "confirm-gamma", float),
            method=config_value(config, "method", str),
            theta=config_value(config, "theta", float),
            keep_id=config_value(config, "keep-id", int) if "keep-id" in config else 0,
            loss=loss.name)
        if request.budget < 0 or request.m_tt <= 0 or request.sigma_prime <= 0 \
                or not 0.0 <= request.confirm_gamma <= 1.0:
            raise ValueError("invalid budget/m-tt/sigma-prime/confirm-gamma: "
                             f"{request.budget}, {request.m_tt}, {request.sigma_prime}, "
                             f"{request.confirm_gamma}")
        device = _device(task, context, loss)
        answer = device.handle(request)
        _keep(device, context)
        metrics = {"task-id": task.task_id, "request-id": request.request_id,
                   "delta-dual-mean": answer.delta_dual, "loss-mean": answer.loss_mean,
                   "dual-mean": answer.dual_mean, "steps": answer.steps,
                   "state-ok": int(answer.state_ok)}
        return reply(record_dict({"arrays": array_record({"delta-b": answer.d_b}),
                                  "metrics": metric_record(metrics)}), msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """The loss and test errors at the ``w`` received (the state is not touched)."""
        task = self.local_task(context, lifting_of(msg))
        config, w, _ = read_instruction(msg, task, "AsyncMocha")
        metrics = {"task-id": task.task_id,
                   "loss-mean": loss_of(config).mean_value(task.X, task.y, w)}
        metrics.update(eval_metrics(task, w, config))
        return reply(record_dict({"metrics": metric_record(metrics)}), msg)


def make_async_mocha_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None,
                                labels: str = "pm1") -> ClientApp:
    """A barrier-free MOCHA ClientApp over your own data (as
    :func:`~fmtl_flower.clients.mocha.make_mocha_client_app`, without state files)."""
    client = AsyncMochaClient(load_data, task_id, None, labels)
    app = client_app_for(client)
    app.async_mocha_client = client  # type: ignore[attr-defined]  # for tests
    return app
