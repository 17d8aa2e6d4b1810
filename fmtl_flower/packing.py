"""Task packing: one Flower node hosts several tasks; one message per node carries them all.

A phone with several users, a silo with several sites, or a simulated federation with 10^4
tasks on a few hundred Ray nodes: the strategies stay keyed by task id and talk to one
*virtual node* per task, and two adapters pack and unpack the traffic:

* :class:`PackedGrid` (server side) wraps Flower's ``Grid``. It asks every new physical node
  how many task slots it hosts (``query.fmtl_slots``; reply ConfigRecord ``slots``: int
  ``count``, at most ``max_slots_per_node``, default :data:`MAX_SLOTS_PER_NODE`, checked
  before anything is allocated; optional str ``stacked``, its stacking protocols; optional
  str ``tasks-digest``, :func:`tasks_digest` of its task list, which its packed and stacked
  replies repeat so that a changed task list is seen), exposes one virtual node id per slot
  through ``get_node_ids`` (:meth:`PackedGrid.physical_node` maps one back: a packed node
  is one node, e.g. one vote at discovery), and turns the messages of one round into one
  message per physical node (records prefixed ``"<slot>/"``). The reply is split back into
  one reply per virtual node, so the strategy sees exactly what it would see with one task
  per node.
* :func:`packed_client_app` (client side) wraps a ClientApp: it answers the slots query and
  runs the wrapped app once per slot of a packed message, with a per-slot ``Context``
  (``node_config["task-id"]`` set to the slot's task; its ``state`` kept in the node's state
  under the slot's prefix), and packs the replies. A slot whose handler raises yields an error
  reply for that task only; the other slots' replies go through.

Results do not depend on the packing: every task is still solved by the same handler with the
same message; only the number of Flower messages changes. Unpacked messages (no
``"packing"`` record) pass through to the wrapped app unchanged.

Stacked messages (the packing that amortizes)
---------------------------------------------
Splitting a packed message into one Message, Context and set of records per slot costs as much
as sending them one by one. A strategy and a client that share a *stacking protocol* (e.g.
``"mocha"``: :mod:`fmtl_flower.clients.packed_mocha`) skip that: the client names the protocols
it speaks in its slots reply (``stacked``), the strategy asks :meth:`PackedGrid.stacked_groups`
which of its tasks sit on such nodes and sends each of those nodes ONE message whose records
hold the slots' payloads stacked (one ``(K, d)`` array, one vector per per-task value), marked
by a ``stack`` ConfigRecord (``protocol`` str, ``slots`` list of ints: row i is slot
``slots[i]``). :class:`PackedGrid` passes such messages and their replies through unchanged;
the client hands them to the protocol's handler (``stacked`` of :func:`packed_client_app`),
which runs every slot's solver directly and replies with one stacked record: its ``stack``
names the slots whose rows it holds, and ``stack-errors`` (``slots`` list of ints,
``reasons`` list of str) the slots that failed, each failing only its own task.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import os
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import WARNING
from typing import Any, NamedTuple, TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.app.message.message import make_message
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid

from .engine import CLIENT_APP_RAISED, GridWrapper, create_message, raised_reason
from .families import FAMILIES
from .wire import from_array

__all__ = ["STACK", "STACK_ERRORS", "PackedGrid", "SLOTS_QUERY", "SlotFailed", "SlotTaskCache",
           "StackGroup", "StackedHandler", "each_slot", "packed_client_app", "read_stack",
           "read_stack_errors", "read_stacked_instruction", "stacked_content", "stacked_is_train",
           "tasks_digest", "tasks_of_node"]

#: Message type of the server's "how many task slots do you host" query.
SLOTS_QUERY = "query.fmtl_slots"
#: Record of a packed message naming its slots (ConfigRecord ``{"slots": [int, ...]}``).
PACKING = "packing"
#: Record of a packed reply's slot whose handler failed (ConfigRecord ``code``, ``reason``).
SLOT_ERROR = "slot-error"
#: At most this many task slots per node (the slot is part of a per-slot node id).
MAX_SLOTS = 1 << 20
#: Default operator limit on the slots one node may announce (``PackedGrid``'s
#: ``max_slots_per_node``): a node announcing more is refused before anything is allocated
#: for its slots. Raise it (up to :data:`MAX_SLOTS`) for nodes that really host more tasks.
MAX_SLOTS_PER_NODE = 4096
#: Key of the slots reply, and of a packed or stacked reply's ``packing`` / ``stack`` record:
#: a digest of the node's task list (str), so that a node whose task list changed is seen.
TASKS_DIGEST = "tasks-digest"
#: Record of a stacked message or reply (ConfigRecord ``protocol`` str, ``slots`` [int, ...]).
STACK = "stack"
#: Record of a stacked reply naming its failed slots (``slots`` [int, ...], ``reasons`` [str]).
STACK_ERRORS = "stack-errors"

#: ``handler(message, context, slot_tasks) -> (content, slots replied, {slot: reason})``: a
#: stacking protocol's client side; ``slot_tasks`` pairs each slot of the message with the
#: task it hosts (None: the node has no such slot).
StackedHandler = Callable[[Message, Context, list[tuple[int, int | None]]],
                          tuple[RecordDict, list[int], dict[int, str]]]

#: ``handler(content, context, slot, task) -> reply content``: one slot of a packed message
#: answered without a per-slot Message or Context.
SlotHandler = Callable[[RecordDict, Context, int, int], RecordDict]


class StackGroup(NamedTuple):
    """The tasks of one physical node that a stacked message addresses: ``slots[i]`` hosts
    ``tasks[i]``, whose virtual node is ``virtual[i]``."""

    node: int
    slots: list[int]
    tasks: list[int]
    virtual: list[int]


def _slot_list(record: Any, key: str = "slots") -> list[int]:
    slots = record.get(key, None) if isinstance(record, ConfigRecord) else None
    if not isinstance(slots, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_SLOTS
            for s in slots):
        raise ValueError(f"{key!r} must be a list of ints in 0..{MAX_SLOTS - 1}, "
                         f"got {slots!r}")
    if len(set(slots)) != len(slots):
        raise ValueError(f"{key!r} names a slot twice")
    return slots


def read_stack(content: RecordDict) -> tuple[str, list[int]]:
    """``(protocol, slots)`` of a stacked message or reply; ValueError if malformed."""
    if STACK not in content:
        raise ValueError("not a stacked message: no 'stack' record")
    record = content[STACK]
    slots = _slot_list(record)
    protocol = record.get("protocol", None)
    if not isinstance(protocol, str):
        raise ValueError(f"stack record: 'protocol' must be a string, got {protocol!r}")
    return protocol, slots


def read_stack_errors(content: RecordDict) -> dict[int, str]:
    """``{slot: reason}`` of a stacked reply's failed slots (empty when none failed)."""
    if STACK_ERRORS not in content:
        return {}
    record = content[STACK_ERRORS]
    slots = _slot_list(record)
    reasons = record.get("reasons", None)
    if not isinstance(reasons, list) or len(reasons) != len(slots) or not all(
            isinstance(r, str) for r in reasons):
        raise ValueError("stack-errors record: 'reasons' must be one string per slot")
    return dict(zip(slots, reasons, strict=True))


