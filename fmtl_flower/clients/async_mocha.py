"""ClientApp handlers of barrier-free MOCHA: MOCHA's device with the per-reply commit.

The wire contract is documented in :mod:`fmtl_flower.strategies.async_mocha`. The device is
MOCHA's (:class:`~fmtl_flower.clients.mocha.MOCHAClient`: the same data loading, validation
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
back to when the server resumes from it); and ``data`` (the fingerprint of the training
data) and ``run`` (the messages' ``run-token``), which bind the state to the data and the
run.

State files: with a ``client-state-dir`` (node config, run config, or the app's
``state_dir``) the same arrays and meta are also written, atomically, to
``<dir>/async-mocha-task-<id>.npz`` after every ``train``, and read back when
``context.state`` holds nothing (a restarted SuperNode, or a new Flower run resuming the
server from a checkpoint): the device then continues from its alpha. A stored state of
another task, size or loss, of other training data, or written by another run (another
``run-token``) is not used (logged): the device starts from alpha = 0 and the commit
protocol resets the task on the server, as for a lost state.

Emulating a slow device: a node started with ``--node-config "emulate-delay-s=2.0"``
(:data:`DELAY_KEY`) sleeps that many seconds in every ``train`` before replying; for
experiments and tests of barrier-free runs on real deployments (e.g. one slow SuperNode on
loopback), never needed otherwise.
"""

from __future__ import annotations

import math
import time
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from ..checkpoint import CheckpointError, read_state_file, write_state_file
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
    run_token,
    state_file_for,
)
from .mocha import MOCHAClient, loss_of

STATE_ARRAYS = "async-mocha.arrays"
STATE_META = "async-mocha.meta"
#: The state files' kind: ``<client-state-dir>/async-mocha-task-<id>.npz``.
STATE_KIND = "async-mocha"
NAME = "AsyncMOCHA"
#: Node-config key: seconds a device sleeps in every ``train`` before replying (emulating a
#: slow device; default none). For experiments and tests only.
DELAY_KEY = "emulate-delay-s"


