"""``"digits-dirichlet"``: scikit-learn's digits split among devices by label skew."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.data import load_dataset
from fmtl_flower.data.digits import load_digits_arrays, make_digits_dirichlet


def test_the_split_partitions_the_digits_with_label_skew():
    X, y = load_digits_arrays()
    dataset = load_dataset("digits-dirichlet")
    assert dataset.name == "digits-dirichlet" and len(dataset.tasks) == 10
    sizes = [t.X_train.shape[0] + t.X_test.shape[0] for t in dataset.tasks]
    assert sum(sizes) == len(y) and min(sizes) >= 20
    labels = np.concatenate([np.concatenate([t.y_train, t.y_test]) for t in dataset.tasks])
    np.testing.assert_array_equal(np.bincount(labels.astype(int)), np.bincount(y))
    assert all(t.X_train.shape[1] == 64 and 0 <= t.X_train.min() and t.X_train.max() <= 1
               for t in dataset.tasks)
    # label skew: most devices lack some class, the largest class share is far above 1/10
    shares = [np.bincount(t.y_train.astype(int), minlength=10) / t.y_train.size
              for t in dataset.tasks]
    assert np.mean([s.max() for s in shares]) > 0.25


def test_the_split_is_seeded_and_checked():
    a, b = make_digits_dirichlet(seed=3), make_digits_dirichlet(seed=3)
    assert all(np.array_equal(s.X_train, t.X_train) for s, t in zip(a.tasks, b.tasks,
                                                                      strict=True))
    other = make_digits_dirichlet(seed=4)
    assert not np.array_equal(a.tasks[0].y_train, other.tasks[0].y_train)
    assert len(load_dataset("digits-dirichlet", num_tasks=4).tasks) == 4
    with pytest.raises(ValueError, match="dim cannot be used with 'digits-dirichlet'"):
        load_dataset("digits-dirichlet", dim=5)
    with pytest.raises(ValueError, match="num_tasks must be"):
        make_digits_dirichlet(num_tasks=500)


def test_the_validation_split_cuts_the_training_data_only():
    from fmtl_flower.data.digits import validation_split

    data = make_digits_dirichlet(seed=1)
    held = validation_split(data, 0.2, seed=1)
    assert held.name == "digits-dirichlet-validation" and len(held.tasks) == len(data.tasks)
    for task, part in zip(data.tasks, held.tasks, strict=True):
        rows = np.concatenate([part.X_train, part.X_test])
        labels = np.concatenate([part.y_train, part.y_test])
        order = np.lexsort(rows.T)
        expected = np.lexsort(task.X_train.T)  # a partition of the training rows
        np.testing.assert_array_equal(rows[order], task.X_train[expected])
        np.testing.assert_array_equal(labels[order], task.y_train[expected])
        for c in np.unique(task.y_train):  # stratified: round(0.2 n_c) of each class held out
            n_c = int(np.count_nonzero(task.y_train == c))
            assert np.count_nonzero(part.y_test == c) == max(0, min(round(0.2 * n_c), n_c - 1))
    again = validation_split(data, 0.2, seed=1)
    assert all(np.array_equal(a.y_test, b.y_test) for a, b in zip(held.tasks, again.tasks,
                                                                  strict=True))
    with pytest.raises(ValueError, match="val_frac must be in"):
        validation_split(data, 0.0)
