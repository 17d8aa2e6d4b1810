"""Pull a deployment's replies at a finer interval than Flower's ``send_and_receive``.

flwr 1.42's deployment grid (``HttpGrid``, ``flwr/superlink/grid/http_grid.py``) pushes a
round's messages, pulls the replies at once, then every 3 s (a hard-coded ``time.sleep(3)``)
until all have come or the timeout has passed. A round therefore lasts a whole number of 3 s
steps: a reply that arrives 0.2 s after a pull waits 2.8 s. :class:`PollingGrid` is the same
loop with the pause as a parameter; everything else (push, pull, nodes, run, messages) is the
wrapped grid's. Flower's simulation grid (``InMemoryGrid``) already pulls every 0.1 s and the
in-process engine does not poll: :func:`poll_replies` leaves them as they are.

The ServerApp applies it on deployments with the run-config key ``reply-poll-interval``
(seconds, default 0.5; :class:`fmtl_flower.settings.CommonSettings`), and
``TaskStrategy.start(grid=...)`` wraps a deployment grid it is given with the strategy's
``reply_poll_interval``. Elsewhere (OFMTL's, the async methods' ``start``, your own
ServerApp)::

    grid = poll_replies(grid, interval=0.5)

Each pull is one request to the SuperLink for the replies still missing (0.5 s: two a
second, whatever the number of nodes). An idle SuperNode still asks for work every 3 s
(Flower's SuperNode, not a setting): a message can wait up to 3 s before its node sees it.

This module imports flwr and the standard library only (``benchmarks/loopback_rounds.py``
copies it into its trivial Flower App, so both apps poll alike).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

__all__ = ["DEPLOYMENT_GRIDS", "PollingGrid", "check_interval", "poll_replies"]

#: Class names of Flower's deployment grids (flwr 1.42: ``HttpGrid``; earlier: ``GrpcGrid``),
#: the grids whose ``send_and_receive`` pauses 3 s between pulls.
DEPLOYMENT_GRIDS = ("HttpGrid", "GrpcGrid")


def check_interval(interval: Any) -> float:
    """``interval`` as a float > 0 and finite; a ValueError naming it otherwise."""
    try:
        if isinstance(interval, bool):
            raise TypeError
        value = float(interval)
    except (TypeError, ValueError):
        raise ValueError(f"interval: expected a number of seconds, got {interval!r}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"interval: must be a finite number of seconds > 0, got {interval!r}")
    return value


class PollingGrid(Grid):
    """A grid whose :meth:`send_and_receive` pulls replies every ``interval`` seconds.

    Parameters
    ----------
    grid : Grid
        The grid that carries the messages (``push_messages``, ``pull_messages``, ...).
    interval : float
        Seconds between two pulls of the replies still missing (> 0).
    sleep : callable, optional
        The pause (default ``time.sleep``; tests pass a fake clock's).
    clock : callable, optional
        Seconds now (default ``time.time``, as Flower's loop).

    Notes
    -----
    A transport, not a protocol wrapper: it does not derive from
    :class:`fmtl_flower.engine.GridWrapper`, so :func:`fmtl_flower.legacy.detect_legacy`
    still wraps it (NumPyClient devices) and :func:`fmtl_flower.apps.common.engine_of` calls
    it a deployment.
    """

    def __init__(self, grid: Grid, interval: float, *,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time) -> None:
        self.inner = grid
        self.interval = check_interval(interval)
        self._sleep, self._clock = sleep, clock

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then pull their replies at once and every ``interval`` seconds
        until all have come or ``timeout`` seconds have passed (None: no limit); the replies
        in the order pulled. Flower's ``HttpGrid.send_and_receive``, with its 3 s pause
        replaced by ``interval``: a reply still missing at the timeout is not waited for."""
        missing = set(self.inner.push_messages(messages))
        del messages
        end_time = self._clock() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while timeout is None or self._clock() < end_time:
            pulled = list(self.inner.pull_messages(missing))
            replies.extend(pulled)
            missing.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            if not missing:
                break
            self._sleep(self.interval)
        return replies

    # everything else is the wrapped grid's -------------------------------------------------
    def set_run(self, run_id: Any) -> None:  # noqa: D102
        self.inner.set_run(run_id)

    @property
    def run(self) -> Any:  # noqa: D102
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:  # noqa: D102
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.inner.pull_messages(message_ids)

    def __getattr__(self, name: str) -> Any:
        """Any other attribute (``close``, ...) is the wrapped grid's."""
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def poll_replies(grid: Grid, interval: float) -> Grid:
    """``grid`` pulling its replies every ``interval`` s: a :class:`PollingGrid` around a
    Flower deployment grid (:data:`DEPLOYMENT_GRIDS`), any other grid as it is (the
    simulation's ``InMemoryGrid`` pulls every 0.1 s already; the in-process engine, a
    ``PollingGrid`` and our wrappers are left alone)."""
    interval = check_interval(interval)
    if type(grid).__name__ not in DEPLOYMENT_GRIDS:
        return grid
    log(INFO, "replies pulled every %g s (reply-poll-interval; Flower's %s: every 3 s)",
        interval, type(grid).__name__)
    return PollingGrid(grid, interval)
