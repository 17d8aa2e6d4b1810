"""The accountant (fmtl_flower.core.privacy) against independent computations."""

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import log_ndtr

from fmtl_flower.core.privacy import (
    GaussianAccountant,
    gaussian_event,
    noise_multiplier_for_epsilon,
    rdp_epsilon,
)

pytest.importorskip("dp_accounting")

DELTA = 1e-5
#: (noise multiplier, releases) of the full-participation checks.
GAUSSIAN_SETTINGS = [(1.0, 1), (1.0, 50), (5.0, 10), (0.7, 3), (20.0, 200)]
#: dp-accounting's default Renyi orders (the accountant minimises over these).
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


def closed_form_rdp_epsilon(z: float, steps: int, delta: float, improved: bool) -> float:
    """Epsilon of ``steps`` Gaussian releases from the closed form of the Gaussian
    mechanism's RDP, alpha / (2 z^2) per release, composed by addition, converted by
    eps = rdp + log(1/delta) / (alpha - 1) (Mironov 2017, Prop. 3) or, ``improved``, by
    eps = rdp + log(1 - 1/alpha) - log(delta alpha) / (alpha - 1) (Canonne, Kamath and
    Steinke 2020, Prop. 12), minimised over the orders."""
    best = math.inf
    for a in ORDERS:
        if a <= 1.01:
            continue
        rdp = steps * a / (2 * z * z)
        if improved:
            eps = rdp + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
        else:
            eps = rdp + math.log(1 / delta) / (a - 1)
        best = min(best, eps)
    return max(best, 0.0)


def exact_gaussian_epsilon(z: float, steps: int, delta: float) -> float:
    """The exact epsilon of the analytic Gaussian mechanism (Balle and Wang 2018, Thm 8):
    ``steps`` releases with noise multiplier z are one Gaussian mechanism with
    mu = sqrt(steps) / z, and delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""
    mu = math.sqrt(steps) / z

    def excess(eps: float) -> float:
        return (math.exp(log_ndtr(mu / 2 - eps / mu))
                - math.exp(eps + log_ndtr(-mu / 2 - eps / mu)) - delta)

    return brentq(excess, 0.0, 1000.0, xtol=1e-12)


@pytest.mark.parametrize(("z", "steps"), GAUSSIAN_SETTINGS)
def test_epsilon_equals_the_closed_form_rdp(z, steps):
    accountant = GaussianAccountant(delta=DELTA)
    for _ in range(steps):
        accountant.compose(z)
    assert accountant.releases == steps
    assert accountant.epsilon() == pytest.approx(
        closed_form_rdp_epsilon(z, steps, DELTA, improved=True), rel=1e-9)


@pytest.mark.parametrize(("z", "steps"), GAUSSIAN_SETTINGS)
def test_epsilon_between_the_exact_and_the_classic_bound(z, steps):
    """A valid accountant is never below the exact epsilon (it would under-report the
    privacy loss) and RDP's slack over it is the usual few tens of percent."""
    eps = rdp_epsilon([(z, 1.0, steps)], DELTA)
    exact = exact_gaussian_epsilon(z, steps, DELTA)
    assert exact <= eps <= closed_form_rdp_epsilon(z, steps, DELTA, improved=False)
    assert eps <= 1.35 * exact


@pytest.mark.parametrize(("z", "q", "steps"),
                         [(1.0, 1.0, 20), (0.8, 0.1, 200), (2.0, 0.01, 1000), (1.2, 0.5, 30)])
def test_rdp_agrees_with_the_pld_accountant(z, q, steps):
    """dp-accounting's PLD accountant is near-exact: RDP is above it, by at most ~30 %."""
    from dp_accounting.pld import pld_privacy_accountant

    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(gaussian_event(z, q, steps))
    pld_eps = pld.get_epsilon(DELTA)
    eps = rdp_epsilon([(z, q, steps)], DELTA)
    assert pld_eps <= eps <= 1.3 * pld_eps


def test_composition_merges_and_is_additive_in_releases():
    one = GaussianAccountant(delta=DELTA)
    one.compose(1.5, steps=40)
    split = GaussianAccountant(delta=DELTA)
    for _ in range(40):
        split.compose(1.5)
    assert split.events == [(1.5, 1.0, 40)]
    assert split.epsilon() == one.epsilon()
    mixed = GaussianAccountant(delta=DELTA)
    mixed.compose(1.5, steps=20)
    mixed.compose(3.0, steps=20)
    assert mixed.epsilon() < one.epsilon()
    assert GaussianAccountant(delta=DELTA).epsilon() == 0.0
    nothing = GaussianAccountant(delta=DELTA)
    nothing.compose(0.0)
    assert nothing.epsilon() == math.inf


def test_state_round_trip_resumes_the_account():
    accountant = GaussianAccountant(delta=1e-6)
    accountant.compose(1.1, steps=7)
    accountant.compose(0.9, 0.25, steps=3)
    resumed = GaussianAccountant.from_state(accountant.state())
    assert resumed == accountant
    resumed.compose(1.1)
    accountant.compose(1.1)
    assert resumed.epsilon() == accountant.epsilon()
    with pytest.raises(ValueError, match="not an accountant state"):
        GaussianAccountant.from_state({"events": []})