def _prefix(slot: int) -> str:
    return f"{slot}/"


def _split_slot(name: str) -> tuple[int, str] | None:
    """``(slot, rest)`` of a record named ``"<slot>/<rest>"``; None if it names no slot."""
    head, sep, rest = name.partition("/")
    if not sep or not head.isdigit():
        return None
    return int(head), rest


def tasks_digest(tasks: Sequence[int]) -> str:
    """A short digest of a node's task list, slot by slot (its order counts)."""
    text = ",".join(str(int(t)) for t in tasks)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def pack_content(parts: dict[int, RecordDict], digest: str | None = None) -> RecordDict:
    """One RecordDict holding every slot's records under ``"<slot>/<name>"``, plus
    ``packing`` (with the node's :func:`tasks_digest` when given)."""
    packing: dict[str, Any] = {"slots": sorted(parts)}
    if digest is not None:
        packing[TASKS_DIGEST] = digest
    packed = RecordDict({PACKING: ConfigRecord(packing)})
    for slot, content in parts.items():
        for name, record in content.items():
            packed[_prefix(slot) + name] = record
    return packed


def unpack_content(content: RecordDict) -> dict[int, RecordDict]:
    """Inverse of :func:`pack_content`; ValueError if the ``packing`` record is malformed."""
    if PACKING not in content:
        raise ValueError("not a packed message: no 'packing' record")
    slots = content[PACKING].get("slots", None) if isinstance(content[PACKING],
                                                                ConfigRecord) else None
    if not isinstance(slots, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_SLOTS
            for s in slots):
        raise ValueError(f"packing record: 'slots' must be a list of ints in "
                         f"0..{MAX_SLOTS - 1}, got {slots!r}")
    parts: dict[int, RecordDict] = {slot: RecordDict() for slot in slots}
    for name, record in content.items():
        if name == PACKING:
            continue
        split = _split_slot(name)
        if split is None or split[0] not in parts:
            raise ValueError(f"packed record {name!r} names no slot of {slots}")
        parts[split[0]][split[1]] = record
    return parts


