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


@pytest.mark.parametrize("tail", [b"\1\2\3", b"\0" * 8])
def test_trailing_bytes_are_rejected(tail):
    """Issue 15: np.load reads a payload with trailing bytes; the wire decoder refuses it."""
    good = to_array(np.arange(5.0))
    bad = Array(dtype=good.dtype, shape=tuple(good.shape), stype=good.stype, data=good.data + tail)
    with pytest.raises(ValueError, match="payload"):
        from_array(bad)


def test_payload_must_match_its_record():
    """A payload decoding to another shape or dtype than the record announces is refused."""
    other = Array(np.arange(6.0).reshape(2, 3))  # Flower's own bytes
    lying = Array(dtype="float64", shape=(6,), stype=other.stype, data=other.data)
    with pytest.raises(ValueError, match="announces"):
        from_array(lying)
    lying = Array(dtype="int64", shape=(2, 3), stype=other.stype, data=other.data)
    with pytest.raises(ValueError, match="announces"):
        from_array(lying)