@pytest.mark.parametrize(("epsilon", "steps", "q"), [(1.0, 1, 1.0), (8.0, 100, 1.0),
                                                     (2.0, 500, 0.05)])
def test_noise_multiplier_for_epsilon_is_the_smallest_that_fits(epsilon, steps, q):
    z = noise_multiplier_for_epsilon(epsilon, DELTA, steps, q)
    assert rdp_epsilon([(z, q, steps)], DELTA) <= epsilon
    assert rdp_epsilon([(z * (1 - 1e-3), q, steps)], DELTA) > epsilon


def test_the_one_step_noise_multiplier_matches_the_analytic_calibration():
    """One release at epsilon = 1: RDP's noise is above the analytic Gaussian
    mechanism's exact calibration, and within 20 % of it."""
    z = noise_multiplier_for_epsilon(1.0, DELTA, 1)
    exact = brentq(lambda s: exact_gaussian_epsilon(s, 1, DELTA) - 1.0, 0.5, 50.0)
    assert exact <= z <= 1.2 * exact


@pytest.mark.parametrize("bad", [dict(delta=0.0), dict(delta=1.0), dict(delta=float("nan"))])
def test_bad_delta_is_refused(bad):
    with pytest.raises(ValueError, match="delta"):
        GaussianAccountant(**bad)


def test_bad_inputs_are_refused():
    accountant = GaussianAccountant(delta=DELTA)
    with pytest.raises(ValueError, match="noise_multiplier"):
        accountant.compose(-1.0)
    with pytest.raises(ValueError, match="sampling_rate"):
        accountant.compose(1.0, 0.0)
    with pytest.raises(ValueError, match="steps"):
        accountant.compose(1.0, steps=-2)
    with pytest.raises(ValueError, match="epsilon"):
        noise_multiplier_for_epsilon(0.0, DELTA, 10)
    assert noise_multiplier_for_epsilon(np.inf, DELTA, 10) == 0.0


def test_the_privacy_guide_quotes_what_its_figure_script_prints():
    from pathlib import Path

    from fmtl_flower.experiments.privacy_figure import exact_gaussian_epsilon as figure_exact

    guide = (Path(__file__).parents[2] / "docs/guides/privacy.md").read_text()
    guide = " ".join(guide.split())
    rdp, exact = rdp_epsilon([(1.5, 1.0, 500)], DELTA), figure_exact(1.5, 500)
    assert exact == pytest.approx(exact_gaussian_epsilon(1.5, 500, DELTA), rel=1e-9)
    assert (f"z=1.5: epsilon after 500 rounds RDP {rdp:.3g}, exact {exact:.3g} "
            f"(RDP/exact {rdp / exact:.3f})") in guide
    z = noise_multiplier_for_epsilon(8.0, DELTA, 500)
    assert f"epsilon=8.0: noise multiplier for 500 rounds {z:.3g}" in guide


# ------------------------------------------------------------------ several releases a round
@pytest.mark.parametrize(("z", "rounds"), [(1.0, 25), (3.0, 100), (0.8, 5)])
def test_two_releases_a_round_compose_as_twice_the_rounds(z, rounds):
    """FSVRG-naive and DANE release a gradient and a local model each round: a round
    composed as ``compose(z, steps=2)`` (one record's ``dp_releases`` = 2) costs what 2 R
    releases cost, by the closed form of the Gaussian mechanism's RDP and exactly."""
    accountant = GaussianAccountant(delta=DELTA)
    for _ in range(rounds):
        accountant.compose(z, steps=2)
    assert accountant.releases == 2 * rounds and accountant.events == [(z, 1.0, 2 * rounds)]
    eps = accountant.epsilon()
    assert eps == pytest.approx(closed_form_rdp_epsilon(z, 2 * rounds, DELTA, improved=True),
                                rel=1e-9)
    assert exact_gaussian_epsilon(z, 2 * rounds, DELTA) <= eps
    assert eps > rdp_epsilon([(z, 1.0, rounds)], DELTA)  # the second release is not free


def test_a_round_of_two_releases_costs_one_release_at_z_over_sqrt_2():
    """Two Gaussian releases of noise multiplier z compose (by RDP, alpha / (2 z^2) each) as
    one of z / sqrt(2): the identity the per-round accounting must respect."""
    for z in (0.7, 1.5, 4.0):
        assert rdp_epsilon([(z, 1.0, 2)], DELTA) == pytest.approx(
            rdp_epsilon([(z / math.sqrt(2), 1.0, 1)], DELTA), rel=1e-9)


def test_adaptive_clippings_pair_costs_the_single_release_it_replaces():
    """Andrew et al.'s split: the update at z_update and the count (sensitivity 1/2) at
    sigma_b compose, by the Gaussian RDP alpha / (2 z^2) of each, into exactly alpha /
    (2 z^2): the accountant's one release of z per adaptive round."""
    from fmtl_flower.core.privacy import adaptive_noise_params

    for z, k, sigma in [(1.0, 100, None), (0.9, 30, 4.0), (2.5, 1000, None)]:
        count_std, z_update = adaptive_noise_params(z, k, sigma)
        z_count = count_std / 0.5  # the count's noise multiplier: std over sensitivity
        assert 1 / z_update ** 2 + 1 / z_count ** 2 == pytest.approx(1 / z ** 2, rel=1e-12)
