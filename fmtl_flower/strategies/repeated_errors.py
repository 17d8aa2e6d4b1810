"""Repeated errors in Flower's log, collapsed to one line with a count (issue 27, item 4).

Under Flower's Ray simulation a device-side error is logged by Flower, not by this package:
for every failed message the simulation engine's worker (``flwr/server/superlink/fleet/vce/
vce_api.py``, in the process that runs the ServerApp) logs the exception and its traceback
at ERROR on Flower's logger, and the Ray backend a line before them: about 95 lines per
failed message, so a federation of misconfigured devices prints one such traceback per
device (and per retry), and the one line that says what is wrong is lost among them (issue
27 met 5,600-10,300 lines). Neither Flower nor Ray has a setting for it: Ray's log deduplication
(``RAY_DEDUP_LOGS``) covers what the actors print, not these records, which Flower logs in
the driver process.

:class:`RepeatedErrors` is a ``logging.Filter`` for Flower's logger: an ERROR (or worse)
record whose text was already seen in this run is dropped, except at its 1st, 10th, 100th,
... repeat, where it is replaced by one line that counts the repeats and quotes the error's
last line. Texts are compared with their numbers and Ray's hexadecimal ids masked: what differs
between devices and Ray workers reporting one error (task ids and counts in the message, ``pid=``,
``ip=``, ``actor_id=``, memory addresses; a traceback's line numbers too). No information is
lost: the strategies log each device's reason at WARNING (never filtered), and a
:class:`~fmtl_flower.strategies.discovery.DiscoveryError` lists the distinct ones. Records
below ERROR pass untouched.
:func:`collapse_repeated_errors` installs it on Flower's logger once per process and starts
its counts afresh; every strategy's ``start()`` calls it, so a user's own ServerApp gets it
too. To see every repeat, remove it: ``FLOWER_LOGGER.removeFilter(collapse_repeated_errors())``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading

from flwr.common.logger import FLOWER_LOGGER

#: What differs between devices and Ray workers reporting one error (masked before comparing
#: texts): Ray's hexadecimal actor ids and addresses, and every number.
DETAILS = re.compile(r"actor_id=[0-9a-f]+|0x[0-9a-f]+|\d+")
#: Distinct error texts remembered per run (the oldest is forgotten beyond it).
MAX_REMEMBERED = 10_000


class RepeatedErrors(logging.Filter):
    """Drop repeats of ERROR records already logged; count them (module docstring)."""

    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__()
        self.level = level
        self.repeats: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every error seen (a new run reports each once again)."""
        with self._lock:
            self.repeats.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        """True for a record to log (rewritten to a count line at the 1st, 10th, 100th, ...
        repeat of its text), False for a repeat to drop."""
        if record.levelno < self.level:
            return True
        text = record.getMessage()
        key = hashlib.sha1(DETAILS.sub("#", text).encode(), usedforsecurity=False)
        with self._lock:
            repeats = self.repeats.get(key.digest(), -1) + 1
            self.repeats[key.digest()] = repeats
            if len(self.repeats) > MAX_REMEMBERED:
                del self.repeats[next(iter(self.repeats))]
        if repeats == 0:
            return True
        if not is_power_of_ten(repeats):
            return False
        times = "once" if repeats == 1 else f"{repeats} times"
        record.msg = (f"(the error above repeated {times}; further repeats are counted, not "
                      f"printed: {last_line(text)})")
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def is_power_of_ten(count: int) -> bool:
    """1, 10, 100, ...: the repeats at which :class:`RepeatedErrors` prints a count."""
    if count < 1:
        return False
    while count % 10 == 0:
        count //= 10
    return count == 1


def last_line(text: str, width: int = 200) -> str:
    """The last non-empty line of ``text`` (a traceback's: the exception), cut at ``width``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= width else line[:width] + "..."


def collapse_repeated_errors(logger: logging.Logger = FLOWER_LOGGER) -> RepeatedErrors:
    """Install :class:`RepeatedErrors` on ``logger`` (Flower's) unless it is there, and start
    its counts afresh; returns it."""
    for existing in logger.filters:
        if isinstance(existing, RepeatedErrors):
            existing.reset()
            return existing
    installed = RepeatedErrors()
    logger.addFilter(installed)
    return installed
