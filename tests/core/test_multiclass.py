"""The one-vs-rest lifting, the class votes and the intercept column
(:mod:`fmtl_flower.core.multiclass`)."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.multiclass import (
    Lifting,
    class_indices,
    decide_classes,
    label_values,
    lift,
    multiclass_errors,
    natural_binary,
    predict_classes,
    with_intercept,
)


def test_lift_puts_each_sample_in_its_class_block():
    X = np.array([[1.0, 2.0], [3.0, 4.0]])
    Xl, yl = lift(X, np.array([2, 0]), 3)
    expected = np.array([
        [1, 2, 0, 0, 0, 0], [0, 0, 1, 2, 0, 0], [0, 0, 0, 0, 1, 2],
        [3, 4, 0, 0, 0, 0], [0, 0, 3, 4, 0, 0], [0, 0, 0, 0, 3, 4]], dtype=float)
    np.testing.assert_array_equal(Xl, expected)
    np.testing.assert_array_equal(yl, [-1, -1, 1, 1, -1, -1])
    # a lifted model's score of (i, k) is w_k . x_i
    w = np.arange(6.0)
    np.testing.assert_array_equal(Xl @ w, (X @ w.reshape(3, 2).T).ravel())


def test_a_lifting_too_large_for_a_device_is_refused():
    with pytest.raises(ValueError, match=r"over 2000 classes would take 29\.8 GiB"):
        lift(np.zeros((1, 1000)), np.zeros(1, dtype=np.int64), 2000)


def test_predictions_are_the_argmax_over_blocks():
    X = with_intercept(np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]), 2.0)
    assert X.shape == (3, 3) and np.all(X[:, 2] == 2.0)
    w = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.1])  # class 2: bias 0.2
    np.testing.assert_array_equal(predict_classes(X, w, 3), [0, 1, 2])
    assert multiclass_errors(X, np.array([0, 1, 1]), w, 3) == 1


def test_labels_are_canonical_sorted_and_homogeneous():
    assert label_values(np.array([2, 0, 1, 1]), np.array([3.0])) == [0, 1, 2, 3]
    assert label_values(np.array([1.5, 0.0])) == [0.0, 1.5]
    assert label_values(np.array(["b", "a"]), np.array([], dtype=str)) == ["a", "b"]
    assert label_values(np.array([True, False])) == [0, 1]
    with pytest.raises(ValueError, match="finite"):
        label_values(np.array([1.0, np.nan]))
    np.testing.assert_array_equal(class_indices(np.array([7.0, 2.0]), (2, 7), "t"), [1, 0])
    with pytest.raises(ValueError, match=r"t: labels \['z'\] are not among"):
        class_indices(np.array(["a", "z"]), ("a", "b"), "t")


def test_binary_labels_need_no_class_list():
    assert natural_binary((-1, 1)) and natural_binary((0, 1)) and natural_binary((1,))
    assert not natural_binary((-1, 0, 1)) and not natural_binary(("a", "b"))


def test_lifting_sizes_and_config_round_trip():
    lifting = Lifting(("a", "b", "c"), 2.0)
    assert (lifting.blocks, lifting.dim(4), lifting.n(5)) == (3, 15, 15)
    assert lifting.row_norm(3.0) == pytest.approx(np.sqrt(13.0))
    assert Lifting.from_config(lifting.config()) == lifting
    assert Lifting(("no", "yes")).blocks == 1 and Lifting().is_identity
    assert Lifting().config() == {} and Lifting.from_config({}) == Lifting()
    with pytest.raises(ValueError, match="at least 2"):
        Lifting.from_config({"classes": ["a"]})
    with pytest.raises(ValueError, match="intercept-scaling"):
        Lifting.from_config({"intercept-scaling": -1.0})


def test_class_votes_keep_label_skew_and_fence_inflation():
    honest = {node: ("a", "b", "c") for node in range(8)}
    skewed = {**honest, 8: ("a", "d")}  # "d": one device alone holds it
    assert decide_classes(skewed, robust=True, max_classes=1000) == (("a", "b", "c", "d"), {})
    inflated = {**honest, 9: tuple(f"z{i:03d}" for i in range(500))}
    classes, refused = decide_classes(inflated, robust=True, max_classes=1000)
    assert classes == ("a", "b", "c") and list(refused) == [9]
    assert "above the federation's fence" in refused[9]
    classes, refused = decide_classes(inflated, robust=False, max_classes=1000)
    assert len(classes) == 503 and not refused
    # the cap keeps the classes most nodes hold
    classes, _ = decide_classes(inflated, robust=False, max_classes=3)
    assert classes == ("a", "b", "c")


def test_class_votes_refuse_the_minority_kind():
    votes = {0: (0, 1, 2), 1: (0, 1, 2), 2: ("x", "y")}
    classes, refused = decide_classes(votes, robust=False, max_classes=10)
    assert classes == (0, 1, 2) and refused[2] == "labels are strings, the federation's numbers"
