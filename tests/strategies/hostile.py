"""A grid that lets tests tamper with replies: replace, lose, duplicate, forge, reorder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message

from fmtl_flower.engine import InProcessGrid

#: ``tamper(message, reply)`` -> the replies the server sees for ``message`` (``reply`` is the
#: real ClientApp's, None if the node was offline or late).
Tamper = Callable[[Message, Message | None], list[Message]]


def untouched(message: Message, reply: Message | None) -> list[Message]:
    return [] if reply is None else [reply]


class HostileGrid(InProcessGrid):
    """An in-process grid whose replies pass through ``tamper``; ``reverse`` delivers each
    exchange's replies in reverse order (arrival order != task order)."""

    tamper: Tamper = staticmethod(untouched)
    reverse: bool = False

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        out: list[Message] = []
        for message in messages:
            out.extend(self.tamper(message, self._deliver_one(message, timeout)))
        return out[::-1] if self.reverse else out


def run_on_hostile_grid(server_main: Callable[[Any], None], client: Any, num_nodes: int,
                        tamper: Tamper = untouched, reverse: bool = False,
                        node_configs: list[dict[str, Any]] | None = None) -> HostileGrid:
    """Run ``server_main(grid)`` against ``num_nodes`` nodes of ``client`` on a
    :class:`HostileGrid`."""
    grid = HostileGrid(client, num_nodes, node_configs=node_configs)
    grid.tamper = tamper
    grid.reverse = reverse
    server_main(grid)
    return grid
