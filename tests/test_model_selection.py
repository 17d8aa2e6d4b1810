"""Cross-validation of lambda on the training data."""

import numpy as np
import pytest

from fmtl_flower.data import make_synthetic_tasks
from fmtl_flower.model_selection import cross_validate_lambda, stratified_folds


def test_stratified_folds_balance_classes():
    y = np.array([1.0] * 7 + [-1.0] * 13)
    folds = stratified_folds(y, 5, np.random.default_rng(0))
    for f in range(5):
        assert abs((folds == f).sum() - 4) <= 1
        assert 1 <= (y[folds == f] == 1).sum() <= 2


def test_cv_picks_a_grid_value_and_reports_scores():
    Xs, ys = make_synthetic_tasks(num_tasks=4, dim=5, samples_per_task=30, seed=0)
    tasks = list(zip(Xs, ys, strict=True))
    grid = (1e-3, 1e-1, 10.0)
    for method, extra in (("local", {}), ("global", {}), ("mtl", {"rounds": 20})):
        best, scores = cross_validate_lambda(method, tasks, grid=grid, seed=1, **extra)
        assert best in grid and set(scores) == set(grid)
        assert scores[best] == min(scores.values())
    with pytest.raises(ValueError, match="method"):
        cross_validate_lambda("svm", tasks)