# ------------------------------------------------------------------------------ server side
class PackedGrid(GridWrapper):
    """A ``Grid`` presenting one virtual node per task slot of the wrapped grid's nodes.

    Parameters
    ----------
    grid : Grid
        Flower's grid (Ray simulation, deployment) or the in-process one.
    query_timeout : float
        Seconds to wait for a node's answer to the slots query.
    retry_after : float
        Seconds before a node whose slots query failed is asked again.
    max_slots_per_node : int
        The most slots one node may announce (default :data:`MAX_SLOTS_PER_NODE`): a node
        announcing more is refused (logged with the reason, asked again after
        ``retry_after``) before anything is allocated for its slots.

    Notes
    -----
    Virtual node ids are never reused: a node that goes offline takes its virtual nodes with
    it, and when it comes back (a new Flower node id) its slots get new virtual ids, which
    the strategies' task directories treat as a restarted device. A node whose task list
    changes (its replies carry another :func:`tasks_digest` than its slots reply did) is
    treated the same way: its replies of that exchange are dropped and its slots are
    discovered again, under new virtual ids. A node that does not answer the slots query,
    or answers badly, is logged and asked again after ``retry_after`` seconds;
    :meth:`refusals` says why for each.
    """

    #: ``send_and_receive`` iterates the messages once (then packs a list for the wrapped grid).
    streams_messages = True

    def __init__(self, grid: Grid, *, query_timeout: float = 60.0,
                 retry_after: float = 30.0,
                 max_slots_per_node: int = MAX_SLOTS_PER_NODE) -> None:
        super().__init__(grid)
        self.query_timeout = float(query_timeout)
        self.retry_after = float(retry_after)
        if isinstance(max_slots_per_node, bool) or not isinstance(max_slots_per_node, int) \
                or not 1 <= max_slots_per_node <= MAX_SLOTS:
            raise ValueError(f"max_slots_per_node must be an int in 1..{MAX_SLOTS}, got "
                             f"{max_slots_per_node!r}")
        self.max_slots_per_node = max_slots_per_node
        self._virtual = itertools.count(1)
        self._slots: dict[int, list[int]] = {}  # physical node -> its virtual ids, by slot
        self._where: dict[int, tuple[int, int]] = {}  # virtual id -> (physical node, slot)
        self._refused: dict[int, tuple[float, str]] = {}  # node -> (when, why) it was refused
        self._protocols: dict[int, frozenset[str]] = {}  # physical node -> stacking protocols
        self._digests: dict[int, str | None] = {}  # physical node -> its tasks_digest
        self.messages_sent = 0  # physical messages, for benchmarks and tests
        # push_messages' one-slot messages: their id -> (the packed message's id, node, slot,
        # the message pushed), until pulled
        self._pushed: dict[str, tuple[str, int, int, Message]] = {}
        self._pushed_ids = itertools.count(1)

    # Grid's interface (set_run and run: the wrapped grid's) -------------------------------
    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:  # noqa: D102
        return create_message(content, message_type, dst_node_id, group_id, ttl)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push each message to a virtual node on its own, as a packed message of one slot
        to the physical node (barrier-free strategies: one request per task in flight, each
        answered when its slot is done; :mod:`fmtl_flower.strategies.async_mocha`). Returns
        one id per message pushed (the id :meth:`pull_messages` takes and its reply answers);
        a message to an unknown virtual node is logged and dropped (no id)."""
        ids = []
        for message in messages:
            virtual = message.metadata.dst_node_id
            if virtual not in self._where:
                log(WARNING, "packing: no virtual node %s; message dropped", virtual)
                continue
            node, slot = self._where[virtual]
            sub_id = f"{virtual}.{next(self._pushed_ids)}"
            message.metadata.__dict__["_message_id"] = sub_id
            packed = Message(pack_content({slot: message.content}), dst_node_id=node,
                             message_type=message.metadata.message_type,
                             ttl=message.metadata.ttl)
            inner_ids = list(self.inner.push_messages([packed]))
            self.messages_sent += 1
            if inner_ids:
                self._pushed[sub_id] = (inner_ids[0], node, slot, message)
                ids.append(sub_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies that arrived for the ids :meth:`push_messages` returned, split back
        to their virtual nodes (a reply from a node whose task list changed is dropped, as
        in :meth:`send_and_receive`)."""
        wanted = {self._pushed[i][0]: i for i in message_ids if i in self._pushed}
        replies: list[Message] = []
        for reply in self.inner.pull_messages(list(wanted)):
            sub_id = wanted.get(reply.metadata.reply_to_message_id)
            if sub_id is None or sub_id not in self._pushed:
                continue
            _, node, slot, message = self._pushed.pop(sub_id)
            if reply.metadata.src_node_id == node and self._task_list_changed(node, reply):
                continue
            replies.extend(_split_reply(reply, {slot: message}))
        return replies

    # virtual nodes ------------------------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        """The virtual node ids (one per task slot) of the online physical nodes."""
        online = set(self.inner.get_node_ids())
        for node in [n for n in self._slots if n not in online]:
            self._forget(node)
        for node in [n for n in self._refused if n not in online]:
            del self._refused[node]
        now = time.monotonic()
        new = sorted(n for n in online - set(self._slots)
                     if n not in self._refused or now - self._refused[n][0] >= self.retry_after)
        if new:
            self._ask_slots(new)
        return [v for node in sorted(self._slots) for v in self._slots[node]]

    def physical_node(self, node_id: int) -> int:
        """The physical node hosting virtual node ``node_id`` (itself if it is none: a
        physical node, or a virtual node already gone)."""
        where = self._where.get(node_id)
        return node_id if where is None else where[0]

    def refusals(self) -> dict[int, str]:
        """``{physical node: reason}`` of the nodes whose slots query failed (they host no
        virtual node until asked again)."""
        return {node: reason for node, (_, reason) in self._refused.items()}

    def _forget(self, node: int) -> None:
        """Drop a physical node's virtual nodes (it left, or its task list changed)."""
        for virtual in self._slots.pop(node, []):
            del self._where[virtual]
        self._protocols.pop(node, None)
        self._digests.pop(node, None)

    def _refuse(self, node: int, reason: str) -> None:
        log(WARNING, "packing: node %s: %s; asked again in %.0f s", node, reason,
            self.retry_after)
        self._refused[node] = (time.monotonic(), reason)

    def _ask_slots(self, nodes: list[int]) -> None:
        queries = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n,
                           message_type=SLOTS_QUERY) for n in nodes]
        self.messages_sent += len(queries)
        asked, answered = set(nodes), set()
        for reply in self.inner.send_and_receive(queries, timeout=self.query_timeout):
            node = reply.metadata.src_node_id
            if node not in asked or node in answered:
                continue  # not an answer to this query, or a second one
            answered.add(node)
            try:  # the count is checked against the limit before anything is allocated
                count, protocols, digest = _read_slots_reply(reply, self.max_slots_per_node)
            except ValueError as err:
                self._refuse(node, f"bad slots reply: {err}")
                continue
            self._refused.pop(node, None)
            virtual = [next(self._virtual) for _ in range(count)]
            self._slots[node] = virtual
            self._protocols[node] = protocols
            self._digests[node] = digest
            for slot, v in enumerate(virtual):
                self._where[v] = (node, slot)
        for node in sorted(asked - answered):
            self._refuse(node, f"no answer to the slots query within "
                         f"{self.query_timeout:.0f} s")

    def stacked_groups(self, protocol: str, targets: Mapping[int, int]
                       ) -> tuple[list[StackGroup], dict[int, int]]:
        """Split ``targets`` (task -> virtual node) into the groups of tasks whose physical
        node speaks the stacking ``protocol`` (one :class:`StackGroup` per node, in slot
        order, nodes in order of their first task) and the rest (task -> virtual node), which
        go as ordinary messages."""
        by_node: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        rest: dict[int, int] = {}
        for task, virtual in targets.items():
            where = self._where.get(virtual)
            if where is None or protocol not in self._protocols.get(where[0], ()):
                rest[task] = virtual
                continue
            by_node[where[0]].append((where[1], task, virtual))
        groups = []
        for node, rows in by_node.items():
            rows.sort()
            groups.append(StackGroup(node, [r[0] for r in rows], [r[1] for r in rows],
                                     [r[2] for r in rows]))
        groups.sort(key=lambda g: min(g.tasks))
        return groups, rest

    # traffic ------------------------------------------------------------------------------
    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Send one packed message per (physical node, message type); return the replies
        split per virtual node (replies that did not arrive are missing, as in Flower).
        Stacked messages (addressed to a physical node already) and their replies pass
        through unchanged (a stacked reply only when it answers the stacked message sent to
        the node it comes from: any other is logged and ignored)."""
        groups: dict[tuple[int, str], dict[int, Message]] = defaultdict(dict)
        stacked: list[Message] = []
        stacked_keys: set[tuple[int, str]] = set()
        for message in messages:
            if STACK in message.content:
                key = (message.metadata.dst_node_id, message.metadata.message_type)
                if key[0] not in self._slots or key in stacked_keys:
                    log(WARNING, "packing: stacked %s message to node %s dropped (%s)", key[1],
                        key[0], "a second one in one call" if key in stacked_keys
                        else "no such node")
                    continue
                stacked_keys.add(key)
                stacked.append(message)
                continue
            virtual = message.metadata.dst_node_id
            if virtual not in self._where:
                log(WARNING, "packing: no virtual node %s; message dropped", virtual)
                continue
            node, slot = self._where[virtual]
            group = groups[(node, message.metadata.message_type)]
            if slot in group:
                log(WARNING, "packing: a second %s message to virtual node %s in one call; "
                    "dropped", message.metadata.message_type, virtual)
                continue
            message.metadata.__dict__["_message_id"] = f"{virtual}"
            group[slot] = message
        packed = list(stacked)
        for (node, message_type), subs in groups.items():
            ttls = [m.metadata.ttl for m in subs.values()]
            msg = Message(pack_content({s: m.content for s, m in subs.items()}),
                          dst_node_id=node, message_type=message_type, ttl=min(ttls))
            packed.append(msg)
        self.messages_sent += len(packed)
        replies: list[Message] = []
        stacked_ids: set[str] = set()
        changed: set[int] = set()  # nodes whose task list changed in this exchange
        sent: dict[str, tuple[int, str]] = {}  # message id -> (node, message type)
        for reply in self.inner.send_and_receive(packed, timeout=timeout):
            key = (reply.metadata.src_node_id, reply.metadata.message_type)
            if key[0] in changed:
                continue
            answered = reply.metadata.reply_to_message_id
            if answered not in sent:  # message ids are given as messages are pushed
                sent = {m.metadata.message_id: (m.metadata.dst_node_id,
                                                m.metadata.message_type) for m in packed}
                stacked_ids = {m.metadata.message_id for m in stacked}
            if sent.get(answered) == key and self._task_list_changed(key[0], reply):
                changed.add(key[0])  # only a reply to what was sent to that node says so
                continue
            if key in stacked_keys:
                if sent.get(answered) != key or answered not in stacked_ids:
                    log(WARNING, "packing: reply from node %s (%s) answers no stacked message "
                        "sent to it; ignored", *key)
                    continue
                stacked_keys.discard(key)
                replies.append(reply)
                continue
            subs = groups.pop(key, None)  # pop: no defaultdict entry made
            if subs is None:
                log(WARNING, "packing: unexpected reply from node %s (%s); ignored", *key)
                continue
            replies.extend(_split_reply(reply, subs))
        return replies

    def _task_list_changed(self, node: int, reply: Message) -> bool:
        """Whether ``reply`` says that ``node``'s task list is no longer the one of its slots
        reply; if so the node is forgotten (logged): its slots are discovered again."""
        known = self._digests.get(node)
        digest = _reply_digest(reply)
        if known is None or digest is None or digest == known:
            return False
        log(WARNING, "packing: node %s's task list changed since its slots were discovered; "
            "its replies are dropped and its slots discovered again", node)
        self._forget(node)
        return True


def _reply_digest(reply: Message) -> str | None:
    """The :func:`tasks_digest` a packed or stacked reply carries (None: none, or an error
    reply)."""
    if reply.has_error():
        return None
    for name in (PACKING, STACK):
        record = reply.content[name] if name in reply.content else None
        if isinstance(record, ConfigRecord):
            digest = record.get(TASKS_DIGEST, None)
            return digest if isinstance(digest, str) else None
    return None


def _read_slots_reply(reply: Message, limit: int = MAX_SLOTS
                      ) -> tuple[int, frozenset[str], str | None]:
    """``(count, stacking protocols, tasks digest)`` of a slots reply; ValueError if it is
    malformed or announces more than ``limit`` slots."""
    if reply.has_error():
        raise ValueError(f"error reply: {reply.error.reason}")
    if "slots" not in reply.content or "count" not in reply.content["slots"]:
        raise ValueError("no 'slots' record with 'count'")
    record = reply.content["slots"]
    count = record["count"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"'count' must be an int >= 0, got {count!r}")
    if count > limit:
        raise ValueError(f"{count} slots announced, above the limit of {limit} per node "
                         "(max_slots_per_node)")
    stacked = record.get("stacked", "")
    if not isinstance(stacked, str):
        raise ValueError(f"'stacked' must be a comma-separated string, got {stacked!r}")
    digest = record.get(TASKS_DIGEST, None)
    if digest is not None and not isinstance(digest, str):
        raise ValueError(f"{TASKS_DIGEST!r} must be a string, got {digest!r}")
    return count, frozenset(p for p in stacked.split(",") if p), digest


def _split_reply(reply: Message, subs: dict[int, Message]) -> list[Message]:
    """One reply per sub-message: the slot's records, or an error reply."""
    if reply.has_error():
        return [Message(Error(code=reply.error.code, reason=reply.error.reason), reply_to=m)
                for m in subs.values()]
    try:
        parts = unpack_content(reply.content)
    except ValueError as err:
        reason = f"malformed packed reply: {err}"
        return [Message(Error(code=CLIENT_APP_RAISED, reason=reason), reply_to=m)
                for m in subs.values()]
    out = []
    for slot, sub in subs.items():
        if slot not in parts:
            continue  # that slot's reply is missing: as if it never arrived
        content = parts[slot]
        if SLOT_ERROR in content:
            err = content[SLOT_ERROR]
            out.append(Message(Error(code=int(err.get("code", CLIENT_APP_RAISED)),
                                     reason=str(err.get("reason", ""))), reply_to=sub))
        else:
            out.append(Message(content, reply_to=sub))
    return out


