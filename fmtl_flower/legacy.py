"""The legacy record layout of ``NumPyClient`` / ``ClientApp(client_fn=...)`` devices.

Flower's legacy client path (``flwr.compat``) does not read the records a Message-API
strategy sends: a ``ClientApp(client_fn=...)`` understands the message types ``train``,
``evaluate``, ``get_properties`` and ``get_parameters`` only, and expects (and replies with)
records named after the legacy ``FitIns``/``FitRes``, ``EvaluateIns``/``EvaluateRes`` and
``GetPropertiesIns``/``GetPropertiesRes``. This module translates between the two, so that
the strategies' math and wire contracts stay as they are:

* :class:`LegacyGrid` (server side) wraps a ``Grid``. Messages to a legacy device are
  re-encoded (:func:`to_legacy`); replies in the legacy layout are turned back into the
  native one (:func:`from_legacy_reply`), which a strategy then validates as usual. Native
  replies pass unchanged, so one federation may mix both kinds of devices.
* :func:`detect_legacy` is what :meth:`TaskStrategy.start
  <fmtl_flower.strategies.base.TaskStrategy.start>` does with the grid it is given: a
  ``LegacyGrid(grid, "auto")``, so a NumPyClient device just works with ``start(grid)``
  (found at its first ``whoami``: the native query fails with Flower's "Invalid message type:
  query.whoami", and is asked again in the legacy layout).
* :func:`native_instruction` and :func:`legacy_result` (device side) rebuild the native
  message from what a ``NumPyClient`` receives and flatten the native reply into
  ``(parameters, num_examples, metrics)``; :mod:`fmtl_flower.clients.numpy_client` uses them
  to run the very same handlers as the native ClientApps.

Mapping (native -> legacy)
--------------------------
``query.whoami`` -> ``get_properties`` with config ``{"fmtl.query": "whoami"}``; the
    properties are the reply's ``info`` record.
``train`` / ``evaluate`` -> ``fitins.*`` / ``evaluateins.*``: the ``arrays`` record becomes
    the parameter list (``.npy`` bytes, the names in order in the config entry
    ``fmtl.arrays``, comma-separated), the ``config`` record the config. The reply's
    parameters (named by the metric ``fmtl.arrays``) become ``arrays``, its metrics
    ``metrics``; ``num_examples`` and the evaluate ``loss`` are informative only.

Config and metric values must be Flower scalars (int, float, str, bool, bytes): a native
message with a list value has no legacy form and is refused with an error naming the key.
Other message types (OFMTL's newcomer protocol, FSVRG's gradient exchange, task packing)
have no legacy form either: only MOCHA's and FedEM's NumPyClients exist.
"""

from __future__ import annotations

import copy
import io
import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid

from .engine import GridWrapper
from .wire import NUMPY_STYPE, from_array, to_array

__all__ = ["ARRAY_NAMES", "CLIENT_APIS", "QUERY_KEY", "LegacyGrid", "detect_legacy",
           "from_legacy_reply", "is_legacy_reply", "legacy_result", "native_instruction",
           "to_legacy", "wrap_grid"]

#: ``client_api`` values: native Message-API devices, NumPyClient devices, or either
#: (found out per device at discovery).
CLIENT_APIS = ("message", "numpyclient", "auto")
#: Config / metrics entry naming the parameter list's arrays, comma-separated, in order.
ARRAY_NAMES = "fmtl.arrays"
#: ``get_properties`` config entry naming the native query it stands for.
QUERY_KEY = "fmtl.query"
WHOAMI = f"{MessageType.QUERY}.whoami"
GET_PROPERTIES = "get_properties"
_INS = {MessageType.TRAIN: "fitins", MessageType.EVALUATE: "evaluateins"}


# ------------------------------------------------------------------------------ encoding
def _scalars(record: Mapping[str, Any], what: str) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if not isinstance(value, bool | int | float | str | bytes):
            raise ValueError(f"{what} {key!r} = {value!r} has no legacy (NumPyClient) form: "
                             "only int, float, str, bool and bytes values")
        out[key] = value
    return out


