"""FedEM (Marfoq et al. 2021) and its baselines as one Flower ``Strategy``.

Every client's data is a mixture of M shared components (:mod:`fmtl_flower.core.fedem`).
Each round the server samples clients, sends them the M component models, and each sampled
client runs the E-step, updates its mixture weights pi and trains every component on its
responsibility-weighted loss; the server aggregates each component weighted by n_k. The same
strategy runs the baselines of the paper's Table 1:

========== ============================================================================
method     what it is
========== ============================================================================
fedem      M components, E-step and pi on the device, components aggregated
fedavg     one global model (M = 1)
fedprox    FedAvg with the proximal term (mu / 2) ||theta - theta_global||^2 locally
fedavg-ft  FedAvg+, FedAvg then local fine-tuning before evaluation
cfl        clustered FL of Sattler et al. (the paper's "clustered FL" column): one cluster
           at first, trained as FedAvg; a cluster whose mean client update is small
           (< ``cfl_eps1``) while its largest is not (> ``cfl_eps2``) is split in two by
           the cosine similarity of the updates (:mod:`fmtl_flower.core.cfl`); each device
           trains and uses its cluster's model
clustered  IFCA (an extra, stronger clustered baseline; alias ``ifca``): M models, each
           device trains and uses the one of lowest loss
pfedme     pFedMe (Moreau envelopes, :mod:`fmtl_flower.core.pfedme`): the devices keep a
           personalised theta_i, send their local copy w of the global model, and are
           evaluated on theta_i; the server takes w <- (1 - beta) w + beta avg(w_k)
local      each device trains its own model alone (the server only relays the start model)
========== ============================================================================

PyTorch models: ``model="torch"`` with ``initial_components=[ArrayRecord(net.state_dict()),
...]`` (M independently initialised modules; or ``start(initial_arrays=ArrayRecord(...))``
for one component) and the ClientApp of
:func:`fmtl_flower.clients.fedem_torch.make_fedem_torch_client_app`. The components are then
the modules' state_dicts (weights and BatchNorm buffers) flattened to float64 vectors, and
:meth:`FedEM.component_records` gives them back as ArrayRecords
(``net.load_state_dict(record.to_torch_state_dict())``).

Held-out (unseen) clients never train; at each evaluation they receive the components and
(FedEM) fit only pi on their own training split by EM to convergence, then are evaluated.
Their metrics are reported separately (``unseen_accuracy_*``).

Wire contract
-------------
query ``whoami`` (server -> node): empty ``config``. Reply ConfigRecord ``info`` with ints
``task-id`` (0 <= id < num_tasks), ``n-train`` >= 1, ``n-test`` >= 0, ``dim`` >= 1,
``num-classes`` >= 2.

``train`` (server -> node), to the round's sampled training clients:
    arrays ``components``: float64 (M, P), the server's component models;
    config ``task-id``, ``server-round``, ``seed`` (ints), ``method`` (str), ``model`` (str),
    ``num-classes``, ``hidden``, ``batch-size``, ``local-epochs`` (ints), ``lr``, ``momentum``,
    ``weight-decay``, ``prox-mu``, ``pi-floor`` (floats), ``unseen`` (bool, false),
    ``finetune-epochs`` (int); with ``model`` ``"torch"`` also ``layout`` (str, the
    signature of the state_dict's keys, shapes and dtypes,
    :func:`fmtl_flower.core.backend.layout_signature`), P being the state_dict's size.
    With ``method`` ``"pfedme"`` also ``pfedme-lambda``, ``pfedme-lr`` (floats) and
    ``pfedme-steps`` (int). CFL sends each device only its cluster's model (M = 1).
    With client-level DP ``client-clip`` also ``dp-clip`` (float > 0): the device moves its
    returned components back to within that L2 distance of those sent
    (:mod:`~fmtl_flower.strategies.privacy`).
    Reply: arrays ``components`` float64 (M, P), finite, the locally trained components, and
    ``weights`` float64 (M,): n-train for each trained component, 0 for an untouched one
    (every component for fedem / fedavg / fedprox / fedavg-ft / cfl / pfedme / local,
    exactly one for clustered), ``responsibility`` float64 (M,) on the simplex (within
    1e-6): the device's mean E-step responsibility of each component, its new pi (1 for the
    single-model methods, one-hot for clustered: for these the server uses the one-hot of
    ``weights`` whatever is sent; used in robust mode only; optional in a
    one-task reply, whose device then counts as equally responsible for every component
    it trained, required in a stacked one); metrics ``task-id``, ``round``, ``n-train`` (ints,
    matching the message) and
    ``train-loss`` (float >= 0, the mixture's mean negative log-likelihood on the training
    set at the received components); optional ``e-step-s`` and ``train-s`` (floats >= 0, the
    device's seconds in the E-step and in local SGD, summed into the round's record).

``evaluate`` (server -> node), to every known client every ``eval_every`` rounds and after
the last: the same arrays and config, ``unseen`` true for held-out clients (CFL: a training
client receives its cluster's model, a held-out one every cluster's model). Reply: metrics
``task-id``, ``round``, ``n-train``, ``test-correct``, ``test-n`` (0 <= correct <= n),
``em-iterations`` (ints), ``train-loss`` (float). No arrays.

Every reply is validated (presence, types, shapes, finiteness, weights in {0, n-train},
matching task and round, the largest absolute parameter below ``max_abs_param``); a reply
that fails is logged with its reason and counts as a dropped client; the components are
untouched by it. A reply is read against the state its exchange was sent with (its
:class:`~fmtl_flower.strategies.round_state.FedEMSentRound`: the components and the tasks
sent, whatever was configured since); a reply to no awaited exchange (late, foreign, or
read already) is logged and dropped. A reply holding anything the contract does not name
(another record, metric or array, or arrays above the bytes of ``components``' and
``weights``' shapes) is rejected before it is decoded (:func:`reply_contracts`).

Bounds: each returned component theta_m must stay within ``max_update_ratio`` times
max(|theta_m|_2, 1) of the component theta_m it was sent (Euclidean norms over the
parameters); ``train-loss`` in [0, ``MAX_LOSS`` = 1e6]; ``e-step-s``, ``train-s`` in
[0, the round timeout];
``test-n`` at most the discovery limit ``max_n`` and ``0 <= test-correct <= test-n``;
``em-iterations`` >= 0. An aggregate that is not finite is not taken (components kept, the
round's replies rejected).

Robust mode (``robust``, the default; ``robust=False`` takes every device at its word, the
behaviour before it): what a device says about itself is capped by what the federation makes
plausible before it enters a weight or a bound.

* ``n-train`` (``whoami``, at most the operator's discovery limit ``max_n``) enters every
  average as at most :func:`~fmtl_flower.core.robust.log_upper_fence` of the training tasks'
  n-train (10 times their median, more only when the honest sizes themselves spread that
  widely): :meth:`FedEM.trusted_n_train`. The replies still report their true n-train.
* No device's share of any weighted average (a component's aggregate, the round's
  ``train_loss``) exceeds ``max_weight_share`` (:func:`~fmtl_flower.core.robust.cap_shares`).
* ``components``: each shared model (FedEM's components, the single model of fedavg / fedprox /
  fedavg-ft / pfedme, IFCA's cluster models, CFL's cluster models) is aggregated by
  :func:`~fmtl_flower.core.fedem.robust_aggregate_components`: every update clipped to the
  ball around the updates' median of twice their median distance to it (the honest spread;
  so the update-ratio bound above, whose reference is the server's own model, is no longer
  the largest step a device can force), then
  combined by the weighted coordinate-wise trimmed mean (``aggregator`` / ``trim``; or median,
  or mean) with the devices' weights ``weights`` (their capped n-train) times their
  ``responsibility`` for the component, each update divided by that responsibility (so
  the devices' updates are alike and comparable, and FedEM's step is kept) and, for FedEM,
  by the device's number of local steps (FedNova's normalisation: a device with 15 times the
  data moves 15 times as far; :meth:`FedEM._local_steps`), the combined per-step update
  scaled back by the devices' combined step count. pi stays on
  the devices: its reported value enters only that weight, at most the device's capped
  n-train over all components together.
* ``test-n`` (``evaluate``) enters the pooled accuracy as at most the log-scale fence of the
  round's test-n values (the reply's accuracy kept: ``test-correct`` scaled alike).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from logging import INFO, WARNING
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..checkpoint import read_checkpoint
from ..core.backend import flatten_arrays, layout_of, layout_signature, unflatten_arrays
from ..core.cfl import split_clusters
from ..core.fedem import (
    aggregate_components,
    clip_around_median,
    learning_rate,
    robust_aggregate_components,
    sample_clients,
)
from ..core.local_sgd import SGDConfig
from ..core.models import make_model
from ..core.pfedme import PFedMeConfig
from ..core.rng import TAG_FEDEM_INIT, TAG_FEDEM_SAMPLE, round_rng
from ..core.robust import (
    cap_shares,
    log_upper_fence,
    trimmed_mean,
)
from ..metrics import error_summary, round_record
from ..packing import StackGroup
from ..settings import FedEMSettings, apply_settings, check_num_tasks
from ..wire import from_array, to_array
from .base import TaskStrategy
from .discovery import (
    ReplyError,
    TaskDirectory,
    arrays_of,
    check_task_and_round,
    read_metrics,
)
from .packed_fedem import PROTOCOL as STACKING_PROTOCOL
from .packed_fedem import read_stacked_reply, stacked_message
from .records import RoundRecords
from .round_state import FedEMSentRound, SentRounds, drop_unsent, frozen_array
from .trust import ReplyBoundary, ReplyContract, all_finite, check_bound, norm

__all__ = ["METHODS", "FedEM", "ReplyError"]

RoundCallback = Callable[[dict[str, Any]], None]
METHODS = ("fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "ifca", "cfl", "pfedme",
           "local")
#: Method names that mean another (``ifca`` is IFCA, run as ``clustered``).
ALIASES = {"ifca": "clustered"}
SINGLE_MODEL = ("fedavg", "fedprox", "fedavg-ft", "local", "cfl", "pfedme")
TAG_SAMPLE, TAG_INIT = TAG_FEDEM_SAMPLE, TAG_FEDEM_INIT
#: Largest ``train-loss`` a reply may report (a mean negative log-likelihood beyond it is
#: divergence or hostility, and would overflow the round's sums).
MAX_LOSS = 1e6
#: What a device with more classes than the run decided is told (its exclusion's reason).
CLASSES_FIX = ("if the devices' labels really have that many classes, set the strategy's "
               "num_classes (FedEM(num_classes=C)) to the federation's number of classes")


def reply_contracts() -> dict[str, ReplyContract]:
    """What a reply may hold, by message type (the wire contract above; ``M``, ``P``: the
    server's components' shape): the metrics of :meth:`FedEM._reply_keys`, the ``train``
    reply's ``components`` (M, P), ``weights`` (M,) and ``responsibility`` (M,)."""
    return {MessageType.TRAIN: ReplyContract.of(
                [key for keys in FedEM._reply_keys(True) for key in keys],
                {"components": ("M", "P"), "weights": ("M",), "responsibility": ("M",)}),
            MessageType.EVALUATE: ReplyContract.of(
                [key for keys in FedEM._reply_keys(False) for key in keys])}
