"""The estimated-time model (MOCHA appendix E.3, eq. (30))."""

import math

import numpy as np
import pytest

from fmtl_flower.systems.timing import (
    DEFAULT_CLOCK_RATE,
    METHODS,
    NETWORKS,
    REFERENCE_NETWORKS,
    Network,
    get_network,
    local_flops,
    node_times,
    round_time,
    steps_within_deadline,
)


def test_flop_counts_and_eq30():
    assert local_flops([10], 9, "mocha")[0] == 10 * (4 * 9 + 8) + 2 * 9
    assert local_flops([10], 9, "mb-sgd")[0] == 10 * (4 * 9 + 3)
    # CoCoA: 1 + ceil(25 / 10) = 4 gap checks of n (2d + 6)
    assert local_flops([25], 9, "cocoa", n=40, check_every=10)[0] == \
        25 * 44 + 18 + 4 * 40 * 24
    t = node_times([1000], 9, "mocha", "lte")[0]
    lte = NETWORKS["lte"]
    expected = (1000 * 44 + 18) / DEFAULT_CLOCK_RATE + lte.latency_s + 64 * 9 / lte.down_bps \
        + 64 * 9 / lte.up_bps
    assert t == pytest.approx(expected, rel=1e-12)


def test_monotone_in_steps_and_network():
    steps = np.array([0, 10, 100, 10_000, 10**7])
    for method in METHODS:
        kw = {"n": 100} if method == "cocoa" else {}
        for net in ("wifi", "lte", "3g"):
            assert np.all(np.diff(node_times(steps, 50, method, net, **kw)) > 0)
        for model in ("physical", "reference"):
            by_net = [node_times(steps, 50, method, net, model=model, **kw)
                      for net in ("wifi", "lte", "3g")]
            assert np.all(by_net[0] < by_net[1]) and np.all(by_net[1] < by_net[2])
    # larger payloads cost more
    assert node_times([5], 1000, "mocha", "3g")[0] > node_times([5], 10, "mocha", "3g")[0]


def test_reference_networks_scale_like_the_paper():
    comm = [REFERENCE_NETWORKS[k].comm_time(100, 100) * DEFAULT_CLOCK_RATE
            for k in ("wifi", "lte", "3g")]
    np.testing.assert_allclose(comm, [10, 100, 1000])


def test_slowest_node_sets_the_round():
    steps = np.array([100, 5000, 300])
    times = node_times(steps, 20, "mocha", "lte")
    assert round_time(steps, 20, "mocha", "lte") == times.max() == times[1]
    part = np.array([True, False, True])
    assert round_time(steps, 20, "mocha", "lte", participating=part) == times[2]
    assert round_time(steps, 20, "mocha", "lte", participating=np.zeros(3, bool)) == 0.0
    assert round_time(steps, 20, "mocha", "lte", participating=np.zeros(3, bool),
                      clock_cycle=1.0) == 0.0
    # a deadline closes the round early, but never later than the last reply
    assert round_time(steps, 20, "mocha", "lte", clock_cycle=times[0]) == times[0]
    assert round_time(steps, 20, "mocha", "lte", clock_cycle=10.0) == times.max()
    # heterogeneous devices and links
    slow = round_time(steps, 20, "mocha", ["wifi", "wifi", "3g"],
                      clock_rate=np.array([1e9, 1e9, 1e6]))
    assert slow == node_times([300], 20, "mocha", "3g", clock_rate=1e6)[0]


@pytest.mark.parametrize("method", METHODS)
def test_deadline_caps_steps(method):
    kw = {"n": np.array([50, 80, 120, 60])} if method == "cocoa" else {}
    rates = np.array([1e9, 2e8, 5e7, 1e7])
    d, net, cycle = 30, "lte", 0.075
    caps = steps_within_deadline(cycle, d, method, net, clock_rate=rates, **kw)
    assert caps.dtype == np.int64 and np.all(caps > 0)
    assert np.all(np.diff(caps) < 0)  # slower devices do less
    # the capped work fits the deadline; for the exact models one more step would not
    fits = node_times(caps, d, method, net, clock_rate=rates, **kw)
    assert np.all(fits <= cycle)
    assert round_time(caps, d, method, net, clock_rate=rates, clock_cycle=cycle, **kw) <= cycle
    if method != "cocoa":
        assert np.all(node_times(caps + 1, d, method, net, clock_rate=rates) > cycle)
    budgets = np.array([10, 10**9, 10**9, 3])
    capped = steps_within_deadline(cycle, d, method, net, clock_rate=rates, budgets=budgets,
                                   **kw)
    np.testing.assert_array_equal(capped, np.minimum(caps, budgets))


def test_deadline_shorter_than_communication_gives_zero():
    caps = steps_within_deadline(0.05, 10, "mocha", ["wifi", "lte", "3g"])
    assert caps[0] > 0 and caps[1] == 0 and caps[2] == 0


def test_errors():
    with pytest.raises(ValueError, match="network"):
        get_network("5g")
    with pytest.raises(ValueError, match="model"):
        get_network("lte", model="simulated")
    custom = Network("lab", 0.001, math.inf, 1e9)
    assert get_network(custom) is custom
    with pytest.raises(ValueError, match="latency_s"):
        Network("bad", -1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="up_bps"):
        Network("bad", 0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="method"):
        node_times([1], 5, "sgd", "lte")
    with pytest.raises(ValueError, match="cocoa"):
        node_times([1], 5, "cocoa", "lte")
    with pytest.raises(ValueError, match="steps"):
        node_times([-1], 5, "mocha", "lte")
    with pytest.raises(ValueError, match="dim"):
        node_times([1], 0, "mocha", "lte")
    with pytest.raises(ValueError, match="clock_rate"):
        node_times([1], 5, "mocha", "lte", clock_rate=0.0)
    with pytest.raises(ValueError, match="clock_cycle"):
        round_time([1], 5, "mocha", "lte", clock_cycle=0.0)
    with pytest.raises(ValueError, match="network must be one network or 2"):
        node_times([1, 2], 5, "mocha", ["lte"] * 3)
    with pytest.raises(ValueError, match="num_nodes"):
        steps_within_deadline(1.0, 5, "mocha", "lte")
    with pytest.raises(ValueError, match="budgets"):
        steps_within_deadline(1.0, 5, "mocha", "lte", budgets=np.array([-1, 2]))


def test_steps_within_deadline_takes_node_times_options():
    """Its per-node options are node_times's keyword arguments, with their defaults."""
    rates = np.array([1e6, 2e6])
    explicit = steps_within_deadline(0.5, 20, "cocoa", "lte", clock_rate=rates, n=[40, 50],
                                     check_every=None, floats_down=20, floats_up=20,
                                     bytes_per_float=8, model="physical")
    np.testing.assert_array_equal(
        explicit, steps_within_deadline(0.5, 20, "cocoa", "lte", clock_rate=rates, n=[40, 50]))
    fits = node_times(explicit, 20, "cocoa", "lte", clock_rate=rates, n=[40, 50])
    assert np.all(fits <= 0.5)
    with pytest.raises(TypeError, match="steps_within_deadline.*'clock_rates'"):
        steps_within_deadline(0.5, 20, "mocha", "lte", clock_rates=rates)