def _npy_bytes(values: np.ndarray) -> bytes:
    """``values`` as the ``.npy`` bytes a legacy ``Parameters`` tensor holds."""
    return to_array(values).data


def _from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _parameters_record(arrays: Sequence[tuple[str, np.ndarray]]) -> ArrayRecord:
    """The legacy parameters record: tensors ``"0"``, ``"1"``, ... (``.npy`` bytes, no dtype
    or shape metadata, as ``flwr.compat``'s ``parameters_to_arrayrecord`` writes them)."""
    record = {str(i): Array(data=_npy_bytes(values), dtype="", stype=NUMPY_STYPE, shape=())
              for i, (_, values) in enumerate(arrays)}
    if not record:
        record["_empty"] = Array(data=b"", dtype="", stype=NUMPY_STYPE, shape=())
    return ArrayRecord(record)


def _legacy_metadata(message: Message, message_type: str) -> Metadata:
    metadata = copy.copy(message.metadata)  # the same destination, ttl and group
    metadata.__dict__["_message_type"] = message_type
    metadata.__dict__["_message_id"] = ""  # set by the grid when pushed
    return metadata


def to_legacy(message: Message) -> Message:
    """The legacy form of a native instruction (``query.whoami``, ``train``, ``evaluate``).

    Raises
    ------
    ValueError
        For another message type, records other than ``config`` and ``arrays``, or a config
        value that is not a Flower scalar (the error names it).
    """
    content, kind = message.content, message.metadata.message_type
    if kind == WHOAMI:
        config = _scalars(content["config"], "config") if "config" in content else {}
        legacy = RecordDict({"getpropertiesins.config": ConfigRecord(
            {**config, QUERY_KEY: "whoami"})})
        return make_message(metadata=_legacy_metadata(message, GET_PROPERTIES), content=legacy)
    if kind not in _INS:
        raise ValueError(f"message type {kind!r} has no legacy (NumPyClient) form")
    extra = sorted(set(content.keys()) - {"config", "arrays"})
    if extra:
        raise ValueError(f"{kind} message records {extra} have no legacy (NumPyClient) form")
    config = _scalars(content["config"], "config") if "config" in content else {}
    arrays = content["arrays"] if "arrays" in content else ArrayRecord()
    names = list(arrays.keys())
    if any("," in name for name in names):
        raise ValueError(f"array names {names} must not contain ','")
    ins = _INS[kind]
    legacy = RecordDict({
        f"{ins}.parameters": _parameters_record([(n, from_array(arrays[n])) for n in names]),
        f"{ins}.config": ConfigRecord({**config, ARRAY_NAMES: ",".join(names)}),
    })
    return make_message(metadata=_legacy_metadata(message, kind), content=legacy)


def is_legacy_reply(reply: Message) -> bool:
    """Whether ``reply`` (not an error) is in the legacy layout."""
    return not reply.has_error() and any(
        name in reply.content for name in ("getpropertiesres.properties", "fitres.parameters",
                                           "evaluateres.metrics"))


def _native_metrics(record: Mapping[str, Any]) -> tuple[MetricRecord, list[str]]:
    """Numbers of a legacy metrics record (``ARRAY_NAMES`` and non-numbers left out) and the
    array names it carries."""
    names = str(record.get(ARRAY_NAMES, ""))
    metrics = {k: v for k, v in record.items() if k != ARRAY_NAMES
               and isinstance(v, int | float) and not isinstance(v, bool)}
    skipped = sorted(set(record) - set(metrics) - {ARRAY_NAMES})
    if skipped:
        log(WARNING, "legacy reply: metrics %s are not numbers; left out", skipped)
    return MetricRecord(metrics), [n for n in names.split(",") if n]


