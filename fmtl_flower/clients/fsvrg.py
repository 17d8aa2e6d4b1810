"""ClientApp handlers of FSVRG (Algorithm 4), naive FSVRG (Algorithm 3), distributed GD,
CoCoA+ and DANE (Algorithm 2).

The wire contract (keys, shapes, dtypes) is documented in :mod:`fmtl_flower.strategies.fsvrg`.
Its data (and its feature counts, computed once) are cached per node and run by
:class:`FSVRGClient`. Except for CoCoA+, the node keeps no state between messages: everything
a round needs (``w_t``, ``grad f(w_t)``, ``phi``) arrives in the message, so a restarted device
can resume at once.

CoCoA+ keeps the node's dual variables in ``context.state`` (ArrayRecord ``cocoa-plus.arrays``:
``duals`` float64 (2, n_k) = [committed alpha; pending d_alpha]; ConfigRecord
``cocoa-plus.meta``: ``task-id``, ``committed-round``, ``pending-round`` (-1: none)) under the
dual commit protocol (design decision 4, as :mod:`fmtl_flower.clients.mocha`): the pending
change is committed if its round equals the message's ``last-accepted-round`` L and dropped
otherwise; a committed round that then differs from L (state lost or reverted) restarts the
node from alpha = 0 with ``state-ok = 0``. The state is written last, after the reply is built.

Handlers:

* ``query.whoami``: task id, ``n-train``, ``n-test``, ``dim``;
* ``query.fsvrg_stats``: ``(n_k, counts_k)`` (:func:`~fmtl_flower.core.fsvrg.node_feature_counts`);
* ``query.fsvrg_gram``: ``X_k^T (X_k v)`` (:func:`~fmtl_flower.core.fsvrg.local_gram_product`;
  GD's power iteration for ``L``);
* ``query.fsvrg_gradient``: ``(loss_sum_k, grad_sum_k)`` at ``w_t``
  (:func:`~fmtl_flower.core.fsvrg.local_loss_grad_sums`), and test errors on request;
* ``train``: the local pass (:func:`~fmtl_flower.core.fsvrg.fsvrg_local_pass` with
  ``s_k = node_scaling(phi, n_k, counts_k)`` and ``order = coordinate_order(seed, task,
  round, n_k)``, :func:`~fmtl_flower.core.fsvrg.naive_fsvrg_local_pass` with
  ``uniform_sample_order``, or :func:`~fmtl_flower.core.fsvrg.dane_local_solve` with
  ``dane_epoch_orders``), replying ``w_k``; CoCoA+: commit or roll back, the loss and dual
  sums at ``w_t``, then :func:`~fmtl_flower.core.fsvrg.cocoa_plus_local_sdca`, replying
  ``d_w_k``;
* ``evaluate``: loss sum and test errors at ``w`` (no gradient); CoCoA+: after the commit,
  with the dual sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..core.fsvrg import (
    cocoa_plus_local_sdca,
    dane_epoch_orders,
    dane_local_solve,
    fsvrg_local_pass,
    local_error_count,
    local_gram_product,
    local_loss_grad_sums,
    logistic_dual_sum,
    naive_fsvrg_local_pass,
    node_feature_counts,
    node_scaling,
    uniform_sample_order,
)
from ..core.rng import coordinate_order
from ..wire import from_array, to_array
from .common import (
    TaskIdFn,
    config_value,
    default_task_id,
    use_kernel_cache,
)
from .dual_state import DualState, DualStore, data_fingerprint

__all__ = ["COCOA_STATE_ARRAYS", "COCOA_STATE_META", "FSVRGClient", "SparseLocalTask",
           "make_fsvrg_client_app"]

SparseLoader = Callable[[Context], tuple[Any, Any, Any, Any]]
LOCAL_METHODS = ("fsvrg", "fsvrg-naive", "dane", "cocoa-plus")
COCOA_STATE_ARRAYS = "cocoa-plus.arrays"
COCOA_STATE_META = "cocoa-plus.meta"


@dataclass(frozen=True, eq=False)
class SparseLocalTask:
    """One node's validated data and its feature counts ``n_k^j``."""

    task_id: int
    X: sp.csr_matrix
    y: np.ndarray
    X_test: sp.csr_matrix
    y_test: np.ndarray
    counts: np.ndarray
    fingerprint: str = ""  # of (X, y): CoCoA+'s dual state is bound to it
    sq_norm_sum: float = -1.0  # sum_i |x_i|^2 (every loss reply's ``sq-norm-sum``); -1: compute

    def __post_init__(self) -> None:
        if self.sq_norm_sum < 0:  # computed once here, not per reply
            object.__setattr__(self, "sq_norm_sum", float(self.X.multiply(self.X).sum()))

    @property
    def n(self) -> int:
        return int(self.X.shape[0])

    @property
    def dim(self) -> int:
        return int(self.X.shape[1])


