"""ClientApp handlers of OFMTL: MOCHA's handlers plus the newcomer's and a model evaluation.

A device that joins a running federation solves its own single-task subproblem
(:mod:`fmtl_flower.core.ofmtl`) from two quantities the server sends, omega (a float) and c
(d floats), and returns its model w (d floats): the only data that leave it. Its dual
variables alpha stay in ``context.state`` (ArrayRecord ``ofmtl.arrays``: ``alpha``;
ConfigRecord ``ofmtl.meta``: ``task-id``, ``step``), so that the protocol's steps continue
the same dual solution. A device whose state does not hold step s - 1 when step s arrives
(lost, or from another run, or of another loss) restarts from alpha = 0 and says so
(``state-ok`` 0).

The loss: ``train.ofmtl`` carries the run's ``loss`` as MOCHA's messages do (absent: the
hinge; :func:`fmtl_flower.clients.mocha.loss_of`); the newcomer's subproblem, its dual
variables' domain and its ``gap`` are that loss's. Record-level DP is for the hinge only
(its sensitivity argument, :mod:`fmtl_flower.core.ofmtl_privacy`).

Record-level DP (a message with ``dp-clip``; :mod:`fmtl_flower.core.ofmtl_privacy`). The
newcomer clips its rows to ``dp-clip``, solves its subproblem as without DP and on to a gap
target, and replies its model plus Gaussian noise calibrated to one record (output
perturbation); ``gap`` is withheld (0). Its state then also holds ``released`` (the w it
replied) and ``own`` (its model, without the noise). ``evaluate.ofmtl`` evaluates ``own``
when the w it is sent is exactly ``released`` (its column, unchanged since), else the w
sent.

The existing devices of the federation are MOCHA devices (:class:`MOCHAClient`); they are
never contacted while a newcomer joins.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..core.hinge import classification_errors
from ..core.losses import LOSSES, Loss
from ..core.ofmtl import newcomer_duality_gap, newcomer_fit
from ..core.ofmtl_privacy import newcomer_noise_rng, private_newcomer_fit
from ..wire import from_array, to_array
from .common import DataLoader, LocalTask, TaskIdFn, config_value
from .mocha import MOCHAClient, loss_of, noise_seed_of, record_dp_of

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
        loss = loss_of(config)
        if record_dp_of(config) is not None:
            if loss.name != "hinge":
                raise ValueError(f"record-level DP is for the hinge loss only, got {loss.name!r}")
            return self._private_newcomer(msg, context, self.dp_task(task, config), config,
                                          c, omega, lam)
        alpha, state_ok = self._stored_alpha(context, task, step, loss)
        fit = newcomer_fit(task.X, task.y, omega=omega, c=c, lam=lam, rounds=inner,
                           local_frac=config_value(config, "local-frac", float),
                           seed=config_value(config, "seed", int), task_id=task.task_id,
                           alpha=alpha, first_round=step * inner + 1, track_gap=False,
                           loss=loss)
        gap = newcomer_duality_gap(task.X, task.y, fit.alpha, omega=omega, c=c, lam=lam,
                                   loss=loss)
        context.state[STATE_ARRAYS] = ArrayRecord({"alpha": to_array(fit.alpha)})
        context.state[STATE_META] = ConfigRecord({"task-id": task.task_id, "step": step,
                                                  **_loss_meta(loss)})
        metrics = MetricRecord({"task-id": task.task_id, "step": step, "n-train": task.n,
                                "state-ok": int(state_ok), "gap": float(gap)})
        return Message(RecordDict({"arrays": ArrayRecord({"w": to_array(fit.w)}),
                                   "metrics": metrics}), reply_to=msg)

    def _private_newcomer(self, msg: Message, context: Context, task: LocalTask,
                          config: ConfigRecord, c: np.ndarray, omega: float, lam: float
                          ) -> Message:
        """The newcomer's step under record-level DP (module docstring); ``task``'s rows
        are clipped."""
        dp = record_dp_of(config)
        step = config_value(config, "step", int)
        alpha, state_ok = self._stored_alpha(context, task, step)
        out = private_newcomer_fit(
            task.X, task.y, omega=omega, c=c, lam=lam,
            rounds=config_value(config, "inner-rounds", int),
            local_frac=config_value(config, "local-frac", float),
            seed=config_value(config, "seed", int), task_id=task.task_id, alpha=alpha,
            first_round=step * config_value(config, "inner-rounds", int) + 1, clip=dp.clip,
            noise_multiplier=dp.noise_multiplier,
            rng=newcomer_noise_rng(noise_seed_of(context), task.task_id, step))
        context.state[STATE_ARRAYS] = ArrayRecord({
            "alpha": to_array(out.alpha), "released": to_array(out.released),
            "own": to_array(out.w)})
        context.state[STATE_META] = ConfigRecord({"task-id": task.task_id, "step": step})
        metrics = MetricRecord({"task-id": task.task_id, "step": step, "n-train": task.n,
                                "state-ok": int(state_ok), "gap": 0.0})  # gap withheld
        return Message(RecordDict({"arrays": ArrayRecord({"w": to_array(out.released)}),
                                   "metrics": metrics}), reply_to=msg)

    @staticmethod
    def _stored_vector(context: Context, name: str, dim: int) -> np.ndarray | None:
        """The state's array ``name`` if it is finite of shape (dim,), else None."""
        if STATE_ARRAYS not in context.state or name not in context.state[STATE_ARRAYS]:
            return None
        try:
            v = np.array(from_array(context.state[STATE_ARRAYS][name]), dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return None
        return v if v.shape == (dim,) and np.all(np.isfinite(v)) else None

    def _model_to_evaluate(self, context: Context, task: LocalTask, w: np.ndarray
                           ) -> np.ndarray:
        """``w``, or under record-level DP the newcomer's model without its own noise when
        ``w`` is the one it released last."""
        released = self._stored_vector(context, "released", task.dim)
        own = self._stored_vector(context, "own", task.dim)
        if released is None or own is None or not np.array_equal(released, w):
            return w
        meta = context.state[STATE_META] if STATE_META in context.state else {}
        return own if meta.get("task-id") == task.task_id else w

    def evaluate_model(self, msg: Message, context: Context) -> Message:
        """Test errors of the model ``w`` the server sends (no state is touched); under
        record-level DP a newcomer's own model when ``w`` is its last release."""
        task = self.local_task(context)
        config = self._check_task(msg, task)
        w = self._model_to_evaluate(context, task, self._vector(msg, "w", task.dim))
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
    def _stored_alpha(context: Context, task: LocalTask, step: int,
                      loss: Loss = LOSSES["hinge"]) -> tuple[np.ndarray | None, bool]:
        """The alpha of step - 1 under ``loss`` (None at step 0); (None, False) when the state
        lags or holds another loss's duals."""
        if step == 0:
            return None, True
        if STATE_META not in context.state or STATE_ARRAYS not in context.state:
            return None, False
        meta = context.state[STATE_META]
        if meta.get("task-id") != task.task_id or meta.get("step") != step - 1 \
                or meta.get("loss", "hinge") != loss.name:
            return None, False
        try:
            alpha = np.array(from_array(context.state[STATE_ARRAYS]["alpha"]), dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return None, False
        y = task.y
        if alpha.shape != (task.n,) or not np.all(np.isfinite(alpha)) \
                or not loss.feasible(alpha, y, 1e-12):
            return None, False
        return np.clip(y * alpha, *loss.dual_domain) * y, True


def _loss_meta(loss: Loss) -> dict[str, str]:
    """The state's record of the loss its duals belong to (nothing for the hinge: the state
    written before OFMTL had losses stays usable)."""
    return {} if loss.name == "hinge" else {"loss": loss.name}


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
