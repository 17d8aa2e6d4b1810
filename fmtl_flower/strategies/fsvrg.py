"""FSVRG (Algorithm 4), naive FSVRG (Algorithm 3) and the baselines distributed GD, CoCoA+ and
DANE (Algorithm 2) as a Flower ``Strategy``.

One global model ``w`` for sparse L2-regularised logistic regression (the numerics, and the
objective ``f(w) = (1/n) sum_i log(1 + exp(-y_i x_i^T w)) + (lam/2)|w|^2``, are in
:mod:`fmtl_flower.core.fsvrg`). The strategy runs inside Flower's ``Strategy.start`` loop:

* setup (``fsvrg`` only, once, in round 1 after discovery): query ``fsvrg_stats``; the server
  combines the nodes' counts into :class:`~fmtl_flower.core.fsvrg.FeatureStats` (``n``,
  ``phi``, ``A``);
* setup (``gd`` without a given ``step``, once, in round 1 after discovery): power iteration
  on the pooled Gram operator ``X^T X``, one ``fsvrg_gram`` query per iteration
  (:func:`~fmtl_flower.core.fsvrg.power_estimate`, at most ``GD_POWER_MAX_ITER``, until the
  estimate of ``sigma_max(X)^2`` grows by less than ``GD_POWER_TOL``); the step is
  ``1/L``, ``L = gd_smoothness(estimate, n, lam)``;
* exchange 1 of round r (inside ``configure_train``; all methods but ``cocoa-plus``): query
  ``fsvrg_gradient`` with ``w_t``; the server sums the nodes' loss and gradient sums (in task
  order) and computes ``f(w_t)`` and ``g = grad f(w_t)``. GD takes ``w <- gd_step(w, g,
  step)`` here and sends no ``train``;
* exchange 2 (``fsvrg`` / ``fsvrg-naive`` / ``dane``; the ``train`` messages): the nodes run
  the local pass (DANE: ``local_epochs`` SVRG epochs on the local subproblem) from ``w_t`` and
  reply ``w_k``; the server aggregates with :func:`~fmtl_flower.core.fsvrg.fsvrg_aggregate`
  (``A``, ``n = stats.n``), :func:`~fmtl_flower.core.fsvrg.naive_fsvrg_aggregate` or
  :func:`~fmtl_flower.core.fsvrg.dane_aggregate` (the mean of the accepted ``w_k``);
* ``cocoa-plus`` (one exchange per round, the ``train`` messages): each node keeps its dual
  variables ``alpha_k``, reports ``f``'s and the dual's sums at the ``w_t`` it received, runs
  ``local_epochs`` SDCA passes (``sigma' = K``) and replies ``d_w_k = X_k^T d_alpha_k /
  (lam n)``; the server adds the accepted ones, ``w <- w + sum_k d_w_k``
  (:func:`~fmtl_flower.core.fsvrg.cocoa_plus_aggregate`);
* after the last round, one ``evaluate`` message gives ``f(w_R)`` and the test error
  (``cocoa-plus``: and the dual, so the duality gap).

CoCoA+'s dual commit protocol (design decision 4)
-------------------------------------------------
The server keeps, per task, the share ``v_k = X_k^T alpha_k / (lam n)`` of ``w`` that its
accepted replies add up to (:class:`DualLedger`, sparse: ``v_k`` lives on node ``k``'s
features) and ``last-accepted-round`` L_k, the newest round whose reply from task k it added;
``w = sum_k v_k`` (up to rounding). Every ``train`` / ``evaluate`` message carries L_k. The
node keeps its newest ``d_alpha`` pending with its round: it commits it if that round equals
L_k and drops it otherwise; if its committed round then differs from L_k (state lost, reverted
by Ray after a failed call, or from another run) it restarts from ``alpha_k = 0`` and replies
``state-ok = 0``, and the server removes ``v_k`` from ``w`` before adding the reply. A rejected
or lost reply changes nothing on the server, and the node rolls its ``d_alpha`` back at the
next message. So ``w == w(alpha)`` for the nodes' committed alphas, whatever is lost.

Wire contract
-------------
query ``whoami``: as :mod:`fmtl_flower.strategies.discovery` (``task-id``, ``n-train``, ``dim``).

query ``fsvrg_stats`` (server -> node): config ``task-id``. Reply: metrics ``task-id``,
    ``n-train`` (ints, matching whoami); arrays ``counts``: integer (d,), ``counts[j] = n_k^j``
    in ``[0, n-train]``. Nothing else leaves the node.

query ``fsvrg_gram`` (server -> node, GD's setup): arrays ``v`` float64 (d,) (unit norm);
    config ``task-id``. Reply: metrics ``task-id``, ``n-train`` (ints); arrays ``gram-v``
    float64 (d,), ``X_k^T (X_k v)``.

query ``fsvrg_gradient`` (server -> node): arrays ``w`` float64 (d,); config ``task-id``,
    ``server-round`` (int >= 1), ``eval`` (bool). Reply: metrics ``task-id``, ``round``,
    ``n-train`` (ints), ``loss-sum`` (float >= 0, ``sum_i l_i(w)``), ``sq-norm-sum`` (float >= 0,
    ``sum_i |x_i|^2``), with ``eval`` ``test-errors``, ``test-n`` (ints, ``0 <= errors <= n``);
    arrays ``grad-sum`` float64 (d,), ``sum_i grad l_i(w)``.

``train`` (server -> node, ``fsvrg`` / ``fsvrg-naive`` / ``dane``): arrays ``w`` (``w_t``),
    ``g`` (``grad f(w_t)``) and, for ``fsvrg``, ``phi`` (float64 (d,) each; ``phi`` is
    broadcast every round, so the node keeps no state and computes ``s_k = node_scaling(phi,
    n_k, counts_k)`` itself); config ``task-id``, ``server-round``, ``seed`` (ints), ``method``
    (str), ``lam`` (float); ``fsvrg`` / naive: ``h`` (float); ``dane``: ``mu`` (float >= 0),
    ``epochs`` (int >= 1), optional ``step`` (float > 0; absent: the node's
    ``default_dane_step``). The node visits ``coordinate_order(seed, task, round, n_k)``
    (``fsvrg``), ``uniform_sample_order(seed, task, round, n_k)`` (naive) or
    ``dane_epoch_orders(seed, task, round, n_k, epochs)`` (``dane``, ``eta = 1``). Reply:
    metrics ``task-id``, ``round``, ``n-train``; arrays ``w-local`` float64 (d,).

``train`` (server -> node, ``cocoa-plus``): arrays ``w`` float64 (d,) (``w_t``); config
    ``task-id``, ``server-round``, ``seed``, ``last-accepted-round`` (0 = none; < server-round),
    ``run-token`` (str: the run's identity, :mod:`fmtl_flower.strategies.base`), with
    checkpoints ``checkpoint-round`` (:mod:`fmtl_flower.clients.dual_state`),
    ``n`` (the global row count), ``epochs`` (ints), ``method`` (str), ``lam``,
    ``sigma-prime`` (floats > 0), ``eval`` (bool). The node commits or rolls back (above),
    then runs :func:`~fmtl_flower.core.fsvrg.cocoa_plus_local_sdca` over the concatenated
    ``dane_epoch_orders(seed, task, round, n_k, epochs)`` (one pass: ``coordinate_order``).
    With client-level DP ``client-clip`` also ``dp-clip`` (float > 0): the node scales its
    ``d_alpha`` and ``d-w`` by one factor so that ``|d-w| <= dp-clip`` before replying and
    committing (:func:`~fmtl_flower.core.fsvrg.clip_dual_step`).
    Reply: metrics as ``fsvrg_gradient``'s at ``w_t`` (``loss-sum``, ``sq-norm-sum``, test
    errors with ``eval``) plus ``state-ok`` (int 0/1; 0: restarted from ``alpha_k = 0``) and
    ``dual-sum`` (float in ``[0, n-train log 2]``, ``sum_i H(y_i alpha_i)`` after the commit);
    arrays ``d-w`` float64 (d,), ``X_k^T d_alpha_k / (lam n)``.

``evaluate`` (once, after the last round): as ``fsvrg_gradient`` with ``eval`` true; the reply
    has no arrays. ``cocoa-plus`` adds config ``method``, ``last-accepted-round`` (the node
    commits or rolls back, and keeps no pending change) and reply metrics ``state-ok``,
    ``dual-sum``.

Packed nodes (:mod:`fmtl_flower.packing`) that speak the stacking protocol ``"fsvrg"`` get
each exchange's contents for all of their tasks in ONE message: the config values and global
vectors (``w``, ``g``, ``phi``, ``v``) once, ``task-id`` (and CoCoA+'s
``last-accepted-round``) as vectors; they reply with the metrics as vectors and the reply's
array as a (K, d) matrix (contract in :mod:`fmtl_flower.clients.packed_fsvrg`). Each row is
checked as a one-task reply and the sums run in task order, so the run equals the unpacked
one bit for bit; a bad row or slot fails only its task.

Each exchange's sent state is fixed, before its messages are made from it, as one frozen
:class:`~fmtl_flower.strategies.round_state.FSVRGSentExchange` (the messages and their ids,
the w_t, |w_t|, CoCoA+'s ``last-accepted-round`` and w_t . v_k, the power iteration's v, the
``dp-clip``); its replies are read against it, whatever was configured since, and a round's
replies read a second time are logged and dropped.

Every reply is validated (records and keys, int metrics as ints, finite numbers, arrays of
dtype float64 (integers for ``counts``) and shape (d,), finite, matching task, round and
n-train; nothing the contract does not name, and arrays within the bytes of their shapes,
checked before decoding: :func:`reply_contracts`); a reply that fails is logged with its
reason and counts as a dropped node: no
gradient term (the gradient and objective are then over the replying nodes, normalised by
their ``n``; the record's ``objective`` is None and ``tasks_missing`` lists them) or no local
model (``fsvrg``: weight ``n_k/n`` with the full ``n``, so the node contributes no change;
naive and ``dane``: the mean over the accepted nodes; ``cocoa-plus``: no ``d_w_k``, no reset,
L_k unchanged). ``w`` is never touched by a rejected reply.

Bounds (each violation rejects the reply). With ``S_k`` the reply's ``sq-norm-sum`` (at most
``n-train`` times the discovery limit ``max_row_norm`` squared) and ``sum_i |x_i| <=
sqrt(n_k S_k)``: a logistic loss gradient has norm at most ``|x_i|``, so
``|grad-sum|_2 <= sqrt(n_k S_k)``; a loss is at most ``log 2 + |x_i| |w|``, so
``loss-sum <= n_k log 2 + |w_t| sqrt(n_k S_k)``; CoCoA+'s ``y_i alpha_i`` stay in [0, 1], so
``|d-w|_2 <= sqrt(n_k S_k) / (lam n)``. CoCoA+'s pair (the certificate's check, always on,
:mod:`fmtl_flower.core.certificate`): ``dual-sum`` in ``[0, n-train log 2]`` and
``loss-sum - dual-sum + lam n (w_t . v_k) >= 0`` (Fenchel-Young for a truthful pair, up to a
relative rounding slack; ``v_k`` the task's share of ``w`` in the ledger, below, 0 after a
``state-ok`` 0), so that a gap made of pairs that passed is >= 0. Local models and ``d-w``
must stay within ``max_update_ratio`` times ``max(|w_t|, 1)`` of ``w_t``
(``|w-local - w_t|``, ``|d-w|``). A server step whose result is not finite is not taken
(``w`` kept, the round's replies rejected).

Robust mode (``robust``, the default; :mod:`fmtl_flower.core.fsvrg.robust` has the choices and
the measurements behind them). What a device says about itself is capped by what the
federation makes plausible, and the model's updates are aggregated robustly; ``robust=False``
is the behaviour above, bit for bit:

* ``n-train`` (whoami): each task is weighted by its *trusted* count :attr:`FSVRG.n_weight`,
  the reported one cut to the federation's log-scale fence, ``max_n`` and
  ``max-weight-share`` (logged when a cap binds); ``n``, the default ``lam = 1/n``, the
  objective, the gradient and FSVRG's weights ``n_k/n`` and statistics use it (a capped
  task's sums and ``counts`` are scaled by trusted / reported);
* ``sq-norm-sum``: at most the fence of the federation's mean squared row norms (this
  exchange's and earlier ones) times the trusted ``n_k``; the bounds on ``grad-sum``,
  ``loss-sum`` and ``d-w`` above are checked again with it;
* ``grad-sum`` at ``w_t``: ``-W(1/e) n-train <= w_t . grad-sum <= loss-sum`` (what every
  logistic row meets: ``w . grad l_i(w) = -z_i sigma(-z_i)``); a gradient that keeps pushing
  ``w`` one way is refused once the server has followed it far enough;
* ``gram-v``: ``v . gram-v >= 0`` and ``|gram-v|^2 <= rho v . gram-v`` (``rho``: the fence of the
  federation's per-row Rayleigh quotients times the trusted ``n_k``); the estimate of
  ``sigma_max^2`` never decreases;
* ``w-local`` is clipped to 3 times the median of the accepted ones' distances to ``w_t``,
  the per-row gradient ``grad-sum / n-train`` to 2 times the median of their norms;
* CoCoA+'s ``d-w``: the task's share of ``w`` after it, ``|v_k + d-w|``, at most
  ``sqrt(n_k S_k) / (lam n)`` (``y alpha`` in [0, 1]) and per row within the fence of the
  round's shares unless within 5 % of that bound; a reply above is rejected (the node rolls
  back), never clipped.

A reply that fails one of these is rejected and logged like any invalid reply.

Client-level DP (:attr:`FSVRG.privacy`, :class:`~fmtl_flower.strategies.privacy.FSVRGDP`)
-----------------------------------------------------------------------------------------
Every release is clipped, noised and accounted, with fixed denominators (the federation's K
and ``n``; a silent or rejected device adds 0); robust mode's federation-level checks are
off (one device's data must not decide whether another's reply counts). ``fsvrg``: the
setup's counts go into one private release (:meth:`~.privacy.FSVRGDP.feature_stats`), so
``stats`` (``n_j``, ``omega``: floats), ``phi`` and ``A`` are post-processing of it; each
round's gradient and mean update ``sum_k weight_k clip(w_k - w_t)`` are released, and
``w_{t+1} = w_t + A (released mean update)``. ``cocoa-plus`` (``client-clip``): the devices
scale their steps (``dp-clip``), the server clips each ``d-w`` again to the ``dp-clip`` its
round was sent with (a no-op for an honest device), keeps the clipped one in the ledger and
adds the noisy sum to ``w``. So ``w`` is ``w(alpha)`` plus the noise of every release so
far, and the ledger's ``sum_k v_k`` is
``w(alpha)`` itself: a record's ``dual`` is ``D(alpha)`` with ``w(alpha)`` from the ledger,
and ``gap = objective - dual = P(w) - D(alpha) >= P(w) - P*`` bounds the suboptimality of
the released (noisy) ``w`` (weak duality holds for any pair); ``gap_certified`` keeps its
meaning. The objective, the dual and the test errors come from the devices' exact sums:
like Flower's metrics, they are not covered by the guarantee.

Records
-------
Record k (state after k rounds, k = 0 .. R): ``round``, ``exchanges`` (server-client round
trips used to reach ``w_k``: 1 setup for ``fsvrg`` plus 2 per round for ``fsvrg``/naive/DANE,
the power iterations for GD's default step plus 1 per round for GD, 1 per round for CoCoA+;
the measurement-only final ``evaluate`` is not counted),
``objective`` (``f(w_k)``, from round k + 1's exchange 1 (CoCoA+: its ``train`` replies), or
the final ``evaluate``), the keys of :func:`fmtl_flower.metrics.error_summary` (``test_error``
the mean of the nodes' test error rates, as for every strategy; ``test_error_pooled``
misclassification over all test sets pooled; the accuracies), every ``eval_every`` rounds and
at k = R, ``num_replies`` (accepted replies of the round that
produced ``w_k``: exchange 2, or exchange 1 for GD), ``wall_time_s`` (of that round),
``tasks_missing``. CoCoA+ adds ``dual`` (``D(alpha_k)``), ``gap`` (``objective - dual >= 0``;
both None unless every task reported with ``state-ok``), ``num_resets``, ``gap_certified``
(true when the record has a gap: every task's pair passed the certificate's check, no task
missing, and the dual's ``n`` is the objective's, which a node found after round 1's setup
breaks; the gap bounds the suboptimality if the devices computed honestly) and
``certificate_rejections`` (the replies completing it that failed the check); its ``final``
adds ``certificate_rejections_total`` over the run. GD's ``final``
adds ``step`` (the step used), ``L_estimate`` (``L`` of the default step; None for a given
``step``) and ``power_iterations`` (its round trips, 0 for a given ``step``).

Resume
------
``n``, ``lam = 1/n`` (by default), ``fsvrg``'s statistics and CoCoA+'s shares of ``w`` all
derive from every node's data. A run resumed from a checkpoint rediscovers its nodes and
compares each task's ``n-train`` with the checkpoint's: another count (the run resumed on
other data) is a :class:`~fmtl_flower.checkpoint.CheckpointError` naming the tasks, never a
run that goes on with the old ``n`` and ``lam``. (Other data of the same sizes is not seen
by the server; CoCoA+'s devices then reset their dual state, which is bound to their data.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from logging import INFO, WARNING
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..checkpoint import CheckpointError
from ..core.certificate import certificate_rejections, logistic_pair_problem
from ..core.fsvrg import (
    GD_POWER_MAX_ITER,
    GD_POWER_TOL,
    FeatureCountAccumulator,
    FeatureStats,
    cocoa_plus_aggregate,
    dane_aggregate,
    dual_objective,
    fsvrg_aggregate,
    gd_smoothness,
    gd_step,
    global_gradient,
    global_objective,
    gram_power_start,
    naive_fsvrg_aggregate,
    power_estimate,
)
from ..core.fsvrg.robust import (
    CLIP_FACTOR,
    GRADIENT_CLIP_FACTOR,
    QUOTIENT_FACTOR,
    SHARE_BOUND_FLOOR,
    SQ_NORM_FACTOR,
    clip_rows,
    gradient_pairing_problem,
    gram_reply_problem,
    share_outliers,
    trusted_counts,
)
from ..core.robust import log_upper_fence
from ..metrics import error_summary, round_record
from ..packing import StackGroup
from ..settings import FSVRGSettings, apply_settings, check_num_tasks
from ..wire import from_array, to_array
from .base import RUN_TOKEN_KEY, TaskStrategy, check_initial_dim, initial_model
from .discovery import (
    ReplyError,
    TaskDirectory,
    arrays_of,
    check_task_and_round,
    read_metrics,
)
from .packed_fsvrg import MESSAGE_TYPES as _MESSAGE_TYPES
from .packed_fsvrg import PROTOCOL as STACKING_PROTOCOL
from .packed_fsvrg import TEST_KEYS as _TEST_KEYS
from .packed_fsvrg import read_stacked_reply, reply_keys, stacked_message
from .records import RoundRecords
from .round_state import FSVRGSentExchange, SentRounds, drop_unsent, frozen_array
from .trust import ReplyBoundary, ReplyContract, all_finite, check_bound, norm

__all__ = ["METHODS", "DualLedger", "FSVRG", "ReplyError"]

METHODS = ("fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane")
DEFAULT_H = 16.0
_LN2 = math.log(2.0)
RoundCallback = Callable[[dict[str, Any]], None]
_NAME = "FSVRG"


def reply_contracts(method: str) -> dict[str, ReplyContract]:
    """What a reply may hold, by message type (the wire contract above; ``d``: the
    dimension): the metrics and the array of :func:`~.packed_fsvrg.reply_keys` (test errors
    allowed), CoCoA+'s for ``train`` and ``evaluate`` when ``method`` is ``cocoa-plus``."""
    out = {}
    for kind, message_type in _MESSAGE_TYPES.items():
        cocoa = method == "cocoa-plus" and kind in ("train", "evaluate")
        ints, floats, array = reply_keys(message_type, cocoa, True)
        out[message_type] = ReplyContract.of([*ints, *floats],
                                             {array: ("d",)} if array else None)
    return out