# ------------------------------------------------------------------------------ stacked handlers
T = TypeVar("T")


class SlotFailed(ValueError):
    """A slot's instruction or work failed (only that task fails)."""


def stacked_is_train(message: Message, family: str) -> bool:
    """Whether a stacked message of ``family`` is a ``train`` message (else ``evaluate``);
    ValueError (the whole message fails) for any other message type."""
    kind = message.metadata.message_type
    if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
        raise ValueError(f"stacked {family} messages are train or evaluate, not {kind!r}")
    return kind == MessageType.TRAIN


def each_slot(slot_tasks: Sequence[tuple[int, int | None]],
              work: Callable[[int, int, int], T]) -> tuple[list[tuple[int, T]], dict[int, str]]:
    """``work(i, slot, task)`` for row i of a stacked message, every slot in turn:
    ``([(slot, result), ...] in row order, {slot: reason})``. A slot whose work raises, or
    that the node does not host, fails alone (its reason: the exception's type and text)."""
    done: list[tuple[int, T]] = []
    errors: dict[int, str] = {}
    for i, (slot, task_id) in enumerate(slot_tasks):
        try:
            if task_id is None:
                raise SlotFailed(f"slot {slot}: this node hosts no such slot")
            done.append((slot, work(i, slot, task_id)))
        except Exception as ex:  # noqa: BLE001 - one slot's failure is its task's error
            errors[slot] = f"{type(ex).__name__}: {ex}"
    return done, errors


