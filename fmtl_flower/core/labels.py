"""Class labels for the probabilistic models (FedEM's family): one conversion, used by the
FedEM client and the Flower-free pooled baseline (:mod:`fmtl_flower.centralized`)."""

from __future__ import annotations

import numpy as np

__all__ = ["labels_as_classes"]


def labels_as_classes(y: np.ndarray, name: str) -> np.ndarray:
    """Labels as int64 classes: {-1, +1} -> {0, 1}; {0, 1} or 0..C-1 kept; else ValueError."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name}: labels must be 1-D, got shape {y.shape}")
    values = np.unique(y)
    if values.size and not np.all(np.isfinite(values.astype(np.float64))):
        raise ValueError(f"{name}: labels must be finite")
    if values.size and np.all(np.isin(values, (-1.0, 1.0))) and np.any(values == -1):
        return (y > 0).astype(np.int64)
    if values.size and (np.any(values < 0) or np.any(values != np.round(values))):
        raise ValueError(f"{name}: labels must be {{-1, +1}} or classes 0..C-1, got "
                         f"{values[:5].tolist()}")
    return y.astype(np.int64)