def _csr(X: Any, what: str) -> sp.csr_matrix:
    if not sp.issparse(X):
        raise TypeError(f"{what} must be a scipy sparse matrix, got {type(X).__name__}")
    X = sp.csr_matrix(X, dtype=np.float64)
    if not X.has_canonical_format:
        X.sum_duplicates()
    return X


def _labels(y: Any, n: int, what: str) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if y.shape != (n,):
        raise ValueError(f"{what} has {y.shape[0]} labels for {n} rows")
    if y.size and not np.all(np.abs(y) == 1.0):
        raise ValueError(f"{what} must be in {{-1, +1}}")
    return y


class FSVRGClient:
    """FSVRG's device-side handlers over a user-supplied data loader.

    Parameters
    ----------
    load_data : callable
        ``load_data(context) -> (X, y, X_test, y_test)``: scipy sparse design matrices (rows
        are samples; converted to float64 CSR) and labels in {-1, +1}. Called once per node
        and run, then cached.
    task_id : callable, optional
        ``task_id(context) -> int``; default: node config ``task-id``, else ``partition-id``.
    """

    def __init__(self, load_data: SparseLoader, task_id: TaskIdFn | None = None,
                 state_dir: str | None = None) -> None:
        self.state_dir = state_dir or None
        self.load_data = load_data
        self.task_id = task_id or default_task_id
        self._cache: dict[tuple[int, int], SparseLocalTask] = {}
        self._duals = DualStore("cocoa-plus", "CoCoA+", self.state_dir)

    # -- data -------------------------------------------------------------------------------
    def local_task(self, context: Context) -> SparseLocalTask:
        """The node's validated data (loaded once per node and run)."""
        key = (int(context.run_id), int(context.node_id))
        if key not in self._cache:
            self._cache[key] = self._build_task(context)
        return self._cache[key]

    def _build_task(self, context: Context) -> SparseLocalTask:
        """Load and validate the data of ``context``'s task (the stacked handler of
        :mod:`fmtl_flower.clients.packed_fsvrg` calls it once per slot)."""
        use_kernel_cache(context, self.state_dir)  # before any kernel runs
        loaded = self.load_data(context)
        if len(loaded) != 4:
            raise ValueError("load_data must return (X, y, X_test, y_test)")
        X, y, X_test, y_test = loaded
        X = _csr(X, "X")
        X_test = _csr(X_test, "X_test")
        if X.shape[0] < 1:
            raise ValueError("the node holds no training rows")
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(f"X_test has {X_test.shape[1]} features, X {X.shape[1]}")
        y = _labels(y, X.shape[0], "y")
        y_test = _labels(y_test, X_test.shape[0], "y_test")
        _, counts = node_feature_counts(X)
        fingerprint = data_fingerprint(X.indptr, X.indices, X.data, y)
        return SparseLocalTask(int(self.task_id(context)), X, y, X_test, y_test, counts,
                               fingerprint)

    # -- handlers ---------------------------------------------------------------------------
    def whoami(self, msg: Message, context: Context) -> Message:
        """Reply with the task id and the sizes (no data)."""
        task = self.local_task(context)
        info = ConfigRecord({"task-id": task.task_id, "n-train": task.n,
                             "n-test": int(task.X_test.shape[0]), "dim": task.dim})
        return Message(RecordDict({"info": info}), reply_to=msg)

    def stats(self, msg: Message, context: Context) -> Message:
        """Send ``n_k`` and the feature counts ``n_k^j`` (int64, (d,))."""
        task = self.local_task(context)
        self._check_task(msg, task)
        metrics = MetricRecord({"task-id": task.task_id, "n-train": task.n})
        return Message(RecordDict({"metrics": metrics,
                                   "arrays": ArrayRecord({"counts": to_array(task.counts)})}),
                       reply_to=msg)

    def gram(self, msg: Message, context: Context) -> Message:
        """Send ``X_k^T (X_k v)`` (float64, (d,)): the node's share of the Gram operator."""
        task = self.local_task(context)
        self._check_task(msg, task)
        u = local_gram_product(task.X, self._vector(msg, "v", task.dim))
        metrics = MetricRecord({"task-id": task.task_id, "n-train": task.n})
        return Message(RecordDict({"metrics": metrics,
                                   "arrays": ArrayRecord({"gram-v": to_array(u)})}),
                       reply_to=msg)

    def gradient(self, msg: Message, context: Context) -> Message:
        """Send the loss sum and the gradient sum at ``w_t`` (and test errors on request)."""
        return self._loss_reply(msg, context, with_grad=True)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Send the loss sum (and test errors on request) at ``w``; no gradient. CoCoA+:
        commit or roll back first, and add ``state-ok`` and the dual sum."""
        task = self.local_task(context)
        config = self._check_task(msg, task)
        if "method" not in config or config_value(config, "method", str) != "cocoa-plus":
            return self._loss_reply(msg, context, with_grad=False)
        metrics, state = self.cocoa_evaluate(
            task, config, lambda key: self._vector(msg, key, task.dim),
            lambda: self._reconcile(context, task, config))
        reply = Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
        self._write_duals(context, task, state, None, -1)  # last
        return reply

    def train(self, msg: Message, context: Context) -> Message:
        """Run the local solver from ``w_t`` and send ``w_k`` (CoCoA+: ``d_w_k``)."""
        task = self.local_task(context)
        config = self._check_task(msg, task)
        method = config_value(config, "method", str)
        if method not in LOCAL_METHODS:
            raise ValueError(f"method must be one of {LOCAL_METHODS}, got {method!r}")
        if method == "cocoa-plus":
            return self._cocoa_plus(msg, context, task, config)
        metrics, w_k = self.local_model(task, config, method,
                                        lambda key: self._vector(msg, key, task.dim))
        return Message(RecordDict({"metrics": MetricRecord(metrics),
                                   "arrays": ArrayRecord({"w-local": to_array(w_k)})}),
                       reply_to=msg)

    # -- local solvers ----------------------------------------------------------------------
    @staticmethod
    def local_model(task: SparseLocalTask, config: Mapping[str, Any], method: str,
                    vector: Callable[[str], np.ndarray]) -> tuple[dict[str, int], np.ndarray]:
        """A ``train`` message's work for ``fsvrg`` / ``fsvrg-naive`` / ``dane``: the reply's
        metrics and ``w_k`` (``vector(key)``: the message's checked (d,) array ``key``)."""
        server_round = config_value(config, "server-round", int)
        seed = config_value(config, "seed", int)
        lam = config_value(config, "lam", float)
        w = vector("w")
        g = vector("g")
        if method == "dane":
            w_k = FSVRGClient._dane(task, config, w, g, seed, server_round, lam)
        elif method == "fsvrg":
            phi = vector("phi")
            s = node_scaling(phi, task.n, task.counts)
            order = coordinate_order(seed, task.task_id, server_round, task.n)
            w_k = fsvrg_local_pass(task.X, task.y, w, g, lam=lam,
                                   h=config_value(config, "h", float), s=s, order=order)
        else:
            order = uniform_sample_order(seed, task.task_id, server_round, task.n)
            w_k = naive_fsvrg_local_pass(task.X, task.y, w, g, lam=lam,
                                         h=config_value(config, "h", float), order=order)
        return {"task-id": task.task_id, "round": server_round, "n-train": task.n}, w_k

    @staticmethod
    def _dane(task: SparseLocalTask, config: Mapping[str, Any], w: np.ndarray, g: np.ndarray,
              seed: int, server_round: int, lam: float) -> np.ndarray:
        """DANE's local subproblem by ``epochs`` SVRG epochs (``eta = 1``)."""
        mu = config_value(config, "mu", float)
        epochs = config_value(config, "epochs", int)
        step = config_value(config, "step", float) if "step" in config else None
        if mu < 0 or epochs < 1 or (step is not None and step <= 0):
            raise ValueError(f"DANE needs mu >= 0, epochs >= 1, step > 0; got {mu}, {epochs}, "
                             f"{step}")
        orders = dane_epoch_orders(seed, task.task_id, server_round, task.n, epochs)
        return dane_local_solve(task.X, task.y, w, g, lam=lam, step=step, orders=orders, mu=mu)

    def _cocoa_plus(self, msg: Message, context: Context, task: SparseLocalTask,
                    config: ConfigRecord) -> Message:
        """Commit or roll back, report the sums at ``w_t``, run SDCA, send ``d_w_k``."""
        metrics, state, d_alpha, d_w = self.cocoa_train(
            task, config, lambda key: self._vector(msg, key, task.dim),
            lambda: self._reconcile(context, task, config))
        reply = Message(RecordDict({"metrics": MetricRecord(metrics),
                                    "arrays": ArrayRecord({"d-w": to_array(d_w)})}),
                        reply_to=msg)
        self._write_duals(context, task, state, d_alpha, int(metrics["round"]))  # last
        return reply

    @staticmethod
    def cocoa_train(task: SparseLocalTask, config: Mapping[str, Any],
                    vector: Callable[[str], np.ndarray], reconcile: Callable[[], DualState]
                    ) -> tuple[dict[str, int | float], DualState, np.ndarray, np.ndarray]:
        """CoCoA+'s ``train`` work: ``(metrics, reconciled state, d_alpha, d_w)``;
        ``reconcile()`` applies the commit protocol to the stored state (called after the
        message's checks), ``vector(key)`` gives the message's checked (d,) array."""
        server_round = config_value(config, "server-round", int)
        seed = config_value(config, "seed", int)
        epochs = config_value(config, "epochs", int)
        n = config_value(config, "n", int)
        lam = config_value(config, "lam", float)
        sigma_prime = config_value(config, "sigma-prime", float)
        if config_value(config, "last-accepted-round", int) >= server_round:
            raise ValueError("last-accepted-round must precede server-round in a train message")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        w = vector("w")
        state = reconcile()
        alpha = state.alpha
        metrics, _ = FSVRGClient._loss_metrics(task, config, w)
        metrics.update({"state-ok": int(state.ok), "dual-sum": logistic_dual_sum(task.y, alpha)})
        order = np.concatenate(dane_epoch_orders(seed, task.task_id, server_round, task.n,
                                                 epochs))
        d_alpha, d_w = cocoa_plus_local_sdca(task.X, task.y, alpha, w, lam=lam, n=n,
                                             sigma_prime=sigma_prime, order=order)
        return metrics, state, d_alpha, d_w

    @staticmethod
    def cocoa_evaluate(task: SparseLocalTask, config: Mapping[str, Any],
                       vector: Callable[[str], np.ndarray], reconcile: Callable[[], DualState]
                       ) -> tuple[dict[str, int | float], DualState]:
        """CoCoA+'s ``evaluate`` work (commit or roll back, then the sums at ``w``):
        ``(metrics, reconciled state)``."""
        w = vector("w")
        state = reconcile()
        metrics, _ = FSVRGClient._loss_metrics(task, config, w)
        metrics.update({"state-ok": int(state.ok),
                        "dual-sum": logistic_dual_sum(task.y, state.alpha)})
        return metrics, state

    # -- CoCoA+'s dual state (the protocol of fmtl_flower.clients.dual_state) -----------------
    def _reconcile(self, context: Context, task: SparseLocalTask,
                   config: ConfigRecord) -> DualState:
        return self._duals.reconcile(context, task.task_id, task.n, task.fingerprint, config)

    def _write_duals(self, context: Context, task: SparseLocalTask, state: DualState,
                     pending: np.ndarray | None, pending_round: int) -> None:
        self._duals.write(context, task.task_id, task.fingerprint, state, pending,
                          pending_round)

    # -- helpers ----------------------------------------------------------------------------
    def _loss_reply(self, msg: Message, context: Context, with_grad: bool) -> Message:
        task = self.local_task(context)
        config = self._check_task(msg, task)
        metrics, grad = self._loss_metrics(task, config, self._vector(msg, "w", task.dim))
        records: dict[str, Any] = {"metrics": MetricRecord(metrics)}
        if with_grad:
            records["arrays"] = ArrayRecord({"grad-sum": to_array(grad)})
        return Message(RecordDict(records), reply_to=msg)

    @staticmethod
    def _loss_metrics(task: SparseLocalTask, config: Mapping[str, Any],
                      w: np.ndarray) -> tuple[dict[str, int | float], np.ndarray]:
        """The loss-reply metrics at ``w`` (test errors when ``eval``) and the gradient sum."""
        loss, grad = local_loss_grad_sums(task.X, task.y, w)
        metrics: dict[str, int | float] = {
            "task-id": task.task_id, "round": config_value(config, "server-round", int),
            "n-train": task.n, "loss-sum": float(loss),
            "sq-norm-sum": task.sq_norm_sum,
        }
        if "eval" in config and config_value(config, "eval", bool):
            wrong, count = local_error_count(task.X_test, task.y_test, w)
            metrics["test-errors"] = int(wrong)
            metrics["test-n"] = int(count)
        return metrics, grad

    @staticmethod
    def _check_task(msg: Message, task: SparseLocalTask) -> ConfigRecord:
        if "config" not in msg.content:
            raise ValueError("FSVRG message needs a 'config' record")
        config = msg.content["config"]
        tid = config_value(config, "task-id", int)
        if tid != task.task_id:
            raise ValueError(f"message for task {tid} reached the node of task {task.task_id}")
        return config

    @staticmethod
    def _vector(msg: Message, key: str, dim: int) -> np.ndarray:
        if "arrays" not in msg.content or key not in msg.content["arrays"]:
            raise ValueError(f"FSVRG message lacks array {key!r}")
        v = from_array(msg.content["arrays"][key])
        if v.dtype != np.float64 or v.shape != (dim,) or not np.all(np.isfinite(v)):
            raise ValueError(f"{key!r} must be finite float64 of shape ({dim},), "
                             f"got {v.dtype} {v.shape}")
        return v


def make_fsvrg_client_app(load_data: SparseLoader, task_id: TaskIdFn | None = None,
                          state_dir: str | None = None) -> ClientApp:
    """Build an FSVRG / naive FSVRG / GD / CoCoA+ / DANE ClientApp over your own sparse data.

    Routes ``query.whoami``, ``query.fsvrg_stats``, ``query.fsvrg_gram``,
    ``query.fsvrg_gradient``, ``train`` and
    ``evaluate`` to :class:`FSVRGClient`'s handlers. CoCoA+ devices keep their duals in state
    files under ``state_dir`` unless the node or run config sets ``client-state-dir``.
    """
    client = FSVRGClient(load_data, task_id, state_dir)
    app = ClientApp()
    app.query("whoami")(client.whoami)
    app.query("fsvrg_stats")(client.stats)
    app.query("fsvrg_gram")(client.gram)
    app.query("fsvrg_gradient")(client.gradient)
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    app.fsvrg_client = client  # type: ignore[attr-defined]  # for tests and introspection
    return app
