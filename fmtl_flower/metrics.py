"""Prediction metrics shared by every strategy: per-task and pooled error, client accuracies."""

from __future__ import annotations

import math
from typing import Any, TypedDict

import numpy as np

#: The keys :func:`error_summary` fills, in every strategy's per-round record.
ERROR_KEYS = ("test_error", "test_error_pooled", "accuracy_mean", "accuracy_mean_unweighted",
              "accuracy_bottom_decile")


class RoundRecord(TypedDict, total=False):
    """One per-round record, the same for every strategy (docs/reference/results-json.md).

    Every strategy's record has ``round``, the :data:`ERROR_KEYS` (from
    :func:`error_summary`: ``test_error`` is always the mean of per-task error rates and
    ``test_error_pooled`` the error over all test samples pooled), ``num_replies``,
    ``wall_time_s`` and ``tasks_missing``; a value not measured in that round is None. The
    other keys belong to some families: the objective (``primal``, ``dual``, ``gap``; FSVRG's
    ``objective``), counts and times, FedEM's training loss and unseen clients, OFMTL's event.
    """

    round: int
    test_error: float | None
    test_error_pooled: float | None
    accuracy_mean: float | None
    accuracy_mean_unweighted: float | None
    accuracy_bottom_decile: float | None
    num_replies: int | None
    wall_time_s: float | None
    tasks_missing: list[int] | None
    primal: float | None
    dual: float | None
    gap: float | None
    objective: float | None
    num_dropped: int | None


def round_record(k: int, **fields: Any) -> RoundRecord:
    """A new record of round ``k``: the keys every strategy has, unmeasured (None), then
    ``fields`` (the family's own keys, or values known already)."""
    record: dict[str, Any] = {"round": k, **dict.fromkeys(ERROR_KEYS), "num_replies": None,
                              "wall_time_s": None, "tasks_missing": None}
    record.update(fields)
    return record  # type: ignore[return-value]


def error_summary(errors: np.ndarray, counts: np.ndarray) -> dict[str, float | None]:
    """Summarise per-task test errors.

    Parameters
    ----------
    errors : ndarray of shape (m,)
        Number of misclassified test samples per task.
    counts : ndarray of shape (m,)
        Number of test samples per task. Tasks with no test samples are left out.

    Returns
    -------
    dict
        ``test_error`` (mean of per-task error rates: the MOCHA paper's number),
        ``test_error_pooled`` (all test samples pooled), ``accuracy_mean`` (per-client
        accuracy weighted by test-set size: the FedEM authors' number),
        ``accuracy_mean_unweighted`` and ``accuracy_bottom_decile`` (10th percentile of
        per-client accuracies). Every value is None when no task has test samples.
    """
    errors = np.asarray(errors, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    keep = counts > 0
    if not np.any(keep):
        return dict.fromkeys(ERROR_KEYS)
    rates = errors[keep] / counts[keep]
    pooled = float(errors[keep].sum() / counts[keep].sum())
    return {
        "test_error": float(rates.mean()),
        "test_error_pooled": pooled,
        "accuracy_mean": 1.0 - pooled,
        "accuracy_mean_unweighted": float(1.0 - rates.mean()),
        "accuracy_bottom_decile": bottom_decile(1.0 - rates),
    }


def bottom_decile(values: np.ndarray) -> float:
    """``np.percentile(values, 10)`` (its default ``linear`` method), bit for bit.

    Finite values are sorted in Python and interpolated with numpy's own formulas (virtual
    index ``(n - 1) q``, lerp from the nearer end): a few microseconds for the tens of tasks
    of a round record, where ``np.percentile``'s general machinery costs tens. Anything else
    (NaN, inf, empty) goes to ``np.percentile``.

    Parameters
    ----------
    values : ndarray of shape (k,)

    Returns
    -------
    float
    """
    if values.ndim != 1 or not len(values) or not np.isfinite(values).all():
        return float(np.percentile(values, 10))
    ordered = sorted(values.tolist())
    virtual = (len(ordered) - 1) * (10 / 100)
    below = math.floor(virtual)
    if virtual >= len(ordered) - 1:
        return float(ordered[-1])
    a, b, gamma = ordered[below], ordered[below + 1], virtual - below
    diff = b - a
    return float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)
