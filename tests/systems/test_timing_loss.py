"""The time model takes the run's loss: its coordinate step's FLOPs (``Loss.step_flops``).

The hinge's numbers are the method-keyed table's of before, bit for bit (the constants are
written out here, not read from the module); another loss changes only ``b``."""

import numpy as np
import pytest

from fmtl_flower.core.losses import LOSSES
from fmtl_flower.systems.timing import (
    deadline_budgets,
    local_flops,
    node_times,
    per_step_flops,
    round_time,
    steps_within_deadline,
)

#: The table before the time model took a loss: method -> (a, b, c), FLOPs a d + b per step
#: and c d per round.
OLD_FLOP_COUNTS = {"mocha": (4, 8, 2), "cocoa": (4, 8, 2), "mb-sdca": (4, 8, 1),
                   "mb-sgd": (4, 3, 0)}
STEPS = np.array([0, 1, 17, 250, 4096])
DIM = 13
DEADLINE = 0.0202  # wifi: 20 ms latency + 0.125 ms for d = 13 down and up, then ~75 kFLOP


def flops_within_deadline(c):
    """The FLOPs left for local steps at DEADLINE on wifi (1e9 FLOP/s), per-round c d paid."""
    return (DEADLINE - 0.020 - 64.0 * DIM / 20e6 - 64.0 * DIM / 10e6) * 1e9 - c * DIM


@pytest.mark.parametrize("method", list(OLD_FLOP_COUNTS))
def test_the_hinge_is_timed_as_the_old_table_bit_for_bit(method):
    a, b, c = OLD_FLOP_COUNTS[method]
    n = np.full(STEPS.size, 300) if method == "cocoa" else None
    default = local_flops(STEPS, DIM, method, n=n)
    for hinge in ("hinge", LOSSES["hinge"]):
        assert per_step_flops(method, hinge) == (a, b, c)
        np.testing.assert_array_equal(local_flops(STEPS, DIM, method, n=n, loss=hinge),
                                      default)
    expected = STEPS * float(a * DIM + b) + c * DIM
    if method == "cocoa":
        expected = expected + (1.0 + np.ceil(STEPS / 300)) * 300 * (2 * DIM + 6)
    np.testing.assert_array_equal(default, expected)
    caps = steps_within_deadline(DEADLINE, DIM, method, "wifi", num_nodes=STEPS.size, n=n)
    np.testing.assert_array_equal(
        steps_within_deadline(DEADLINE, DIM, method, "wifi", num_nodes=STEPS.size, n=n,
                              loss="hinge"), caps)
    if method != "cocoa":  # the cap's closed form without gap checks
        np.testing.assert_array_equal(
            caps, np.floor(flops_within_deadline(c) / float(a * DIM + b)))
        assert caps[0] > 100


@pytest.mark.parametrize("method", ["mocha", "cocoa", "mb-sdca"])
@pytest.mark.parametrize("name", ["smoothed-hinge", "logistic", "squared"])
def test_a_coordinate_step_costs_its_losss_step_flops(method, name):
    a, _, c = OLD_FLOP_COUNTS[method]
    b = LOSSES[name].step_flops
    n = np.full(STEPS.size, 300) if method == "cocoa" else None
    flops = local_flops(STEPS, DIM, method, n=n, loss=name)
    hinge = local_flops(STEPS, DIM, method, n=n)
    np.testing.assert_array_equal(flops - hinge, STEPS * float(b - 8))
    assert per_step_flops(method, name) == (a, b, c)
    times = node_times(STEPS, DIM, method, "lte", n=n, loss=name)
    np.testing.assert_allclose(times - node_times(STEPS, DIM, method, "lte", n=n),
                               STEPS * (b - 8) / 1e9, rtol=1e-9, atol=1e-15)
    assert round_time(STEPS, DIM, method, "lte", n=n, loss=name) == times.max()


def test_the_logistic_step_costs_its_newton_solve_and_a_deadline_cuts_it_more():
    """~15 safeguarded Newton iterations of ~48 FLOPs: about 90 hinge steps' scalar work, so
    the same deadline allows fewer logistic steps (and as many for the closed-form losses)."""
    assert 600 <= LOSSES["logistic"].step_flops <= 900
    for name in ("hinge", "smoothed-hinge", "squared"):
        assert LOSSES[name].step_flops == 8
    budgets = np.array([5000, 5000])
    hinge = deadline_budgets(budgets, DEADLINE, DIM, "mocha", "wifi")
    logistic = deadline_budgets(budgets, DEADLINE, DIM, "mocha", "wifi", loss="logistic")
    assert 0 < logistic[0] < hinge[0] < 5000
    b = LOSSES["logistic"].step_flops
    assert logistic[0] == np.floor(flops_within_deadline(2) / (4 * DIM + b))


@pytest.mark.parametrize("name", ["smoothed-hinge", "logistic", "squared"])
def test_a_sampled_point_of_mb_sgd_costs_its_losss_gradient_flops(name):
    b = LOSSES[name].gradient_flops
    assert per_step_flops("mb-sgd", name) == (4, b, 0)
    np.testing.assert_array_equal(local_flops(STEPS, DIM, "mb-sgd", loss=name),
                                  STEPS * float(4 * DIM + b))
    assert {n: loss.gradient_flops for n, loss in LOSSES.items()} == {
        "hinge": 3, "smoothed-hinge": 5, "logistic": 25, "squared": 2}


def test_unknown_losses_are_refused():
    with pytest.raises(ValueError, match="loss must be one of"):
        node_times(STEPS, DIM, "mocha", "lte", loss="no-such-loss")
