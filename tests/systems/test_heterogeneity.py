"""Local budgets and drop-outs."""

import numpy as np
import pytest

from fmtl_flower.systems import drop_mask, local_budgets


def test_budgets_none_low_high():
    n = np.array([40, 60, 100, 50])
    np.testing.assert_array_equal(local_budgets(n, local_frac=0.5), [20, 30, 50, 25])
    for level, lo in (("low", 0.9), ("high", 0.1)):
        draws = np.concatenate([local_budgets(n, sys_het=level, seed=1, server_round=r)
                                for r in range(1, 200)])
        assert draws.min() >= np.floor(lo * 40) and draws.max() <= 40
        own = np.stack([local_budgets(n, sys_het=level, base="n_t", seed=1, server_round=r)
                        for r in range(1, 200)])
        assert np.all(own <= n) and np.all(own >= np.floor(lo * n))
    assert local_budgets(n, sys_het="high", seed=1, server_round=3).tolist() == \
        local_budgets(n, sys_het="high", seed=1, server_round=3).tolist()
    assert local_budgets(np.array([1]), local_frac=0.01).tolist() == [1]  # at least one step


def test_drop_mask_rate_and_determinism():
    masks = np.stack([drop_mask(50, 0.3, seed=2, server_round=r) for r in range(1, 101)])
    assert abs(masks.mean() - 0.3) < 0.03
    np.testing.assert_array_equal(masks[0], drop_mask(50, 0.3, seed=2, server_round=1))
    assert not drop_mask(10, 0.0, seed=0, server_round=1).any()


@pytest.mark.parametrize("kwargs, match", [
    ({"sys_het": "medium"}, "sys-het"), ({"base": "n_max"}, "sys-het-base"),
    ({"local_frac": 0.0}, "local-frac")])
def test_budget_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        local_budgets(np.array([10]), **kwargs)


def test_drop_errors():
    with pytest.raises(ValueError, match="drop-prob"):
        drop_mask(3, 1.0, seed=0, server_round=1)
