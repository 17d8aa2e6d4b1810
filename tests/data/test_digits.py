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
