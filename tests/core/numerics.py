"""Numerical comparison helpers shared by the core tests."""

import numpy as np


def assert_close(actual, expected, rtol):
    """|actual - expected| <= rtol * max|expected| entry-wise (scalars too)."""
    actual, expected = np.asarray(actual, float), np.asarray(expected, float)
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-300)
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} * {scale:.3g}"
