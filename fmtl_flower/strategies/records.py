"""One home for a run's records: created, completed, checkpointed and published here.

A strategy keeps one record per state k = 0 .. R (the results contract,
``docs/reference/results-json.md``). A record is **opened** when its state exists (MOCHA,
Mb-SGD and FSVRG: after round k's update; FedEM: in round k's train phase) and stays
**pending** until the numbers that describe it arrive (the devices' losses with round k + 1's
replies or the final metrics round; FedEM's evaluate phase). It is then **completed** once:
a record completed already stays as it is (the last record of a finished run that is resumed
with more rounds was completed by its final metrics round; the first round of the resumed run
neither completes nor publishes it again). Only completed records are **published**
(``on_round``, ``results()``).

:class:`RoundRecords` keeps the records as plain dicts of their public fields (``records``:
what ``strategy.records`` is) and what each pending one still waits for in a separate slot
(:class:`Pending`: the regulariser the primal adds to the devices' loss sums, when the method
has one). OFMTL's records are complete when created (:meth:`RoundRecords.add`).

Checkpoints hold the records as a JSON list (:meth:`RoundRecords.to_meta`): a pending
record carries the key ``_reg`` (its regulariser, or null), as checkpoints always did;
:meth:`RoundRecords.load` also reads FSVRG's older marker ``_open``.

This module does not import Flower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PENDING_KEY", "KeepsRecords", "Pending", "RoundRecords", "public_record"]

#: The key a pending record carries in a checkpoint: its regulariser (null when none).
PENDING_KEY = "_reg"
#: FSVRG's marker of a pending record in checkpoints written before this module.
_LEGACY_OPEN_KEY = "_open"

Record = dict[str, Any]
RoundCallback = Callable[[Record], Any]


@dataclass(frozen=True)
class Pending:
    """What a pending record waits for.

    Attributes
    ----------
    regulariser : float or None
        The regulariser of the record's state (MOCHA: ``R(W, Omega)``; Mb-SGD the same),
        added to the devices' loss sums to give the primal; None when the method has none.
    """

    regulariser: float | None = None


def public_record(record: Record) -> Record:
    """A copy of ``record`` without internal fields (keys starting with ``_``)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


class RoundRecords:
    """The records of a run, in state order, and which of them are still pending.

    ``records`` is the list of record dicts (public fields only); ``pending`` maps the index
    of each record still waiting for its numbers to its :class:`Pending`.
    """

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.pending: dict[int, Pending] = {}

    def __len__(self) -> int:
        return len(self.records)

    # ------------------------------------------------------------------ lifecycle
    def open(self, record: Record, regulariser: float | None = None) -> Record:
        """Append ``record``, pending until :meth:`complete`; returns it."""
        self.pending[len(self.records)] = Pending(regulariser)
        self.records.append(record)
        return record

    def add(self, record: Record) -> Record:
        """Append ``record`` complete already (OFMTL's event records); returns it."""
        self.records.append(record)
        return record

    def is_pending(self, k: int) -> bool:
        """Whether record ``k`` still waits for its numbers."""
        return k in self.pending

    def complete(self, k: int) -> Pending | None:
        """Mark record ``k`` completed; return what it waited for, or None when it was
        completed already (then the caller leaves it as it is and does not publish it)."""
        if not 0 <= k < len(self.records):
            raise IndexError(f"no record {k}: the run has {len(self.records)}")
        return self.pending.pop(k, None)

    @staticmethod
    def publish(record: Record, on_round: RoundCallback | None) -> None:
        """Pass the public fields of a record just completed to ``on_round`` (if any)."""
        if on_round is not None:
            on_round(public_record(record))

    def published(self) -> list[Record]:
        """The completed records, public fields only (``results()["rounds"]``)."""
        return [public_record(r) for k, r in enumerate(self.records)
                if k not in self.pending]

    # ------------------------------------------------------------------ checkpoints
    def to_meta(self) -> list[Record]:
        """The records as a checkpoint's JSON meta holds them: a pending record with
        :data:`PENDING_KEY` set to its regulariser."""
        out = []
        for k, record in enumerate(self.records):
            pending = self.pending.get(k)
            out.append(record if pending is None
                       else {**record, PENDING_KEY: pending.regulariser})
        return out

    def load(self, records: Iterable[Record]) -> None:
        """Replace the records with a checkpoint's (:meth:`to_meta`'s output, or that of a
        checkpoint written before this module: ``_reg`` in MOCHA's and Mb-SGD's, ``_open``
        in FSVRG's pending records)."""
        self.records, self.pending = [], {}
        for k, saved in enumerate(records):
            record = dict(saved)
            marked = PENDING_KEY in record or _LEGACY_OPEN_KEY in record
            regulariser = record.pop(PENDING_KEY, None)
            record.pop(_LEGACY_OPEN_KEY, None)
            if marked:
                self.pending[k] = Pending(None if regulariser is None else float(regulariser))
            self.records.append(record)


class KeepsRecords:
    """Mixin: a strategy's ``records`` are its :class:`RoundRecords` ``book``'s (assigning a
    list loads it as a checkpoint's records are loaded)."""

    book: RoundRecords

    @property
    def records(self) -> list[Record]:
        """The run's records, one dict per state (pending ones included)."""
        return self.book.records

    @records.setter
    def records(self, value: Iterable[Record]) -> None:
        self.book.load(value)
