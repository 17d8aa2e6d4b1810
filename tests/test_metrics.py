"""Error and accuracy summaries."""

import numpy as np

from fmtl_flower.metrics import bottom_decile, error_summary


def test_error_summary_numbers():
    out = error_summary(np.array([1, 0, 5, 0]), np.array([10, 10, 10, 0]))
    assert np.isclose(out["test_error"], (0.1 + 0 + 0.5) / 3)
    assert np.isclose(out["test_error_pooled"], 6 / 30)
    assert np.isclose(out["accuracy_mean"], 24 / 30)
    assert np.isclose(out["accuracy_mean_unweighted"], 1 - (0.6 / 3))
    assert np.isclose(out["accuracy_bottom_decile"], np.percentile([0.9, 1.0, 0.5], 10))
    assert all(v is None for v in error_summary(np.zeros(2), np.zeros(2)).values())


def test_bottom_decile_is_numpys_percentile_bit_for_bit():
    rng = np.random.default_rng(7)
    for i in range(3000):
        n = int(rng.integers(1, 60))
        if i % 3 == 0:  # rates of a round: ties, 0 and 1
            counts = rng.integers(1, 20, n)
            values = 1.0 - rng.integers(0, 20, n) % (counts + 1) / counts
        elif i % 3 == 1:
            values = rng.random(n)
        else:
            values = rng.normal(size=n) * 10.0 ** int(rng.integers(-6, 6))
        expected = float(np.percentile(values, 10))
        got = bottom_decile(values)
        assert got == expected and np.signbit(got) == np.signbit(expected), values
    for odd in (np.array([0.5, np.nan, 0.1]), np.array([np.inf, 0.2])):  # numpy's answer
        assert np.array_equal(bottom_decile(odd), np.percentile(odd, 10), equal_nan=True)
