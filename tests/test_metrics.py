"""Error and accuracy summaries."""

import numpy as np

from fmtl_flower.metrics import error_summary


def test_error_summary_numbers():
    out = error_summary(np.array([1, 0, 5, 0]), np.array([10, 10, 10, 0]))
    assert np.isclose(out["test_error"], (0.1 + 0 + 0.5) / 3)
    assert np.isclose(out["test_error_pooled"], 6 / 30)
    assert np.isclose(out["accuracy_mean"], 24 / 30)
    assert np.isclose(out["accuracy_mean_unweighted"], 1 - (0.6 / 3))
    assert np.isclose(out["accuracy_bottom_decile"], np.percentile([0.9, 1.0, 0.5], 10))
    assert all(v is None for v in error_summary(np.zeros(2), np.zeros(2)).values())
