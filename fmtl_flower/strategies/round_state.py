"""A round's sent state: what the server sent in one exchange, which its replies are checked
against.

``configure_train`` (and ``configure_evaluate``) of MOCHA's family (MOCHA, CoCoA, Mb-SDCA,
packed or not; and Mb-SGD, with the fields it has) builds one :class:`SentRound` before it
makes a single message: the round
number, the shared config, the models w_t as sent, the per-task budgets and drop-outs, the
bounds' inputs (|w_t|, w_t . b_t, m_tt, sigma'), Mb-SDCA's scale, the seeding targets, which
tasks were sent and to which node, and the trust boundary's
:class:`~fmtl_flower.strategies.trust.Exchange` that ties every reply to the message it
answers. The messages are made from it, and nothing else; ``aggregate_train`` (and
``aggregate_evaluate``) takes the round's :class:`SentRound` back from the strategy's
:class:`SentRounds` and reads the replies against it, so a reply is always checked against
the state it was sent with, whatever the strategy has configured since. A reply whose round
or message matches no sent state (late, foreign, or read already) is logged and dropped.

The values are frozen: the arrays are read-only copies. Only the exchange fills as the
messages are made and pushed (message ids are given when a message is pushed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from ..packing import StackGroup
from .trust import Exchange, ReplyBoundary

__all__ = ["SentRound", "SentRounds", "drop_unsent", "frozen_array"]


def frozen_array(values: Any, dtype: Any = None) -> np.ndarray:
    """A read-only C-ordered copy of ``values`` (as ``dtype`` when given)."""
    out = np.array(values, dtype=dtype, copy=True, order="C")
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class SentRound:
    """What one exchange of MOCHA's family sent (module docstring).

    Attributes
    ----------
    server_round : int
        The round the messages name (``server-round``; every reply must echo it).
    message_type : str
        ``"train"`` or ``"evaluate"``.
    evaluate : bool
        Whether the devices were asked for their test errors (``eval``).
    config : mapping
        The config every message shares (the one-task messages' and the stacked ones',
        which add ``server-round``), built once.
    models : ndarray, (m, d)
        Row t: the model w_t sent to task t (read-only).
    w_norm : ndarray, (m,)
        |w_t| as sent: the input of the loss bound.
    budgets : ndarray of int, (m,), or None
        The steps (MOCHA's coordinate steps, Mb-SGD's mini-batch size) each task was given
        (None: no work, the evaluate exchange).
    dropped : ndarray of bool, (m,)
        The tasks sent ``dropped`` (simulated drop-out, or not sampled this round).
    w_dot_b : ndarray, (m,), or None
        MOCHA: w_t . b_t as sent, the input of the certificate's check (None: Mb-SGD).
    m_diag, sigma_prime : ndarray, (m,), or None
        MOCHA: (K^-1)_tt and sigma'_t as sent.
    last_accepted : ndarray of int, (m,), or None
        MOCHA: ``last-accepted-round`` as sent.
    scale : float
        Mb-SDCA's update scale as sent (1.0 otherwise).
    seed_targets : tuple of ndarray, or None
        (W0, W0 K) of the seeding round (None otherwise).
    chosen : mapping of int to int
        task -> node of the one-task messages.
    stacks : tuple of StackGroup
        The stacked messages' groups (packed nodes).
    num_sampled : int
        How many tasks were sampled to train (``num-sampled``).
    exchange : Exchange
        The trust boundary's registry of the messages sent (fills as they are made).
    """

    server_round: int
    message_type: str
    evaluate: bool
    config: Mapping[str, Any]
    models: np.ndarray
    w_norm: np.ndarray
    budgets: np.ndarray | None
    dropped: np.ndarray
    w_dot_b: np.ndarray | None = None
    m_diag: np.ndarray | None = None
    sigma_prime: np.ndarray | None = None
    last_accepted: np.ndarray | None = None
    scale: float = 1.0
    seed_targets: tuple[np.ndarray, np.ndarray] | None = None
    chosen: Mapping[int, int] = field(default_factory=dict)
    stacks: tuple[StackGroup, ...] = ()
    num_sampled: int = 0
    exchange: Exchange = field(default_factory=Exchange, compare=False)

    @property
    def with_work(self) -> bool:
        """Whether the messages gave the devices work (a ``train`` exchange: a delta-b in
        every reply)."""
        return self.budgets is not None

    def work(self, tasks: np.ndarray) -> np.ndarray:
        """The coordinate steps ``tasks`` may have done: their budget, 0 when ``dropped``
        (0 everywhere in an exchange without work)."""
        if self.budgets is None:
            return np.zeros(len(tasks), dtype=np.int64)
        return np.where(self.dropped[tasks], 0, self.budgets[tasks])

    def stacked_vectors(self) -> dict[str, np.ndarray]:
        """The per-task values of a stacked message as vectors over all tasks (cut per node
        by :func:`~fmtl_flower.strategies.packed_mocha.stacked_message`)."""
        out: dict[str, np.ndarray] = {}
        if self.last_accepted is not None:  # MOCHA's dual protocol
            out.update({"last-accepted-round": self.last_accepted, "m-tt": self.m_diag,
                        "sigma-prime": self.sigma_prime})
        if self.budgets is not None:
            out["budget"] = self.budgets
            out["dropped"] = self.dropped
            if self.seed_targets is not None:  # the seeding round: rows (m, d)
                out["seed-w"], out["seed-b"] = (t.T for t in self.seed_targets)
        return out


class SentRounds:
    """The :class:`SentRound` of every exchange whose replies are not read yet, keyed by
    (message type, round).

    Parameters
    ----------
    name : str
        The strategy's name, for the log.
    keep : int
        The most exchanges kept waiting for their replies; the oldest is forgotten beyond it
        (its replies, should they come, are then dropped as foreign).
    """

    def __init__(self, name: str, keep: int = 4) -> None:
        self.name = name
        self.keep = keep
        self._waiting: dict[tuple[str, int], SentRound] = {}

    def add(self, sent: SentRound) -> SentRound:
        """Keep ``sent`` until its replies are read (replacing an exchange of the same type
        and round that was never read)."""
        key = (sent.message_type, sent.server_round)
        self._waiting.pop(key, None)
        self._waiting[key] = sent
        while len(self._waiting) > self.keep:
            old = next(iter(self._waiting))
            del self._waiting[old]
            log(WARNING, "%s: the %s messages of round %d were never read; forgotten (their "
                "replies will be dropped)", self.name, old[0], old[1])
        return sent

    def get(self, message_type: str, server_round: int) -> SentRound | None:
        """The sent state of that exchange, if its replies are still awaited."""
        return self._waiting.get((message_type, server_round))

    def take(self, message_type: str, server_round: int) -> SentRound | None:
        """Remove and return the sent state of that exchange (None: never sent, or its
        replies were read already)."""
        return self._waiting.pop((message_type, server_round), None)

    def clear(self) -> None:
        """Forget every exchange."""
        self._waiting.clear()


def drop_unsent(boundary: ReplyBoundary, message_type: str, server_round: int,
                replies: Iterable[Message]) -> None:
    """Log and drop ``replies`` to an exchange that has no sent state (never sent, read
    already, or forgotten): each one answers no message the server is waiting on, and is
    logged as such by ``boundary`` (nothing is parsed)."""
    log(WARNING, "%s round %d: no %s messages of this round are awaiting replies (never "
        "sent, or their replies were read already); every reply is dropped", boundary.name,
        server_round, message_type)
    boundary.read(f"round {server_round}", replies, lambda reply, task: {},
                  exchange=Exchange())


# ------------------------------------------------------------------ FedEM's family
# FedEM and its baselines (fedavg, fedprox, fedavg-ft, IFCA, CFL, pFedMe, local; packed or
# not) send every task the same kind of message: the components, or CFL's cluster model.

__all__ += ["FedEMSentRound"]


@dataclass(frozen=True)
class FedEMSentRound:
    """What one exchange of FedEM's family sent, which its replies are checked against
    (``configure_train`` / ``configure_evaluate`` of
    :class:`~fmtl_flower.strategies.fedem.FedEM` build it; the messages are made from it).

    Attributes
    ----------
    server_round : int
        The round the messages name (``server-round``; every reply must echo it).
    message_type : str
        ``"train"`` or ``"evaluate"``.
    config : mapping
        The config every message shares (the one-task messages add ``task-id`` and
        ``unseen``), built once.
    components : ndarray, (M, P)
        The server's components as sent (read-only): the reference of the update bound.
    cluster_of : ndarray of int, (num_tasks,), or None
        CFL: each task's cluster as sent (-1: a held-out task, sent every cluster's model);
        None for the other methods (every task is sent every component).
    tasks : tuple of int
        The tasks sent a message, sorted: the round's sample (``train``; with
        ``dp.sampling=poisson`` the secret Poisson sample) or the evaluated tasks.
    skipped : frozenset of int
        ``evaluate``: the known tasks Flower's ``fraction_evaluate`` left out (not missing).
    exchange : Exchange
        The trust boundary's registry of the messages sent (fills as they are made).
    """

    server_round: int
    message_type: str
    config: Mapping[str, Any]
    components: np.ndarray
    cluster_of: np.ndarray | None
    tasks: tuple[int, ...]
    skipped: frozenset[int] = frozenset()
    exchange: Exchange = field(default_factory=Exchange, compare=False)

    def components_of(self, task: int) -> np.ndarray:
        """The components ``task`` was sent: CFL's training clients their cluster's model
        (1, P), everyone else every component (M, P)."""
        if self.cluster_of is not None and self.cluster_of[task] >= 0:
            c = int(self.cluster_of[task])
            return self.components[c:c + 1]
        return self.components

    def components_key(self, task: int) -> int:
        """Which rows :meth:`components_of` gives ``task``: its cluster, or -1 (every
        component); tasks with one key are sent one encoding."""
        if self.cluster_of is None:
            return -1
        return int(self.cluster_of[task])


# ------------------------------------------------------------------------------------------
# The FSVRG family (fsvrg, fsvrg-naive, gd, dane, cocoa-plus; strategies/fsvrg.py)

__all__ += ["FSVRGSentExchange"]


@dataclass(frozen=True)
class FSVRGSentExchange:
    """What one exchange of the FSVRG family sent: its replies are checked against it.

    One global model and several exchanges a round (the setup's ``stats`` and ``gram``
    queries, the ``gradient`` query, the ``train`` and final ``evaluate`` messages, module
    docstring of :mod:`fmtl_flower.strategies.fsvrg`). Each is made from one of these and
    nothing else; the exchanges read inside ``configure_train`` (setup, gradient) are read
    against theirs at once, the ``train`` and ``evaluate`` ones are kept in the strategy's
    :class:`SentRounds` (keyed by message type and round, like :class:`SentRound`) until
    ``aggregate_train`` / ``aggregate_evaluate`` takes them back.

    Attributes
    ----------
    server_round : int
        The round the messages name (0: the setup's exchanges, which name none).
    kind : str
        ``"stats"``, ``"gram"``, ``"gradient"``, ``"train"`` or ``"evaluate"``.
    message_type : str
        The messages' type.
    evaluate : bool
        Whether the devices were asked for their test errors.
    config : mapping
        The config every message shares (without ``task-id`` and the commit-protocol keys).
    arrays : mapping of str to ndarray
        The global vectors sent (read-only): ``w`` (w_t), ``g`` (grad f(w_t)), ``phi``,
        ``v`` (the power iteration's vector).
    w_norm : float
        |w_t| as sent (0 without ``w``): the input of the loss bound.
    protocol : mapping
        CoCoA+'s commit-protocol keys every message shares (``run-token``, with checkpoints
        ``checkpoint-round``); empty for the other exchanges.
    last_accepted : ndarray of int, (m,), or None
        CoCoA+'s ``last-accepted-round`` L_k as sent.
    coupling : ndarray, (m,), or None
        CoCoA+: w_t . v_k as sent (v_k the task's share of w in the ledger then), the input
        of the certificate's check of a reply's (loss, dual) pair.
    chosen : mapping of int to int
        task -> node of the one-task messages.
    stacks : tuple of StackGroup
        The stacked messages' groups (packed nodes).
    exchange : Exchange
        The trust boundary's registry of the messages sent (fills as they are made).
    """

    server_round: int
    kind: str
    message_type: str
    evaluate: bool
    config: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    w_norm: float = 0.0
    protocol: Mapping[str, Any] = field(default_factory=dict)
    last_accepted: np.ndarray | None = None
    coupling: np.ndarray | None = None
    chosen: Mapping[int, int] = field(default_factory=dict)
    stacks: tuple[StackGroup, ...] = ()
    exchange: Exchange = field(default_factory=Exchange, compare=False)

    @property
    def w(self) -> np.ndarray | None:
        """w_t as sent (None: the setup's exchanges)."""
        return self.arrays.get("w")

    @property
    def dp_clip(self) -> float | None:
        """``dp-clip`` as sent (CoCoA+ under client-level DP ``client-clip``), or None."""
        clip = self.config.get("dp-clip")
        return None if clip is None else float(clip)


# ------------------------------------------------------------------------------------------
# OFMTL's own exchanges (strategies/ofmtl.py): a newcomer's round trips and the evaluations
# after each event (its MOCHA (re)trainings use MOCHA's SentRound).

__all__ += ["OFMTLSentExchange"]


@dataclass(frozen=True)
class OFMTLSentExchange:
    """What one of OFMTL's own exchanges sent: its replies are checked against it.

    Made once, when the exchange's messages are made (:meth:`newcomer` for one step of a
    newcomer's protocol, :meth:`evaluation` for the evaluation after an event); the messages
    are made from it, the trust boundary reads the replies against its :attr:`exchange`
    (a reply to a message of another exchange, e.g. a late reply to an earlier step, is
    logged and dropped) and the reply check reads the values here, never the strategy's
    attributes.

    Attributes
    ----------
    kind : str
        ``"newcomer"`` or ``"evaluate"``.
    message_type : str
        The messages' type.
    config : mapping
        The config the messages share (a copy); an evaluation's messages add
        ``task-id``.
    chosen : mapping of int to int
        task -> node of the messages (one task for a newcomer's step).
    d : int
        The models' dimension: a newcomer's ``w`` must have shape (d,).
    step : int
        The newcomer's protocol step (``step``; every reply must echo it); -1: an evaluation.
    server_round : int
        The evaluation's ``server-round`` (every reply must echo it as ``round``); -1: a
        newcomer's step.
    omega : float
        The newcomer's omega = Omega[m, m] as sent (nan: an evaluation).
    c : ndarray, (d,), or None
        The newcomer's c = sum_t Omega[t, m] w_t as sent (read-only; None: an evaluation).
    exchange : Exchange
        The trust boundary's registry of the messages sent (fills as they are made).
    """

    kind: str
    message_type: str
    config: Mapping[str, Any]
    chosen: Mapping[int, int]
    d: int
    step: int = -1
    server_round: int = -1
    omega: float = float("nan")
    c: np.ndarray | None = None
    exchange: Exchange = field(default_factory=Exchange, compare=False)

    @classmethod
    def newcomer(cls, message_type: str, config: Mapping[str, Any], task: int, node: int,
                 c: np.ndarray, exchange: Exchange | None = None) -> OFMTLSentExchange:
        """One step of the newcomer ``task``'s protocol (on ``node``): ``config`` holds its
        ``step`` and ``omega``, ``c`` is the array sent."""
        frozen_c = frozen_array(c)
        return cls("newcomer", message_type, dict(config), {task: node},
                   int(frozen_c.shape[0]), step=int(config["step"]),
                   omega=float(config["omega"]), c=frozen_c,
                   exchange=Exchange() if exchange is None else exchange)

    @classmethod
    def evaluation(cls, message_type: str, server_round: int, chosen: Mapping[int, int],
                   d: int, exchange: Exchange | None = None) -> OFMTLSentExchange:
        """The evaluation ``server_round`` of the tasks ``chosen`` (task -> node)."""
        return cls("evaluate", message_type,
                   {"server-round": int(server_round)},
                   dict(chosen), int(d), server_round=int(server_round),
                   exchange=Exchange() if exchange is None else exchange)

    @property
    def task(self) -> int:
        """The newcomer's task (a newcomer's step has one message)."""
        if len(self.chosen) != 1:
            raise ValueError(f"a {self.kind} exchange sent {len(self.chosen)} tasks, not one")
        return next(iter(self.chosen))

    @property
    def where(self) -> str:
        """The exchange, for the log (``"newcomer 3 step 1"``, ``"evaluation 2"``)."""
        if self.kind == "newcomer":
            return f"newcomer {self.task} step {self.step}"
        return f"evaluation {self.server_round}"
