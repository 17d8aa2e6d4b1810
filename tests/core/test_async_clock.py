"""Barrier-free MOCHA's virtual clock (:mod:`fmtl_flower.core.async_mocha`): the latency
model's persistent per-device share (``latency-persistence``) and the devices' availability
windows, for the asynchronous protocol and the synchronous baseline alike."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fmtl_flower.core.async_mocha import (
    APPLIED,
    AsyncDevice,
    AsyncMOCHAServer,
    Availability,
    EventLoop,
    ReplyBounds,
    Run,
    latency_factor,
    simulate_async_mocha,
    simulate_sync_mocha,
    sync_round_plan,
)
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.mocha import MOCHAServerState
from fmtl_flower.core.rng import TAG_LATENCY


def _tasks(m: int = 6, d: int = 4, seed: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(m):
        n = 10 + 3 * t
        X = rng.standard_normal((n, d))
        y = np.where(X @ rng.standard_normal(d) >= 0, 1.0, -1.0)
        out.append((X, y))
    return out


# ----------------------------------------------------------------------------- latency


def test_persistence_zero_is_the_per_request_model():
    """p = 0 keeps the first model bit for bit: exp(sigma z), z of ``[seed, t, k, tag]``."""
    for task, request in ((0, 1), (3, 7), (11, 250)):
        z = np.random.default_rng([4, task, request, TAG_LATENCY]).standard_normal()
        assert latency_factor(4, task, request, 0.8, 0.0) == math.exp(0.8 * z)


def test_full_persistence_gives_each_device_one_factor():
    factors = np.array([[latency_factor(2, t, k, 1.0, 1.0) for k in range(1, 6)]
                        for t in range(40)])
    assert np.all(factors == factors[:, :1])  # the same on every request of a device
    assert len(np.unique(factors[:, 0])) == 40  # and different between devices


def test_every_persistence_keeps_the_law_of_one_request():
    """log factor ~ N(0, sigma^2) for every p; the correlation of two requests of one device
    is p (2000 devices x 2 requests: the estimates are within 0.07 of their values)."""
    sigma = 1.3
    for p in (0.0, 0.5, 1.0):
        logs = np.log([[latency_factor(9, t, k, sigma, p) for k in (1, 2)]
                       for t in range(2000)])
        assert abs(logs.mean()) < 0.07 * sigma
        assert logs.std() == pytest.approx(sigma, rel=0.05)
        assert np.corrcoef(logs[:, 0], logs[:, 1])[0, 1] == pytest.approx(p, abs=0.07)


@pytest.mark.parametrize("persistence", [-0.1, 1.01, math.nan])
def test_persistence_outside_the_unit_interval_is_refused(persistence):
    with pytest.raises(ValueError, match="latency-persistence"):
        latency_factor(0, 0, 1, 1.0, persistence)
    with pytest.raises(ValueError, match="latency-persistence"):
        simulate_async_mocha(_tasks(2), np.full(2, 1.0), replies=2,
                             latency_persistence=persistence)


def test_a_persistent_slow_device_is_slow_in_both_protocols():
    """p = 1: the device with the largest factor needs the longest for every request, and
    synchronous rounds without a deadline last exactly as long as that device's request."""
    m, sigma = 5, 1.0
    factors = np.array([latency_factor(1, t, 1, sigma, 1.0) for t in range(m)])
    tasks = _tasks(m)
    sync = simulate_sync_mocha(tasks, np.ones(m), np.full(m, 0.5), rounds=3,
                               latency_sigma=sigma, latency_persistence=1.0, seed=1)
    assert [r["time_s"] for r in sync.records] == pytest.approx(
        [k * factors.max() for k in (1, 2, 3)], rel=1e-12)
    run = simulate_async_mocha(tasks, np.ones(m), replies=3 * m, latency_sigma=sigma,
                               latency_persistence=1.0, seed=1)
    for t in range(m):
        times = [r["time_s"] for r in run.records if r["task"] == t]
        assert np.diff([0.0] + times) == pytest.approx(factors[t], rel=1e-12)


# ----------------------------------------------------------------------------- availability


@pytest.mark.parametrize("fraction, mean", [(-0.1, 1.0), (1.0, 1.0), (0.2, 0.0),
                                            (0.2, math.inf), (0.2, -1.0)])