def stacked_content(protocol: str, slots: Sequence[int], config: Mapping[str, Any],
                    arrays: Mapping[str, Any]) -> RecordDict:
    """The records of a stacked message: ``stack``, ``config`` (the values every task
    shares) and ``arrays`` (Arrays: per-task vectors, stacked rows, shared arrays)."""
    return RecordDict({"stack": ConfigRecord({"protocol": protocol, "slots": list(slots)}),
                       "config": ConfigRecord(dict(config)),
                       "arrays": ArrayRecord(dict(arrays))})


def read_stacked_instruction(content: RecordDict, k: int, family: str,
                             vectors: Mapping[str, Any], rows: Sequence[str] = ()
                             ) -> tuple[ConfigRecord, dict[str, np.ndarray]]:
    """The shared config and the arrays of a stacked message of k rows: each of ``vectors``
    (name -> dtype) of shape (k,), each of ``rows`` float64 (k, d); ValueError (the whole
    message fails) names the first missing or malformed one."""
    if "config" not in content or "arrays" not in content:
        raise ValueError(f"stacked {family} message needs 'config' and 'arrays' records")
    record = content["arrays"]
    out: dict[str, np.ndarray] = {}
    for name in [*vectors, *rows]:
        if name not in record:
            raise ValueError(f"stacked {family} message lacks array {name!r}")
        values = from_array(record[name])
        if name in vectors:
            if values.dtype != vectors[name] or values.shape != (k,):
                raise ValueError(f"array {name!r} must be {np.dtype(vectors[name])} of shape "
                                 f"({k},), got {values.dtype} {values.shape}")
        elif values.dtype != np.float64 or values.ndim != 2 or values.shape[0] != k:
            raise ValueError(f"{name!r} must be float64 of shape ({k}, d), got "
                             f"{values.dtype} {values.shape}")
        out[name] = values
    return content["config"], out


