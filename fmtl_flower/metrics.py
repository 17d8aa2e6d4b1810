"""Prediction metrics shared by every strategy: per-task and pooled error, client accuracies."""

from __future__ import annotations

import numpy as np


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
        return dict.fromkeys(
            ("test_error", "test_error_pooled", "accuracy_mean", "accuracy_mean_unweighted",
             "accuracy_bottom_decile"))
    rates = errors[keep] / counts[keep]
    pooled = float(errors[keep].sum() / counts[keep].sum())
    return {
        "test_error": float(rates.mean()),
        "test_error_pooled": pooled,
        "accuracy_mean": 1.0 - pooled,
        "accuracy_mean_unweighted": float(1.0 - rates.mean()),
        "accuracy_bottom_decile": float(np.percentile(1.0 - rates, 10)),
    }