_NAMES = {"fedem": "FedEM", "fedavg": "FedAvg", "fedprox": "FedProx", "fedavg-ft": "FedAvg+",
          "clustered": "IFCA", "cfl": "CFL", "pfedme": "pFedMe", "local": "Local"}


#: Robust mode, CFL: the clipping radius in honest median distances. Looser than the
#: components' (:data:`~fmtl_flower.core.fedem.CLIP_FACTOR`): a cluster CFL has yet to split
#: holds two populations, and clipping one to the other's spread would erase the
#: heterogeneity its split test looks for (at 1, two opposite groups are never split).
CFL_CLIP_FACTOR = 3.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _clipped(updates: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Robust mode, CFL: every update clipped to the ball around their median of
    :data:`~fmtl_flower.core.fedem.CLIP_FACTOR` times the median distance to it, one vote per
    task (:func:`~fmtl_flower.core.fedem.clip_around_median`), before the split test."""
    stacked = np.stack(list(updates.values()))
    clipped = clip_around_median(stacked, np.ones(stacked.shape[0]), CFL_CLIP_FACTOR)
    return dict(zip(updates, clipped, strict=True))


def _check_responsibility(resp: np.ndarray, num_components: int) -> None:
    """A reply's ``responsibility``: float64 (M,), finite, on the simplex within 1e-6."""
    if resp.dtype != np.float64 or resp.shape != (num_components,):
        raise ReplyError(f"'responsibility' must be float64 of shape ({num_components},), got "
                         f"{resp.dtype} {resp.shape}")
    if not np.all(np.isfinite(resp)) or np.any(resp < 0) or abs(float(resp.sum()) - 1) > 1e-6:
        raise ReplyError("'responsibility' must be finite, >= 0 and sum to 1")


def _responsibility(reply: dict[str, Any], soft: bool) -> np.ndarray:
    """A reply's ``responsibility`` when ``soft`` (FedEM's mixture) and it sent one, else
    equal shares of the components it trained (its total weight over the components is its
    n-train either way). The clustered and single-model methods (``soft`` False) assign hard:
    the one-hot of the component trained whatever the reply says (a reported soft one would
    switch its component's whole cluster to the soft aggregation path)."""
    if soft and "responsibility" in reply:
        return np.asarray(reply["responsibility"], dtype=np.float64)
    trained = (reply["weights"] > 0).astype(np.float64)
    return trained / trained.sum()


def decide_num_classes(votes: Sequence[int], robust: bool) -> int:
    """The run's number of classes from the nodes' reports (one per physical node, each the
    most classes of its tasks): the largest report, in robust mode the largest within the
    log-scale fence of the reports (:func:`~fmtl_flower.core.robust.log_upper_fence`: a
    minority cannot inflate it beyond what the federation makes plausible, while an honest
    device that alone holds the highest class is kept: label skew is common in federated
    data, and excluding it would cost an honest device its place)."""
    ordered = sorted((int(v) for v in votes), reverse=True)
    if not ordered:
        return 0
    if not robust:
        return ordered[0]
    fence = log_upper_fence(np.asarray(ordered, dtype=np.float64))
    return max(v for v in ordered if v <= fence)


def _capped_test_counts(correct: np.ndarray, counts: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Robust mode: every ``test-n`` at most the log-scale fence of the round's test-n values,
    ``test-correct`` scaled alike (each task's accuracy kept, its weight in the pooled
    accuracy bounded)."""
    counts = counts.astype(np.float64)
    capped = np.minimum(counts, log_upper_fence(counts))
    scale = np.divide(capped, counts, out=np.zeros_like(counts), where=counts > 0)
    return correct * scale, capped


class FedEM(TaskStrategy):
    """Federated EM over M shared components, and its baselines (see the module docstring).

    Flower's knobs (:mod:`fmtl_flower.strategies.base`): ``fraction_train`` is ``fraction``
    (set one), ``min_train_nodes`` raises the round's sample to at least that many training
    clients; unsampled clients get no message in that round.

    Parameters
    ----------
    num_tasks : int or None
        Number of clients (tasks) to wait for; task ids are 0 .. num_tasks - 1.
        None (the default): the distinct task ids of the nodes online once
        ``min_available_nodes`` are, counted when ``start`` runs (Flower's habit of sizing
        a run by its SuperNodes; :class:`~fmtl_flower.strategies.base.SizedAtStart`).
    method : {"fedem", "fedavg", "fedprox", "fedavg-ft", "cfl", "clustered", "ifca", "pfedme", \
              "local"}
        ``ifca`` is an alias of ``clustered`` (IFCA); ``cfl`` is Sattler et al.'s CFL.
    num_components : int
        M, the number of components (fedem) or cluster models (clustered); the single-model
        methods use 1 whatever is given (CFL starts with one cluster and splits).
    model : {"logistic", "softmax", "mlp", "torch"}
        Component model family (:func:`fmtl_flower.core.models.make_model`), or ``"torch"``:
        the clients' torch module (needs ``initial_components``, or ``start(initial_arrays=)``
        when there is one component).
    initial_components : sequence of ArrayRecord, optional
        ``model="torch"``: one ``ArrayRecord(net.state_dict())`` per component (M of them; 1
        for the single-model methods), independently initialised, all of one layout.
    num_classes, hidden : int
        Classes (2 for logistic) and hidden units (mlp); not used by ``model="torch"`` (the
        module fixes both). ``num_classes`` None (default): learned at the first round's
        discovery from the classes the devices report in their ``whoami`` (``num-classes``:
        their labels' largest class id + 1), one vote per physical node
        (:func:`decide_num_classes`), at least 2; a device reporting more is excluded.
    lr, batch_size, local_epochs, momentum, weight_decay : float / int
        The local solver: epochs of mini-batch SGD with momentum and weight decay (torch's
        rule), one optimiser state per component kept on the device across rounds.
    lr_schedule : {"constant", "multi-step"}
        multi-step: x0.1 after rounds floor(R/2) and 3 floor(R/4) (the authors' scripts).
    fraction : float
        Client sampling rate in (0, 1]: max(1, floor(fraction K)) training clients per round,
        uniformly without replacement (with client-level DP's ``dp.sampling=poisson``: each
        training client independently with probability ``fraction``, from the server's
        secret randomness; :mod:`~fmtl_flower.strategies.privacy`).
    aggregation : {"all", "sampled"}
        ``all``: the authors' rule, theta_m <- sum over all K training clients of
        (n_k / N) theta_{m,k}, a client not heard from counting as holding theta_m (the step
        shrinks with the sampling rate); ``sampled``: the n_k-weighted average over the
        replying clients (unbiased under partial participation). IFCA and CFL always average
        each model over the replying clients that chose it (CFL: of its cluster).
    prox_mu : float
        FedProx's mu (``fedprox``; must be > 0 there, ignored elsewhere).
    finetune_epochs : int
        Local epochs of fine-tuning before evaluation (``fedavg-ft``).
    unseen_tasks : sequence of int
        Held-out clients: never sampled for training, evaluated after fitting pi (fedem).
    pi_floor : float
        Smallest mixture weight after a pi update.
    max_abs_param : float
        Replies with a parameter of larger magnitude are rejected (divergence or hostility).
    max_update_ratio : float
        Replies whose component m moved farther than this times max(|theta_m|, 1) from the
        component sent are rejected (> 0).
    cfl_eps1, cfl_eps2 : float
        CFL's split thresholds on the norm of a cluster's mean update and on its largest
        update (the FedEM authors' 0.4 and 1.6, :data:`fmtl_flower.core.cfl.EPS1` / ``EPS2``).
    pfedme_lambda, pfedme_lr, pfedme_steps, pfedme_beta : float / int
        pFedMe's lambda, the inner steps' learning rate, their number K, and the server's
        beta (``lr`` is pFedMe's eta; pFedMe's steps use no momentum).
    robust : bool
        Robust mode (default True; see the module docstring): n-train capped by the
        federation, no device above ``max_weight_share`` of any average, shared models
        aggregated Byzantine-robustly. False: every device taken at its word.
    max_weight_share : float
        The largest share of any weighted average one device may carry (robust mode).
    aggregator : {"trimmed-mean", "median", "mean"}
        Robust mode's combination of the clipped updates of a shared model.
    trim : float
        ``trimmed-mean`` cuts floor(trim x K) of the K contributors from each end of every
        coordinate (none below 1 / trim contributors), in [0, 0.5).
    dim : int, optional
        The feature dimension when configured (None: by majority of the nodes).
    eval_every : int
        Rounds between evaluations (the final model is always evaluated).
    seed : int
        Seed of the initial components, client sampling and the devices' mini-batch orders.
    discovery_timeout : float
        Seconds to wait, at the first round, for ``num_tasks`` nodes to appear (at most
        ``start``'s ``timeout``; fewer than ``min_tasks`` raise ``DiscoveryError``).
    on_round : callable, optional
        Called with each completed round record (a dict).
    settings : FedEMSettings, optional
        The parameters above and the common knobs (``min_tasks``, Flower's) as one checked object
        (:mod:`fmtl_flower.settings`); keyword arguments override it.
    """

    #: Settings this strategy derives its own value of (SettingsHome).
    derived_settings = frozenset({"method", "model", "num_classes", "num_components"})

    #: Client-level DP (:func:`fmtl_flower.strategies.privacy.enable_client_dp`), or None.
    privacy: Any = None

    def __init__(self, num_tasks: int | None = None, settings: FedEMSettings | None = None,
                 *, dim: int | None = None, on_round: RoundCallback | None = None,
                 initial_components: Sequence[ArrayRecord] | None = None,
                 **kwargs: Any) -> None:
        s = FedEMSettings.resolve(settings, kwargs)
        self.settings = s
        if num_tasks is None:  # built by start, for the tasks online
            self.build_at_start(partial(FedEM.__init__, self, settings=s,
                                        dim=dim, on_round=on_round,
                                        initial_components=initial_components), s)
            return
        self.num_tasks = check_num_tasks(num_tasks)
        if s.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {s.method!r}")
        if initial_components is not None and s.model != "torch":
            raise ValueError("initial_components is for model='torch'")
        unseen = list(s.unseen_tasks)
        if unseen and unseen[-1] >= self.num_tasks:
            raise ValueError(f"unseen_tasks must be task ids in 0..{self.num_tasks - 1}")
        if len(unseen) >= self.num_tasks:
            raise ValueError("at least one task must train (every task is held out)")
        method = ALIASES.get(s.method, s.method)
        self.directory = TaskDirectory(self.num_tasks, _NAMES[method], dim=dim)
        apply_settings(self, s)
        self.method = method
        self.sgd = SGDConfig(lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay,
                             batch_size=s.batch_size, epochs=s.local_epochs, prox_mu=s.prox_mu)
        self.pfedme = PFedMeConfig(lr=s.lr, personal_lr=s.pfedme_lr, lam=s.pfedme_lambda,
                                   inner_steps=s.pfedme_steps, batch_size=s.batch_size,
                                   epochs=s.local_epochs, weight_decay=s.weight_decay)
        self.cfl_eps = (s.cfl_eps1, s.cfl_eps2)
        self.name = _NAMES[method]
        self.num_components = 1 if method in SINGLE_MODEL else s.num_components
        self.model = None if s.model == "torch" else make_model(
            s.model, 1, num_classes=s.num_classes or 2, hidden=s.hidden)
        self.layout: list[tuple[str, tuple[int, ...], str]] | None = None
        self.model_name = s.model
        self.on_round = on_round
        self.unseen = np.zeros(self.num_tasks, dtype=bool)
        self.unseen[unseen] = True
        if method == "local":
            self.unseen[:] = False  # no sharing: every device trains its own model
        #: CFL: the training clients (task ids) of each cluster, whose model is components[c].
        self.clusters: list[np.ndarray] = [np.flatnonzero(~self.unseen)]
        self.ever_replied = np.zeros(self.num_tasks, dtype=bool)
        self.book = RoundRecords()  # one record per round (strategies/records.py)
        self.components: np.ndarray | None = None
        self.replies = ReplyBoundary(self.name, reply_contracts(), lambda: dict(
            zip(("M", "P"), self.components.shape, strict=True)))
        #: Each exchange's FedEMSentRound until its replies are read (strategies/round_state).
        self.sent_rounds = SentRounds(self.name)
        self._round_start = 0.0
        if initial_components is not None:
            self._set_initial(list(initial_components), "initial_components")

    # ------------------------------------------------------------------ Strategy interface
    samples_devices = True
    samples_evaluation = True

    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├── %s: %d clients (%d held out), M=%d, model=%s", self.name,
            self.num_tasks, int(self.unseen.sum()), self.num_components, self.model_name)
        log(INFO, "\t└── lr=%g (%s), batch=%d, epochs=%d, momentum=%g, wd=%g, fraction=%g, "
            "aggregation=%s", self.sgd.lr, self.lr_schedule, self.sgd.batch_size,
            self.sgd.epochs, self.sgd.momentum, self.sgd.weight_decay, self.fraction,
            self.aggregation)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """``train`` messages to the round's sampled training clients."""
        if not self.sent_identity:  # not from start(): Flower's generic loop (e.g. a DP wrapper)
            raise RuntimeError(f"{self.name} runs through its own start(); Flower's DP "
                               "wrappers cannot wrap it: use fmtl_flower.strategies.privacy."
                               "from_flower(wrapper) or enable_client_dp(strategy, ...)")
        self._round_start = time.perf_counter()
        self.discover(grid, wait=server_round == self.first_round)
        if self.components is None and self.model_name == "torch":
            if self.num_components != 1 or len(arrays) == 0:
                raise ValueError(f"{self.name} with model='torch' needs initial_components "
                                 f"({self.num_components} ArrayRecords of state_dicts), or "
                                 "start(initial_arrays=ArrayRecord(net.state_dict())) for one "
                                 "component")
            self._set_initial([arrays], "initial_arrays")
        if self.components is None:
            raise RuntimeError(f"{self.name} found no usable node: check that the ClientApp "
                               "is FedEM's and that nodes report a task id")
        known = np.array(sorted(t for t in self.task_to_node if not self.unseen[t]), dtype=int)
        fraction = self._train_fraction()
        if self._poisson_sampled():  # client-level DP's secret Poisson sample (privacy.py)
            sampled = self.privacy.sample(known, fraction, int((~self.unseen).sum()),
                                          self.min_train_nodes)
        else:
            rng = round_rng(self.seed, server_round, TAG_SAMPLE)
            if max(1, int(np.floor(fraction * known.size))) >= self.min_train_nodes:
                sampled = sample_clients(known, fraction, rng)
            else:  # min_train_nodes raises the count (capped at the eligible clients)
                sampled = np.sort(rng.choice(known, size=min(self.min_train_nodes, known.size),
                                             replace=False))
        return self._send(server_round, MessageType.TRAIN, [int(t) for t in sampled], grid)

    def _poisson_sampled(self) -> bool:
        """Whether client-level DP samples the devices (``dp.sampling=poisson``): each
        round then releases, replies or none."""
        return self.privacy is not None and getattr(self.privacy, "poisson", False)

    def _train_fraction(self) -> float:
        """The sampling rate: Flower's ``fraction_train`` when set below 1, else ``fraction``
        (the paper's name of the same knob); both below 1 and different is an error."""
        if self.fraction_train != 1.0 and self.fraction != 1.0 \
                and self.fraction_train != self.fraction:
            raise ValueError(f"{self.name}: fraction ({self.fraction:g}) and fraction_train "
                             f"({self.fraction_train:g}) are the same knob; set one")
        return float(self.fraction_train) if self.fraction_train != 1.0 else self.fraction

    def seed_model(self, initial_arrays: ArrayRecord) -> None:
        """``model="torch"``: the one component's state_dict, taken at the first round (see
        ``initial_components``); the other models start from their seeded initialisation,
        so a non-empty ``initial_arrays`` is an error."""
        if len(initial_arrays) and self.model_name != "torch":
            raise ValueError(f"{self.name} with model={self.model_name!r} starts from its "
                             "seeded initialisation; initial_arrays (a torch state_dict) is "
                             "for model='torch'")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Validate the replies against the round's sent state and aggregate each component
        (replies to no awaited round: logged and dropped)."""
        assert self.components is not None
        sent = self.sent_rounds.take(MessageType.TRAIN, server_round)
        if sent is None:
            drop_unsent(self.replies, MessageType.TRAIN, server_round, replies)
            return None, MetricRecord({"num-replies": 0, "num-dropped": 0})
        # keyed by task in task order: sums must not depend on the order replies arrive in
        accepted = self._read_replies(sent, replies)
        started = time.perf_counter()
        if self.method != "local" and (accepted or self._poisson_sampled()):
            clusters = self.clusters
            if self.method == "cfl":
                components, clusters = self._cfl_aggregate(accepted)
            else:
                components = self._aggregate_components(accepted, len(sent.tasks))
            if all_finite(components):
                self.components, self.clusters = components, clusters
            else:  # the bounds make this unreachable: belt and braces
                log(WARNING, "%s round %d: the aggregate is not finite; not taken, the replies "
                    "of tasks %s rejected", self.name, server_round, list(accepted)[:20])
                accepted = {}
        aggregate_s = time.perf_counter() - started
        n = self._average_weights(list(accepted))
        loss = np.array([accepted[t]["train-loss"] for t in accepted])
        timing = {key: float(sum(r.get(key, 0.0) for r in accepted.values()))
                  for key in ("e-step-s", "train-s")}
        record = round_record(
            server_round, primal=None, dual=None, gap=None,
            train_loss=float(loss @ n / n.sum()) if n.size else None,
            unseen_accuracy_mean=None, unseen_accuracy_bottom_decile=None,
            num_sampled=len(sent.tasks), num_replies=len(accepted),
            num_dropped=len(sent.tasks) - len(accepted), lr=self._lr(server_round),
            client_estep_s=timing["e-step-s"], client_train_s=timing["train-s"],
            aggregate_s=aggregate_s,
            **({} if self.privacy is None else self.privacy.record_fields(self.records)),
            **({"num_clusters": len(self.clusters)} if self.method == "cfl" else {}))
        self.book.open(record)  # completed by the evaluate phase
        metrics = MetricRecord({"num-replies": len(accepted),
                                "num-dropped": record["num_dropped"]})
        return ArrayRecord({"components": to_array(self.components)}), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """``evaluate`` messages to the known clients, on evaluation rounds: all of them, or
        Flower's ``fraction_evaluate`` / ``min_evaluate_nodes`` sample of them."""
        if not self._evaluation_due(server_round):
            return []
        known = sorted(self.task_to_node)
        chosen = self.sample_evaluate_tasks(known, server_round, self.seed)
        return self._send(server_round, MessageType.EVALUATE, chosen, grid,
                          skipped=set(known) - set(chosen))

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Complete the round's record (accuracies of training and held-out clients, read
        against the round's sent state; replies to no awaited round: logged and dropped, the
        records untouched)."""
        sent = None
        if self._evaluation_due(server_round):
            sent = self.sent_rounds.take(MessageType.EVALUATE, server_round)
            if sent is None:
                drop_unsent(self.replies, MessageType.EVALUATE, server_round, replies)
                return None
        record = self.records[-1]
        self.book.complete(len(self.records) - 1)
        if sent is not None:
            self._record_evaluation(record, sent, self._read_replies(sent, replies))
        record["wall_time_s"] = time.perf_counter() - self._round_start
        self.book.publish(record, self.on_round)
        return MetricRecord({k: float(v) for k, v in record.items()
                             if isinstance(v, int | float) and not isinstance(v, bool)})

    def _record_evaluation(self, record: dict[str, Any], sent: FedEMSentRound,
                           accepted: dict[int, dict[str, Any]]) -> None:
        """The accepted evaluate replies of the exchange ``sent`` into the round's
        ``record``: the accuracies of the training and held-out clients, the training
        clients' loss, and the tasks missing (neither replied nor left out by Flower's
        ``fraction_evaluate``)."""
        for key, mask in (("", ~self.unseen), ("unseen_", self.unseen)):
            tasks = [t for t in accepted if mask[t]]
            if not tasks:
                continue
            correct = np.array([accepted[t]["test-correct"] for t in tasks])
            counts = np.array([accepted[t]["test-n"] for t in tasks])
            if self.robust:
                correct, counts = _capped_test_counts(correct, counts)
            summary = error_summary(counts - correct, counts)
            if key:
                record["unseen_accuracy_mean"] = summary["accuracy_mean"]
                record["unseen_accuracy_bottom_decile"] = summary["accuracy_bottom_decile"]
            else:
                record.update(summary)
                n = self._average_weights(tasks)
                loss = np.array([accepted[t]["train-loss"] for t in tasks])
                record["train_loss_eval"] = float(loss @ n / n.sum())
        record["tasks_missing"] = sorted(set(range(self.num_tasks)) - set(accepted)
                                         - sent.skipped)

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must share with this run to be resumed."""
        return {"strategy": "FedEM", "num_tasks": self.num_tasks, "method": self.method,
                "num_components": self.num_components, "model": self.model_name,
                "num_classes": self.num_classes, "hidden": self.hidden, "seed": self.seed,
                "sgd": [self.sgd.lr, self.sgd.momentum, self.sgd.weight_decay,
                        self.sgd.batch_size, self.sgd.epochs, self.sgd.prox_mu],
                "fraction": self._train_fraction(), "aggregation": self.aggregation,
                "unseen": np.flatnonzero(self.unseen).tolist(),
                **({"layout": layout_signature(self.layout)} if self.layout is not None
                   else {}),
                **({"cfl_eps": list(self.cfl_eps)} if self.method == "cfl" else {}),
                **({"pfedme": [self.pfedme.lam, self.pfedme.personal_lr,
                               self.pfedme.inner_steps, self.pfedme_beta]}
                   if self.method == "pfedme" else {}),
                **({"dp": self.privacy.fingerprint()} if self.privacy is not None else {})}

    def _resume(self) -> None:
        """As the base's, with ``num_classes`` unset taken from the checkpoint first (the
        number the run that wrote it learned, or was given): it is part of the model."""
        if self.num_classes is None and self.checkpoint_dir is not None:
            checkpoint = read_checkpoint(self.checkpoint_dir)
            saved = None if checkpoint is None else \
                (checkpoint.meta.get("fingerprint") or {}).get("num_classes")
            if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 2:
                self.num_classes = saved
        super()._resume()

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The components, the tasks' sizes and the records (client sampling and the
        learning rate derive from the seed and the round; pi stays on the devices)."""
        assert self.components is not None
        meta: dict[str, Any] = {"records": self.book.to_meta(), "dim": self.directory.dim,
                                "num_classes": self.num_classes}
        if self.method == "cfl":
            meta["clusters"] = [[int(t) for t in c] for c in self.clusters]
        if self.layout is not None:
            meta["layout"] = [[k, list(shape), dtype] for k, shape, dtype in self.layout]
        return {"components": self.components, "n_train": self.n_train}, meta

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state`'s output."""
        dim = int(meta["dim"])
        if self.num_classes is None:  # learned by the run that wrote the checkpoint
            self.num_classes = int(meta.get("num_classes") or 2)
        components = np.asarray(arrays["components"], dtype=np.float64)
        if self.model_name == "torch":
            model = None
            layout = [(str(k), tuple(int(x) for x in shape), str(dtype))
                      for k, shape, dtype in meta["layout"]]
            if self.layout is not None and layout != self.layout:
                raise ValueError("checkpoint components have another state_dict layout than "
                                 "initial_components")
            self.layout = layout
            size = sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in layout)
        else:
            model = make_model(self.model_name, dim, num_classes=self.num_classes,
                               hidden=self.hidden)
            size = model.num_params
        clusters = self.clusters
        if self.method == "cfl":
            clusters = [np.array(c, dtype=int) for c in meta["clusters"]]
            if sorted(int(t) for c in clusters for t in c) != np.flatnonzero(
                    ~self.unseen).tolist():
                raise ValueError("checkpoint clusters do not partition the training tasks")
        expected = (len(clusters) if self.method == "cfl" else self.num_components, size)
        if components.shape != expected or not np.all(np.isfinite(components)):
            raise ValueError(f"checkpoint components must be finite of shape {expected}, got "
                             f"{components.shape}")
        self.model, self.components, self.clusters = model, components.copy(), clusters
        self.directory.dim = dim
        self.book.load(meta["records"])
        if self.privacy is not None:  # what the interrupted run released after it
            self.privacy.charge_after_checkpoint(self.checkpoint_every)

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, wait: bool = False) -> None:
        """Map new node ids to tasks (``whoami``); initialise the components once ``dim`` is
        known (component m from its own seeded stream, so components differ)."""
        self.directory.discover(grid, wait=self.discovery_timeout if wait else 0.0,
                                query_timeout=max(self.round_timeout, 60.0))
        if self.num_classes is None and self.directory.dim is not None:
            self._learn_num_classes()
        if self.components is None and self.directory.dim is not None and self.model is not None:
            self.model = make_model(self.model_name, self.directory.dim,
                                    num_classes=self.num_classes, hidden=self.hidden)
            self.components = np.stack([
                self.model.init_params(np.random.default_rng([self.seed, m, TAG_INIT]))
                for m in range(self.num_components)])

    def _learn_num_classes(self) -> None:
        """``num_classes`` unset: decided by the nodes' reports at discovery
        (:func:`decide_num_classes`, one vote per physical node; at least 2; logistic: 2),
        logged, with the reports when they disagree. A node whose tasks reported more
        classes is excluded, now or when it is found, with a reason saying to set
        ``num_classes`` (:data:`CLASSES_FIX`)."""
        votes = self.directory.classes_by_node()
        if self.model_name == "logistic" or not votes:
            self.num_classes = 2
            log(INFO, "%s: num_classes = 2 (%s)", self.name, "logistic" if votes
                else "no device reported its classes")
            return
        decided = decide_num_classes(list(votes.values()), self.robust)
        self.num_classes = max(2, decided)
        counts = Counter(votes.values())
        log(INFO if len(counts) == 1 else WARNING, "%s: num_classes = %d, decided by the "
            "%d nodes that reported their classes (%s)", self.name, self.num_classes,
            len(votes), ", ".join(f"{c}: {k} node(s)" for c, k in sorted(counts.items())))
        self.directory.cap_classes(self.num_classes, CLASSES_FIX)

    # ------------------------------------------------------------------ torch components
    def _set_initial(self, records: list[ArrayRecord], name: str) -> None:
        """Components from state_dict ArrayRecords (``model="torch"``), one per component."""
        if len(records) != self.num_components:
            raise ValueError(f"{name} has {len(records)} ArrayRecords, expected "
                             f"{self.num_components} (num_components; 1 for {self.method})")
        flats, layout = [], None
        for m, record in enumerate(records):
            if not isinstance(record, ArrayRecord):
                raise ValueError(f"{name}[{m}] must be an ArrayRecord, got "
                                 f"{type(record).__name__}")
            try:
                arrays = {key: np.asarray(array.numpy()) for key, array in record.items()}
            except (TypeError, ValueError) as err:
                raise ValueError(f"{name}[{m}] cannot be decoded: {err}") from None
            if not arrays:
                raise ValueError(f"{name}[{m}] is empty")
            this = layout_of(arrays)
            if layout is not None and this != layout:
                raise ValueError(f"{name}[{m}] has another layout (keys, shapes, dtypes) than "
                                 f"{name}[0]")
            layout = this
            flat = flatten_arrays(arrays)
            if not np.all(np.isfinite(flat)):
                raise ValueError(f"{name}[{m}] has non-finite values")
            flats.append(flat)
        self.layout = layout
        self.components = np.stack(flats)

    def component_records(self) -> list[ArrayRecord]:
        """The current components as ArrayRecords: for ``model="torch"`` state_dicts in
        their own dtypes (``net.load_state_dict(rec.to_torch_state_dict())``), else one
        array ``params`` each."""
        if self.components is None:
            raise RuntimeError("no components yet (the federation has not started)")
        if self.layout is None:
            return [ArrayRecord({"params": to_array(theta)}) for theta in self.components]
        return [ArrayRecord({k: to_array(v) for k, v in
                             unflatten_arrays(theta, self.layout).items()})
                for theta in self.components]

    # ------------------------------------------------------------------ CFL
    def cluster_of(self) -> np.ndarray:
        """CFL: the cluster of every task (-1 for a held-out task), shape (num_tasks,)."""
        out = np.full(self.num_tasks, -1, dtype=int)
        for c, members in enumerate(self.clusters):
            out[members] = c
        return out

    def _cfl_aggregate(self, accepted: dict[int, dict[str, Any]]
                       ) -> tuple[np.ndarray, list[np.ndarray]]:
        """CFL's server step: the replying clients' updates dW_k = theta_k - theta_c(k),
        the split test in every cluster (:func:`fmtl_flower.core.cfl.split_clusters`), then
        every cluster's model moved by the n_k-weighted mean of its replying clients'
        updates (a cluster none of whose clients replied keeps its model)."""
        assert self.components is not None
        owner = self.cluster_of()
        updates = {t: r["components"][0] - self.components[owner[t]]
                   for t, r in accepted.items()}
        if self.robust:  # one device's update cannot force, hold back or steer a split
            updates = _clipped(updates)
            clusters = split_clusters(self.clusters, updates, *self.cfl_eps,
                                      mean=self._split_test_mean)
        else:
            clusters = split_clusters(self.clusters, updates, *self.cfl_eps)
        models = []
        for members in clusters:
            theta = self.components[owner[members[0]]].copy()
            heard = [int(t) for t in members if int(t) in updates]
            if heard:
                theta += self._mean_update(np.stack([updates[t] for t in heard]), heard,
                                           round_tasks=list(updates))
            models.append(theta)
        if len(clusters) > len(self.clusters):
            log(INFO, "CFL: %d clusters, sizes %s", len(clusters),
                [int(c.size) for c in clusters])
        return np.stack(models), clusters

    def _split_test_mean(self, updates: np.ndarray) -> np.ndarray:
        """Robust mode, CFL's split test: the trimmed mean of a cluster's K >= 3 updates,
        cutting at least one device's worth (1 / K) from each end of every coordinate."""
        return trimmed_mean(updates, max(self.trim, 1.0 / updates.shape[0]))

    def _mean_update(self, updates: np.ndarray, tasks: list[int], round_tasks: list[int]
                     ) -> np.ndarray:
        """CFL: the weighted mean of a cluster's updates (K, P) of ``tasks``, by n-train; in
        robust mode aggregated as :func:`~fmtl_flower.core.fedem.robust_aggregate_components`
        does, no device above ``max_weight_share`` of the trusted n-train of the round's
        ``round_tasks`` (the federation's, not the cluster's: a small cluster's weights stay
        its devices' sizes)."""
        if not self.robust:
            n = self._average_weights(tasks)
            return (n @ updates) / n.sum()
        n = self.trusted_n_train()
        one_model = [(update[None], n[t:t + 1]) for t, update in zip(tasks, updates,
                                                                      strict=True)]
        return robust_aggregate_components(
            np.zeros((1, updates.shape[1])), one_model, aggregator=self.aggregator,
            trim=self.trim, max_share=self.max_weight_share,
            round_weight=float(n[round_tasks].sum()), clip_factor=CFL_CLIP_FACTOR)[0]

    # ------------------------------------------------------------------ robust mode
    def _local_steps(self, tasks: list[int]) -> np.ndarray:
        """Robust mode, FedEM: the local SGD steps each of ``tasks`` took this round,
        epochs x ceil(n / batch size), shape (len(tasks),), the scale of its update
        (:func:`~fmtl_flower.core.fedem.robust_aggregate_components` compares the updates
        per step, FedNova's normalisation).

        n is the trusted n-train capped at 10 times the training tasks' median n-train
        (:func:`~fmtl_flower.core.robust.log_upper_fence` without its allowance for spread):
        the step counts scale every device's step through FedNova's tau_eff, and the n-train
        fence is loose when the honest sizes spread (600,000 when one of 10 tasks of 67 to
        1000 examples claims 1e9; median 170): two devices claiming it held half the weight
        and multiplied the round's step many times over (the components diverged). Only
        FedEM's mixture is compared per step: the single-model methods and IFCA held their
        targets without it, and IFCA lost 3 points with nobody attacking (0.790 to 0.760)
        with it."""
        n = self.trusted_n_train()
        fence = log_upper_fence(n[~self.unseen & (n > 0)], factor=10.0, k=0.0)
        return self.sgd.epochs * np.ceil(np.minimum(n[np.asarray(tasks, dtype=int)], fence)
                                         / self.sgd.batch_size)

    def trusted_n_train(self) -> np.ndarray:
        """Each task's n-train as it enters a weight, shape (num_tasks,): as reported, or in
        robust mode at most the log-scale fence of the training tasks' reported n-train
        (:func:`~fmtl_flower.core.robust.log_upper_fence`; 0 for a task not discovered)."""
        n = self.n_train.astype(np.float64)
        if not self.robust:
            return n
        return np.minimum(n, log_upper_fence(n[~self.unseen & (n > 0)]))

    def _average_weights(self, tasks: list[int]) -> np.ndarray:
        """The weights of ``tasks`` in an average by n-train: the reported n-train, or in
        robust mode the trusted n-train with no task above ``max_weight_share`` of the sum."""
        if not self.robust:
            return np.array([self.n_train[t] for t in tasks], dtype=float)
        n = self.trusted_n_train()[np.asarray(tasks, dtype=int)]
        return cap_shares(n, self.max_weight_share) if n.size else n

    def _aggregate_components(self, accepted: dict[int, dict[str, Any]],
                              num_sampled: int) -> np.ndarray:
        """The components after the round's accepted replies (every method but CFL and
        local): n-weighted averages of the updates (``aggregation``'s rule), made robust in
        robust mode; pFedMe's server step ``beta`` applied. ``num_sampled``: the tasks the
        round was sent to (client-level DP's divisor)."""
        assert self.components is not None
        total = None
        if self.privacy is not None:  # client-level DP: clipped noisy mean (strategies/privacy)
            components = self.privacy.aggregate(
                self.components, [r["components"] for r in accepted.values()],
                num_sampled, self.records, self.num_rounds or 1)
        elif self.robust:
            n = self.trusted_n_train()
            updates = [(r["components"], np.where(r["weights"] > 0, n[t], 0.0))
                       for t, r in accepted.items()]
            responsibilities = np.stack([_responsibility(r, soft=self.method == "fedem")
                                         for r in accepted.values()])
            if self.aggregation == "all" and self.method != "clustered":
                total = float(n[~self.unseen].sum())
            components = robust_aggregate_components(
                self.components, updates, total, aggregator=self.aggregator, trim=self.trim,
                max_share=self.max_weight_share, responsibilities=responsibilities,
                local_steps=self._local_steps(list(accepted)) if self.method == "fedem"
                else None)
        else:
            updates = [(r["components"], r["weights"]) for r in accepted.values()]
            if self.aggregation == "all" and self.method != "clustered":
                total = float(self.n_train[~self.unseen].sum())
            components = aggregate_components(self.components, updates, total)
        if self.method == "pfedme" and self.pfedme_beta != 1.0:
            components = self.components + self.pfedme_beta * (components - self.components)
        return components

    # ------------------------------------------------------------------ helpers
    def _evaluation_due(self, server_round: int) -> bool:
        return server_round % self.eval_every == 0 or server_round == self.num_rounds

    def _lr(self, server_round: int) -> float:
        return learning_rate(self.sgd.lr, server_round, self.num_rounds or server_round,
                             self.lr_schedule)

    def _shared_config(self, server_round: int, message_type: str) -> dict[str, Any]:
        """The config every message of the exchange shares (the wire contract's)."""
        base = {"server-round": server_round, "seed": self.seed, "method": self.method,
                "model": self.model_name, "num-classes": self.num_classes,
                "hidden": self.hidden, "batch-size": self.sgd.batch_size,
                "local-epochs": self.sgd.epochs, "lr": self._lr(server_round),
                "momentum": self.sgd.momentum, "weight-decay": self.sgd.weight_decay,
                "prox-mu": self.sgd.prox_mu if self.method == "fedprox" else 0.0,
                "pi-floor": self.pi_floor, "finetune-epochs": self.finetune_epochs}
        if self.method == "pfedme":
            base.update({"pfedme-lambda": self.pfedme.lam, "pfedme-lr": self.pfedme.personal_lr,
                         "pfedme-steps": self.pfedme.inner_steps})
        if self.layout is not None:
            base["layout"] = layout_signature(self.layout)
        if self.privacy is not None and message_type == MessageType.TRAIN:
            base.update(self.privacy.wire_config())  # client-clip: dp-clip
        return base

    def _send(self, server_round: int, message_type: str, tasks: list[int],
              grid: Grid | None = None, skipped: Iterable[int] = ()) -> list[Message]:
        """The exchange's :class:`~fmtl_flower.strategies.round_state.FedEMSentRound`, kept
        in :attr:`sent_rounds` until its replies are read against it, and its messages."""
        assert self.components is not None
        sent = self.sent_rounds.add(FedEMSentRound(
            server_round, message_type,
            MappingProxyType(self._shared_config(server_round, message_type)),
            components=frozen_array(self.components),
            cluster_of=frozen_array(self.cluster_of()) if self.method == "cfl" else None,
            tasks=tuple(int(t) for t in tasks), skipped=frozenset(skipped),
            exchange=self.replies.begin()))
        return self._messages(sent, grid)

    def _messages(self, sent: FedEMSentRound, grid: Grid | None = None) -> list[Message]:
        """The messages of the exchange ``sent``, made from it: one per task; one stacked
        message per packed node that speaks FedEM's stacking protocol
        (:mod:`~fmtl_flower.strategies.packed_fedem`; numpy models)."""
        encoded: dict[int, Any] = {}  # the components each task is sent, encoded once

        def components(task: int) -> tuple[int, Any]:
            """(key, encoding) of the components sent to ``task``: every component (key -1)
            or, CFL's training clients, their cluster's model (key: the cluster)."""
            key = sent.components_key(task)
            if key not in encoded:
                encoded[key] = to_array(sent.components_of(task))
            return key, encoded[key]

        out = []
        tasks = list(sent.tasks)
        stacked_groups = getattr(grid, "stacked_groups", None)
        if callable(stacked_groups) and self.layout is None:
            groups, rest = stacked_groups(STACKING_PROTOCOL, {t: self.task_to_node[t]
                                                             for t in tasks})
            out = [sent.exchange.track_stack(group, stacked_message(
                group, sent.message_type, sent.server_round, sent.config,
                [components(t) for t in group.tasks], self.unseen)) for group in groups]
            tasks = [t for t in tasks if t in rest]
        for task in tasks:
            node = self.task_to_node[task]
            config = ConfigRecord({**sent.config, "task-id": int(task),
                                   "unseen": bool(self.unseen[task])})
            content = RecordDict({"arrays": ArrayRecord({"components": components(task)[1]}),
                                  "config": config})
            out.append(sent.exchange.track(int(task), node, Message(
                content, dst_node_id=node, message_type=sent.message_type,
                group_id=str(sent.server_round))))
        return out

    def _read_replies(self, sent: FedEMSentRound, replies: Iterable[Message]
                      ) -> dict[int, dict[str, Any]]:
        """Validated replies to the exchange ``sent``, keyed by task, in task order, checked
        against what it sent; invalid ones logged and left out
        (:class:`~fmtl_flower.strategies.trust.ReplyBoundary`)."""
        def on_accept(task: int) -> None:
            self.ever_replied[task] = True

        return self.replies.read(
            f"round {sent.server_round}", replies,
            lambda reply, task: self._parse_reply(reply, task, sent),
            on_accept,
            lambda reply, group: self._parse_stack(reply, group, sent),
            exchange=sent.exchange).accepted

    def _parse_reply(self, reply: Message, task: int, sent: FedEMSentRound
                     ) -> dict[str, Any]:
        """One reply's keys, types, shapes and values against the exchange ``sent``."""
        train = sent.message_type == MessageType.TRAIN
        ints, numbers, optional = self._reply_keys(train)
        out = read_metrics(reply, ints=ints, numbers=numbers, optional_numbers=optional)
        self._check_metrics(out, task, sent)
        if not train:
            return out
        arrays = arrays_of(reply)
        if arrays is None or "components" not in arrays or "weights" not in arrays:
            raise ReplyError("arrays 'components' and 'weights' required")
        if "responsibility" in arrays:
            out["responsibility"] = from_array(arrays["responsibility"])
        return self._check_arrays(out, from_array(arrays["components"]),
                                  from_array(arrays["weights"]), sent)

    def _parse_stack(self, reply: Message, group: StackGroup, sent: FedEMSentRound
                     ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """The rows of a stacked reply (:mod:`~fmtl_flower.strategies.packed_fedem`), each
        checked as :meth:`_parse_reply` checks one reply, and the rejected tasks."""
        train = sent.message_type == MessageType.TRAIN

        def check(row: dict[str, Any], task: int) -> None:
            self._check_metrics(row, task, sent)
            if train:
                self._check_arrays(row, row["components"], row["weights"], sent)

        return read_stacked_reply(reply, group, self._reply_keys(train),
                                  ("components", "weights", "responsibility") if train else (),
                                  check)

    @staticmethod
    def _reply_keys(train: bool) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The reply's int metrics, number metrics and optional number metrics."""
        ints: tuple[str, ...] = ("task-id", "round", "n-train")
        if not train:
            ints += ("test-correct", "test-n", "em-iterations")
        return ints, ("train-loss",), ("e-step-s", "train-s") if train else ()

    def _check_metrics(self, out: dict[str, Any], task: int, sent: FedEMSentRound) -> None:
        """A reply's metrics against the exchange ``sent`` (its task, round and type)."""
        train = sent.message_type == MessageType.TRAIN
        check_task_and_round(out, task, sent.server_round)
        if out["n-train"] != self.n_train[task]:
            raise ReplyError(f"n-train {out['n-train']} differs from {self.n_train[task]}")
        if not 0 <= out["train-loss"] <= MAX_LOSS:
            raise ReplyError(f"train-loss must be in [0, {MAX_LOSS:g}], got {out['train-loss']}")
        if not train:
            if not 0 <= out["test-correct"] <= out["test-n"] <= self.directory.max_n:
                raise ReplyError(f"test-correct, test-n outside 0 <= test-correct <= test-n <= "
                                 f"{self.directory.max_n}")
            if out["em-iterations"] < 0:
                raise ReplyError("em-iterations must be >= 0")
            return
        for key in ("e-step-s", "train-s"):
            if not 0 <= out.get(key, 0.0) <= max(self.round_timeout, 1.0):
                raise ReplyError(f"metric {key!r} must be in [0, the round timeout "
                                 f"{self.round_timeout:g} s]")

    def _check_arrays(self, out: dict[str, Any], theta: np.ndarray, weights: np.ndarray,
                      exchange: FedEMSentRound) -> dict[str, Any]:
        """A train reply's components and weights against those the exchange sent its task
        (shapes, finiteness, the update bound, the trained components)."""
        sent = exchange.components_of(int(out["task-id"]))
        M, P = sent.shape
        if theta.dtype != np.float64 or theta.shape != (M, P):
            raise ReplyError(f"'components' must be float64 of shape ({M}, {P}), got "
                             f"{theta.dtype} {theta.shape}")
        if weights.dtype != np.float64 or weights.shape != (M,):
            raise ReplyError(f"'weights' must be float64 of shape ({M},), got "
                             f"{weights.dtype} {weights.shape}")
        if not np.all(np.isfinite(theta)):
            raise ReplyError("'components' has non-finite values")
        if np.max(np.abs(theta)) > self.max_abs_param:
            raise ReplyError(f"'components' has |values| above {self.max_abs_param:g}")
        moved = norm(theta - sent, axis=1)
        limits = self.max_update_ratio * np.maximum(norm(sent, axis=1), 1.0)
        worst = int(np.argmax(moved / limits))
        check_bound("|theta_m - theta_m sent|", float(moved[worst]), float(limits[worst]),
                    "component %d; max_update_ratio %g x max(|theta_m|, 1)", worst,
                    self.max_update_ratio)
        n = float(out["n-train"])
        if not np.all((weights == 0) | (weights == n)):
            raise ReplyError("'weights' entries must be 0 or n-train")
        expected = 1 if self.method == "clustered" else M
        if int(np.count_nonzero(weights)) != expected:
            raise ReplyError(f"{int(np.count_nonzero(weights))} trained components, expected "
                             f"{expected}")
        if self.robust and "responsibility" in out:  # it enters a weight in robust mode only
            _check_responsibility(out["responsibility"], M)
        out["components"], out["weights"] = theta, weights
        return out