#: The tasks loaded in this process, per handler token (the newest few handlers only).
_TASK_CACHES: OrderedDict[str, dict[tuple[int, int, int], Any]] = OrderedDict()
_KEEP_CACHES = 4


def _task_cache(token: str) -> dict[tuple[int, int, int], Any]:
    cache = _TASK_CACHES.get(token)
    if cache is None:
        cache = _TASK_CACHES[token] = {}
        while len(_TASK_CACHES) > _KEEP_CACHES:
            _TASK_CACHES.popitem(last=False)
    _TASK_CACHES.move_to_end(token)
    return cache


class SlotTaskCache:
    """The slots' data of a stacked handler, loaded once per node, run and task.

    Flower's Ray engine ships the ClientApp to its worker with every message (a fresh copy
    each time), so the loaded tasks live in the worker process, keyed by the handler's
    token: a copy finds the data its original's earlier copies loaded there.
    """

    def __init__(self) -> None:
        self._token = uuid.uuid4().hex
        self._tasks = _task_cache(self._token)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_tasks"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tasks = _task_cache(self._token)

    def slot_task(self, context: Context, task_id: int, build: Callable[[Context], T]) -> T:
        """Task ``task_id``'s data: ``build(context)`` over a Context whose node config names
        the task (``task-id``), called once per node, run and task."""
        key = (int(context.run_id), int(context.node_id), int(task_id))
        task = self._tasks.get(key)
        if task is None:
            node_config = {k: v for k, v in context.node_config.items() if k != "task-ids"}
            node_config["task-id"] = int(task_id)
            sub = Context(run_id=context.run_id, node_id=context.node_id, state=RecordDict(),
                          node_config=node_config, run_config=context.run_config)
            task = build(sub)
            self._tasks[key] = task
        return task


