"""ClientApp handlers of OFMTL: MOCHA's handlers plus the newcomer's and a model evaluation.

A device that joins a running federation solves its own single-task subproblem
(:mod:`fmtl_flower.core.ofmtl`) from two quantities the server sends, omega (a float) and c
(d floats), and returns its model w (d floats): the only data that leave it. Its dual
variables alpha stay in ``context.state`` (ArrayRecord ``ofmtl.arrays``: ``alpha``;
ConfigRecord ``ofmtl.meta``: ``task-id``, ``step``), so that the protocol's steps continue
the same dual solution. A device whose state does not hold step s - 1 when step s arrives
(lost, or from another run) restarts from alpha = 0 and says so (``state-ok`` 0).

The existing devices of the federation are MOCHA devices (:class:`MOCHAClient`); they are
never contacted while a newcomer joins.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..core.hinge import classification_errors
from ..core.ofmtl import newcomer_duality_gap, newcomer_fit
from ..wire import from_array, to_array
from .common import DataLoader, LocalTask, TaskIdFn, config_value
from .mocha import MOCHAClient

STATE_ARRAYS = "ofmtl.arrays"
STATE_META = "ofmtl.meta"
NEWCOMER_ACTION = "ofmtl"


class OFMTLClient(MOCHAClient):
    """MOCHA's device handlers plus ``train.ofmtl`` (newcomer step) and ``evaluate.ofmtl``
    (test errors of a model the server sends)."""

    def newcomer(self, msg: Message, context: Context) -> Message:
        """One step of the newcomer protocol: continue SDCA on the single-task subproblem
        with the (omega, c) received, for ``inner-rounds`` rounds; reply w."""
        task = self.local_task(context)
        config = self._check_task(msg, task)
        step = config_value(config, "step", int)
        inner = config_value(config, "inner-rounds", int)
        omega = config_value(config, "omega", float)
        lam = config_value(config, "lambda", float)
        if step < 0 or inner < 0:
            raise ValueError("step and inner-rounds must be >= 0")
        c = self._vector(msg, "c", task.dim)
        alpha, state_ok = self._stored_alpha(context, task, step)
        fit = newcomer_fit(task.X, task.y, omega=omega, c=c, lam=lam, rounds=inner,
                           local_frac=config_value(config, "local-frac", float),
                           seed=config_value(config, "seed", int), task_id=task.task_id,
                           alpha=alpha, first_round=step * inner + 1, track_gap=False)
        gap = newcomer_duality_gap(task.X, task.y, fit.alpha, omega=omega, c=c, lam=lam)
        context.state[STATE_ARRAYS] = ArrayRecord({"alpha": to_array(fit.alpha)})
        context.state[STATE_META] = ConfigRecord({"task-id": task.task_id, "step": step})
        metrics = MetricRecord({"task-id": task.task_id, "step": step, "n-train": task.n,
                                "state-ok": int(state_ok), "gap": float(gap)})
        return Message(RecordDict({"arrays": ArrayRecord({"w": to_array(fit.w)}),
                                   "metrics": metrics}), reply_to=msg)

    def evaluate_model(self, msg: Message, context: Context) -> Message:
        """Test errors of the model ``w`` the server sends (no state is touched)."""
        task = self.local_task(context)
        config = self._check_task(msg, task)
        w = self._vector(msg, "w", task.dim)
        errors = classification_errors(task.X_test, task.y_test, w) if task.X_test.shape[0] else 0
        metrics = MetricRecord({"task-id": task.task_id,
                                "round": config_value(config, "server-round", int),
                                "test-errors": int(errors),
                                "test-n": int(task.X_test.shape[0])})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    @staticmethod
    def _check_task(msg: Message, task: LocalTask) -> ConfigRecord:
        if "config" not in msg.content:
            raise ValueError("message lacks the 'config' record")
        config = msg.content["config"]
        if config_value(config, "task-id", int) != task.task_id:
            raise ValueError(f"message for task {config['task-id']} reached task "
                             f"{task.task_id}")
        return config

    @staticmethod
    def _vector(msg: Message, name: str, dim: int) -> np.ndarray:
        """The message's array ``name``: finite, of shape ``(dim,)``, float64."""
        arrays = msg.content["arrays"] if "arrays" in msg.content else None
        if arrays is None or name not in arrays:
            raise ValueError(f"array {name!r} missing")
        v = np.asarray(from_array(arrays[name]), dtype=np.float64)
        if v.shape != (dim,) or not np.all(np.isfinite(v)):
            raise ValueError(f"{name!r} must be finite of shape ({dim},), got {v.shape}")
        return v

    @staticmethod
    def _stored_alpha(context: Context, task: LocalTask, step: int
                      ) -> tuple[np.ndarray | None, bool]:
        """The alpha of step - 1 (None at step 0); (None, False) when the state lags."""
        if step == 0:
            return None, True
        if STATE_META not in context.state or STATE_ARRAYS not in context.state:
            return None, False
        meta = context.state[STATE_META]
        if meta.get("task-id") != task.task_id or meta.get("step") != step - 1:
            return None, False
        try:
            alpha = np.array(from_array(context.state[STATE_ARRAYS]["alpha"]), dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return None, False
        y = task.y
        ya = y * alpha
        if alpha.shape != (task.n,) or not np.all(np.isfinite(alpha)) or np.any(ya < -1e-12) \
                or np.any(ya > 1 + 1e-12):
            return None, False
        return np.clip(ya, 0.0, 1.0) * y, True


def make_ofmtl_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None) -> ClientApp:
    """A ClientApp serving MOCHA's messages and OFMTL's newcomer protocol over ``load_data``."""
    return ofmtl_routes(OFMTLClient(load_data, task_id))


def ofmtl_routes(client: OFMTLClient, app: ClientApp | None = None) -> ClientApp:
    """Register ``client``'s MOCHA and OFMTL handlers on ``app`` (a new one by default)."""
    app = app or ClientApp()
    app.query("whoami")(client.whoami)
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    app.train(NEWCOMER_ACTION)(client.newcomer)
    app.evaluate(NEWCOMER_ACTION)(client.evaluate_model)
    return app


__all__ = ["NEWCOMER_ACTION", "OFMTLClient", "make_ofmtl_client_app", "ofmtl_routes"]
