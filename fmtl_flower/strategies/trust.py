"""The trust boundary: what the server accepts from a node's reply, and how.

Every strategy reads its nodes' replies through :class:`ReplyBoundary`; a reply is untrusted
until it has passed it. Whatever a reply contains, reading it never raises and never changes
the strategy's state: a reply that fails any check is logged, counted as a drop
(:class:`RoundReplies.failed`) and otherwise ignored. The bound checks every strategy applies
to reported values (:func:`check_bound`), and the guard that undoes a server step that failed
(:func:`guarded`), live here too, so a reader finds what the server trusts in one place.

The envelope
------------
Before a reply is parsed, the boundary checks its envelope (:meth:`ReplyBoundary.read`):

* its ``run_id`` must be the run's: that of the message it answers (a reply from another
  Flower run is rejected);
* with a :class:`ReplyContract` for the message's type (each strategy declares one per
  message type beside its wire contract), the reply may hold only the records, metrics and
  arrays the contract names (a one-task reply: ``metrics`` and ``arrays``; a stacked reply,
  :mod:`fmtl_flower.packing`: ``stack``, ``stack-errors`` and ``arrays``, whose entries are
  the contract's metrics as vectors and its arrays as stacked rows), and its arrays may
  hold at most the bytes of the contract's shapes (8 bytes an element, plus
  :data:`ARRAY_HEADER_BYTES` each; a stacked reply's times its rows), counted from the
  serialised arrays before anything is decoded. Anything else rejects the reply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from ..packing import STACK, STACK_ERRORS, StackGroup
from .discovery import ReplyError, describe_tasks, error_reason, reason_shape, suggested_fix

#: ``parse_stack(reply, group) -> ({task: values}, {task: reason})``: a stacked reply's rows.
StackParser = Callable[[Message, StackGroup], tuple[dict[int, dict[str, Any]], dict[int, str]]]
#: ``check_rows({task: parsed}) -> {task: reason}``: vectorised checks over accepted replies.
RowsCheck = Callable[[dict[int, dict[str, Any]]], dict[int, str]]

#: Relative slack of every bound a reply is checked against (the devices' rounding).
BOUND_SLACK = 1.0 + 1e-6

#: Bytes a serialised array may hold beyond its values (numpy's header: 128 for the shapes
#: of the wire contracts).
ARRAY_HEADER_BYTES = 1024

#: Bytes of one array element in a reply's size cap (float64 and int64: the widest a
#: contract names).
ELEMENT_BYTES = 8


@dataclass(frozen=True)
class ReplyContract:
    """What a one-task reply to one message type may hold (the envelope, module docstring).

    Parameters
    ----------
    metrics : frozenset of str
        The keys its ``metrics`` record may have (required or optional: the strategy's parse
        says which).
    arrays : mapping of str to tuple
        The arrays its ``arrays`` record may have, each with its largest shape: ints, or
        names of the sizes the strategy gives :class:`ReplyBoundary` (``"d"``: the feature
        dimension, ...).
    """

    metrics: frozenset[str]
    arrays: Mapping[str, tuple[int | str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, metrics: Iterable[str], arrays: Mapping[str, tuple[int | str, ...]] | None = None
           ) -> ReplyContract:
        """A contract from the metric names and ``{array: shape}``."""
        return cls(frozenset(metrics), dict(arrays or {}))

    def size_names(self) -> set[str]:
        """The sizes its shapes name."""
        return {s for shape in self.arrays.values() for s in shape if isinstance(s, str)}

    def array_bytes(self, sizes: Mapping[str, int], rows: int = 1) -> int:
        """The most bytes its arrays may hold: each array's shape in ``sizes``, times
        ``rows`` (a stacked reply also sends every metric as a vector of ``rows``)."""
        total = 0
        for shape in self.arrays.values():
            elements = 1
            for size in shape:
                elements *= size if isinstance(size, int) else int(sizes[size])
            total += rows * elements * ELEMENT_BYTES + ARRAY_HEADER_BYTES
        return total


@dataclass(frozen=True)
class ExchangeSizes:
    """One exchange's sizes for the contracts' shapes, and each message type's byte limit
    for a one-task reply (None: its sizes could not be given)."""

    sizes: dict[str, int]
    limits: dict[str, int | None]


def check_envelope(content: Any, contract: ReplyContract, limit: int) -> None:
    """:class:`ReplyError` unless a one-task reply's records hold only what ``contract``
    names, its arrays at most ``limit`` bytes (:meth:`ReplyContract.array_bytes`; module
    docstring); nothing is decoded."""
    for name, record in content.items():
        if name == "metrics":
            if not contract.metrics.issuperset(record.keys()):
                extra = sorted(set(record.keys()) - contract.metrics)
                raise ReplyError(f"metrics {extra[:5]} are not in the wire contract")
        elif name == "arrays" and contract.arrays:
            _check_arrays(record, contract.arrays, limit)
        else:
            raise ReplyError(f"record {name!r} is not in the wire contract")


def check_stacked_envelope(content: Any, contract: ReplyContract, sizes: Mapping[str, int],
                           rows: int) -> None:
    """:class:`ReplyError` unless a stacked reply of ``rows`` slots holds only ``stack``,
    ``stack-errors`` and ``arrays`` with the contract's metrics (vectors) and arrays (stacked
    rows), within their size; nothing is decoded."""
    for name, record in content.items():
        if name == "arrays":
            allowed = {**dict.fromkeys(contract.metrics, (1,)), **contract.arrays}
            limit = contract.array_bytes(sizes, rows) + len(contract.metrics) * (
                rows * ELEMENT_BYTES + ARRAY_HEADER_BYTES)
            _check_arrays(record, allowed, limit)
        elif name not in (STACK, STACK_ERRORS):
            raise ReplyError(f"record {name!r} is not in the wire contract")


def _check_arrays(record: Any, allowed: Mapping[str, Any], limit: int) -> None:
    """The record is an ArrayRecord whose arrays are among ``allowed`` and whose serialised
    bytes are at most ``limit`` (each Array's ``data``, not decoded)."""
    if not isinstance(record, ArrayRecord):
        raise ReplyError(f"'arrays' must be an ArrayRecord, got a {type(record).__name__}")
    total = 0
    for key, array in record.items():
        if key not in allowed:
            raise ReplyError(f"array {key!r} is not in the wire contract")
        total += len(array.data)
    if total > limit:
        raise ReplyError(f"arrays of {total} bytes, above the wire contract's {limit}")


def norm(values: np.ndarray, axis: int | None = None) -> Any:
    """Euclidean norm (of a vector, or along ``axis``); inf where it overflows, without a
    warning."""
    with np.errstate(over="ignore", invalid="ignore"):
        if axis is None and values.ndim == 1:
            return math.sqrt(float(np.dot(values, values)))
        return np.linalg.norm(values, axis=axis)


def check_bound(what: str, size: float, limit: float, why: str, *args: Any) -> None:
    """:class:`ReplyError` unless ``size <= limit`` (with :data:`BOUND_SLACK`); the reason
    ``why % args`` is formatted only then."""
    if not size <= limit * BOUND_SLACK:
        raise ReplyError(f"{what} = {size:.6g} above its bound {limit:.6g} ({why % args})")


def guarded(step: Callable[[], None], objects: Iterable[Any],
            check: Callable[[], bool]) -> str | None:
    """Run a server step that replaces attributes of ``objects``; if it raises or ``check()``
    fails afterwards, put every attribute back as it was and return the reason (None: the
    step stands). The steps guarded this way assign new arrays, never write into them, so a
    shallow copy of the attributes is the snapshot."""
    objects = list(objects)
    saved = [dict(vars(obj)) for obj in objects]
    try:
        step()
        reason = None if check() else "it left non-finite values"
    except Exception as err:  # noqa: BLE001 - a failed step is undone, not fatal
        reason = f"{type(err).__name__}: {err}"
    if reason is not None:
        for obj, attributes in zip(objects, saved, strict=True):
            vars(obj).clear()
            vars(obj).update(attributes)
    return reason


def all_finite(*arrays: np.ndarray) -> bool:
    """Whether every value of every array is finite."""
    return all(bool(np.isfinite(a).all()) for a in arrays)


@dataclass
class RoundReplies:
    """What one exchange's replies came to, as :meth:`ReplyBoundary.read` found them.

    Attributes
    ----------
    accepted : dict[int, dict]
        The parsed replies that passed every check, keyed by task, in task order (so sums
        over them do not depend on the order the replies arrived in).
    failed : dict[int, str]
        Tasks that were sent a message and answered with an error or a rejected reply, with
        the reason.
    """

    accepted: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def arrived(self) -> int:
        """Replies that arrived from tasks the exchange was sent to (accepted or not)."""
        return len(self.accepted) + len(self.failed)


def log_device_errors(name: str, where: str, errors: dict[str, list[tuple[int, int, str]]]
                      ) -> None:
    """Log the error replies of an exchange: one line per distinct error (up to its
    numbers, :func:`~fmtl_flower.strategies.discovery.reason_shape`), its first task's in
    full with the fix when the server knows it, and how many other tasks sent the same, not
    one line (a device's traceback) per task."""
    for failures in errors.values():
        task, node, reason = failures[0]
        others = [t for t, _, _ in failures[1:]]
        fix = suggested_fix(reason)
        log(WARNING, "%s %s: task %d: node %s failed: %s%s%s", name, where, task, node, reason,
            f"; the same error from {len(others)} more task(s): {describe_tasks(others, 10)}"
            if others else "", f". To fix: {fix}" if fix else "")


class Exchange:
    """The messages of one exchange (a round's ``train`` or ``evaluate``), so that each reply
    is tied to the message it answers (:meth:`ReplyBoundary.read`).

    Attributes
    ----------
    sent : dict[int, int]
        node -> task of the exchange's messages (a packed node's virtual nodes for its
        stacked message).
    """

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        # message id -> (task, node, message type, run id)
        self._by_id: dict[str, tuple[int, int, str, int]] = {}
        self._pending: list[tuple[int, int, Message]] = []  # sent, id not indexed yet
        self._stacks: list[tuple[StackGroup, Message]] = []  # stacked messages sent

    def track(self, task: int, node: int, message: Message) -> Message:
        """Register ``message`` (to ``node``, for ``task``)."""
        self.sent[node] = task
        self._pending.append((task, node, message))
        return message

    def track_stack(self, group: StackGroup, message: Message) -> Message:
        """Register a stacked ``message`` for the tasks of ``group``."""
        self.sent.update(zip(group.virtual, group.tasks, strict=True))
        self._stacks.append((group, message))
        return message

    def match_stack(self, message_id: str) -> tuple[StackGroup, str, int] | None:
        """The (group, message type, run id) of the stacked message ``message_id``, if any."""
        for group, message in self._stacks:
            meta = message.metadata
            if meta.message_id == message_id:
                return group, meta.message_type, meta.run_id
        return None

    def match(self, message_id: str) -> tuple[int, int, str, int] | None:
        """The (task, node, message type, run id) of the sent message ``message_id``, if any.

        Message ids are given when a message is pushed, so the sent messages are indexed
        lazily (each once)."""
        found = self._by_id.get(message_id)
        if found is None and self._pending:
            waiting = []
            for task, node, message in self._pending:
                meta = message.metadata
                mid = meta.message_id
                if mid:
                    self._by_id[mid] = (task, node, meta.message_type, meta.run_id)
                else:
                    waiting.append((task, node, message))
            self._pending = waiting
            found = self._by_id.get(message_id)
        return found


class ReplyBoundary:
    """The trust boundary every strategy reads its nodes' replies through.

    A strategy registers each message it sends with :meth:`track` and reads the replies with
    :meth:`read`, giving a ``parse(reply, task)`` function that decodes and checks one reply
    and raises on anything wrong with it. The boundary

    * checks every reply's envelope before parsing it (module docstring): its ``run_id``
      must be its message's, and with a :class:`ReplyContract` for the message's type, its
      records, keys and array bytes must be within the contract;
    * ties every reply to the message it answers (``reply_to_message_id``), so an error reply
      made by the SuperLink for a node that died is logged with the task and the real node it
      was sent to, and its cause;
    * ignores a reply to no message of this exchange and a reply from another node than the
      one its message went to (neither counts against the task), rejects a reply whose
      message type differs from its message's, and rejects a second reply for a task (the
      first is kept, whether it was accepted or rejected);
    * runs ``parse`` inside the boundary: *any* exception it raises (a :class:`ReplyError`,
      or whatever decoding a hostile payload throws) becomes a logged rejection of that reply,
      counted as a drop, and never leaves :meth:`read`. ``parse`` must not change the
      strategy's state; the caller applies the accepted replies afterwards.

    Parameters
    ----------
    name : str
        Prefix of the log lines (the strategy's name).
    contracts : mapping of str to ReplyContract, optional
        The reply contract of each message type the strategy sends (a type without one:
        only the ``run_id`` is checked).
    sizes : callable, optional
        ``sizes() -> {name: int}``: the sizes the contracts' shapes name (``"d"``, ...), read
        once per :meth:`read` (a size it cannot give rejects the replies with arrays).
    """

    def __init__(self, name: str, contracts: Mapping[str, ReplyContract] | None = None,
                 sizes: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.name = name
        self.contracts = dict(contracts or {})
        self._sizes = sizes
        self.exchange = Exchange()  # the current exchange: what track registers
        self.last: RoundReplies | None = None  # the newest exchange read

    @property
    def sent(self) -> dict[int, int]:
        """node -> task of the current exchange's messages."""
        return self.exchange.sent

    def begin(self) -> Exchange:
        """Start a new exchange and return it; :meth:`track` registers messages in it and
        :meth:`read` reads replies against it unless given another (a strategy that keeps
        each exchange with the state it sent, :mod:`~fmtl_flower.strategies.round_state`,
        reads a round's replies against that round's exchange)."""
        self.exchange = Exchange()
        return self.exchange

    def track_stack(self, group: StackGroup, message: Message) -> Message:
        """Register a stacked ``message`` (one message for the tasks of ``group`` on one
        packed node, :mod:`fmtl_flower.packing`) as part of the current exchange."""
        return self.exchange.track_stack(group, message)

    def track(self, task: int, node: int, message: Message) -> Message:
        """Register ``message`` (to ``node``, for ``task``) as part of the current exchange."""
        return self.exchange.track(task, node, message)

    def read(self, where: str, replies: Iterable[Message],
             parse: Callable[[Message, int], dict[str, Any]],
             on_accept: Callable[[int], None] | None = None,
             parse_stack: StackParser | None = None,
             check_rows: RowsCheck | None = None,
             exchange: Exchange | None = None) -> RoundReplies:
        """Check and parse ``replies``; see the class docstring.

        Parameters
        ----------
        where : str
            What the exchange is, for the log (``"round 3"``, ``"setup"``).
        replies : iterable of Message
        parse : callable
            ``parse(reply, task) -> dict``; raises on a bad reply.
        on_accept : callable, optional
            Called with the task of each accepted reply.
        parse_stack : callable, optional
            ``parse_stack(reply, group) -> (accepted, rejected)`` for the reply to a stacked
            message (:meth:`track_stack`): the valid rows ``{task: values}`` and the
            rejected ones ``{task: reason}``. Each row is then one task's reply: a rejected
            row, or a task the reply has no row for, fails only that task; an error reply,
            or anything ``parse_stack`` raises, fails every task of the message.
        check_rows : callable, optional
            ``check_rows({task: parsed}) -> {task: reason}``: checks run once over all the
            replies ``parse`` accepted (vectorised bounds), after every reply was read; each
            task it names is rejected as if ``parse`` had raised (anything it raises rejects
            them all); and over each stacked reply's rows that ``parse_stack`` accepted, a
            row it names rejected like a row ``parse_stack`` rejects (anything it raises
            fails every task of that message).
        exchange : Exchange, optional
            The exchange the replies answer (default: the current one, :meth:`begin`). A
            reply to a message it did not send is logged and ignored.
        """
        sent = self.exchange if exchange is None else exchange
        out = RoundReplies()
        accepted: dict[int, dict[str, Any]] = {}
        singles: dict[int, int] = {}  # task -> node of the replies parse accepted
        errors: dict[str, list[tuple[int, int, str]]] = {}  # device errors, by reason shape
        sizes = self._exchange_sizes()
        for reply in replies:
            try:
                meta = reply.metadata
                stack = sent.match_stack(meta.reply_to_message_id)
                match = None if stack is not None else sent.match(meta.reply_to_message_id)
                src = meta.src_node_id
            except Exception as err:  # noqa: BLE001 - a malformed reply object
                log(WARNING, "%s %s: malformed reply ignored: %s", self.name, where,
                    _reason(err))
                continue
            if stack is not None:
                self._read_stack(where, reply, stack, parse_stack, check_rows, accepted, out,
                                 on_accept, sizes)
                continue
            if match is None:
                cause = f": {error_reason(reply)}" if _has_error(reply) else ""
                log(WARNING, "%s %s: reply from node %s answers no message of this exchange; "
                    "ignored%s", self.name, where, src, cause)
                continue
            task, node, message_type, run_id = match
            error = _has_error(reply)
            if src != node and not error:  # (the SuperLink makes error replies)
                log(WARNING, "%s %s: reply for task %d from node %s, but its message went to "
                    "node %s; ignored", self.name, where, task, src, node)
                continue
            if task in accepted or task in out.failed:
                log(WARNING, "%s %s: second reply for task %d (node %s) rejected; the first "
                    "is kept", self.name, where, task, node)
                continue
            if error:
                reason = error_reason(reply)
                errors.setdefault(reason_shape(reason), []).append((task, node, reason))
                out.failed[task] = reason
                continue
            try:
                self._check_envelope(reply, message_type, run_id, sizes)
                parsed = parse(reply, task)
            except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
                reason = _reason(err)
                log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                    where, task, node, reason)
                out.failed[task] = reason
                continue
            accepted[task] = parsed
            singles[task] = node
        log_device_errors(self.name, where, errors)
        if check_rows is not None and singles:
            self._check_rows(where, check_rows, singles, accepted, out)
        if on_accept is not None:
            for task in singles:
                if task in accepted:
                    on_accept(task)
        out.accepted = dict(sorted(accepted.items()))
        silent = sorted(set(sent.sent.values()) - set(accepted) - set(out.failed))
        self.last = out  # what the exchange came to (TaskStrategy.start stops a dead run)
        if silent:
            names = ", ".join(str(t) for t in silent[:20]) + (", ..." if len(silent) > 20 else "")
            log(WARNING, "%s %s: no reply from task%s %s within the timeout; counted as "
                "dropped", self.name, where, "s" if len(silent) > 1 else "", names)
        return out

    def _exchange_sizes(self) -> ExchangeSizes:
        """The contracts' sizes for this exchange, and each one-task contract's byte limit."""
        if not self.contracts:
            return ExchangeSizes({}, {})
        try:
            sizes = dict(self._sizes()) if self._sizes is not None else {}
        except Exception:  # noqa: BLE001 - no sizes: every reply with arrays is rejected
            sizes = {}
        limits: dict[str, int | None] = {}
        for message_type, contract in self.contracts.items():
            try:
                limits[message_type] = contract.array_bytes(sizes)
            except (KeyError, TypeError, ValueError):
                limits[message_type] = None
        return ExchangeSizes(sizes, limits)

    def _check_envelope(self, reply: Message, message_type: str, run_id: int,
                        sizes: ExchangeSizes, rows: int | None = None) -> None:
        """:class:`ReplyError` unless ``reply`` has its message's type and run id and, when
        the type has a contract, only what the contract names (``rows``: a stacked reply's
        slots); nothing is decoded."""
        meta = reply.metadata
        if meta.message_type != message_type:
            raise ReplyError(f"message type {meta.message_type!r}, expected {message_type!r}")
        if meta.run_id != run_id:
            raise ReplyError(f"run_id {meta.run_id}, but its message was sent in run {run_id}")
        contract = self.contracts.get(message_type)
        if contract is None:
            return
        limit = sizes.limits[message_type]
        try:
            if limit is None:
                raise KeyError(f"sizes {sorted(contract.size_names())} unknown")
            if rows is None:
                check_envelope(reply.content, contract, limit)
            else:
                check_stacked_envelope(reply.content, contract, sizes.sizes, rows)
        except (KeyError, TypeError) as err:  # a size the strategy could not give
            raise ReplyError(f"the reply's arrays cannot be bounded yet ({err})") from None

    def _check_rows(self, where: str, check_rows: RowsCheck, singles: dict[int, int],
                    accepted: dict[int, dict[str, Any]], out: RoundReplies) -> None:
        """Reject the replies among ``singles`` that ``check_rows`` names (read's docstring)."""
        try:
            rejected = check_rows({task: accepted[task] for task in singles})
        except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
            rejected = dict.fromkeys(singles, _reason(err))
        for task, reason in rejected.items():
            if task in singles and accepted.pop(task, None) is not None:
                log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                    where, task, singles[task], reason)
                out.failed[task] = reason

    def _read_stack(self, where: str, reply: Message, stack: tuple[StackGroup, str, int],
                    parse_stack: StackParser | None, check_rows: RowsCheck | None,
                    accepted: dict[int, dict[str, Any]], out: RoundReplies,
                    on_accept: Callable[[int], None] | None,
                    sizes: ExchangeSizes) -> None:
        """The rows of the reply to a stacked message, each as one task's reply (envelope,
        ``parse_stack`` then ``check_rows``: :meth:`read`)."""
        group, message_type, run_id = stack
        src = reply.metadata.src_node_id
        if src != group.node and not _has_error(reply):
            log(WARNING, "%s %s: reply for tasks %s from node %s, but their message went to "
                "node %s; ignored", self.name, where, group.tasks, src, group.node)
            return
        fresh = [t for t in group.tasks if t not in accepted and t not in out.failed]
        if len(fresh) < len(group.tasks):
            log(WARNING, "%s %s: second reply for tasks %s (node %s) rejected; the first is "
                "kept", self.name, where, sorted(set(group.tasks) - set(fresh)), group.node)
        rows: dict[int, dict[str, Any]] = {}
        if _has_error(reply):
            rejected = {t: error_reason(reply) for t in group.tasks}
            log(WARNING, "%s %s: tasks %s: node %s failed: %s", self.name, where,
                group.tasks, group.node, error_reason(reply))
        else:
            try:
                self._check_envelope(reply, message_type, run_id, sizes, len(group.slots))
                if parse_stack is None:
                    raise ReplyError("a stacked reply where none was expected")
                rows, rejected = parse_stack(reply, group)
                if check_rows is not None and rows:
                    for task, reason in check_rows(rows).items():
                        if rows.pop(task, None) is not None:
                            rejected[task] = reason
            except Exception as err:  # noqa: BLE001 - the trust boundary: any failure rejects
                rows, rejected = {}, {t: _reason(err) for t in group.tasks}
            for task, reason in rejected.items():
                if task in fresh:
                    log(WARNING, "%s %s: reply of task %d (node %s) rejected: %s", self.name,
                        where, task, group.node, reason)
        for task in fresh:
            if task in rows:
                accepted[task] = rows[task]
                if on_accept is not None:
                    on_accept(task)
            elif task in rejected:
                out.failed[task] = rejected[task]


def _has_error(reply: Message) -> bool:
    try:
        return bool(reply.has_error())
    except Exception:  # noqa: BLE001 - a reply without a readable error is not an error reply
        return False


def _reason(err: BaseException) -> str:
    """A rejection reason: the message of a ReplyError, else the exception's type and text."""
    if isinstance(err, ReplyError):
        return str(err)
    text = str(err)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
