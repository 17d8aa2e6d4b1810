"""FSVRG (Algorithm 4), naive FSVRG (Algorithm 3) and distributed GD as a Flower ``Strategy``.

One global model ``w`` for sparse L2-regularised logistic regression (the numerics, and the
objective ``f(w) = (1/n) sum_i log(1 + exp(-y_i x_i^T w)) + (lam/2)|w|^2``, are in
:mod:`fmtl_flower.core.fsvrg`). The strategy runs inside Flower's ``Strategy.start`` loop:

* setup (``fsvrg`` only, once, in round 1 after discovery): query ``fsvrg_stats``; the server
  combines the nodes' counts into :class:`~fmtl_flower.core.fsvrg.FeatureStats` (``n``,
  ``phi``, ``A``);
* exchange 1 of round r (inside ``configure_train``): query ``fsvrg_gradient`` with ``w_t``;
  the server sums the nodes' loss and gradient sums (in task order) and computes ``f(w_t)``
  and ``g = grad f(w_t)``. GD takes ``w <- gd_step(w, g, step)`` here and sends no ``train``;
* exchange 2 (``fsvrg`` / ``fsvrg-naive``; the ``train`` messages): the nodes run the local
  pass from ``w_t`` and reply ``w_k``; the server aggregates with
  :func:`~fmtl_flower.core.fsvrg.fsvrg_aggregate` (``A``, ``n = stats.n``) or
  :func:`~fmtl_flower.core.fsvrg.naive_fsvrg_aggregate`;
* after the last round, one ``evaluate`` message gives ``f(w_R)`` and the test error.

Wire contract
-------------
query ``whoami``: as :mod:`fmtl_flower.strategies.discovery` (``task-id``, ``n-train``, ``dim``).

query ``fsvrg_stats`` (server -> node): config ``task-id``. Reply: metrics ``task-id``,
    ``n-train`` (ints, matching whoami); arrays ``counts``: integer (d,), ``counts[j] = n_k^j``
    in ``[0, n-train]``. Nothing else leaves the node.

query ``fsvrg_gradient`` (server -> node): arrays ``w`` float64 (d,); config ``task-id``,
    ``server-round`` (int >= 1), ``eval`` (bool). Reply: metrics ``task-id``, ``round``,
    ``n-train`` (ints), ``loss-sum`` (float >= 0, ``sum_i l_i(w)``), ``sq-norm-sum`` (float >= 0,
    ``sum_i |x_i|^2``), with ``eval`` ``test-errors``, ``test-n`` (ints, ``0 <= errors <= n``);
    arrays ``grad-sum`` float64 (d,), ``sum_i grad l_i(w)``.

``train`` (server -> node, ``fsvrg`` / ``fsvrg-naive``): arrays ``w`` (``w_t``), ``g``
    (``grad f(w_t)``) and, for ``fsvrg``, ``phi`` (float64 (d,) each; ``phi`` is broadcast
    every round, so the node keeps no state and computes ``s_k = node_scaling(phi, n_k,
    counts_k)`` itself); config ``task-id``, ``server-round``, ``seed`` (ints), ``method``
    (str), ``lam``, ``h`` (floats). The node visits ``coordinate_order(seed, task, round,
    n_k)`` (``fsvrg``) or ``uniform_sample_order(seed, task, round, n_k)`` (naive). Reply:
    metrics ``task-id``, ``round``, ``n-train``; arrays ``w-local`` float64 (d,).

``evaluate`` (once, after the last round): as ``fsvrg_gradient`` with ``eval`` true; the reply
    has no arrays.

Every reply is validated (records and keys, int metrics as ints, finite numbers, arrays of
dtype float64 (integers for ``counts``) and shape (d,), finite, matching task, round and
n-train); a reply that fails is logged with its reason and counts as a dropped node: no
gradient term (the gradient and objective are then over the replying nodes, normalised by
their ``n``; the record's ``objective`` is None and ``tasks_missing`` lists them) or no local
model (``fsvrg``: weight ``n_k/n`` with the full ``n``, so the node contributes no change;
naive: the mean over the accepted nodes). ``w`` is never touched by a rejected reply.

Records
-------
Record k (state after k rounds, k = 0 .. R): ``round``, ``exchanges`` (server-client round
trips used to reach ``w_k``: 1 setup for ``fsvrg`` plus 2 per round for ``fsvrg``/naive, 1 per
round for GD; the measurement-only final ``evaluate`` is not counted), ``objective`` (``f(w_k)``,
from round k + 1's exchange 1, or the final ``evaluate``), ``test_error`` (pooled
misclassification over the test sets, every ``eval_every`` rounds and at k = R), ``num_replies``
(accepted replies of the round that produced ``w_k``: exchange 2, or exchange 1 for GD),
``wall_time_s`` (of that round), ``tasks_missing``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..core.fsvrg import (
    FeatureCountAccumulator,
    FeatureStats,
    fsvrg_aggregate,
    gd_step,
    global_gradient,
    global_objective,
    naive_fsvrg_aggregate,
)
from ..wire import from_array, to_array
from .base import TaskStrategy
from .discovery import ReplyError, TaskDirectory, check_task_and_round, read_metrics

__all__ = ["METHODS", "Fsvrg", "ReplyError"]

METHODS = ("fsvrg", "fsvrg-naive", "gd")
DEFAULT_H = 16.0
RoundCallback = Callable[[dict[str, Any]], None]
_NAME = "FSVRG"


def _positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
    return float(value)


class Fsvrg(TaskStrategy):
    """Federated SVRG (and naive FSVRG, GD) for one global sparse logistic-regression model.

    Parameters
    ----------
    num_tasks : int
        Number of nodes ``K`` to wait for; task ids 0 .. K - 1.
    method : {"fsvrg", "fsvrg-naive", "gd"}
    lam : float, optional
        ``lam > 0``; default ``1/n`` (the paper's), ``n`` the total of the discovered
        ``n-train``.
    h : float, optional
        Stepsize of the local pass. ``fsvrg``: ``h`` (the local one is ``h/n_k``), default 16
        (the best of 8/16/32 at K = 1000 in :mod:`fmtl_flower.core.fsvrg`). ``fsvrg-naive``:
        the stepsize itself, required (no safe default is known without the data).
    step : float, optional
        GD stepsize; default ``1/L_F`` with ``L_F = sum_i |x_i|^2 / (4 n) + lam``, an upper
        bound on the smoothness constant ``L = sigma_max(X)^2/(4n) + lam`` (Frobenius >=
        spectral norm) computable from the nodes' ``sq-norm-sum`` (fixed from the first round
        with replies, over the nodes that replied). Pass ``1/L`` from ``sigma_max`` when a
        centralised estimate is available (it is larger, so faster).
    eval_every : int
        Rounds between test-error evaluations (state 0 and the final one are always evaluated).
    seed : int
        Seed of the nodes' orders.
    discovery_timeout : float
        Seconds to wait, at round 1, for ``num_tasks`` nodes.
    on_round : callable, optional
        Called with each completed record.

    Attributes
    ----------
    w : ndarray (d,) or None
        The current model (zeros after discovery).
    stats : FeatureStats or None
        The sparsity statistics (``fsvrg``).
    records : list of dict
        See the module docstring; read with :meth:`results`.
    """

    def __init__(self, num_tasks: int, *, method: str = "fsvrg", lam: float | None = None,
                 h: float | None = None, step: float | None = None, eval_every: int = 1,
                 seed: int = 0, discovery_timeout: float = 120.0,
                 on_round: RoundCallback | None = None) -> None:
        if isinstance(num_tasks, bool) or int(num_tasks) != num_tasks or num_tasks < 1:
            raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.lam_arg = _positive_or_none("lam", lam)
        h = _positive_or_none("h", h)
        if method == "fsvrg-naive" and h is None:
            raise ValueError("fsvrg-naive needs an explicit stepsize h (no default)")
        self.h = DEFAULT_H if h is None else h
        self.step_arg = _positive_or_none("step", step)
        if isinstance(eval_every, bool) or int(eval_every) != eval_every or eval_every < 1:
            raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
        if isinstance(seed, bool) or int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not discovery_timeout >= 0:
            raise ValueError(f"discovery_timeout must be >= 0, got {discovery_timeout!r}")
        self.num_tasks = int(num_tasks)
        self.method = method
        self.eval_every = int(eval_every)
        self.seed = int(seed)
        self.discovery_timeout = float(discovery_timeout)
        self.on_round = on_round
        self.directory = TaskDirectory(self.num_tasks, _NAME)
        self.ever_replied = np.zeros(self.num_tasks, dtype=bool)
        self.records: list[dict[str, Any]] = []
        self.w: np.ndarray | None = None
        self.stats: FeatureStats | None = None
        self.lam: float | None = self.lam_arg
        self.step: float | None = self.step_arg
        self.exchanges = 0
        self._g: np.ndarray | None = None
        self._gd_replies = 0
        self._sent: dict[int, int] = {}
        self._round_start = 0.0

    @property
    def dim(self) -> int | None:
        return self.directory.dim

    # ------------------------------------------------------------------ Strategy interface
    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├── %s (%s): %d nodes, lambda=%s, h=%g, step=%s", _NAME, self.method,
            self.num_tasks, "1/n" if self.lam_arg is None else f"{self.lam_arg:g}", self.h,
            "1/L_F" if self.step_arg is None else f"{self.step_arg:g}")
        log(INFO, "\t└── eval-every=%d, seed=%d", self.eval_every, self.seed)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Setup (once), exchange 1 (gradient at w_t), then the local-pass messages."""
        self._round_start = time.perf_counter()
        self.directory.discover(grid, wait=self.discovery_timeout if server_round == 1 else 0.0,
                                query_timeout=max(self.round_timeout, 60.0))
        if self.w is None:
            if self.dim is None:
                raise RuntimeError(f"{_NAME} found no usable node: check the ClientApp and "
                                   "the nodes' task ids")
            self.w = np.zeros(self.dim)
            if self.lam is None:
                self.lam = 1.0 / float(self.n_train.sum())
        if self.method == "fsvrg" and self.stats is None:
            self._setup(grid)
        if len(self.records) < server_round:
            self._new_record(server_round - 1)
        evaluate = (server_round - 1) % self.eval_every == 0
        accepted = self._exchange(grid, server_round, f"{MessageType.QUERY}.fsvrg_gradient",
                                  evaluate, kind="gradient")
        self.exchanges += 1
        self._complete_record(server_round - 1, accepted)
        self._g = None
        if not accepted:
            log(WARNING, "%s round %d: no gradient reply; the model is kept", _NAME,
                server_round)
            return []
        n_rep = int(sum(r["n-train"] for r in accepted.values()))
        grad_sum = np.zeros(self.dim or 0)
        for task in sorted(accepted):
            grad_sum += accepted[task]["grad-sum"]
        assert self.lam is not None and self.w is not None
        self._g = global_gradient(self.w, grad_sum, n_rep, self.lam)
        if self.method == "gd":
            if self.step is None:
                sq = float(sum(r["sq-norm-sum"] for r in accepted.values()))
                self.step = 1.0 / (sq / (4.0 * n_rep) + self.lam)
            self.w = gd_step(self.w, self._g, self.step)
            self._gd_replies = len(accepted)
            return []
        return self._train_messages(server_round)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Aggregate the local models (``fsvrg`` / naive) and open the next record."""
        assert self.w is not None
        if self.method == "gd" or self._g is None:
            num_replies = self._gd_replies if (self.method == "gd" and self._g is not None) \
                else 0
        else:
            self.exchanges += 1
            accepted = self._read_replies(server_round, replies, kind="train")
            tasks = sorted(accepted)
            models = [accepted[t]["w-local"] for t in tasks]
            if self.method == "fsvrg":
                assert self.stats is not None
                self.w = fsvrg_aggregate(self.w, models, [int(self.n_train[t]) for t in tasks],
                                         self.stats.a, n=self.stats.n)
            else:
                self.w = naive_fsvrg_aggregate(self.w, models)
            num_replies = len(accepted)
        record = self._new_record(server_round)
        record.update(num_replies=num_replies,
                      wall_time_s=time.perf_counter() - self._round_start)
        return (ArrayRecord({"w": to_array(self.w)}),
                MetricRecord({"num-replies": num_replies, "exchanges": self.exchanges}))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Nothing, except after the last round: f(w_R) and the test error."""
        if self.num_rounds is None or server_round != self.num_rounds or self.w is None:
            return []
        return self._loss_messages(server_round, MessageType.EVALUATE, True)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Complete the final record."""
        if self.num_rounds is None or server_round != self.num_rounds or self.w is None:
            return None
        accepted = self._read_replies(server_round, replies, kind="evaluate")
        record = self._complete_record(server_round, accepted)
        return MetricRecord({k: float(v) for k, v in record.items()
                             if isinstance(v, int | float) and not isinstance(v, bool)})

    # ------------------------------------------------------------------ exchanges
    def _setup(self, grid: Grid) -> None:
        """Query every node's feature counts once and build the statistics."""
        assert self.dim is not None
        self._sent = {}
        messages = []
        for task, node in sorted(self.task_to_node.items()):
            messages.append(Message(RecordDict({"config": ConfigRecord({"task-id": task})}),
                                    dst_node_id=node,
                                    message_type=f"{MessageType.QUERY}.fsvrg_stats"))
            self._sent[node] = task
        replies = grid.send_and_receive(messages, timeout=self.round_timeout)
        accepted = self._read_replies(0, replies, kind="stats")
        self.exchanges += 1
        acc = FeatureCountAccumulator(self.dim)
        for task in sorted(accepted):
            acc.add(int(self.n_train[task]), accepted[task]["counts"])
        if acc.n <= 0:
            raise RuntimeError(f"{_NAME}: no node sent its feature counts")
        self.stats = acc.result()
        log(INFO, "%s: statistics from %d of %d nodes (n = %d)", _NAME, self.stats.num_nodes,
            self.num_tasks, self.stats.n)

    def _exchange(self, grid: Grid, server_round: int, message_type: str, evaluate: bool,
                  kind: str) -> dict[int, dict[str, Any]]:
        messages = self._loss_messages(server_round, message_type, evaluate)
        return self._read_replies(server_round,
                                  grid.send_and_receive(messages, timeout=self.round_timeout),
                                  kind=kind)

    def _loss_messages(self, server_round: int, message_type: str,
                       evaluate: bool) -> list[Message]:
        assert self.w is not None
        self._sent = {}
        messages = []
        w = to_array(self.w)
        for task, node in sorted(self.task_to_node.items()):
            config = {"task-id": task, "server-round": server_round, "eval": bool(evaluate)}
            messages.append(Message(RecordDict({"arrays": ArrayRecord({"w": w}),
                                                "config": ConfigRecord(config)}),
                                    dst_node_id=node, message_type=message_type))
            self._sent[node] = task
        return messages

    def _train_messages(self, server_round: int) -> list[Message]:
        assert self.w is not None and self._g is not None and self.lam is not None
        arrays = {"w": to_array(self.w), "g": to_array(self._g)}
        if self.method == "fsvrg":
            assert self.stats is not None
            arrays["phi"] = to_array(self.stats.phi)
        self._sent = {}
        messages = []
        for task, node in sorted(self.task_to_node.items()):
            config = {"task-id": task, "server-round": server_round, "seed": self.seed,
                      "method": self.method, "lam": self.lam, "h": self.h}
            messages.append(Message(RecordDict({"arrays": ArrayRecord(arrays),
                                                "config": ConfigRecord(config)}),
                                    dst_node_id=node, message_type=MessageType.TRAIN))
            self._sent[node] = task
        return messages

    # ------------------------------------------------------------------ replies
    def _read_replies(self, server_round: int, replies: Iterable[Message],
                      kind: str) -> dict[int, dict[str, Any]]:
        """Validated replies keyed by task; invalid ones are logged and left out."""
        accepted: dict[int, dict[str, Any]] = {}
        failed: set[int] = set()
        where = "setup" if kind == "stats" else f"round {server_round} ({kind})"
        for reply in replies:
            node = reply.metadata.src_node_id
            task = self._sent.get(node)
            if reply.has_error():
                log(WARNING, "%s %s: node %s failed: %s", _NAME, where, node,
                    reply.error.reason)
                if task is not None:
                    failed.add(task)
                continue
            if task is None:
                log(WARNING, "%s %s: reply from unexpected node %s ignored", _NAME, where, node)
                continue
            if task in accepted or task in failed:
                log(WARNING, "%s %s: duplicate reply of task %d ignored", _NAME, where, task)
                continue
            try:
                parsed = self._parse_reply(reply, task, server_round, kind)
            except ReplyError as err:
                log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", _NAME, where,
                    task, node, err)
                failed.add(task)
                continue
            accepted[task] = parsed
            self.ever_replied[task] = True
        silent = sorted(set(self._sent.values()) - set(accepted) - failed)
        if silent:
            log(WARNING, "%s %s: no reply from tasks %s; counted as dropped", _NAME, where,
                silent[:20])
        return accepted

    def _array(self, reply: Message, key: str, integer: bool = False) -> np.ndarray:
        content = reply.content
        if "arrays" not in content or key not in content["arrays"]:
            raise ReplyError(f"array {key!r} missing")
        try:
            v = from_array(content["arrays"][key])
        except (TypeError, ValueError) as err:
            raise ReplyError(f"{key!r} cannot be decoded: {err}") from None
        ok_dtype = v.dtype.kind in "iu" if integer else v.dtype == np.float64
        if not ok_dtype or v.shape != (self.dim,):
            raise ReplyError(f"{key!r} must be {'integer' if integer else 'float64'} of shape "
                             f"({self.dim},), got {v.dtype} {v.shape}")
        if not integer and not np.all(np.isfinite(v)):
            raise ReplyError(f"{key!r} has non-finite values")
        return v

    def _parse_reply(self, reply: Message, task: int, server_round: int,
                     kind: str) -> dict[str, Any]:
        if kind == "stats":
            out = read_metrics(reply, ints=("task-id", "n-train"))
            if out["task-id"] != task:
                raise ReplyError(f"reply for task {out['task-id']}, expected {task}")
        elif kind == "train":
            out = read_metrics(reply, ints=("task-id", "round", "n-train"))
            check_task_and_round(out, task, server_round)
        else:
            out = read_metrics(reply, ints=("task-id", "round", "n-train"),
                               numbers=("loss-sum", "sq-norm-sum"),
                               optional_ints=("test-errors", "test-n"))
            check_task_and_round(out, task, server_round)
            if out["loss-sum"] < 0 or out["sq-norm-sum"] < 0:
                raise ReplyError("loss-sum and sq-norm-sum must be >= 0")
            if ("test-errors" in out) != ("test-n" in out) or (
                    "test-n" in out and not 0 <= out["test-errors"] <= out["test-n"]):
                raise ReplyError("test-errors/test-n inconsistent")
        if out["n-train"] != self.n_train[task]:
            raise ReplyError(f"n-train {out['n-train']} differs from {self.n_train[task]}")
        if kind == "stats":
            counts = self._array(reply, "counts", integer=True)
            if np.any(counts < 0) or np.any(counts > out["n-train"]):
                raise ReplyError(f"counts must be in [0, n-train = {out['n-train']}]")
            out["counts"] = counts
        elif kind == "gradient":
            out["grad-sum"] = self._array(reply, "grad-sum")
        elif kind == "train":
            out["w-local"] = self._array(reply, "w-local")
        return out

    # ------------------------------------------------------------------ records
    def _new_record(self, k: int) -> dict[str, Any]:
        assert len(self.records) == k
        record: dict[str, Any] = {
            "round": k, "exchanges": self.exchanges, "objective": None, "test_error": None,
            "num_replies": None, "wall_time_s": None, "tasks_missing": None, "_open": True,
        }
        self.records.append(record)
        return record

    def _complete_record(self, k: int, accepted: dict[int, dict[str, Any]]) -> dict[str, Any]:
        assert self.w is not None and self.lam is not None
        record = self.records[k]
        record.pop("_open", None)
        missing = sorted(set(range(self.num_tasks)) - set(accepted))
        record["tasks_missing"] = missing
        if accepted:
            n_rep = int(sum(r["n-train"] for r in accepted.values()))
            loss = float(sum(accepted[t]["loss-sum"] for t in sorted(accepted)))
            if not missing:
                record["objective"] = global_objective(self.w, loss, n_rep, self.lam)
            evaluated = [t for t in accepted if "test-n" in accepted[t]]
            tested = sum(accepted[t]["test-n"] for t in evaluated)
            if evaluated and not missing and tested > 0:
                record["test_error"] = sum(accepted[t]["test-errors"]
                                           for t in evaluated) / tested
        if self.on_round is not None:
            self.on_round(self.public_record(record))
        return record

    def results(self) -> dict[str, Any]:
        """``{"rounds": [...], "final": {...}}`` over the completed records."""
        rounds = [self.public_record(r) for r in self.records if "_open" not in r]
        final = dict(rounds[-1]) if rounds else {}
        final["tasks_never_replied"] = sorted(int(t) for t in np.flatnonzero(~self.ever_replied))
        final["complete"] = bool(rounds) and not final.get("tasks_missing")
        final["method"] = self.method
        return {"rounds": rounds, "final": final}
