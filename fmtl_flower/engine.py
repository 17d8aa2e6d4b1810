"""Engines that run a ServerApp/ClientApp pair: in-process (no Ray) and Flower's Ray simulation.

The in-process engine calls the ClientApp synchronously from a :class:`InProcessGrid`, so the
very same ``ServerApp``, ``Strategy`` and ``ClientApp`` objects that run on Ray or on real
SuperNodes run here, without Ray or a SuperLink: for tests, sweeps and large simulated
federations. It touches two semi-internal Flower classes (``TaskIdentity``, ``Run``), which is
why the Flower dependency is pinned below the next minor release that has not been tested.
"""

from __future__ import annotations

import itertools
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from logging import WARNING
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

#: Error code of a reply whose ClientApp raised (Flower's ``CLIENT_APP_RAISED_EXCEPTION``).
CLIENT_APP_RAISED = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
FIRST_NODE_ID = 1001
_RUN_IDS = itertools.count(1)


def new_run_id() -> int:
    """A run id not used before in this process (Contexts and client caches key on it)."""
    return next(_RUN_IDS)

ClientCallable = Callable[[Message, Context], Message]


def raised_reason(ex: BaseException) -> str:
    """The reason of the error reply to a ClientApp call that raised ``ex``."""
    return f"{type(ex).__name__}: {ex}"


def create_message(content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                   ttl: float | None = None) -> Message:
    """``Grid.create_message`` of the grids here: a message to ``dst_node_id``."""
    return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


class GridWrapper(Grid):
    """Base of a ``Grid`` in front of another one (``inner``): the run is the wrapped
    grid's (:class:`fmtl_flower.packing.PackedGrid`, :class:`fmtl_flower.legacy.LegacyGrid`)."""

    def __init__(self, grid: Grid) -> None:
        self.inner = grid

    def set_run(self, run_id: int) -> None:  # noqa: D102
        self.inner.set_run(run_id)

    @property
    def run(self) -> Run:  # noqa: D102
        return self.inner.run


class InProcessGrid(Grid):
    """A Flower ``Grid`` whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp or callable
        Called as ``client_app(message, context)`` for each message.
    num_nodes : int
        Number of simulated nodes; node i gets ``node_config = {"partition-id": i,
        "num-partitions": num_nodes}`` (plus ``node_configs[i]`` when given).
    run_config : mapping, optional
        The run config every node's Context sees.
    node_configs : list of mappings, optional
        Extra per-node config entries (e.g. ``{"task-id": 3}``).
    run_id : int, optional
        The run id of every Context (default: a new one, see :func:`new_run_id`).

    Notes
    -----
    A reply whose ClientApp call took longer than the ``timeout`` of ``send_and_receive`` is
    discarded, as Flower discards a late reply; the node's Context keeps what the call wrote
    (as on a real SuperNode). A ClientApp that raises yields an error reply, as in Flower.
    """

    #: ``send_and_receive`` takes the messages in one pass, delivering as it goes: strategies
    #: may pass generators (:func:`fmtl_flower.strategies.base.as_taken_by`).
    streams_messages = True

    def __init__(self, client_app: ClientApp | ClientCallable, num_nodes: int,
                 run_config: Mapping[str, Any] | None = None,
                 node_configs: list[Mapping[str, Any]] | None = None,
                 run_id: int | None = None) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        run_id = new_run_id() if run_id is None else run_id
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 1, 1
        self._app = client_app
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=run_id)
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            node_config: dict[str, Any] = {"partition-id": i, "num-partitions": num_nodes}
            if node_configs is not None:
                node_config.update(node_configs[i])
            self.contexts[FIRST_NODE_ID + i] = Context(
                run_id=run_id, node_id=FIRST_NODE_ID + i, node_config=node_config,
                state=RecordDict(), run_config=dict(run_config or {}))
        self.offline: set[int] = set()

    # Grid's abstract interface -----------------------------------------------------------
    def set_run(self, run_id: int) -> None:  # noqa: D102
        self._run = Run.create_empty(run_id=run_id)

    @property
    def run(self) -> Run:  # noqa: D102
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:  # noqa: D102
        return create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The ids of the nodes that are online."""
        return [n for n in self.contexts if n not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver messages (calling the ClientApp at once); return their message ids."""
        return self._deliver(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies of the given message ids that are available."""
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Deliver messages and return the replies that arrived within ``timeout``.

        The replies are a :class:`StreamedReplies`: each message is taken from ``messages``
        and delivered only when the caller asks for the next reply, so neither all messages
        nor all replies of a round are ever held at once (memory flat in the number of
        nodes when ``messages`` is a generator). Its ``drain()`` delivers what the caller did
        not read, as Flower would have delivered it.
        """
        return StreamedReplies(self, messages, timeout)

    def _deliver(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            reply = self._deliver_one(message, None)
            if reply is not None:
                self._replies[reply.metadata.reply_to_message_id] = reply
                ids.append(reply.metadata.reply_to_message_id)
        return ids

    def _deliver_one(self, message: Message, timeout: float | None) -> Message | None:
        """The node's reply to ``message``; None if the node is unknown or offline, or the
        reply missed ``timeout``."""
        node = message.metadata.dst_node_id
        if node not in self.contexts or node in self.offline:
            log(WARNING, "in-process grid: no node %s; message dropped", node)
            return None
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        started = time.perf_counter()
        try:
            reply = self._app(message, self.contexts[node])
        except Exception as ex:  # noqa: BLE001 - a node's failure becomes an error reply
            reply = Message(Error(code=CLIENT_APP_RAISED, reason=raised_reason(ex)),
                            reply_to=message)
        if timeout is not None and time.perf_counter() - started > timeout:
            return None  # the reply missed the deadline: Flower would not deliver it
        return reply


class StreamedReplies(Iterator[Message]):
    """The replies of one :meth:`InProcessGrid.send_and_receive`, delivered one message at
    a time as they are iterated."""

    def __init__(self, grid: InProcessGrid, messages: Iterable[Message],
                 timeout: float | None) -> None:
        self._grid = grid
        self._messages = iter(messages)
        self._timeout = timeout

    def __next__(self) -> Message:
        for message in self._messages:
            reply = self._grid._deliver_one(message, self._timeout)
            if reply is not None:
                return reply
        raise StopIteration

    def drain(self) -> None:
        """Deliver the messages not delivered yet (their replies are dropped)."""
        for _ in self:
            pass



def run_inprocess(server_app: ServerApp, client_app: ClientApp | ClientCallable, num_nodes: int,
                  run_config: Mapping[str, Any] | None = None,
                  node_configs: list[Mapping[str, Any]] | None = None) -> InProcessGrid:
    """Run ``server_app`` against ``num_nodes`` in-process nodes; return the grid used."""
    grid = InProcessGrid(client_app, num_nodes, run_config, node_configs)
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(run_config or {}))
    server_app(grid, context)
    return grid


#: ``HOST:PORT``: a host name, an IPv4 address or a bracketed IPv6 address; a port 1-65535.
_RAY_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
                          r"|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})")


