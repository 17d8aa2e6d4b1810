"""Tests for fmtl_flower.data.validation."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.data import TaskData, check_same_dim, validate_task


def test_normalises_dtypes_and_shapes() -> None:
    X = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(4, 3))
    y = np.array([[1], [-1], [1], [-1]], dtype=np.int16)
    Xv, yv = validate_task(X, y)
    assert Xv.dtype == np.float64 and Xv.flags.c_contiguous and Xv.shape == (4, 3)
    assert yv.dtype == np.float64 and yv.shape == (4,)
    np.testing.assert_array_equal(Xv, X)
    np.testing.assert_array_equal(yv, [1.0, -1.0, 1.0, -1.0])


def test_accepts_row_vector_labels_and_lists() -> None:
    _, y = validate_task([[0.5, 1.0], [2.0, 3.0]], np.array([[1, -1]]))
    np.testing.assert_array_equal(y, [1.0, -1.0])


def test_labels_01() -> None:
    _, y = validate_task(np.ones((3, 2)), [0, 1, 1], labels="01")
    np.testing.assert_array_equal(y, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"part B: labels must be in \{0, 1\}.*\[-1\]"):
        validate_task(np.ones((3, 2)), [0, 1, -1], labels="01", name="part B")


@pytest.mark.parametrize("labels", ["pm", "", "0/1", None])
def test_unknown_label_convention(labels: str) -> None:
    with pytest.raises(ValueError, match="labels must be one of"):
        validate_task(np.ones((2, 2)), [1, -1], labels=labels)


@pytest.mark.parametrize(
    ("X", "y", "pattern"),
    [
        (np.ones(3), [1, -1, 1], r"X must be 2-D"),
        (np.ones((2, 2, 2)), [1, -1], r"X must be 2-D"),
        (np.ones((0, 3)), [], r"X has no samples"),
        (np.ones((3, 0)), [1, 1, 1], r"X has no features"),
        (np.ones((3, 2)), [1, -1], r"y has 2 labels but X has 3 samples"),
        (np.ones((2, 2)), np.ones((2, 2)), r"y must be a vector"),
        (np.array([[1.0, np.nan], [0.0, 1.0]]), [1, -1], r"X contains 1 non-finite"),
        (np.array([[1.0, np.inf], [0.0, 1.0]]), [1, -1], r"X contains 1 non-finite"),
        (np.ones((2, 2)), [1.0, np.nan], r"y contains 1 non-finite"),
        (np.array([["a", "b"]]), [1], r"X must be a real numeric array"),
        (np.ones((1, 2)), ["x"], r"y must be a real numeric array"),
    ],
)
def test_shape_and_value_errors_name_the_task(X: object, y: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=r"^my task: " + pattern):
        validate_task(X, y, name="my task")


def test_bad_pm1_labels_listed() -> None:
    with pytest.raises(ValueError, match=r"t3: labels must be in \{-1, 1\}.*\[0, 2\]"):
        validate_task(np.ones((4, 1)), np.array([0, 2, 1, 2], dtype=np.int16), name="t3")


def test_at_most_five_offending_values_listed() -> None:
    y = np.arange(2.0, 10.0)  # 8 distinct bad values
    with pytest.raises(ValueError) as info:
        validate_task(np.ones((8, 1)), y)
    msg = str(info.value)
    assert "[2, 3, 4, 5, 6, ...]" in msg and "8 distinct values in all" in msg
    assert "7" not in msg.split("[")[-1].split("]")[0]


def test_no_copy_for_valid_float_input() -> None:
    X = np.ones((3, 2))
    Xv, _ = validate_task(X, [1, -1, 1])
    assert Xv is X


def test_check_same_dim() -> None:
    assert check_same_dim([np.ones((3, 4)), np.ones((1, 4))]) == 4
    with pytest.raises(ValueError, match=r"^ds: task 2 has 5 features but task 0 has 4"):
        check_same_dim(
            [np.ones((3, 4)), np.ones((2, 4)), np.ones((2, 5)), np.ones((2, 6))], name="ds"
        )
    with pytest.raises(ValueError, match="no tasks"):
        check_same_dim([])


def test_check_same_dim_accepts_task_data() -> None:
    a = TaskData(np.ones((2, 3)), np.ones(2), np.ones((1, 3)), np.ones(1))
    b = TaskData(np.ones((2, 2)), np.ones(2), np.ones((0, 2)), np.ones(0))
    assert check_same_dim([a, a]) == 3
    with pytest.raises(ValueError, match="task 1 has 2 features"):
        check_same_dim([a, b])
