"""ClientApp handlers of MOCHA: whoami, local SDCA training and evaluation on one device.

The wire contract (keys, shapes, dtypes) is documented in :mod:`fmtl_flower.strategies.mocha`.
A device keeps its dual variables alpha in ``context.state`` (ArrayRecord ``mocha.arrays``:
``duals`` float64 (3, n) = [committed alpha; pending d_alpha; stable alpha], ConfigRecord
``mocha.meta``: ``task-id``, ``committed-round``, ``pending-round``, ``stable-round`` (-1:
none; the stable copy is the newest committed alpha not after the server's newest
checkpoint), ``data`` (a fingerprint of the training data X, y and, for a loss other than the
hinge, of the loss: state kept for other data or another loss is never resumed) and never
sends them; it sends only ``delta-b = X^T d_alpha / n`` (d floats) and a few scalars.

The loss. The message's optional ``loss`` (``hinge`` when absent; :mod:`fmtl_flower.core.
losses`) chooses the local solver's coordinate step and what ``loss-mean`` and ``dual-mean``
report: the mean loss at w_t and the mean dual term D(y * alpha) = -l*(-y * alpha).

Dual commit protocol (design decision 4). The device keeps its newest ``d_alpha`` *pending*
with the round that produced it. Every message carries ``last-accepted-round`` L, the newest
round whose reply from this task the server added to B. On receipt the device commits the
pending change if its round equals L and discards it otherwise; if the committed round then
differs from L (state lost, reverted, or from another run) the device restarts from
alpha = 0 and says so (``state-ok = 0``), and the server resets b_t = 0. So alpha on the
device and b_t on the server never drift apart, whatever is lost.

Device state that outlives a run. Flower scopes ``context.state`` to one run, and a server
resumed from its checkpoint is a new run. With ``client-state-dir`` set (node config in a
deployment: ``--node-config "task-id=3 client-state-dir=/var/lib/fmtl"``; run config in a
simulation), the device also writes its dual state to ``<dir>/mocha-task-<id>.npz``
(atomically, no pickle; :mod:`fmtl_flower.checkpoint`) after every message, and reads it when
``context.state`` is empty. The commit protocol then reconciles it with the resumed server:
state newer or older than the server's ``last-accepted-round`` is reset, never mixed.

Record-level DP (a message with ``dp-clip``; :mod:`fmtl_flower.core.record_dp`). The device
releases ``delta-b`` plus noise, so the server's b_t is the true X^T alpha / n plus e_t, the
sum of the noises of the device's *accepted* replies. The commit protocol then tracks the
vector [alpha; e_t] (n + d entries, :func:`state_width`; ``duals`` is (3, n + d)): the
round's noise is kept pending with its d_alpha and committed, rolled back, checkpointed and
reset with it, so e_t is exactly the noise in the server's b_t. The device evaluates (test
errors) the model **without its own noise**, w_t - m_tt e_t = sum_{s != t} b~_s M_st +
b_t M_tt (:func:`~fmtl_flower.core.record_dp.own_noise_free`): post-processing of what it
holds, nothing more is sent. Its training step stays at the w_t it was sent (the step's
sensitivity uses public numbers only).

Build a MOCHA ClientApp over your own data with :func:`make_mocha_client_app`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..core.baselines import cocoa_local_update, mbsdca_local_update
from ..core.losses import LOSSES, Loss, get_loss
from ..core.multiclass import Lifting, label_values
from ..core.privacy import check_noise_multiplier
from ..core.record_dp import (
    SEPARABLE_STEP_METHODS,
    check_clip,
    clip_rows,
    noise_rng,
    noisy_release,
    own_noise_free,
    record_contribution,
    release_sensitivity,
    separable_m_tt,
    step_curvature,
)
from ..core.rng import coordinate_order
from ..core.sdca import sdca_local_update
from ..wire import array_record, config_record, metric_record, record_dict, reply
from .common import (  # DataLoader, LocalTask, TaskIdFn, default_task_id: re-exported
    DataLoader,
    DeviceData,
    LocalTask,
    TaskIdFn,
    client_app_for,
    config_value,
    default_task_id,
    eval_metrics,
    hinge_labels,
    lifting_of,
    prepare_task,
    read_instruction,
    use_kernel_cache,
)
from .dual_seed import read_seed_target, seed_duals
from .dual_state import DualState, DualStore

STATE_ARRAYS = "mocha.arrays"
STATE_META = "mocha.meta"
BINARY = Lifting()  # today's binary labels, no intercept


def loss_of(config: Mapping[str, Any]) -> Loss:
    """The loss a MOCHA instruction names (``loss``; the hinge when absent); ValueError
    naming the valid losses for any other value."""
    if "loss" not in config:
        return LOSSES["hinge"]
    return get_loss(config_value(config, "loss", str))


def for_loss(task: LocalTask, loss: Loss) -> LocalTask:
    """``task`` with its dual state bound to ``loss`` too: the data's fingerprint, plus the
    loss's name for a loss other than the hinge (a dual of one loss is never continued under
    another; the hinge keeps the bare data fingerprint, so state written before the loss
    family existed stays usable)."""
    if loss.name == "hinge":
        return task
    return dataclasses.replace(task, fingerprint=f"{task.fingerprint}/{loss.name}")


@dataclasses.dataclass(frozen=True)
class RecordRelease:
    """Record-level DP as a message asks it (``dp-clip`` C, ``dp-noise-multiplier`` z;
    :mod:`fmtl_flower.core.record_dp`)."""

    clip: float
    noise_multiplier: float


def record_dp_of(config: Mapping[str, Any]) -> RecordRelease | None:
    """The message's record-level DP (None when it carries no ``dp-clip``); ValueError for
    a bad value."""
    if "dp-clip" not in config:
        return None
    return RecordRelease(
        check_clip(config_value(config, "dp-clip", float)),
        check_noise_multiplier(config_value(config, "dp-noise-multiplier", float),
                               "dp-noise-multiplier"))


def private_task(task: LocalTask, clip: float) -> LocalTask:
    """``task`` with its training rows clipped to norm ``clip`` (the data record-level DP
    trains on), its dual state bound to the clipping too (the test rows unchanged)."""
    X = clip_rows(task.X, clip)
    return dataclasses.replace(task, X=X, sqnorm=np.einsum("ij,ij->i", X, X),
                               fingerprint=f"{task.fingerprint}/dp-clip={clip!r}")


def release(task: LocalTask, d_b: np.ndarray, config: Mapping[str, Any], steps: int,
            server_round: int, noise_seed: int | None, *, w: np.ndarray, m_tt: float,
            sigma_p: float) -> np.ndarray:
    """What the device sends for ``d_b``: itself, or under record-level DP ``d_b`` plus
    Gaussian noise calibrated to one record (:func:`~fmtl_flower.core.record_dp.
    release_sensitivity` of the step's :func:`~fmtl_flower.core.record_dp.
    record_contribution` at the w, m_tt and sigma' received; no noise on a round without
    work: nothing is released)."""
    dp = record_dp_of(config)
    if dp is None or steps == 0:
        return d_b
    method = config_value(config, "method", str) if "method" in config else "mocha"
    scale = config_value(config, "gamma", float) if "gamma" in config else 1.0
    if method == "mb-sdca":
        scale *= config_value(config, "scale", float)
    loss = loss_of(config)
    contribution = record_contribution(
        dp.clip, task.n, loss.dual_radius, step_curvature(method, m_tt, sigma_p, steps),
        float(np.linalg.norm(w)), loss.name)
    sensitivity = release_sensitivity(dp.clip, task.n, loss.dual_radius, scale,
                                      contribution) * task.blocks  # a record: `blocks` rows
    return noisy_release(d_b, sensitivity, dp.noise_multiplier,
                         noise_rng(noise_seed, task.task_id, server_round))


def state_width(task: LocalTask, config: Mapping[str, Any]) -> int:
    """The entries of the vector the commit protocol tracks for ``task``: its n duals, and
    under record-level DP also its accepted noise e_t (``task.dim`` entries, after the
    duals)."""
    return task.n + (task.dim if record_dp_of(config) is not None else 0)


def split_state(tracked: np.ndarray, task: LocalTask) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, e_t)`` of a tracked vector (:func:`state_width`); e_t is empty without
    record-level DP."""
    return tracked[:task.n], tracked[task.n:]


def pending_change(d_alpha: np.ndarray, released: np.ndarray, d_b: np.ndarray,
                   noise: np.ndarray) -> np.ndarray:
    """What the commit protocol keeps pending for a round: ``d_alpha``, and under
    record-level DP (``noise`` non-empty: the tracked e_t) also the noise the reply carries,
    ``released - d_b``, committed into e_t if the server accepts the reply and dropped with
    ``d_alpha`` if not."""
    if noise.size == 0:
        return d_alpha
    return np.concatenate([d_alpha, released - d_b])


def noise_seed_of(context: Context) -> int | None:
    """The device's own noise seed (node config ``dp-noise-seed``: tests and reproducible
    experiments only), else None (the operating system's entropy)."""
    value = context.node_config.get("dp-noise-seed")
    return None if value is None or value == "" else int(value)


class MOCHAClient:
    """MOCHA's device-side handlers over a user-supplied data loader.

    Parameters
    ----------
    load_data : callable
        ``load_data(context)`` returns ``(X, y)`` or ``(X, y, X_test, y_test)``: samples as
        rows, labels in {-1, +1}. Called once per node and run, then cached.
    task_id : callable, optional
        ``task_id(context) -> int``; default :func:`default_task_id`.
    state_dir : str, optional
        Where to keep the device's state file when neither the node config nor the run config
        sets ``client-state-dir`` (None: nowhere).
    labels : {"pm1", "auto"}, default "pm1"
        ``pm1``: the loader's labels must be -1/+1; ``auto``: 0/1 are taken too, as -1/+1
        (:func:`~fmtl_flower.clients.common.hinge_labels`).
    """

    def __init__(self, load_data: DataLoader, task_id: TaskIdFn | None = None,
                 state_dir: str | None = None, labels: str = "pm1") -> None:
        hinge_labels(np.zeros(0), labels)  # a bad value fails here, not on the first message
        self._labels = labels
        self._state_dir = state_dir or None
        self._load_data = load_data
        self._task_id = task_id or default_task_id
        self._data: dict[tuple[int, int], DeviceData] = {}
        self._cache: dict[tuple[int, int, int, Lifting], LocalTask] = {}
        self._duals = DualStore("mocha", "MOCHA", self._state_dir)
        self._clipped: dict[tuple[int, float], tuple[LocalTask, LocalTask]] = {}

    # -- data -------------------------------------------------------------------------------
    def local_task(self, context: Context, lifting: Lifting = BINARY) -> LocalTask:
        """The node's validated task data as ``lifting`` makes it (default: today's binary
        labels, no intercept), loaded once per node and run, prepared once per lifting."""
        return self.prepared_task(self.device_data(context), context, lifting)

    def device_data(self, context: Context) -> DeviceData:
        """The node's checked data, labels as loaded (loaded once per node and run)."""
        key = (int(context.run_id), int(context.node_id))
        data = self._data.get(key)
        if data is None:
            use_kernel_cache(context, self._state_dir)  # before any kernel runs
            data = self._load_device_data(context)
            if len(self._data) > 4096:
                self._data.clear()
            self._data[key] = data
        return data

    def prepared_task(self, data: DeviceData, context: Context,
                      lifting: Lifting = BINARY) -> LocalTask:
        """``data`` as ``lifting`` makes it (:func:`~.common.prepare_task`), kept per node,
        run, task and lifting."""
        key = (int(context.run_id), int(context.node_id), data.task_id, lifting)
        task = self._cache.get(key)
        if task is None:
            task = prepare_task(data, lifting, self._labels)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = task
        return task

    def dp_task(self, task: LocalTask, config: Mapping[str, Any]) -> LocalTask:
        """``task``, or under record-level DP its rows clipped (:func:`private_task`, kept
        while ``task`` is the same object)."""
        dp = record_dp_of(config)
        if dp is None:
            return task
        key = (id(task), dp.clip)
        kept = self._clipped.get(key)
        if kept is None or kept[0] is not task:
            if len(self._clipped) > 4096:
                self._clipped.clear()
            kept = self._clipped[key] = (task, private_task(task, dp.clip))
        return kept[1]

    def _load_device_data(self, context: Context) -> DeviceData:
        return DeviceData.of(int(self._task_id(context)), self._load_data(context))

    def _build_task(self, context: Context) -> LocalTask:
        """The node's binary task (today's labels, no intercept), not cached."""
        return prepare_task(self._load_device_data(context), BINARY, self._labels)

    def whoami_info(self, data: DeviceData, context: Context) -> dict[str, Any]:
        """The ``whoami`` reply's values: the task's sizes as loaded (the server lifts them,
        :class:`~fmtl_flower.core.multiclass.Lifting`) and, with ``labels="auto"``, the
        labels the device holds (``classes``, train and test: the run's class list is
        agreed from them). ``labels="pm1"``: the labels are checked to be -1/+1 first."""
        if self._labels == "pm1":
            self.prepared_task(data, context)  # today's check: labels -1/+1, else an error
        info: dict[str, Any] = {
            "task-id": data.task_id, "n-train": int(data.X.shape[0]),
            "n-test": int(data.X_test.shape[0]), "dim": int(data.X.shape[1]),
            "max-row-norm": float(np.sqrt(np.einsum("ij,ij->i", data.X, data.X).max()))}
        clip = _record_dp_clip(context)
        if clip is not None:  # record-level DP: the rows' bound, not a statistic of them
            info["max-row-norm"] = clip
        if self._labels == "auto":
            info["classes"] = label_values(data.labels, data.labels_test)
        return info

    # -- handlers ---------------------------------------------------------------------------
    def whoami(self, msg: Message, context: Context) -> Message:
        """Reply with the task id and the sizes the server needs (no data)."""
        info = self.whoami_info(self.device_data(context), context)
        return reply(record_dict({"info": config_record(info)}), msg)

    def train(self, msg: Message, context: Context) -> Message:
        """Commit or roll back, report the objective's sums, run local SDCA, reply d_b."""
        task = self.local_task(context, lifting_of(msg))
        config, w, arrays = self._read_instruction(msg, task)
        loss = loss_of(config)
        task = self.dp_task(for_loss(task, loss), config)
        server_round = config_value(config, "server-round", int)
        budget = config_value(config, "budget", int)
        m_tt = config_value(config, "m-tt", float)
        sigma_p = config_value(config, "sigma-prime", float)
        seed = config_value(config, "seed", int)
        dropped = config_value(config, "dropped", bool)
        if budget < 0 or m_tt <= 0 or sigma_p <= 0:
            raise ValueError(f"invalid budget/m-tt/sigma-prime: {budget}, {m_tt}, {sigma_p}")
        if config_value(config, "last-accepted-round", int) >= server_round:
            raise ValueError("last-accepted-round must precede server-round in a train message")
        state = self._reconcile(context, task, config)
        alpha, noise = split_state(state.alpha, task)
        metrics = self._metrics(task, w, alpha, config, state.ok,
                                own_noise_free(w, m_tt, noise))
        method = config_value(config, "method", str) if "method" in config else "mocha"
        steps = 0 if dropped else budget
        target = read_seed_target(arrays, task.dim)  # initial_arrays
        if target is not None and steps and record_dp_of(config) is not None:
            raise ValueError("record-level DP does not cover the seeding round")
        if target is not None and steps:  # the seeding round: no solver, the seed step
            d_alpha, d_b, steps = seed_duals(task, alpha, *target, m_tt=m_tt, seed=seed,
                                             server_round=server_round, loss=loss)
        elif steps == 0:
            d_alpha, d_b = np.zeros(task.n), np.zeros(task.dim)
        else:
            d_alpha, d_b, steps = self._local_update(method, task, alpha, w, config, budget,
                                                     m_tt, sigma_p, seed, server_round)
        metrics["round"] = server_round
        metrics["steps"] = steps
        released = release(task, d_b, config, steps, server_round, noise_seed_of(context),
                           w=w, m_tt=m_tt, sigma_p=sigma_p)
        content = record_dict({"arrays": array_record({"delta-b": released}),  # its own
                               "metrics": metric_record(metrics, handed_over=True)},
                              handed_over=True)
        pending = pending_change(d_alpha, released, d_b, noise)
        self._write_state(context, task, state, pending, server_round)  # last
        return reply(content, msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Commit or roll back, then report the objective's sums and test errors at w_t."""
        task = self.local_task(context, lifting_of(msg))
        config, w, _ = self._read_instruction(msg, task)
        task = self.dp_task(for_loss(task, loss_of(config)), config)
        state = self._reconcile(context, task, config)
        alpha, noise = split_state(state.alpha, task)
        model = w if noise.size == 0 else own_noise_free(
            w, config_value(config, "m-tt", float), noise)
        metrics = self._metrics(task, w, alpha, config, state.ok, model)
        metrics["round"] = config_value(config, "server-round", int)
        self._write_state(context, task, state, None, -1)
        return reply(record_dict({"metrics": metric_record(metrics, handed_over=True)},
                                 handed_over=True), msg)

    @staticmethod
    def _local_update(method: str, task: LocalTask, alpha: np.ndarray, w: np.ndarray,
                      config: Mapping[str, Any], budget: int, m_tt: float, sigma_p: float,
                      seed: int, server_round: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The local solver of ``method`` for the instruction's loss; returns (d_alpha, d_b,
        steps done), scaled."""
        order = coordinate_order(seed, task.task_id, server_round, task.n)
        loss = loss_of(config)
        if record_dp_of(config) is not None and method in SEPARABLE_STEP_METHODS:
            steps = min(budget, task.n)  # the separable step; CoCoA: no theta stop
            d_alpha, d_b = mbsdca_local_update(
                task.X, task.y, alpha, w, m_tt=separable_m_tt(m_tt, sigma_p, steps),
                budget=steps, order=order, sqnorm=task.sqnorm, loss=loss)
        elif record_dp_of(config) is not None and method != "mb-sdca":
            raise ValueError(f"record-level DP covers methods mocha, cocoa and mb-sdca, "
                             f"not {method!r}")
        elif method == "mocha":
            d_alpha, d_b = sdca_local_update(
                task.X, task.y, alpha, w, budget=budget, m_tt=m_tt, sigma_prime=sigma_p,
                order=order, sqnorm=task.sqnorm, loss=loss)
            steps = budget
        elif method == "cocoa":
            theta = config_value(config, "theta", float)
            d_alpha, d_b, steps, _ = cocoa_local_update(
                task.X, task.y, alpha, w, m_tt=m_tt, sigma_prime=sigma_p, theta=theta,
                max_steps=budget, order=order, sqnorm=task.sqnorm, loss=loss)
        elif method == "mb-sdca":
            scale = config_value(config, "scale", float)
            if not 0.0 <= scale <= 1.0:
                raise ValueError(f"scale must be in [0, 1], got {scale}")
            steps = min(budget, task.n)
            d_alpha, d_b = mbsdca_local_update(task.X, task.y, alpha, w, m_tt=m_tt,
                                               budget=steps, order=order, sqnorm=task.sqnorm,
                                               loss=loss)
            d_alpha, d_b = scale * d_alpha, scale * d_b
        else:
            raise ValueError(f"unknown method {method!r}")
        gamma = config_value(config, "gamma", float) if "gamma" in config else 1.0
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if gamma != 1.0:  # aggregation parameter (appendix D.1): apply a gamma-step
            d_alpha, d_b = gamma * d_alpha, gamma * d_b
        return d_alpha, d_b, int(steps)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _read_instruction(msg: Message, task: LocalTask
                          ) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
        return read_instruction(msg, task, "MOCHA")

    def _reconcile(self, context: Context, task: LocalTask,
                   config: Mapping[str, Any]) -> DualState:
        """Apply the dual commit protocol (:mod:`fmtl_flower.clients.dual_state`) to the
        stored state, read from the state file when ``context.state`` is empty."""
        return self._duals.reconcile(context, task.task_id, state_width(task, config),
                                     task.fingerprint, config)

    @staticmethod
    def _metrics(task: LocalTask, w: np.ndarray, alpha: np.ndarray, config: Mapping[str, Any],
                 state_ok: bool, model: np.ndarray | None = None) -> dict[str, int | float]:
        """The reply's metrics: the instruction's loss's ``loss-mean`` at w_t and
        ``dual-mean`` at alpha (:mod:`fmtl_flower.core.losses`), and the test errors of
        ``model`` (default w_t; under record-level DP the device's model without its own
        noise, :func:`~fmtl_flower.core.record_dp.own_noise_free`)."""
        loss = loss_of(config)
        private = record_dp_of(config) is not None  # record-level DP: withheld, sent as 0
        out: dict[str, int | float] = {
            "task-id": task.task_id,
            "n-train": task.n,
            "state-ok": int(state_ok),
            "loss-mean": 0.0 if private else loss.mean_value(task.X, task.y, w),
            "dual-mean": 0.0 if private else loss.dual_mean(alpha, task.y),
        }
        out.update(eval_metrics(task, w if model is None else model, config))
        return out

    def _write_state(self, context: Context, task: LocalTask, state: DualState,
                     pending: np.ndarray | None, pending_round: int) -> None:
        self._duals.write(context, task.task_id, task.fingerprint, state, pending,
                          pending_round)


def _record_dp_clip(context: Context) -> float | None:
    """``dp.clip`` of a run configured with ``dp.mechanism = record`` (whoami then reports
    it as the rows' bound), else None."""
    config = context.run_config
    if config.get("dp.mechanism") != "record" or not config.get("dp.clip"):
        return None
    return check_clip(float(config["dp.clip"]))


def make_mocha_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None,
                          state_dir: str | None = None, labels: str = "pm1") -> ClientApp:
    """Build a ready MOCHA ClientApp over your own data.

    Parameters
    ----------
    load_data : callable
        ``load_data(context) -> (X, y)`` or ``(X, y, X_test, y_test)`` for this node.
    task_id : callable, optional
        ``task_id(context) -> int``; default: node config ``task-id``, else ``partition-id``.
    state_dir : str, optional
        Default ``client-state-dir`` (device state files that survive a server restart).
    labels : {"pm1", "auto"}, default "pm1"
        ``auto`` takes labels 0/1 as -1/+1 (``pm1``: they must be -1/+1).

    Examples
    --------
    >>> app = make_mocha_client_app(lambda ctx: my_arrays(ctx.node_config["partition-id"]))
    """
    client = MOCHAClient(load_data, task_id, state_dir, labels)
    app = client_app_for(client)
    app.mocha_client = client  # type: ignore[attr-defined]  # for tests and introspection
    return app