def _stored(task: LocalTask, context: Context, path: Path | None
            ) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The task's stored state ``(arrays, meta)``: ``context.state``'s records, else (a new
    ClientApp context: a restarted SuperNode, or a new run) the state file's, put back into
    ``context.state``; None when there is none (an unreadable file is logged)."""
    if STATE_META not in context.state or STATE_ARRAYS not in context.state:
        if path is None or not path.exists():
            return None
        try:
            arrays, meta = read_state_file(path)
        except CheckpointError as err:
            log(WARNING, "%s task %d: state file unusable (%s); starting from alpha = 0", NAME,
                task.task_id, err)
            return None
        context.state[STATE_ARRAYS] = array_record(arrays)
        context.state[STATE_META] = config_record(meta)
    meta = dict(context.state[STATE_META].items())
    arrays = {k: from_array(v) for k, v in context.state[STATE_ARRAYS].items()}
    return arrays, meta


def _unusable(task: LocalTask, arrays: dict[str, np.ndarray], meta: dict[str, Any],
              loss: Loss, run: str | None) -> str:
    """Why the stored state cannot be resumed ("" if it can): ``other task`` (another task's,
    size's or loss's), ``data changed`` (another data fingerprint) or ``other run`` (another
    ``run-token``: a ``client-state-dir`` shared by two runs)."""
    shapes_ok = all(arrays.get(k, np.zeros(0)).shape == (task.n,)
                    for k in ("alpha", "pending", "stable"))
    if meta.get("task-id") != task.task_id or not shapes_ok \
            or meta.get("loss", "hinge") != loss.name:
        return "other task"
    if meta.get("data") != task.fingerprint:
        return "data changed"
    if run is not None and meta.get("run") != run:
        return "other run"
    return ""


def _device(task: LocalTask, context: Context, loss: Loss, run: str | None,
            path: Path | None) -> AsyncDevice:
    """The task's :class:`AsyncDevice` for ``loss`` with its stored state (:func:`_stored`);
    fresh (alpha = 0, nothing committed) when there is none or it cannot be resumed
    (:func:`_unusable`, logged: the commit protocol then restarts the task, and the server
    resets b_t, unless the server holds nothing of it yet)."""
    device = AsyncDevice(task.task_id, task.X, task.y, loss)
    stored = _stored(task, context, path)
    if stored is None:
        return device
    arrays, meta = stored
    note = _unusable(task, arrays, meta, loss, run)
    if note == "other run":
        log(WARNING, "%s task %d: the stored state was written by another run (another "
            "run-token: a client-state-dir shared by two runs, or another server); not used: "
            "starting from alpha = 0", NAME, task.task_id)
    elif note == "data changed":
        log(WARNING, "%s task %d: the stored state belongs to other training data; not "
            "used: starting from alpha = 0", NAME, task.task_id)
    if note:
        return device
    device.alpha = arrays["alpha"].copy()
    device.committed_id = int(meta["committed-id"])
    if int(meta.get("stable-id", -1)) >= 0:
        device.stable = (int(meta["stable-id"]), arrays["stable"].copy())
    if int(meta["pending-id"]) >= 0:
        device.pending = (int(meta["pending-id"]), arrays["pending"].copy())
    return device


def _keep(device: AsyncDevice, task: LocalTask, context: Context, run: str | None,
          path: Path | None) -> None:
    """Store the device's state in ``context.state`` and, with a ``client-state-dir``, in
    its state file (atomic), bound to the data, the loss and the run."""
    pending_id, pending = device.pending if device.pending is not None else (
        -1, np.zeros_like(device.alpha))
    arrays = {"alpha": device.alpha, "pending": pending, "stable": device.stable[1]}
    meta: dict[str, int | str] = {"task-id": device.task, "committed-id": device.committed_id,
                                  "pending-id": pending_id, "stable-id": device.stable[0],
                                  "loss": device.loss.name, "data": task.fingerprint}
    if run is not None:
        meta["run"] = run
    context.state[STATE_ARRAYS] = array_record(arrays)
    context.state[STATE_META] = config_record(meta)
    if path is not None:
        write_state_file(path, arrays, meta)


def _emulate_slow_device(context: Context) -> None:
    """Sleep the node config's :data:`DELAY_KEY` seconds (none: no delay): a documented
    setting for experiments and tests that need a slow device on a real deployment."""
    if DELAY_KEY not in context.node_config:
        return
    delay = float(context.node_config[DELAY_KEY])
    if not (math.isfinite(delay) and delay >= 0):
        raise ValueError(f"node config {DELAY_KEY} must be a number >= 0, got {delay}")
    time.sleep(delay)


class AsyncMOCHAClient(MOCHAClient):
    """MOCHA's device (data, ``whoami``) with barrier-free MOCHA's ``train`` and
    ``evaluate``; arguments as :class:`~fmtl_flower.clients.mocha.MOCHAClient`."""

    def train(self, msg: Message, context: Context) -> Message:
        """Commit or discard, evaluate the loss at w, run SDCA, keep the step pending."""
        task = self.local_task(context, lifting_of(msg))
        config, w, _ = read_instruction(msg, task, "AsyncMOCHA")
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
        run = run_token(config)
        _emulate_slow_device(context)
        path = state_file_for(context, STATE_KIND, task.task_id, self._state_dir)
        device = _device(task, context, loss, run, path)
        answer = device.handle(request)
        _keep(device, task, context, run, path)
        metrics = {"task-id": task.task_id, "request-id": request.request_id,
                   "delta-dual-mean": answer.delta_dual, "loss-mean": answer.loss_mean,
                   "dual-mean": answer.dual_mean, "steps": answer.steps,
                   "state-ok": int(answer.state_ok)}
        return reply(record_dict({"arrays": array_record({"delta-b": answer.d_b}),
                                  "metrics": metric_record(metrics)}), msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """The loss and test errors at the ``w`` received (the state is not touched)."""
        task = self.local_task(context, lifting_of(msg))
        config, w, _ = read_instruction(msg, task, "AsyncMOCHA")
        metrics = {"task-id": task.task_id,
                   "loss-mean": loss_of(config).mean_value(task.X, task.y, w)}
        metrics.update(eval_metrics(task, w, config))
        return reply(record_dict({"metrics": metric_record(metrics)}), msg)


def make_async_mocha_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None,
                                labels: str = "pm1", state_dir: str | None = None
                                ) -> ClientApp:
    """A barrier-free MOCHA ClientApp over your own data (as
    :func:`~fmtl_flower.clients.mocha.make_mocha_client_app`); ``state_dir``: where to keep
    the state files when neither the node config nor the run config sets
    ``client-state-dir`` (None: nowhere)."""
    client = AsyncMOCHAClient(load_data, task_id, state_dir, labels)
    app = client_app_for(client)
    app.async_mocha_client = client  # type: ignore[attr-defined]  # for tests
    return app
