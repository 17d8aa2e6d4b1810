"""``expit`` and ``logsumexp`` in numpy, so that a device's FedEM client needs no scipy (the
base install has none). Same formulas as scipy's, equal up to rounding."""

from __future__ import annotations

import numpy as np

__all__ = ["expit", "logsumexp"]


def expit(x: np.ndarray) -> np.ndarray:
    """The logistic sigmoid ``1 / (1 + exp(-x))`` elementwise (scipy's formula; exp
    overflowing to inf gives exactly 0)."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def logsumexp(a: np.ndarray, axis: int | None = None) -> np.ndarray:
    """``log(sum(exp(a), axis))`` without overflow: the maximum is taken out first. Entries of
    -inf contribute nothing; a slice of only -inf gives -inf."""
    a = np.asarray(a, dtype=np.float64)
    peak = np.max(a, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(a - peak), axis=axis, keepdims=True)) + peak
    return np.squeeze(out, axis=axis) if axis is not None else out.reshape(())[()]
