"""AsyncMOCHA's virtual-clock settings (latency persistence, offline windows) and its
sigma' rule over Flower's Message API: the run-config keys reach the strategy, and the
in-process run equals the Flower-free core's for the same seed and clock."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.clients.async_mocha import make_async_mocha_client_app
from fmtl_flower.core.async_mocha import Availability, simulate_async_mocha
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.settings import ConfigError, MOCHASettings
from fmtl_flower.strategies.async_mocha import AsyncMOCHA
from fmtl_flower.systems.timing import node_times

from .helpers import make_problem

CLOCK = {"mocha.latency-sigma": 1.0,
         "mocha.latency-persistence": 0.5, "mocha.offline-fraction": 0.3,
         "mocha.offline-mean-s": 0.2, "mocha.sigma-prime-rule": "synchronous"}


def test_the_run_config_keys_reach_the_strategy():
    strategy = AsyncMOCHA.from_settings(MOCHASettings.from_run_config(CLOCK))
    assert strategy.latency_persistence == 0.5
    assert strategy.availability == Availability(0.3, 0.2)
    assert strategy.sigma_prime_rule == "synchronous"
    default = AsyncMOCHA.from_settings(MOCHASettings.from_run_config({}))
    assert (default.latency_persistence, default.availability,
            default.sigma_prime_rule) == (0.0, None, "stale-safe")


@pytest.mark.parametrize("key, value", [("mocha.latency-persistence", 1.5),
                                        ("mocha.offline-fraction", 1.0),
                                        ("mocha.offline-mean-s", 0.0),
                                        ("mocha.sigma-prime-rule", "tiny")])
def test_bad_clock_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[1]):
        MOCHASettings.from_run_config({**CLOCK, key: value})


def test_inprocess_run_with_the_clock_settings_equals_the_core():
    problem = make_problem(num_tasks=6, dim=5, samples_per_task=30)
    knobs = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01}, concurrency=4,
                 tau=5, latency_sigma=1.0, seed=3, latency_persistence=0.5,
                 sigma_prime_rule="synchronous")
    grid = InProcessGrid(make_async_mocha_client_app(problem.load), problem.num_tasks)
    strategy = AsyncMOCHA(**knobs, offline_fraction=0.3, offline_mean_s=0.2)
    strategy.start(grid, num_rounds=6)
    n = np.array([len(y) for y in problem.ys])
    core = simulate_async_mocha(problem.train(), node_times(n, problem.dim, "mocha", "lte"),
                                replies=6 * problem.num_tasks,
                                availability=Availability(0.3, 0.2), **knobs)
    assert strategy.run.records == core.records
    assert core.server.counts["expired"] > 0  # the windows did cut replies
    assert np.all(core.server.sigma_prime == core.server.state.sigma_prime("global"))