# ------------------------------------------------------------------------------ auto packing
#: Strategies whose messages stack (:mod:`fmtl_flower.clients.packed_mocha`,
#: :mod:`~fmtl_flower.clients.packed_fedem`, :mod:`~fmtl_flower.clients.packed_fsvrg`):
#: packing pays. (``local`` is FedEM's local baseline here: with the svm model it is a
#: centralised baseline, never a federation.)
STACKING_STRATEGIES = (*(s for f in FAMILIES if f.stacks for s in f.strategies), "local")
#: At most this many tasks per node when packing automatically (bounds one message's size).
AUTO_MAX_TASKS_PER_NODE = 1000


def auto_tasks_per_node(strategy: str, num_tasks: int, engine: str,
                        cores: int | None = None) -> tuple[int, str]:
    """``(K, rule)``: the tasks per node ``fmtl run`` uses when ``tasks-per-node`` is unset.

    The rule: only strategies whose messages stack (MOCHA, CoCoA, Mb-SDCA, Mb-SGD, FedEM's
    family: FedEM and its baselines, and FSVRG's family: FSVRG, naive FSVRG, GD, CoCoA+,
    DANE) are packed, since packing only pays there (OFMTL keeps one task per node). The
    in-process
    engine calls its nodes one after another, so it uses as few nodes as it can:
    K = min(m, 1000). Ray runs nodes in parallel, so it uses one node per core (``cores``,
    default the machine's CPUs) and packs the rest: K = min(ceil(m / cores), 1000).
    Results do not depend on K.
    """
    if strategy not in STACKING_STRATEGIES or num_tasks <= 1:
        return 1, f"none ({strategy}: one task per node)"
    if engine == "ray":
        cores = max(1, int(cores if cores is not None else (os.cpu_count() or 1)))
        k = min(math.ceil(num_tasks / cores), AUTO_MAX_TASKS_PER_NODE)
        why = f"one node per core ({cores}), at most {AUTO_MAX_TASKS_PER_NODE} tasks each"
    else:
        k = min(num_tasks, AUTO_MAX_TASKS_PER_NODE)
        why = f"in-process: as few nodes as possible, at most {AUTO_MAX_TASKS_PER_NODE} tasks each"
    nodes = math.ceil(num_tasks / k)
    return k, (f"{num_tasks} tasks on {nodes} node{'s' if nodes > 1 else ''}, {k} per node "
               f"(automatic: {why}; set tasks-per-node to choose)")


def auto_packing(cfg: Any, num_tasks: int, engine: str) -> tuple[Any, str]:
    """``cfg`` (a :class:`~fmtl_flower.config.RunConfig` with ``tasks_per_node`` 0) with
    the automatic tasks per node of :func:`auto_tasks_per_node`, and the rule's text."""
    k, rule = auto_tasks_per_node(cfg.strategy, num_tasks, engine)
    return dataclasses.replace(cfg, tasks_per_node=k), rule


# ------------------------------------------------------------------------------ client side
def tasks_of_node(node_config: dict[str, Any], tasks_per_node: int, num_tasks: int
                  ) -> list[int]:
    """The task ids a node hosts.

    ``node_config["task-ids"]`` (deployments: ``"3,4,5"``) when present; else the block
    ``p * tasks_per_node ... (p + 1) * tasks_per_node - 1`` of partition ``p``, cut at
    ``num_tasks``.
    """
    if "task-ids" in node_config:
        text = str(node_config["task-ids"])
        try:
            tasks = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"node config task-ids={text!r}: comma-separated ints "
                             "expected") from None
        if not tasks or len(set(tasks)) != len(tasks) or min(tasks) < 0:
            raise ValueError(f"node config task-ids={text!r}: distinct ints >= 0 expected")
        return tasks
    if "partition-id" not in node_config:
        raise ValueError("this node has no task ids: start the SuperNode with --node-config "
                         "\"task-ids='0,1,2'\" (or partition-id=N in simulation)")
    first = int(node_config["partition-id"]) * tasks_per_node
    return list(range(first, min(first + tasks_per_node, num_tasks)))


def packed_client_app(app: ClientApp | Callable[[Message, Context], Message],
                      tasks_for: Callable[[Context], Sequence[int]],
                      stacked: Mapping[str, StackedHandler] | None = None,
                      slot_handlers: Mapping[str, SlotHandler] | None = None) -> ClientApp:
    """A ClientApp hosting the tasks ``tasks_for(context)`` behind the wrapped ``app``;
    ``stacked`` maps stacking protocols to their handlers (stacked messages);
    ``slot_handlers`` maps message types to handlers that answer one slot of a packed
    message directly (``handler(content, context, slot, task) -> reply content``, no
    per-slot Message or Context; e.g. MOCHA's ``whoami``), instead of the wrapped app."""
    return _PackedClientApp(app, tasks_for, stacked, slot_handlers)


