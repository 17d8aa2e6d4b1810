"""Fast Array encoding: byte-identical to Flower's, and safe on foreign headers."""

import numpy as np
import pytest
from flwr.app import Array

from fmtl_flower.wire import from_array, to_array


@pytest.mark.parametrize("values", [
    np.arange(5.0), np.random.default_rng(0).normal(size=(3, 4)), np.zeros((0, 3)),
    np.arange(6, dtype=np.int64), np.float32([1, 2]), np.array(3.0), np.ones((2, 3))[:, ::2]])
def test_same_bytes_as_flower_and_round_trip(values):
    ours = to_array(values)
    assert ours.data == Array(np.ascontiguousarray(values) if values.ndim else values).data
    for array in (ours, Array(values)):
        decoded = from_array(array)
        assert decoded.dtype == values.dtype and decoded.shape == values.shape
        np.testing.assert_array_equal(decoded, values)
        np.testing.assert_array_equal(array.numpy(), values)


def test_fortran_order_and_bad_stype_fall_back_or_fail():
    values = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(from_array(Array(values)), values)
    bad = Array(dtype="float64", shape=(1,), stype="torch.Tensor", data=b"x")
    with pytest.raises(TypeError, match="serialisation"):
        from_array(bad)
    with pytest.raises(TypeError):
        to_array(np.array([object()]))