def _counts(values: np.ndarray) -> np.ndarray:
    """Checkpointed statistics: integers as int64, a private (noisy) release's floats as
    float64."""
    return values.astype(np.float64 if values.dtype.kind == "f" else np.int64)


class DualLedger:
    """CoCoA+'s server-side bookkeeping: each task's share ``v_k`` of ``w`` and L_k.

    ``v_k = X_k^T alpha_k / (lam n)`` is the sum of task k's accepted ``d_w_k``; it is kept
    sparse (its nonzeros lie on node k's features), so the ledger holds about ``nnz(X)``
    numbers, not ``K d``.

    Attributes
    ----------
    last_accepted : ndarray (num_tasks,), int64
        The newest round whose reply from the task was added (0: none).
    """

    def __init__(self, num_tasks: int, dim: int) -> None:
        self.dim = int(dim)
        self.last_accepted = np.zeros(int(num_tasks), dtype=np.int64)
        self._shares: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def share(self, task: int) -> np.ndarray:
        """``v_k`` as a dense (d,) vector."""
        out = np.zeros(self.dim)
        if task in self._shares:
            idx, values = self._shares[task]
            out[idx] = values
        return out

    def reset(self, task: int) -> np.ndarray:
        """Forget task k's share (its node restarted from alpha = 0); return the old ``v_k``."""
        old = self.share(task)
        self._shares.pop(task, None)
        self.last_accepted[task] = 0
        return old

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The ledger as flat arrays (for checkpoints): tasks, offsets, indices, values."""
        tasks = np.array(sorted(self._shares), dtype=np.int64)
        parts = [self._shares[int(t)] for t in tasks]
        sizes = np.array([len(idx) for idx, _ in parts], dtype=np.int64)
        return {"last_accepted": self.last_accepted, "tasks": tasks,
                "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                "indices": np.concatenate([idx for idx, _ in parts] or [np.zeros(0, int)]
                                          ).astype(np.int64),
                "values": np.concatenate([v for _, v in parts] or [np.zeros(0)])}

    @classmethod
    def from_arrays(cls, num_tasks: int, dim: int, arrays: dict[str, np.ndarray]) -> DualLedger:
        """Inverse of :meth:`to_arrays`; ValueError on inconsistent arrays."""
        ledger = cls(num_tasks, dim)
        tasks, offsets = arrays["tasks"], arrays["offsets"]
        indices, values = arrays["indices"], arrays["values"]
        if (arrays["last_accepted"].shape != (num_tasks,) or offsets.shape != (len(tasks) + 1,)
                or int(offsets[-1]) != len(indices) or len(indices) != len(values)
                or (len(indices) and (indices.min() < 0 or indices.max() >= dim))
                or (len(tasks) and (tasks.min() < 0 or tasks.max() >= num_tasks))
                or not np.all(np.isfinite(values))):
            raise ValueError("checkpoint CoCoA+ ledger is inconsistent")
        ledger.last_accepted = arrays["last_accepted"].astype(np.int64)
        for j, task in enumerate(tasks):
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            ledger._shares[int(task)] = (indices[lo:hi].copy(), values[lo:hi].copy())
        return ledger

    def total(self) -> np.ndarray:
        """``w(alpha) = sum_k v_k``, in task order (O(nnz) over the shares)."""
        out = np.zeros(self.dim)
        for task in sorted(self._shares):
            idx, values = self._shares[task]
            out[idx] += values
        return out

    def dot(self, task: int, w: np.ndarray) -> float:
        """``w . v_k`` (O(nnz(v_k)))."""
        if task not in self._shares:
            return 0.0
        idx, values = self._shares[task]
        return float(w[idx] @ values)

    def add(self, task: int, d_w: np.ndarray, server_round: int) -> None:
        """Add an accepted ``d_w_k`` of ``server_round`` to ``v_k``."""
        v = self.share(task) + d_w
        idx = np.flatnonzero(v)
        self._shares[task] = (idx, v[idx])
        self.last_accepted[task] = int(server_round)


class FSVRG(TaskStrategy):
    """Federated SVRG (naive FSVRG, GD, CoCoA+, DANE) for one global sparse logistic model.

    Parameters
    ----------
    num_tasks : int or None
        Number of nodes ``K`` to wait for; task ids 0 .. K - 1. CoCoA+ uses
        ``sigma' = K``.
        None (the default): the distinct task ids of the nodes online once
        ``min_available_nodes`` are, counted when ``start`` runs (Flower's habit of sizing
        a run by its SuperNodes; :class:`~fmtl_flower.strategies.base.SizedAtStart`).
    method : {"fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane"}
    lam : float, optional
        ``lam > 0``; default ``1/n`` (the paper's), ``n`` the total of the discovered
        ``n-train``.
    h : float, optional
        Stepsize of the local pass. ``fsvrg``: ``h`` (the local one is ``h/n_k``), default 16
        (the best of 8/16/32 at K = 1000 in :mod:`fmtl_flower.core.fsvrg`). ``fsvrg-naive``:
        the stepsize itself, required (no safe default is known without the data).
    step : float, optional
        GD stepsize; default ``1/L`` with ``L = sigma_max(X)^2/(4n) + lam`` (the smoothness
        constant of ``f``), ``sigma_max(X)^2`` of the pooled rows estimated by power iteration
        on the pooled Gram operator before round 1 (``fsvrg_gram`` round trips, counted in
        ``exchanges``; the estimate is a lower bound that never decreases, so the step is
        at least ``1/L``, and ``1/L`` once it has converged). ``dane``: the SVRG
        stepsize of the local solver; default each node's
        :func:`~fmtl_flower.core.fsvrg.default_dane_step` ``1/(4 L_max,k)``.
    mu : float
        DANE's proximal parameter ``mu >= 0`` (the paper's default 0; ``eta`` is 1).
    local_epochs : int
        ``cocoa-plus``: SDCA passes over the node's rows per round; ``dane``: SVRG epochs on
        the local subproblem. Default 1 (one pass, as in the paper's Figure 2).
    eval_every : int
        Rounds between test-error evaluations (state 0 and the final one are always evaluated).
    seed : int
        Seed of the nodes' orders.
    discovery_timeout : float
        Seconds to wait, at round 1, for ``num_tasks`` nodes (at most ``start``'s
        ``timeout``; fewer than ``min_tasks`` raise ``DiscoveryError``).
    max_update_ratio : float
        Bound on a local model's (or ``d-w``'s) distance to ``w_t`` relative to
        max(|w_t|, 1) (> 0; module docstring).
    dim : int, optional
        The feature dimension when configured (None: by majority of the nodes).
    on_round : callable, optional
        Called with each completed record.
    settings : FSVRGSettings, optional
        The parameters above and the common knobs (``min_tasks``, Flower's) as one checked object
        (:mod:`fmtl_flower.settings`); keyword arguments override it.

    Attributes
    ----------
    w : ndarray (d,) or None
        The current model (zeros after discovery).
    stats : FeatureStats or None
        The sparsity statistics (``fsvrg``).
    ledger : DualLedger or None
        CoCoA+'s per-task shares of ``w`` and last-accepted rounds (after discovery).
    records : list of dict
        See the module docstring; read with :meth:`results`.
    privacy : FSVRGDP or None
        Client-level DP (:func:`fmtl_flower.strategies.privacy.enable_client_dp`), or None.
    """

    #: Settings this strategy derives its own value of (SettingsHome).
    derived_settings = frozenset({"h", "lam", "step"})

    privacy: Any = None

    def __init__(self, num_tasks: int | None = None, settings: FSVRGSettings | None = None,
                 *, dim: int | None = None, on_round: RoundCallback | None = None,
                 **kwargs: Any) -> None:
        s = FSVRGSettings.resolve(settings, kwargs)
        self.settings = s
        if num_tasks is None:  # built by start, for the tasks online
            self.build_at_start(partial(FSVRG.__init__, self, settings=s,
                                        dim=dim, on_round=on_round), s)
            return
        self.num_tasks = check_num_tasks(num_tasks)
        if s.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {s.method!r}")
        self.directory = TaskDirectory(self.num_tasks, _NAME, dim=dim)
        apply_settings(self, s)
        self.lam_arg = s.lam
        self.h = DEFAULT_H if s.h is None else s.h
        self.step_arg = s.step
        self.on_round = on_round
        self.ever_replied = np.zeros(self.num_tasks, dtype=bool)
        self.book = RoundRecords()  # one record per state (strategies/records.py)
        self.w: np.ndarray | None = None
        self.stats: FeatureStats | None = None
        self.ledger: DualLedger | None = None
        self.n_total: int | None = None
        self.lam: float | None = self.lam_arg
        self.step: float | None = self.step_arg
        self.gd_estimate: dict[str, Any] | None = None  # GD's L from power iteration
        self.exchanges = 0
        self._gd_replies = 0  # GD: the accepted gradient replies of the round's step
        self.replies = ReplyBoundary(_NAME, reply_contracts(s.method), lambda: {"d": self.dim})
        #: Each train / evaluate exchange's sent state, until its replies are read.
        self.sent_rounds = SentRounds(_NAME)
        self._round_start = 0.0
        self._seed_w: np.ndarray | None = None  # start()'s initial w0, until discovery
        #: The row counts devices are weighted by (robust: :func:`trusted_counts`).
        self.n_weight = np.zeros(self.num_tasks, dtype=np.int64)
        #: Each task's mean squared row norm as last accepted (robust mode's fence).
        self.mean_sq_norm = np.full(self.num_tasks, np.nan)

    @property
    def dim(self) -> int | None:
        return self.directory.dim

    # ------------------------------------------------------------------ Strategy interface
    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├── %s (%s): %d nodes, lambda=%s, %s", _NAME, self.method,
            self.num_tasks, "1/n" if self.lam_arg is None else f"{self.lam_arg:g}",
            self._solver_summary())
        log(INFO, "\t└── eval-every=%d, seed=%d", self.eval_every, self.seed)

    def _solver_summary(self) -> str:
        step = None if self.step_arg is None else f"{self.step_arg:g}"
        if self.method == "gd":
            return f"step={step or '1/L (L by power iteration)'}"
        if self.method == "dane":
            return (f"step={step or '1/(4 L_max,k)'}, mu={self.mu:g}, "
                    f"SVRG epochs={self.local_epochs}")
        if self.method == "cocoa-plus":
            return f"sigma'=K={self.num_tasks}, SDCA passes={self.local_epochs}"
        return f"h={self.h:g}"

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Setup (once), exchange 1 (gradient at w_t), then the local-pass messages
        (CoCoA+: only these)."""
        self._round_start = time.perf_counter()
        wait = self.discovery_timeout if server_round == self.first_round else 0.0
        self.directory.discover(grid, wait=wait, query_timeout=max(self.round_timeout, 60.0))
        if self._checkpoint_n_train is not None:
            self._check_resumed_data()
        self._update_weights()
        if self.w is None:
            self._init_model()
        if self.method == "fsvrg" and self.stats is None:
            self._setup(grid)
        if self.method == "gd" and self.step is None:
            self._estimate_step(grid)
        if len(self.records) < server_round:
            self._new_record(server_round - 1)
        evaluate = (server_round - 1) % self.eval_every == 0
        if self.method == "cocoa-plus":  # one exchange; its replies complete the record
            return self._train_messages(grid, server_round, evaluate)
        sent, accepted = self._gradient_exchange(grid, server_round, evaluate)
        self.exchanges += 1
        completed = self._complete_record(server_round - 1, accepted, sent.w)
        if evaluate and accepted:  # f(w_{r-1}) and its test errors came with exchange 1
            self.report_evaluation(server_round - 1, completed, accepted)
        self._gd_replies = 0
        if not accepted:
            log(WARNING, "%s round %d: no gradient reply; the model is kept", _NAME,
                server_round)
            return []
        n_rep = int(sum(self.n_weight[t] for t in accepted)) if self.privacy is None \
            else int(self.n_weight.sum())  # DP: a fixed denominator (privacy.FSVRGDP)
        grad_sum = self._gradient_sum(accepted)
        assert self.lam is not None and sent.w is not None
        g = global_gradient(sent.w, grad_sum, n_rep, self.lam)
        if self.method == "gd":
            assert self.step is not None
            w = gd_step(sent.w, g, self.step)
            if all_finite(w):
                self.w = w
                self._gd_replies = len(accepted)
            else:  # the bounds make this unreachable: belt and braces
                self._reject_round(server_round, accepted)
            return []
        return self._train_messages(grid, server_round, g=g)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Aggregate the local models (or CoCoA+'s ``d_w``) and open the next record."""
        assert self.w is not None
        if len(self.records) > server_round:  # this round was aggregated already
            drop_unsent(self.replies, MessageType.TRAIN, server_round, replies)
            return None, MetricRecord({"num-replies": 0, "exchanges": self.exchanges})
        num_resets = None
        sent = None if self.method == "gd" else \
            self.sent_rounds.take(MessageType.TRAIN, server_round)
        if self.method == "gd":  # its step was taken in configure_train
            num_replies = self._gd_replies
        elif sent is None:  # no train messages were sent (no gradient reply)
            replies = list(replies)
            if replies:
                drop_unsent(self.replies, MessageType.TRAIN, server_round, replies)
            num_replies = 0
        elif self.method == "cocoa-plus":
            num_replies, num_resets = self._aggregate_cocoa_plus(sent, replies)
        else:
            self.exchanges += 1
            accepted = self._read_replies(sent, replies)
            w = self._aggregate_models(accepted, sent)
            if not all_finite(w):  # the bounds make this unreachable: belt and braces
                self._reject_round(server_round, accepted)
                w, accepted = self.w, {}
            self.w = w
            num_replies = len(accepted)
        record = self._new_record(server_round)
        record.update(num_replies=num_replies,
                      wall_time_s=time.perf_counter() - self._round_start)
        if num_resets is not None:
            record["num_resets"] = num_resets
        return (ArrayRecord({"w": to_array(self.w)}),
                MetricRecord({"num-replies": num_replies, "exchanges": self.exchanges}))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Nothing, except after the last round: f(w_R) and the test error."""
        if self.num_rounds is None or server_round != self.num_rounds or self.w is None:
            return []
        sent, messages = self._loss_exchange(grid, "evaluate", server_round, True)
        self.sent_rounds.add(sent)
        return messages

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Complete the final record."""
        if self.num_rounds is None or server_round != self.num_rounds or self.w is None:
            return None
        sent = self.sent_rounds.take(MessageType.EVALUATE, server_round)
        if sent is None:  # never sent, or read already
            drop_unsent(self.replies, MessageType.EVALUATE, server_round, replies)
            return None
        accepted = self._read_replies(sent, replies)
        record = self._complete_record(server_round, accepted, sent.w)
        return MetricRecord({k: float(v) for k, v in record.items()
                             if isinstance(v, int | float) and not isinstance(v, bool)})

    # ------------------------------------------------------------------ server steps
    def _init_model(self) -> None:
        """``w = 0``, ``n`` and ``lam`` (default ``1/n``) from the discovered nodes."""
        if self.dim is None:
            raise RuntimeError(f"{_NAME} found no usable node: check the ClientApp and "
                               "the nodes' task ids")
        self.w = np.zeros(self.dim)
        if self._seed_w is not None:  # start()'s initial_arrays: the primal start
            check_initial_dim(self._seed_w, self.dim, "w", _NAME)
            self.w, self._seed_w = self._seed_w, None
        self.n_total = int(self.n_weight.sum())
        if self.lam is None:
            self.lam = 1.0 / float(self.n_total)
        if self.method == "cocoa-plus":
            self.ledger = DualLedger(self.num_tasks, self.dim)

    def seed_model(self, initial_arrays: ArrayRecord) -> None:
        """Start from ``initial_arrays`` = ``ArrayRecord([w0])`` (or key ``"w"``), w0 of shape
        (d,): the primal methods (``fsvrg``, ``fsvrg-naive``, ``gd``, ``dane``) take w = w0
        before round 1. ``cocoa-plus`` keeps w = w(alpha) tied to the nodes' duals
        and is refused."""
        if len(initial_arrays) == 0:
            return
        if self.method == "cocoa-plus":
            raise ValueError(f"{_NAME} method 'cocoa-plus' keeps w tied to the nodes' dual "
                             "variables (w = sum_k X_k^T alpha_k / (lam n)); it cannot start "
                             "from initial_arrays. Use a primal method or start from w = 0")
        self._seed_w = initial_model(initial_arrays, "w", None, _NAME, self.directory.dim)

    def _aggregate_models(self, accepted: dict[int, dict[str, Any]],
                          sent: FSVRGSentExchange) -> np.ndarray:
        """The next ``w`` from the accepted local models (``fsvrg`` / naive / ``dane``),
        around the w_t ``sent`` (the models' starting point)."""
        w_t = sent.w
        assert w_t is not None
        tasks = sorted(accepted)
        models = [accepted[t]["w-local"] for t in tasks]
        if self.privacy is not None and self.method == "fsvrg":  # DP: A x a noisy mean
            assert self.stats is not None
            return w_t + self.stats.a * self.privacy.mean_update(
                w_t, models, [int(self.n_weight[t]) for t in tasks], self.n_weight,
                self.records, self._dp_releases())
        if self.privacy is not None:  # client-level DP: clipped, over K, noised
            models, std = self.privacy.local_models(w_t, models, self.num_tasks,
                                                    self.records, self._dp_releases())
            w = dane_aggregate(models) if self.method == "dane" else \
                naive_fsvrg_aggregate(w_t, models)
            return self.privacy.noisy(w, std)
        if self.robust and models:
            models = list(self._clipped(np.array(models), w_t, tasks, "w-local - w"))
        if self.method == "fsvrg":
            assert self.stats is not None
            return fsvrg_aggregate(w_t, models, [int(self.n_weight[t]) for t in tasks],
                                   self.stats.a, n=self.stats.n)
        if self.method == "dane":
            return dane_aggregate(models) if models else w_t.copy()
        return naive_fsvrg_aggregate(w_t, models)

    def _aggregate_cocoa_plus(self, sent: FSVRGSentExchange,
                              replies: Iterable[Message]) -> tuple[int, int]:
        """Complete record r - 1, drop the shares of restarted nodes, add the ``d_w_k`` (the
        replies to the train exchange ``sent`` of round r).

        Returns the numbers of accepted replies and of resets.
        """
        assert self.w is not None and self.ledger is not None
        server_round = sent.server_round
        self.exchanges += 1
        accepted = self._read_replies(sent, replies)
        completed = self._complete_record(server_round - 1, accepted, sent.w)  # the w_t sent
        if sent.evaluate and accepted:
            self.report_evaluation(server_round - 1, completed, accepted)
        tasks = sorted(accepted)
        resets = [t for t in tasks if not accepted[t]["state-ok"]]
        w = self.w
        for task in resets:
            w = w - self.ledger.share(task)
        d_ws = {t: accepted[t]["d-w"] for t in tasks}
        if self.privacy is not None:  # client-level DP: clipped again (to the dp-clip
            # the devices were sent), the sum noised
            clipped, d_w_sum = self.privacy.dual_step_sum(
                list(d_ws.values()), self.num_tasks, self.records, self._dp_releases(),
                clip=sent.dp_clip)
            d_ws = dict(zip(tasks, clipped, strict=True))
        else:
            d_w_sum = np.zeros(self.ledger.dim)
            for task in tasks:
                d_w_sum += d_ws[task]
        w = cocoa_plus_aggregate(w, d_w_sum)
        if not all_finite(w):  # the bounds make this unreachable: belt and braces
            self._reject_round(server_round, accepted)
            return 0, 0
        for task in resets:
            self.ledger.reset(task)
        if resets:
            log(WARNING, "%s round %d: tasks %s lost their dual state and restarted from "
                "alpha = 0; their shares of w were removed", _NAME, server_round, resets[:20])
        for task in tasks:
            self.ledger.add(task, d_ws[task], server_round)
        self.w = w
        return len(tasks), len(resets)

    @staticmethod
    def _reject_round(server_round: int, accepted: dict[int, dict[str, Any]]) -> None:
        log(WARNING, "%s round %d: the step left w non-finite; not taken, the replies of tasks "
            "%s rejected", _NAME, server_round, sorted(accepted)[:20])

    # ------------------------------------------------------------------ exchanges
    def _setup(self, grid: Grid) -> None:
        """Query every node's feature counts once and build the statistics."""
        assert self.dim is not None
        sent, messages = self._send(grid, "stats", 0, {}, {})
        replies = grid.send_and_receive(messages, timeout=self.round_timeout)
        accepted = self._read_replies(sent, replies)
        self.exchanges += 1
        if self.privacy is not None and accepted:  # client-level DP: one noisy release
            tasks = sorted(accepted)
            self.stats = self.privacy.feature_stats(
                [self._trusted_counts_of(t, accepted[t]) for t in tasks],
                [int(self.n_weight[t]) for t in tasks], self.n_weight, self.records,
                self._dp_releases())
            log(INFO, "%s: private statistics from %d of %d nodes (n = %d)", _NAME,
                len(tasks), self.num_tasks, self.stats.n)
            return
        acc = FeatureCountAccumulator(self.dim)
        for task in sorted(accepted):
            acc.add(int(self.n_weight[task]), self._trusted_counts_of(task, accepted[task]))
        if acc.n <= 0:
            raise RuntimeError(f"{_NAME}: no node sent its feature counts")
        self.stats = acc.result()
        log(INFO, "%s: statistics from %d of %d nodes (n = %d)", _NAME, self.stats.num_nodes,
            self.num_tasks, self.stats.n)

    def _estimate_step(self, grid: Grid) -> None:
        """GD's default step 1/L: power iteration on the pooled Gram operator, one round trip
        per iteration (see the module docstring)."""
        assert self.dim is not None and self.lam is not None and self.n_total is not None
        v, estimate, iterations = gram_power_start(self.seed, self.dim), 0.0, 0
        while iterations < GD_POWER_MAX_ITER:
            sent, messages = self._send(grid, "gram", 0, {}, {"v": v})
            replies = grid.send_and_receive(messages, timeout=self.round_timeout)
            accepted = self._read_replies(sent, replies)
            self.exchanges += 1
            iterations += 1
            if not accepted:
                raise RuntimeError(f"{_NAME}: no node answered GD's power iteration for L")
            u = self._gram_sum(accepted)
            previous = estimate
            estimate, v = power_estimate(v, u)
            if self.robust:  # an honest estimate never decreases (core.fsvrg.gd)
                estimate = max(estimate, previous)
            if estimate <= previous * (1.0 + GD_POWER_TOL):
                break
        L = gd_smoothness(estimate, self.n_total, self.lam)
        self.step = 1.0 / L
        self.gd_estimate = {"L_estimate": L, "power_iterations": iterations}
        log(INFO, "%s: GD step 1/L = %.6g, L = %.6g from %d power iterations", _NAME, self.step,
            L, iterations)

    def _gram_sum(self, accepted: dict[int, dict[str, Any]]) -> np.ndarray:
        """``sum_k gram-v_k`` in task order (client-level DP: a clipped, noised release)."""
        tasks = sorted(accepted)
        if self.privacy is not None:
            return self.privacy.gradient_sum(
                [accepted[t]["gram-v"] for t in tasks], [int(self.n_train[t]) for t in tasks],
                self.n_train, self.records, self._dp_releases(), stream="gram")
        u = np.zeros(self.dim or 0)
        for task in tasks:
            u += accepted[task]["gram-v"]
        return u

    def _dp_releases(self) -> int:
        """The run's Gaussian releases under client-level DP (to calibrate a target
        epsilon): a gradient per round, a local model per round (fsvrg, fsvrg-naive, dane),
        fsvrg's statistics once, GD's power iterations at most (without a ``step``), and
        CoCoA+'s one ``d_w`` sum per round."""
        rounds = int(self.num_rounds or 1)
        if self.method == "gd":
            return rounds + (GD_POWER_MAX_ITER if self.step_arg is None else 0)
        if self.method == "cocoa-plus":
            return rounds
        return 2 * rounds + (1 if self.method == "fsvrg" else 0)

    def _gradient_exchange(self, grid: Grid, server_round: int, evaluate: bool
                           ) -> tuple[FSVRGSentExchange, dict[int, dict[str, Any]]]:
        """Exchange 1 of round r: the gradient at w_t, sent and read against what was
        sent."""
        sent, messages = self._loss_exchange(grid, "gradient", server_round, evaluate)
        replies = grid.send_and_receive(messages, timeout=self.round_timeout)
        return sent, self._read_replies(sent, replies)

    def _loss_exchange(self, grid: Grid, kind: str, server_round: int, evaluate: bool
                       ) -> tuple[FSVRGSentExchange, list[Message]]:
        """The ``gradient`` or ``evaluate`` exchange at the current ``w``."""
        assert self.w is not None
        config: dict[str, Any] = {"server-round": server_round, "eval": bool(evaluate)}
        if self.ledger is not None:  # CoCoA+'s evaluate: commit or roll back first
            config["method"] = self.method
        return self._send(grid, kind, server_round, config, {"w": self.w}, evaluate)

    def _train_messages(self, grid: Grid, server_round: int, evaluate: bool = False,
                        g: np.ndarray | None = None) -> list[Message]:
        """The round's ``train`` messages (``g``: the gradient of exchange 1, all methods
        but CoCoA+); their sent state is kept in :attr:`sent_rounds` until
        :meth:`aggregate_train` reads the replies."""
        assert self.w is not None and self.lam is not None
        arrays = {"w": self.w}
        if self.method != "cocoa-plus":
            assert g is not None
            arrays["g"] = g
        if self.method == "fsvrg":
            assert self.stats is not None
            arrays["phi"] = self.stats.phi
        common = {"server-round": server_round, "seed": self.seed, "method": self.method,
                  "lam": self.lam, **self._solver_config(evaluate)}
        if self.privacy is not None:  # client-level DP client-clip (cocoa-plus): dp-clip
            common.update(self.privacy.wire_config())
        sent, messages = self._send(grid, "train", server_round, common, arrays, evaluate)
        self.sent_rounds.add(sent)
        return messages

    def _send(self, grid: Grid, kind: str, server_round: int, config: dict[str, Any],
              arrays: dict[str, np.ndarray], evaluate: bool = False
              ) -> tuple[FSVRGSentExchange, list[Message]]:
        """One exchange's sent state (:meth:`_sent_exchange`) and its messages, made from it
        alone: one stacked message per packed node that speaks the stacking protocol
        ``"fsvrg"`` (:mod:`~fmtl_flower.strategies.packed_fsvrg`: the config and arrays once,
        the task ids and last-accepted rounds as vectors), one message per task otherwise
        (the config plus the task's ``task-id`` and CoCoA+'s commit-protocol keys)."""
        targets = dict(self.task_to_node)
        groups: list[StackGroup] = []
        stacked_groups = getattr(grid, "stacked_groups", None)
        if callable(stacked_groups):
            groups, targets = stacked_groups(STACKING_PROTOCOL, targets)
        sent = self._sent_exchange(kind, server_round, config, arrays, evaluate,
                                   targets, tuple(groups))
        return sent, self._messages(sent)

    def _sent_exchange(self, kind: str, server_round: int, config: dict[str, Any],
                       arrays: dict[str, np.ndarray], evaluate: bool = False,
                       chosen: dict[int, int] | None = None,
                       stacks: tuple[StackGroup, ...] = ()) -> FSVRGSentExchange:
        """What an exchange sends, fixed before a message is made (a new exchange of the
        trust boundary): read-only copies of ``arrays``, |w_t| and, for CoCoA+'s train and
        evaluate, the commit-protocol keys and each task's w_t . v_k."""
        frozen = MappingProxyType({k: frozen_array(v) for k, v in arrays.items()})
        w = frozen.get("w")
        protocol, last_accepted, coupling = {}, None, None
        if self.ledger is not None and kind in ("train", "evaluate"):
            protocol = {RUN_TOKEN_KEY: self.sent_identity}
            if self.checkpoint_dir is not None:
                protocol["checkpoint-round"] = int(self.last_checkpoint_round)
            last_accepted = frozen_array(self.ledger.last_accepted, np.int64)
            assert w is not None
            coupling = frozen_array([self.ledger.dot(t, w) for t in range(self.num_tasks)],
                                    np.float64)
        return FSVRGSentExchange(
            server_round, kind, _MESSAGE_TYPES[kind], bool(evaluate),
            MappingProxyType(dict(config)), frozen,
            w_norm=0.0 if w is None else float(norm(w)), protocol=MappingProxyType(protocol),
            last_accepted=last_accepted, coupling=coupling,
            chosen=MappingProxyType(dict(chosen or {})), stacks=stacks,
            exchange=self.replies.begin())

    def _messages(self, sent: FSVRGSentExchange) -> list[Message]:
        """The messages of the exchange ``sent`` (:meth:`_send`), each registered in its
        :class:`~fmtl_flower.strategies.trust.Exchange`."""
        encoded = {key: to_array(value) for key, value in sent.arrays.items()}
        messages = []
        per_task = {} if sent.last_accepted is None else \
            {"last-accepted-round": sent.last_accepted}
        shared = {**sent.config, **sent.protocol}
        for group in sent.stacks:
            messages.append(sent.exchange.track_stack(group, stacked_message(
                group, sent.message_type, shared, encoded, per_task)))
        for task, node in sorted(sent.chosen.items()):
            task_config = {"task-id": task, **sent.config}
            if sent.last_accepted is not None:  # CoCoA+'s commit protocol
                task_config["last-accepted-round"] = int(sent.last_accepted[task])
                task_config.update(sent.protocol)
            records: dict[str, Any] = {"config": ConfigRecord(task_config)}
            if encoded:
                records["arrays"] = ArrayRecord(encoded)
            messages.append(sent.exchange.track(task, node, Message(
                RecordDict(records), dst_node_id=node, message_type=sent.message_type)))
        return messages

    def _solver_config(self, evaluate: bool) -> dict[str, Any]:
        """The method's keys of a ``train`` config (see the wire contract)."""
        if self.method == "cocoa-plus":
            return {"n": self.n_total, "sigma-prime": float(self.num_tasks),
                    "epochs": self.local_epochs, "eval": bool(evaluate)}
        if self.method == "dane":
            out: dict[str, Any] = {"mu": self.mu, "epochs": self.local_epochs}
            if self.step is not None:
                out["step"] = self.step
            return out
        return {"h": self.h}

    # ------------------------------------------------------------------ replies
    def _read_replies(self, sent: FSVRGSentExchange, replies: Iterable[Message]
                      ) -> dict[int, dict[str, Any]]:
        """Validated replies to the exchange ``sent``, keyed by task, in task order, checked
        against what it sent; invalid ones are logged and left out
        (:class:`~fmtl_flower.strategies.trust.ReplyBoundary`)."""
        def on_accept(task: int) -> None:
            self.ever_replied[task] = True

        kind = sent.kind
        where = "setup" if kind in ("stats", "gram") else \
            f"round {sent.server_round} ({kind})"
        accepted = self.replies.read(
            where, replies,
            lambda reply, task: self._parse_reply(reply, task, sent),
            None,
            lambda reply, group: self._parse_stack(reply, group, sent),
            exchange=sent.exchange).accepted
        if self.robust and self.privacy is None:  # DP: no device's fate hangs on another's
            accepted = self._federation_checks(where, accepted, sent)
        for task in accepted:
            on_accept(task)
        return accepted

    # ------------------------------------------------------------------ robust mode
    def _update_weights(self) -> None:
        """:attr:`n_weight` from the discovered counts (robust: capped by
        :func:`~fmtl_flower.core.fsvrg.robust.trusted_counts`; each new cap logged)."""
        if not self.robust:
            self.n_weight = self.n_train.copy()
            return
        # CoCoA+ weights every row by 1/n (its devices' duals): no share cap, and its n must
        # stay >= each honest device's n_k (the device checks it)
        share = 1.0 if self.method == "cocoa-plus" else self.max_weight_share
        weight = trusted_counts(self.n_train, self.directory.max_n, share)
        capped = np.flatnonzero((weight != self.n_train) & (weight != self.n_weight))
        if capped.size:
            log(WARNING, "%s: row counts capped by what the federation makes plausible "
                "(robust; fence and max-weight-share %g): %s", _NAME, share,
                ", ".join(f"task {t} {self.n_train[t]} -> {weight[t]}" for t in capped[:20]))
        self.n_weight = weight

    def _federation_checks(self, where: str, accepted: dict[int, dict[str, Any]],
                           sent: FSVRGSentExchange) -> dict[int, dict[str, Any]]:
        """Robust mode: the accepted replies to the exchange ``sent`` checked against what
        the federation makes plausible (:mod:`fmtl_flower.core.fsvrg.robust`); a reply that
        fails is logged and rejected like one that failed its own checks."""
        if sent.kind == "gram":
            problems = self._gram_problems(accepted, sent.arrays["v"])
        elif "sq-norm-sum" in next(iter(accepted.values()), {}):
            problems = self._sq_norm_problems(accepted, sent)
            if sent.kind == "train":  # CoCoA+'s d-w
                problems.update(self._d_w_outliers(
                    {t: r for t, r in accepted.items() if t not in problems}))
            for task, reply in accepted.items():  # the fence remembers accepted replies only
                if task not in problems:
                    self.mean_sq_norm[task] = reply["sq-norm-sum"] / max(
                        int(self.n_weight[task]), 1)
        else:
            problems = {}
        last = self.replies.last
        for task, reason in problems.items():
            log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", _NAME, where, task,
                self.task_to_node.get(task), reason)
            if last is not None:
                last.accepted.pop(task, None)
                last.failed[task] = reason
        return {t: r for t, r in accepted.items() if t not in problems}

    def _gram_problems(self, accepted: dict[int, dict[str, Any]],
                       v: np.ndarray) -> dict[int, str]:
        """GD's Gram replies that cannot be ``X_k^T X_k v`` (``v`` as sent) for a plausible
        ``X_k``: ``v . u_k < 0``, or a Rayleigh quotient above the federation's fence per row
        times the task's trusted ``n_k``."""
        quotients = {}
        for task, reply in accepted.items():
            u = reply["gram-v"]
            vu = float(v @ u)
            if vu > 0:
                quotients[task] = float(u @ u) / vu / max(int(self.n_weight[task]), 1)
        fence = log_upper_fence(np.array(list(quotients.values())), factor=QUOTIENT_FACTOR)
        problems = {}
        for task, reply in accepted.items():
            why = gram_reply_problem(v, reply["gram-v"], fence * int(self.n_weight[task]))
            if why is not None:
                problems[task] = why
        return problems

    def _sq_norm_problems(self, accepted: dict[int, dict[str, Any]],
                          sent: FSVRGSentExchange) -> dict[int, str]:
        """Cap each reply's ``sq-norm-sum`` at the federation's fence of mean squared row
        norms (this round's and the tasks' earlier ones, :attr:`mean_sq_norm`) times its
        trusted ``n_k``, and check the bounds that depend on it again (``data-norm`` becomes
        ``sqrt(n_k S_k)`` with the trusted values). :attr:`mean_sq_norm` is left to the
        caller: a reply that passes here may still be rejected by another fence."""
        mean_sq = self.mean_sq_norm.copy()
        for task, reply in accepted.items():
            mean_sq[task] = reply["sq-norm-sum"] / max(int(self.n_weight[task]), 1)
        fence = log_upper_fence(mean_sq, factor=SQ_NORM_FACTOR)
        problems = {}
        for task, reply in accepted.items():
            n = int(self.n_weight[task])
            reply["sq-norm-sum"] = min(reply["sq-norm-sum"], fence * n)
            reply["data-norm"] = math.sqrt(n * reply["sq-norm-sum"])
            try:
                self._check_data_bounds(reply, task, sent)
            except ReplyError as err:
                problems[task] = f"{err} (sq-norm-sum capped by the federation's fence)"
        return problems

    def _d_w_outliers(self, accepted: dict[int, dict[str, Any]]) -> dict[int, str]:
        """CoCoA+'s replies after which the task's share of ``w``, ``|v_k + d-w|``, is an
        outlier of the round (:func:`~fmtl_flower.core.fsvrg.robust.share_outliers`: per row
        of the task above the round's log-scale fence, and above a twentieth of its verifiable
        bound ``sqrt(n_k S_k) / (lam n)``): what one device adds up over the rounds stays what
        the federation's shares make plausible. Rejected rather than clipped: a rejected reply
        rolls the device back (design decision 4), so ``w`` stays ``w(alpha)``; a clipped one
        would not."""
        assert self.ledger is not None and self.lam is not None and self.n_total is not None
        tasks = sorted(accepted)
        sizes = np.array([float(norm((self.ledger.share(t) if accepted[t]["state-ok"] else 0.0)
                                     + accepted[t]["d-w"])) for t in tasks])
        rows = np.array([max(int(self.n_weight[t]), 1) for t in tasks], dtype=np.float64)
        bounds = np.array([accepted[t]["data-norm"] for t in tasks]) / (self.lam * self.n_total)
        outlier, fence = share_outliers(sizes, rows, bounds)
        return {t: f"|the task's share of w| / n-train = {sizes[i] / rows[i]:.6g} above the "
                   f"round's fence {fence:.6g}, and {sizes[i] / bounds[i]:.3g} of its bound "
                   f"sqrt(n-train sq-norm-sum) / (lambda n) (more than {SHARE_BOUND_FLOOR:g})"
                for i, t in enumerate(tasks) if outlier[i]}

    def _check_data_bounds(self, reply: dict[str, Any], task: int,
                           sent: FSVRGSentExchange) -> None:
        """The bounds that follow from ``data-norm`` (module docstring), at the w_t ``sent``;
        CoCoA+'s share of ``w`` after the reply is one ``|X_k^T alpha_k| / (lam n)`` too."""
        n = int(self.n_weight[task])
        check_bound("loss-sum", reply["loss-sum"] * n / reply["n-train"],
                    n * _LN2 + sent.w_norm * reply["data-norm"],
                    "n-train log 2 + |w| sqrt(n-train sq-norm-sum)")
        if "grad-sum" in reply:
            check_bound("|grad-sum|", norm(reply["grad-sum"]) * n / reply["n-train"],
                        reply["data-norm"], "sqrt(n-train sq-norm-sum) >= sum_i |x_i|")
            if sent.w is not None:
                why = gradient_pairing_problem(sent.w, reply["grad-sum"], reply["loss-sum"],
                                               reply["n-train"])
                if why is not None:
                    raise ReplyError(why)
        if "d-w" in reply:
            assert self.lam is not None and self.n_total is not None and self.ledger
            limit = reply["data-norm"] / (self.lam * self.n_total)
            share = self.ledger.share(task) if reply["state-ok"] else 0.0
            check_bound("|d-w|", norm(reply["d-w"]), limit,
                        "sqrt(n-train sq-norm-sum) / (lambda n) for y alpha in [0, 1]")
            check_bound("|the task's share of w|", norm(share + reply["d-w"]), limit,
                        "sqrt(n-train sq-norm-sum) / (lambda n) for y alpha in [0, 1]")

    def _trusted_counts_of(self, task: int, reply: dict[str, Any]) -> np.ndarray:
        """A task's feature counts scaled to its trusted row count (unchanged if equal)."""
        n, counts = int(self.n_weight[task]), reply["counts"]
        if n == reply["n-train"]:
            return counts
        return np.minimum(np.floor(counts * (n / reply["n-train"])), n).astype(np.int64)

    def _scaled(self, task: int, reply: dict[str, Any], key: str) -> Any:
        """A reply's sum ``key`` over its rows rescaled to the task's trusted row count
        (the value itself, bit for bit, when that is the reported count)."""
        n = int(self.n_weight[task])
        return reply[key] if n == reply["n-train"] else reply[key] * (n / reply["n-train"])

    def _gradient_sum(self, accepted: dict[int, dict[str, Any]]) -> np.ndarray:
        """``sum_k grad-sum_k`` in task order; robust: each ``grad-sum_k / n_k`` (a row's
        mean gradient) clipped around 0 to :data:`~fmtl_flower.core.fsvrg.robust.
        GRADIENT_CLIP_FACTOR` times their median norm
        (:func:`~fmtl_flower.core.fsvrg.robust.clip_rows`) and weighted by the trusted
        ``n_k``."""
        tasks = sorted(accepted)
        grads = [self._scaled(t, accepted[t], "grad-sum") for t in tasks]
        if self.privacy is not None:  # client-level DP: clipped, noised (privacy.FSVRGDP)
            return self.privacy.gradient_sum(
                grads, [int(self.n_weight[t]) for t in tasks], self.n_weight, self.records,
                self._dp_releases())
        if self.robust and tasks:
            n = np.array([float(self.n_weight[t]) for t in tasks])
            per_row = np.array(grads) / n[:, None]
            clipped = self._clipped(per_row, np.zeros(per_row.shape[1]), tasks,
                                    "grad-sum / n-train", changed_only=True,
                                    factor=GRADIENT_CLIP_FACTOR)
            for i in clipped:
                grads[i] = clipped[i] * n[i]
        grad_sum = np.zeros(self.dim or 0)
        for g in grads:
            grad_sum += g
        return grad_sum

    def _clipped(self, rows: np.ndarray, center: np.ndarray, tasks: list[int], what: str,
                 changed_only: bool = False, factor: float = CLIP_FACTOR) -> Any:
        """``rows`` clipped to ``factor`` times the median of their distances to ``center``,
        logged; with ``changed_only`` just ``{row index: clipped row}`` of the moved rows."""
        out, radius, moved = clip_rows(rows, center, factor)
        if moved.any():
            log(INFO, "%s: |%s| of tasks %s clipped to %.6g (%g x the median)", _NAME, what,
                [tasks[i] for i in np.flatnonzero(moved)][:20], radius, factor)
        if changed_only:
            return {int(i): out[i] for i in np.flatnonzero(moved)}
        return out

    def _array(self, reply: Message, key: str, integer: bool = False) -> np.ndarray:
        arrays = arrays_of(reply)
        if arrays is None or key not in arrays:
            raise ReplyError(f"array {key!r} missing")
        v = from_array(arrays[key])
        ok_dtype = v.dtype.kind in "iu" if integer else v.dtype == np.float64
        if not ok_dtype or v.shape != (self.dim,):
            raise ReplyError(f"{key!r} must be {'integer' if integer else 'float64'} of shape "
                             f"({self.dim},), got {v.dtype} {v.shape}")
        if not integer and not np.all(np.isfinite(v)):
            raise ReplyError(f"{key!r} has non-finite values")
        return v

    def _parse_reply(self, reply: Message, task: int,
                     sent: FSVRGSentExchange) -> dict[str, Any]:
        """A one-task reply's values, typed (its keys: :func:`~.packed_fsvrg.reply_keys`, as
        for a stacked reply's rows), then :meth:`_check_values` against the exchange
        ``sent``."""
        ints, floats, matrix = reply_keys(sent.message_type, self._cocoa(sent.kind), False)
        out = read_metrics(reply, ints=tuple(ints), numbers=tuple(floats),
                           optional_ints=_TEST_KEYS if floats else ())
        if matrix is not None:
            out[matrix] = self._array(reply, matrix, integer=matrix == "counts")
        return self._check_values(out, task, sent)

    def _cocoa(self, kind: str) -> bool:
        """Whether a ``kind`` exchange is CoCoA+'s (its replies carry the dual)."""
        return self.method == "cocoa-plus" and kind in ("train", "evaluate")

    def _parse_stack(self, reply: Message, group: StackGroup, sent: FSVRGSentExchange
                     ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """The rows of a stacked reply (:mod:`~fmtl_flower.strategies.packed_fsvrg`) as
        :meth:`_parse_reply` gives one reply's values (the same checks, each row's in turn;
        types and shapes over all rows at once), and the rejected tasks with their
        reasons."""
        assert self.dim is not None
        return read_stacked_reply(
            reply, group, sent.message_type, self._cocoa(sent.kind), self.dim,
            lambda row, task: self._check_values(row, task, sent))

    def _check_values(self, out: dict[str, Any], task: int,
                      sent: FSVRGSentExchange) -> dict[str, Any]:
        """A reply's typed values checked against the exchange ``sent`` (task, round,
        n-train, the bounds of the module docstring); ReplyError names the first failing
        check. The arrays are float64 (d,) and finite (``counts``: integer) already."""
        kind = sent.kind
        if kind in ("stats", "gram"):
            if out["task-id"] != task:
                raise ReplyError(f"reply for task {out['task-id']}, expected {task}")
        else:
            self._check_round_metrics(out, sent)
            check_task_and_round(out, task, sent.server_round)
        if out["n-train"] != self.n_train[task]:
            raise ReplyError(f"n-train {out['n-train']} differs from {self.n_train[task]}")
        if kind == "stats":
            counts = out["counts"]
            if np.any(counts < 0) or np.any(counts > out["n-train"]):
                raise ReplyError(f"counts must be in [0, n-train = {out['n-train']}]")
        elif kind == "gradient":
            check_bound("|grad-sum|", norm(out["grad-sum"]), out["data-norm"],
                        "sqrt(n-train sq-norm-sum) >= sum_i |x_i|")
        elif kind == "train":
            self._check_step(out, sent)
        if self._cocoa(kind):
            self._check_pair(out, task, sent)
        return out

    def _check_step(self, out: dict[str, Any], sent: FSVRGSentExchange) -> None:
        """A train reply's step against the w_t ``sent``: ``|w-local - w_t|`` (CoCoA+:
        ``|d-w|``) within ``max_update_ratio`` times ``max(|w_t|, 1)``; CoCoA+'s ``|d-w|``
        also within ``sqrt(n-train sq-norm-sum) / (lam n)``. (Under client-level DP a
        ``d-w`` above the ``dp-clip`` sent is clipped to it, not rejected:
        :meth:`_aggregate_cocoa_plus`.)"""
        w_t = sent.w
        assert w_t is not None
        limit = self.max_update_ratio * max(sent.w_norm, 1.0)
        why = "max_update_ratio %g x max(|w|, 1)"
        if self.method != "cocoa-plus":
            check_bound("|w-local - w|", norm(out["w-local"] - w_t), limit, why,
                        self.max_update_ratio)
            return
        assert self.lam is not None and self.n_total is not None
        size = norm(out["d-w"])
        check_bound("|d-w|", size, limit, why, self.max_update_ratio)
        check_bound("|d-w|", size, out["data-norm"] / (self.lam * self.n_total),
                    "sqrt(n-train sq-norm-sum) / (lambda n) for y alpha in [0, 1]")

    def _check_pair(self, out: dict[str, Any], task: int, sent: FSVRGSentExchange) -> None:
        """The certificate's check of a CoCoA+ reply's (``loss-sum``, ``dual-sum``) at the
        w_t ``sent`` and the task's share v_k of it then (:func:`~fmtl_flower.core.
        certificate.logistic_pair_problem`: the dual box, and Fenchel-Young's
        loss-sum - dual-sum + lam n (w_t . v_k) >= 0; a node that restarted from alpha = 0
        has v_k = 0 on its side); ReplyError if it fails. Always on: an honest pair passes
        it."""
        assert sent.coupling is not None
        assert self.lam is not None and self.n_total is not None
        coupling = self.lam * self.n_total * float(sent.coupling[task]) \
            if out["state-ok"] == 1 else 0.0
        reason = logistic_pair_problem(out["loss-sum"], out["dual-sum"], out["n-train"],
                                       coupling)
        if reason is not None:
            raise ReplyError(reason)

    def _check_round_metrics(self, out: dict[str, Any], sent: FSVRGSentExchange) -> None:
        """The checks of a round reply's metrics against the |w_t| ``sent`` (adds
        ``data-norm``)."""
        dual = self._cocoa(sent.kind)
        if sent.kind == "train" and not dual:
            return
        if out["loss-sum"] < 0 or out["sq-norm-sum"] < 0:
            raise ReplyError("loss-sum and sq-norm-sum must be >= 0")
        n = out["n-train"]
        check_bound("sq-norm-sum", out["sq-norm-sum"], n * self.directory.max_row_norm ** 2,
                    "n-train x the max-row-norm limit squared")
        out["data-norm"] = math.sqrt(n * out["sq-norm-sum"])
        check_bound("loss-sum", out["loss-sum"], n * _LN2 + sent.w_norm * out["data-norm"],
                    "n-train log 2 + |w| sqrt(n-train sq-norm-sum)")
        if "test-n" in out and out["test-n"] > self.directory.max_n:
            raise ReplyError(f"test-n {out['test-n']} above the limit {self.directory.max_n}")
        if ("test-errors" in out) != ("test-n" in out) or (
                "test-n" in out and not 0 <= out["test-errors"] <= out["test-n"]):
            raise ReplyError("test-errors/test-n inconsistent")
        if dual and out["state-ok"] not in (0, 1):
            raise ReplyError(f"state-ok must be 0 or 1, got {out['state-ok']}")

    # ------------------------------------------------------------------ records
    def _new_record(self, k: int) -> dict[str, Any]:
        assert len(self.records) == k
        record: dict[str, Any] = round_record(k, exchanges=self.exchanges, objective=None)
        if self.method == "cocoa-plus":
            record.update(dual=None, gap=None, num_resets=None)
        if self.privacy is not None:  # the releases since the previous record, epsilon
            record.update(self.privacy.record_fields(self.records))
        return self.book.open(record)

    def _complete_record(self, k: int, accepted: dict[int, dict[str, Any]],
                         w: np.ndarray | None) -> dict[str, Any]:
        """Complete record ``k`` (state ``w_k``, the ``w`` sent with the exchange whose
        ``accepted`` replies give its numbers) and publish it; as it was if complete."""
        assert w is not None and self.lam is not None
        record = self.records[k]
        if self.book.complete(k) is None:  # completed already (strategies/records.py)
            return record
        missing = sorted(set(range(self.num_tasks)) - set(accepted))
        record["tasks_missing"] = missing
        if accepted:
            n_rep = int(sum(self.n_weight[t] for t in accepted))
            loss = float(sum(self._scaled(t, accepted[t], "loss-sum") for t in sorted(accepted)))
            if not missing:
                record["objective"] = global_objective(w, loss, n_rep, self.lam)
            evaluated = sorted(t for t in accepted if "test-n" in accepted[t])
            if evaluated and not missing:
                record.update(error_summary(
                    np.array([accepted[t]["test-errors"] for t in evaluated]),
                    np.array([accepted[t]["test-n"] for t in evaluated])))
        if self.method == "cocoa-plus" and record["objective"] is not None and all(
                accepted[t]["state-ok"] for t in accepted):  # a consistent (w, alpha) pair
            assert self.n_total is not None
            dual = float(sum(accepted[t]["dual-sum"] for t in sorted(accepted)))
            # DP: w is w(alpha) plus the noise released so far; D needs w(alpha), the
            # sum of the devices' shares
            assert self.ledger is not None
            w_alpha = w if self.privacy is None else self.ledger.total()
            record["dual"] = dual_objective(w_alpha, dual, self.n_total, self.lam)
            record["gap"] = record["objective"] - record["dual"]
        if self.method == "cocoa-plus":  # the exchange whose replies complete this record
            # every pair passed its check, and the objective's n (every task's rows) is the
            # dual's: a node found after w was set up (n_total) breaks the gap's sum algebra
            record["gap_certified"] = record["gap"] is not None \
                and int(self.n_train.sum()) == self.n_total
            last = self.replies.last
            record["certificate_rejections"] = 0 if last is None else \
                certificate_rejections(last.failed)
        self.book.publish(record, self.on_round)
        return record

    # ------------------------------------------------------------------ checkpoints
    _checkpoint_n_train: np.ndarray | None = None  # each task's n-train at the checkpoint

    def _check_resumed_data(self) -> None:
        """CheckpointError unless every discovered task reports the ``n-train`` it had at
        the checkpoint this run resumed from (module docstring, Resume)."""
        assert self._checkpoint_n_train is not None
        known = self.n_train > 0
        changed = np.flatnonzero(known & (self.n_train != self._checkpoint_n_train))
        if len(changed):
            now, then = self.n_train[changed].tolist(), self._checkpoint_n_train[changed].tolist()
            raise CheckpointError(
                f"{_NAME}: resumed on other data: tasks {changed.tolist()[:20]} report "
                f"n-train {now[:20]}, the checkpoint has {then[:20]}; n = {self.n_total}, "
                f"lambda = {self.lam} and the statistics of the checkpoint belong to other "
                "data: use another checkpoint directory")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must share with this run to be resumed."""
        return {"strategy": "FSVRG", "num_tasks": self.num_tasks, "method": self.method,
                "lam": self.lam_arg, "h": self.h, "step": self.step_arg, "mu": self.mu,
                "local_epochs": self.local_epochs, "seed": self.seed,
                **({"dp": self.privacy.fingerprint()} if self.privacy is not None else {})}

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``w``, the sparsity statistics, CoCoA+'s ledger, the records and counters, and
        the tasks' mean squared row norms (robust mode's fence remembers them)."""
        assert self.w is not None
        arrays: dict[str, np.ndarray] = {"w": self.w, "n_train": self.n_train,
                                         "mean_sq_norm": self.mean_sq_norm}
        meta: dict[str, Any] = {"records": self.book.to_meta(), "exchanges": self.exchanges,
                                "n_total": self.n_total, "lam": self.lam, "step": self.step,
                                "gd_estimate": self.gd_estimate,
                                "gd_replies": self._gd_replies}
        if self.stats is not None:
            arrays.update(stats_n_j=self.stats.n_j, stats_omega=self.stats.omega)
            meta["stats"] = {"num_nodes": self.stats.num_nodes, "n": self.stats.n}
        if self.ledger is not None:
            arrays.update({f"ledger_{k}": v for k, v in self.ledger.to_arrays().items()})
        return arrays, meta

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state`'s output."""
        w = np.asarray(arrays["w"], dtype=np.float64)
        if w.ndim != 1 or not np.all(np.isfinite(w)):
            raise ValueError("checkpoint 'w' must be a finite vector")
        if arrays["n_train"].shape != (self.num_tasks,):
            raise ValueError(f"checkpoint 'n_train' must have shape ({self.num_tasks},)")
        if "mean_sq_norm" in arrays:  # absent from checkpoints written before it was kept
            if arrays["mean_sq_norm"].shape != (self.num_tasks,):
                raise ValueError(f"checkpoint 'mean_sq_norm' must have shape ({self.num_tasks},)")
            self.mean_sq_norm = np.asarray(arrays["mean_sq_norm"], dtype=np.float64).copy()
        self.w = w.copy()
        self._checkpoint_n_train = np.asarray(arrays["n_train"], dtype=np.int64).copy()
        self.directory.dim = int(w.shape[0])
        self.book.load(meta["records"])
        self.exchanges = int(meta["exchanges"])
        self.n_total = meta["n_total"]
        self.lam, self.step = meta["lam"], meta["step"]
        self.gd_estimate = meta.get("gd_estimate")
        self._gd_replies = int(meta["gd_replies"])
        if "stats" in meta:
            self.stats = FeatureStats(num_nodes=int(meta["stats"]["num_nodes"]),
                                      n=int(meta["stats"]["n"]),
                                      n_j=_counts(arrays["stats_n_j"]),
                                      omega=_counts(arrays["stats_omega"]))
        if self.privacy is not None:  # what the interrupted run released after it
            per_round = 1 if self.method in ("gd", "cocoa-plus") else 2
            self.privacy.charge_after_checkpoint(per_round * self.checkpoint_every)
        if self.method == "cocoa-plus":
            self.ledger = DualLedger.from_arrays(
                self.num_tasks, self.dim,
                {k[len("ledger_"):]: v for k, v in arrays.items() if k.startswith("ledger_")})

    def results(self) -> dict[str, Any]:
        """``{"rounds": [...], "final": {...}}`` over the completed records."""
        rounds = self.book.published()
        final = dict(rounds[-1]) if rounds else {}
        final["tasks_never_replied"] = sorted(int(t) for t in np.flatnonzero(~self.ever_replied))
        final["complete"] = bool(rounds) and not final.get("tasks_missing")
        final["method"] = self.method
        if self.method == "cocoa-plus":
            final["certificate_rejections_total"] = sum(
                r.get("certificate_rejections", 0) for r in rounds)
        if self.method == "gd":
            final["step"] = self.step
            final.update(self.gd_estimate or {"L_estimate": None, "power_iterations": 0})
        return {"rounds": rounds, "final": final}