class _PackedClientApp(ClientApp):
    def __init__(self, app: ClientApp | Callable[[Message, Context], Message],
                 tasks_for: Callable[[Context], Sequence[int]],
                 stacked: Mapping[str, StackedHandler] | None = None,
                 slot_handlers: Mapping[str, SlotHandler] | None = None) -> None:
        super().__init__()
        self._app = app
        self._tasks_for = tasks_for
        self._stacked = dict(stacked or {})
        self._slot_handlers = dict(slot_handlers or {})

    def __call__(self, message: Message, context: Context) -> Message:
        if message.metadata.message_type == SLOTS_QUERY:
            tasks = list(self._tasks_for(context))
            answer: dict[str, Any] = {"count": len(tasks), TASKS_DIGEST: tasks_digest(tasks)}
            if self._stacked:
                answer["stacked"] = ",".join(sorted(self._stacked))
            return Message(RecordDict({"slots": ConfigRecord(answer)}), reply_to=message)
        if STACK in message.content:
            return self._call_stacked(message, context)
        if PACKING not in message.content:
            return self._app(message, context)
        tasks = list(self._tasks_for(context))
        parts = unpack_content(message.content)
        states = _slot_states(context.state)  # one pass over the node's state, not one a slot
        node_config = {k: v for k, v in context.node_config.items() if k != "task-ids"}
        replies: dict[int, RecordDict] = {}
        direct = self._slot_handlers.get(message.metadata.message_type)
        for slot, content in parts.items():
            if slot >= len(tasks):
                replies[slot] = _error_content(f"slot {slot}: this node hosts {len(tasks)} "
                                               "tasks")
                continue
            if direct is not None:  # no per-slot Message or Context
                try:
                    replies[slot] = direct(content, context, slot, tasks[slot])
                except Exception as ex:  # noqa: BLE001 - one task's failure is its error
                    replies[slot] = _error_content(raised_reason(ex))
                continue
            replies[slot] = self._call_slot(message, content, context, slot,
                                            {**node_config, "task-id": tasks[slot]},
                                            states.get(slot, {}))
        return Message(pack_content(replies, tasks_digest(tasks)), reply_to=message)

    def _call_stacked(self, message: Message, context: Context) -> Message:
        protocol, slots = read_stack(message.content)
        if protocol not in self._stacked:
            raise ValueError(f"stacked message of protocol {protocol!r}: this node speaks "
                             f"{sorted(self._stacked)}")
        tasks = list(self._tasks_for(context))
        slot_tasks = [(s, tasks[s] if s < len(tasks) else None) for s in slots]
        content, done, errors = self._stacked[protocol](message, context, slot_tasks)
        content[STACK] = ConfigRecord({"protocol": protocol, "slots": list(done),
                                       TASKS_DIGEST: tasks_digest(tasks)})
        if errors:
            content[STACK_ERRORS] = ConfigRecord({"slots": list(errors),
                                                  "reasons": list(errors.values())})
        return Message(content, reply_to=message)

    def _call_slot(self, message: Message, content: RecordDict, context: Context, slot: int,
                   node_config: dict[str, Any], state: dict[str, Any]) -> RecordDict:
        prefix = _prefix(slot)
        sub_context = Context(run_id=context.run_id, node_id=context.node_id * MAX_SLOTS + slot,
                              node_config=node_config, state=RecordDict(state),
                              run_config=context.run_config)
        metadata = copy.copy(message.metadata)  # no TaskIdentity on a ClientApp's side
        metadata.__dict__["_dst_node_id"] = sub_context.node_id
        metadata.__dict__["_message_id"] = f"{message.metadata.message_id}/{slot}"
        sub = make_message(metadata=metadata, content=content)
        try:
            reply = self._app(sub, sub_context)
        except Exception as ex:  # noqa: BLE001 - one task's failure is that task's error
            return _error_content(raised_reason(ex))
        if reply.has_error():
            return _error_content(reply.error.reason, reply.error.code)
        for name in state:
            del context.state[prefix + name]
        for name, record in sub_context.state.items():
            context.state[prefix + name] = record
        return reply.content


def _slot_states(state: RecordDict) -> dict[int, dict[str, Any]]:
    """The node's state records grouped by slot: ``{slot: {name: record}}``."""
    out: dict[int, dict[str, Any]] = defaultdict(dict)
    for name, record in state.items():
        split = _split_slot(name)
        if split is not None:
            out[split[0]][split[1]] = record
    return out


def _error_content(reason: str, code: int = CLIENT_APP_RAISED) -> RecordDict:
    return RecordDict({SLOT_ERROR: ConfigRecord({"code": int(code), "reason": str(reason)})})