def from_legacy_reply(reply: Message) -> Message:
    """The native form of a reply in the legacy layout (records and message type); any other
    reply as it is.

    The parameters of a ``fitres`` are named by its metric ``fmtl.arrays`` (a count mismatch
    leaves the arrays out: the strategy then rejects the reply for the missing array)."""
    if not is_legacy_reply(reply):
        return reply
    content = reply.content
    native = RecordDict()
    kind = reply.metadata.message_type
    if "getpropertiesres.properties" in content:
        native["info"] = ConfigRecord(dict(content["getpropertiesres.properties"]))
        kind = WHOAMI
    for res, res_kind in (("fitres", MessageType.TRAIN), ("evaluateres", MessageType.EVALUATE)):
        if f"{res}.metrics" not in content:
            continue
        kind = res_kind
        metrics, names = _native_metrics(content[f"{res}.metrics"])
        native["metrics"] = metrics
        if f"{res}.parameters" in content:
            params = content[f"{res}.parameters"]
            tensors = [params[k].data for k in params.keys() if k != "_empty"]
            if len(tensors) == len(names):
                native["arrays"] = ArrayRecord({n: to_array(_from_npy(t))
                                                for n, t in zip(names, tensors, strict=True)})
            else:
                log(WARNING, "legacy reply from node %s: %d parameters, names %s; arrays left "
                    "out", reply.metadata.src_node_id, len(tensors), names)
    metadata = copy.copy(reply.metadata)
    metadata.__dict__["_message_type"] = kind
    return make_message(metadata=metadata, content=native)


# ------------------------------------------------------------------------------ device side
def native_instruction(message_type: str, parameters: Sequence[np.ndarray],
                       config: Mapping[str, Any], context: Context) -> Message:
    """The native instruction a NumPyClient's ``fit`` / ``evaluate`` / ``get_properties``
    stands for, addressed to this node (no ``TaskIdentity`` is needed on a device).

    ``config[ARRAY_NAMES]`` names the parameters; ``QUERY_KEY`` is dropped."""
    names = [n for n in str(config.get(ARRAY_NAMES, "")).split(",") if n]
    if len(names) != len(parameters):
        raise ValueError(f"{len(parameters)} parameters arrived, the config names {names} "
                         f"({ARRAY_NAMES!r}); is the server a fmtl-flower strategy behind "
                         "LegacyGrid?")
    content = RecordDict({"config": ConfigRecord(
        {k: v for k, v in config.items() if k not in (ARRAY_NAMES, QUERY_KEY)})})
    if message_type != WHOAMI:
        content["arrays"] = ArrayRecord({n: to_array(np.asarray(p))
                                         for n, p in zip(names, parameters, strict=True)})
    metadata = Metadata(run_id=int(context.run_id), message_id="numpyclient",
                        src_node_id=0, dst_node_id=int(context.node_id), reply_to_message_id="",
                        group_id="", created_at=time.time(), ttl=3600.0,
                        message_type=message_type)
    return make_message(metadata=metadata, content=content)


def legacy_result(reply: Message) -> tuple[list[np.ndarray], dict[str, Any]]:
    """``(parameters, metrics)`` of a native reply, ``metrics`` with ``ARRAY_NAMES``."""
    if reply.has_error():
        raise RuntimeError(reply.error.reason)
    content = reply.content
    arrays = content["arrays"] if "arrays" in content else ArrayRecord()
    names = list(arrays.keys())
    metrics = dict(content["metrics"]) if "metrics" in content else {}
    metrics = {**_scalars(metrics, "metric"), ARRAY_NAMES: ",".join(names)}
    return [np.array(from_array(arrays[n])) for n in names], metrics


