"""MOCHA under record-level DP: the server's account of the noise in B (the per-coordinate
variance accumulated in every b_t) and the Omega-step that discounts it
(``dp.omega-debias``)."""
# ruff: noqa: F811 (the tests take the fixtures imported from test_mocha_record_dp)

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.record_dp import record_contribution
from fmtl_flower.engine import FIRST_NODE_ID
from fmtl_flower.settings import ConfigError, DPSettings

from .helpers import TracingMOCHA, fault_at
from .test_mocha_record_dp import (  # noqa: F401 (the fixtures problem, _quiet_flower)
    ROUNDS,
    SETTINGS,
    _private,
    _quiet_flower,
    _run,
    capturing_sent,
    problem,
)


def test_the_noise_variance_in_b_is_the_accepted_releases_variances(problem):
    """After a run with noise multiplier z, the server's ``noise_var[t]`` is the sum over
    the rounds it accepted task t's reply of (z 2 c / n_t)^2, c the step-bounded contribution
    at the |w_t|, m_tt, sigma' and budget the device was sent (read from the messages);
    task 2's rejected rounds 2 and 3 add nothing."""
    z, clip = 0.7, 0.72
    strategy = _private(TracingMOCHA(problem.num_tasks, **SETTINGS), clip=clip,
                        noise_multiplier=z)
    sent: dict[tuple[int, int], tuple] = {}
    capture = capturing_sent(sent)
    _run(problem, strategy, wrap=lambda app: capture(fault_at("nan", FIRST_NODE_ID + 2, {2, 3})(
        app)))
    for t in range(problem.num_tasks):
        n = problem.Xs[t].shape[0]
        accepted = [r for r in range(1, ROUNDS + 1) if strategy.trace[r]["last_after"][t] == r]
        assert (t != 2) or accepted == [1, 4, 5, 6]
        expected = 0.0
        for r in accepted:
            w_norm, m_tt, sigma_p, budget = sent[(t, r)]
            c = record_contribution(clip, n, 1.0, sigma_p * m_tt * min(budget, n), w_norm)
            expected += (z * 2 * c / n) ** 2
        assert strategy.privacy.noise_var[t] == pytest.approx(expected, rel=1e-12)


def test_the_debiased_omega_step_learns_a_different_sigma_and_keeps_w_consistent(problem):
    """The same noise draws (seeded) with and without ``dp.omega-debias``: the first round
    (before any Omega-step) is the same, the learned Sigma differs after the first
    Omega-step, and W = B M holds at the end."""
    sigmas = []
    for debias in (False, True):
        strategy = _private(TracingMOCHA(problem.num_tasks, **SETTINGS), clip=0.72,
                            noise_multiplier=0.7, omega_debias=debias)
        _run(problem, strategy)
        np.testing.assert_allclose(strategy.state.W, strategy.state.B @ strategy.state.M,
                                   atol=1e-12)
        sigmas.append(strategy.state.formulation.omega)
    assert np.abs(sigmas[0] - sigmas[1]).max() > 1e-3


def test_omega_debias_is_refused_outside_record_level_dp():
    with pytest.raises(ConfigError, match="omega-debias"):
        DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0, omega_debias=True)
    with pytest.raises(ConfigError, match="omega-debias"):
        DPSettings(omega_debias=True)