def test_bad_availability_is_refused(fraction, mean):
    with pytest.raises(ValueError, match="availability"):
        Availability(fraction, mean)


def test_the_windows_do_not_depend_on_the_order_of_the_questions():
    times = np.linspace(0.0, 50.0, 201)
    a = Availability(0.3, 2.0).schedule(7, 4)
    forward = [[a.online_until(t, s) for s in times] for t in range(4)]
    b = Availability(0.3, 2.0).schedule(7, 4)
    backward = [[b.online_until(t, s) for s in times[::-1]][::-1] for t in reversed(range(4))]
    assert forward == backward[::-1]
    c = Availability(0.3, 2.0).schedule(8, 4)
    assert forward != [[c.online_until(t, s) for s in times] for t in range(4)]


def test_the_windows_have_the_asked_offline_share_and_duration():
    """Over a long horizon (5000 mean offline durations per device, 20 devices) the share of
    time offline and the mean offline window are within 5% of the asked values."""
    fraction, mean, horizon = 0.25, 3.0, 15000.0
    schedule = Availability(fraction, mean).schedule(3, 20)
    offline, windows, now = 0.0, [], 0.0
    for t in range(20):
        now = 0.0
        while now < horizon:
            until = schedule.online_until(t, now)
            if until is None:  # offline: until the next online time
                back = schedule.next_online(t, now)
                windows.append(back - now)
                offline += min(back, horizon) - now
                now = back
            else:
                now = until
    assert offline / (20 * horizon) == pytest.approx(fraction, rel=0.05)
    assert np.mean(windows[20:]) == pytest.approx(mean, rel=0.05)


def test_zero_offline_fraction_changes_nothing():
    tasks, m = _tasks(), 6
    seconds = np.linspace(1.0, 2.0, m)
    kw = dict(lam=0.1, latency_sigma=0.7, seed=3)
    base = simulate_async_mocha(tasks, seconds, replies=8 * m, **kw)
    same = simulate_async_mocha(tasks, seconds, replies=8 * m, availability=Availability(
        0.0, 1.0), **kw)
    assert base.records == same.records
    base = simulate_sync_mocha(tasks, seconds, 0.5 * seconds, rounds=8, deadline=1.5, **kw)
    same = simulate_sync_mocha(tasks, seconds, 0.5 * seconds, rounds=8, deadline=1.5,
                               availability=Availability(0.0, 1.0), **kw)
    assert base.records == same.records


def _loop_with_log(tasks, seconds, availability, seed):
    """An EventLoop over directly called devices that logs (task, send time) of every
    request and the requests whose replies it delivered."""
    m = len(tasks)
    state = MOCHAServerState.zeros(tasks[0][0].shape[1], make_formulation(
        "identity", m, lam=0.1))
    server = AsyncMOCHAServer(state, np.array([X.shape[0] for X, _ in tasks]), concurrency=m,
                              seed=seed, bounds=ReplyBounds.of_tasks(tasks))
    devices = [AsyncDevice(t, X, y) for t, (X, y) in enumerate(tasks)]
    sent: list[tuple[int, float]] = []
    holder: dict[str, EventLoop] = {}

    def transport(request):
        sent.append((request.task, holder["loop"].clock.now))
        return [devices[request.task].handle(request)]

    loop = EventLoop(Run(server, devices), seconds, transport, latency_sigma=0.5, seed=seed,
                     availability=availability)
    holder["loop"] = loop
    return loop, sent


def test_an_offline_device_gets_no_work_and_loses_the_reply_it_owes():
    tasks, m = _tasks(), 6
    seconds = np.full(m, 1.0)
    availability = Availability(0.4, 3.0)
    loop, sent = _loop_with_log(tasks, seconds, availability, seed=2)
    run = loop.run(20 * m)
    schedule = availability.schedule(2, m)  # the same windows, drawn again
    assert sent and all(schedule.online_until(t, s) is not None for t, s in sent)
    # some devices went offline during the run, and their replies in progress were lost
    assert any(schedule.online_until(t, s) is None for t in range(m)
               for s in np.linspace(0.0, loop.clock.now, 400))
    assert run.server.counts["expired"] > 0
    for r in run.records:  # every applied reply came before its device went offline
        if r["status"] == APPLIED:
            assert schedule.online_until(r["task"], r["time_s"] - 1e-9) is not None
    duals = np.array([r["dual"] for r in run.records])
    assert np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max())