# ------------------------------------------------------------------------------ server side
class _Ledger:
    """Ties the replies to the messages the strategy made, not to their legacy copies.

    The grid gives the copy it sends a message id; the ledger writes that id into the
    strategy's message too, and gives a reply (also an error reply) back the native message
    type, so that a reply's ``reply_to_message_id`` and ``message_type`` are those of the
    message the strategy sent."""

    def __init__(self) -> None:
        self._pending: list[tuple[Message, Message]] = []  # (copy sent, strategy's message)
        self._types: dict[str, str] = {}  # message id -> the strategy's message type

    def sent(self, copy_sent: Message, original: Message) -> Message:
        if copy_sent is not original:
            self._pending.append((copy_sent, original))
        return copy_sent

    def _sync(self) -> None:
        waiting = []
        for copy_sent, original in self._pending:
            message_id = copy_sent.metadata.message_id
            if message_id:
                original.metadata.__dict__["_message_id"] = message_id
                self._types[message_id] = original.metadata.message_type
            else:
                waiting.append((copy_sent, original))
        self._pending = waiting

    def native(self, reply: Message) -> Message:
        self._sync()
        reply = _decoded(reply)
        kind = self._types.pop(reply.metadata.reply_to_message_id, None)
        if kind is not None and reply.metadata.message_type != kind:
            metadata = copy.copy(reply.metadata)
            metadata.__dict__["_message_type"] = kind
            reply = make_message(metadata=metadata,
                                 error=reply.error if reply.has_error() else None,
                                 content=None if reply.has_error() else reply.content)
        return reply

    def clear(self) -> None:
        self._pending.clear()
        self._types.clear()


def _decoded(reply: Message) -> Message:
    """:func:`from_legacy_reply`, or an error reply saying why a reply in the legacy layout
    could not be decoded (a grid's replies never raise: the strategy's trust boundary counts
    the error as a drop)."""
    try:
        return from_legacy_reply(reply)
    except Exception as err:  # noqa: BLE001 - a malformed reply is a refused reply
        reason = f"reply in the legacy layout not decodable: {type(err).__name__}: {err}"
        return make_message(metadata=copy.copy(reply.metadata),
                            error=Error(code=ErrorCode.UNKNOWN, reason=reason))


def _unknown_message_type(reply: Message) -> bool:
    """Whether an error reply says the device has no handler for the message's type (a
    legacy ``ClientApp(client_fn=...)`` asked ``query.whoami``), not that its handler
    failed."""
    return reply.has_error() and "Invalid message type" in str(reply.error.reason)


class _Replies(Iterator[Message]):
    """The wrapped grid's replies, in the native layout; ``drain`` delegated."""

    def __init__(self, replies: Iterable[Message], ledger: _Ledger) -> None:
        self._replies = replies
        self._iter = iter(replies)
        self._ledger = ledger

    def __next__(self) -> Message:
        return self._ledger.native(next(self._iter))

    def drain(self) -> None:
        finish = getattr(self._replies, "drain", None)
        if callable(finish):
            finish()