def validate_ray_address(address: str) -> str:
    """Check that ``address`` names a Ray cluster to join: ``HOST:PORT`` or ``"auto"``.

    ``HOST:PORT`` is the head node's GCS address (the ``--port`` of ``ray start --head``,
    6379 by default); ``"auto"`` is Ray's own: the address in ``RAY_ADDRESS``, else the
    cluster last started on this machine with ``ray start``. Returns ``address``; raises
    ``ValueError`` with the expected format otherwise. Ray Client addresses (``ray://...``)
    are refused (not supported here): the driver (``fmtl``) must run on a node of the
    cluster, as ``ray.init(address=HOST:PORT)`` attaches to a raylet of this machine.
    """
    expected = ("expected HOST:PORT of the Ray head node (the port of `ray start --head "
                "--port`, e.g. 192.168.1.10:6379) or 'auto'")
    if not isinstance(address, str):
        raise ValueError(f"invalid Ray address {address!r}: {expected}")
    if address == "auto":
        return address
    if "://" in address:
        raise ValueError(f"invalid Ray address {address!r}: Ray Client addresses (ray://) are "
                         f"not supported (run on a node of the cluster); {expected}")
    match = _RAY_ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ValueError(f"invalid Ray address {address!r}: {expected}")
    return address


def run_ray(server_app: ServerApp, client_app: ClientApp, num_nodes: int,
            num_cpus: int = 2, cpus_per_node: int = 1, address: str | None = None) -> None:
    """Run the pair on Flower's Ray simulation engine (``flwr.simulation.run_simulation``).

    The objects are shipped to Ray workers as they are, so configuration baked into them
    (rather than read from ``context.run_config``) reaches every node.

    Parameters
    ----------
    num_cpus : int
        CPUs of the private Ray instance started for this run (ignored with ``address``:
        a cluster brings its own resources, and ``ray.init`` refuses ``num_cpus`` there).
    cpus_per_node : int
        CPUs each simulated node (Ray actor) reserves; the actor pool holds
        ``sum over Ray nodes of floor(node CPUs / cpus_per_node)`` actors.
    address : str, optional
        Join the running Ray cluster at ``HOST:PORT`` (or ``"auto"``) instead of starting
        a private Ray instance; this process becomes the cluster's driver, so it must run on
        a node of the cluster. When ``None``, ``RAY_ADDRESS`` is honoured as ``ray.init``
        does (``"local"`` or unset: a private instance). At the end this process disconnects;
        the cluster keeps running.
    """
    import warnings

    from flwr.simulation import run_simulation

    source = "address"
    if address is None:  # as ray.init: RAY_ADDRESS names a cluster unless empty or "local"
        env_address = os.environ.get("RAY_ADDRESS", "")
        address = env_address if env_address not in ("", "local") else None
        source = "RAY_ADDRESS"
    init_args: dict[str, Any] = {"log_to_driver": False}
    if address is None:
        init_args["num_cpus"] = num_cpus
    else:
        try:
            init_args["address"] = validate_ray_address(address)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_simulation(
            server_app=server_app, client_app=client_app, num_supernodes=num_nodes,
            backend_config={"client_resources": {"num_cpus": cpus_per_node, "num_gpus": 0.0},
                            "init_args": init_args},
        )