def test_the_synchronous_round_trains_only_the_devices_online_at_its_start():
    m = 8
    availability = Availability(0.5, 2.0)
    schedule = availability.schedule(4, m)
    budgets, seconds = np.full(m, 10), np.full(m, 1.0)
    for start in np.linspace(0.0, 30.0, 31):
        until = [schedule.online_until(t, start) for t in range(m)]
        steps, longest = sync_round_plan(budgets, seconds, 0.5 * seconds, None, start,
                                         schedule)
        for t in range(m):
            if until[t] is None or until[t] < start + 1.0:  # offline, or gone before replying
                assert steps[t] == 0
            else:
                assert steps[t] == 10
        online = [u for u in until if u is not None]
        # the round waits for the replies it gets, or for a disconnect, never for an offline
        # device
        expected = max((min(1.0, u - start) for u in online), default=0.0)
        assert longest == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("protocol", ["async", "sync"])
def test_runs_with_availability_are_reproducible_by_seed(protocol):
    tasks, m = _tasks(), 6
    seconds = np.linspace(1.0, 1.5, m)

    def run(seed):
        kw = dict(lam=0.1, latency_sigma=0.5, latency_persistence=0.5, seed=seed,
                  availability=Availability(0.3, 2.0))
        if protocol == "async":
            return simulate_async_mocha(tasks, seconds, replies=10 * m, **kw)
        return simulate_sync_mocha(tasks, seconds, 0.5 * seconds, rounds=10, deadline=1.6,
                                   **kw)

    first, again, other = run(1), run(1), run(2)
    assert first.records == again.records
    assert first.virtual_time_s == again.virtual_time_s
    assert first.records != other.records
    no_windows = (simulate_async_mocha(tasks, seconds, replies=10 * m, lam=0.1,
                                       latency_sigma=0.5, latency_persistence=0.5, seed=1)
                  if protocol == "async" else
                  simulate_sync_mocha(tasks, seconds, 0.5 * seconds, rounds=10, deadline=1.6,
                                      lam=0.1, latency_sigma=0.5, latency_persistence=0.5,
                                      seed=1))
    assert first.records != no_windows.records  # the windows matter
    if protocol == "async":  # and cost time (a synchronous round lasts its deadline anyway)
        assert first.virtual_time_s > no_windows.virtual_time_s


# ----------------------------------------------------------------------------- sigma' rule


def test_the_synchronous_sigma_prime_rule_needs_the_safeguard():
    state = MOCHAServerState.zeros(4, make_formulation("mean", 3, lam=0.1, lam2=0.1))
    with pytest.raises(ValueError, match="sigma-prime-rule"):
        AsyncMOCHAServer(state, np.full(3, 5), concurrency=3, sigma_prime_rule="smaller")
    with pytest.raises(ValueError, match="needs the safeguard"):
        AsyncMOCHAServer(state, np.full(3, 5), concurrency=3, safeguard=False,
                         sigma_prime_rule="synchronous")


def test_the_synchronous_sigma_prime_rule_keeps_the_dual_monotone_with_stale_replies():
    """Coupled tasks, every task in flight, heterogeneous persistent delays (stale replies
    of the slow devices): Lemma 9's sigma', below the stale-safe one, and the safeguard
    keeps every step's dual change >= 0; the certified gap stays >= 0."""
    tasks, m = _tasks(), 6
    kw = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.05}, replies=40 * m,
              latency_sigma=1.0, latency_persistence=1.0, seed=3, tau=4 * m)
    run = simulate_async_mocha(tasks, np.full(m, 1.0), sigma_prime_rule="synchronous", **kw)
    safe = simulate_async_mocha(tasks, np.full(m, 1.0), **kw)
    assert np.all(run.server.sigma_prime == run.server.state.sigma_prime("global"))
    assert np.all(run.server.sigma_prime < safe.server.sigma_prime)
    assert max(r["staleness"] for r in run.records) > 0
    duals = np.array([r["dual"] for r in run.records])
    assert np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max())
    assert all(r["gap"] >= -1e-12 for r in run.records if r["gap"] is not None)