class LegacyGrid(GridWrapper):
    """A ``Grid`` through which a strategy talks to NumPyClient devices (or to both kinds).

    Parameters
    ----------
    grid : Grid
        Flower's grid (simulation, deployment) or the in-process one.
    client_api : {"numpyclient", "auto", "message"}
        ``numpyclient``: every device is a ``ClientApp(client_fn=...)``; ``auto``: a device
        whose native ``whoami`` fails because it has no handler for it ("Invalid message
        type") is asked again in the legacy layout, and whichever form it answers is used
        for it from then on (any other failure is the device's answer, reason kept);
        ``message``: no translation (replies in the legacy layout are still decoded). A
        reply in the legacy layout that cannot be decoded becomes an error reply.

    Examples
    --------
    >>> strategy.start(grid=LegacyGrid(grid), num_rounds=10)  # doctest: +SKIP
    """

    def __init__(self, grid: Grid, client_api: str = "numpyclient") -> None:
        if client_api not in CLIENT_APIS:
            raise ValueError(f"client_api must be one of {CLIENT_APIS}, got {client_api!r}")
        super().__init__(grid)
        self.client_api = client_api
        self.legacy_nodes: set[int] = set()  # auto: nodes found to speak the legacy layout
        self.native_nodes: set[int] = set()  # auto: nodes found to speak the Message API
        self._ledger = _Ledger()

    @property
    def streams_messages(self) -> bool:  # noqa: D102 - as the wrapped grid
        return bool(getattr(self.inner, "streams_messages", False))

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:  # noqa: D102
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def _speaks_legacy(self, node: int) -> bool:
        if self.client_api == "auto":
            return node in self.legacy_nodes
        return self.client_api == "numpyclient"

    def _encode(self, message: Message) -> Message:
        if self._speaks_legacy(message.metadata.dst_node_id):
            return self._ledger.sent(to_legacy(message), message)
        return message

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        ids = self.inner.push_messages([self._encode(m) for m in messages])
        self._ledger._sync()
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return [self._ledger.native(r) for r in self.inner.pull_messages(message_ids)]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Send (translated where the device needs it); return the replies, native: tied to
        the messages given here (``reply_to_message_id``, ``message_type``)."""
        self._ledger.clear()  # replies to earlier calls are never delivered
        messages = iter(messages)
        first = next(messages, None)
        messages = itertools.chain([] if first is None else [first], messages)
        if self.client_api != "auto" or first is None \
                or first.metadata.message_type != WHOAMI:  # a call sends one type: no probe
            encoded = (self._encode(m) for m in messages)
            return _Replies(self.inner.send_and_receive(
                encoded if self.streams_messages else list(encoded), timeout=timeout),
                self._ledger)
        messages = list(messages)
        probing = {m.metadata.dst_node_id: m for m in messages
                   if m.metadata.message_type == WHOAMI
                   and m.metadata.dst_node_id not in self.legacy_nodes | self.native_nodes}
        if not probing:
            return _Replies(self.inner.send_and_receive([self._encode(m) for m in messages],
                                                        timeout=timeout), self._ledger)
        started = time.monotonic()
        sent = [self._encode(m) for m in messages]
        replies = [self._ledger.native(r)
                   for r in self.inner.send_and_receive(sent, timeout=timeout)]
        dst_of = {m.metadata.message_id: m.metadata.dst_node_id for m in sent}
        retry: dict[int, int] = {}  # probed node whose native whoami failed -> reply index
        for i, reply in enumerate(replies):
            node = dst_of.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if node in probing and _unknown_message_type(reply):
                retry[node] = i
            elif node in probing:
                self.native_nodes.add(node)
        if retry:
            left = None if timeout is None else max(1.0, timeout - (time.monotonic() - started))
            copies = {n: self._ledger.sent(to_legacy(probing[n]), probing[n]) for n in retry}
            second = list(self.inner.send_and_receive(list(copies.values()), timeout=left))
            node_of = {c.metadata.message_id: n for n, c in copies.items()}
            for reply in second:  # the second answer replaces the first, error or not
                # (the first said the device has no native whoami)
                node = node_of.get(reply.metadata.reply_to_message_id)
                if node is None:
                    continue
                replies[retry[node]] = self._ledger.native(reply)
                if not reply.has_error():
                    self.legacy_nodes.add(node)
                    log(INFO, "node %s is a NumPyClient device (legacy record layout)", node)
        return replies


def wrap_grid(grid: Grid, client_api: str) -> Grid:
    """``grid`` as a strategy should use it with devices of ``client_api``
    (:data:`CLIENT_APIS`): itself for ``message``, else a :class:`LegacyGrid`."""
    if client_api not in CLIENT_APIS:
        raise ValueError(f"client_api must be one of {CLIENT_APIS}, got {client_api!r}")
    return grid if client_api == "message" else LegacyGrid(grid, client_api)


def detect_legacy(grid: Grid) -> Grid:
    """``grid`` as a strategy uses it: ``LegacyGrid(grid, "auto")`` (a NumPyClient device is
    found at its first ``whoami`` and spoken to in the legacy layout from then on; native
    devices pass unchanged), or ``grid`` itself when it is a wrapper already
    (:class:`LegacyGrid`, a :class:`~fmtl_flower.packing.PackedGrid`: packed nodes are this
    project's own ClientApps)."""
    return grid if isinstance(grid, GridWrapper) else LegacyGrid(grid, "auto")
