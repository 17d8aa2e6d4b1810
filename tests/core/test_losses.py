"""The loss registry (fmtl_flower.core.losses): Fenchel-Young, the exact coordinate step,
conjugates, and the scalar kernels against the vectorised values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from fmtl_flower.core.losses import (
    LOSS_BY_CODE,
    LOSSES,
    coordinate_step,
    dual_value,
    get_loss,
    loss_value,
)
from fmtl_flower.settings import LOSS_NAMES

NAMES = list(LOSSES)
margins = st.floats(-30.0, 30.0, allow_nan=False)
curvatures = st.floats(1e-6, 1e4, allow_nan=False)


def duals_of(name: str):
    """A point of the loss's dual domain (the squared loss's is R: a wide range of it)."""
    lo, hi = LOSSES[name].dual_domain
    return st.floats(max(lo, -20.0), min(hi, 20.0), allow_nan=False)


def independent_loss(name: str, z: float) -> float:
    """l(z) written out again, apart from the module under test."""
    if name == "hinge":
        return max(0.0, 1.0 - z)
    if name == "smoothed-hinge":
        return 0.0 if z >= 1 else (0.5 - z if z <= 0 else 0.5 * (1 - z) ** 2)
    if name == "logistic":
        return float(np.logaddexp(0.0, -z))
    return 0.5 * (1.0 - z) ** 2


@st.composite
def loss_and_dual(draw):
    name = draw(st.sampled_from(NAMES))
    return name, draw(duals_of(name))


def test_registry_is_the_settings_list_and_codes_are_distinct():
    assert tuple(LOSSES) == LOSS_NAMES  # settings.py names them without importing numerics
    assert len({loss.code for loss in LOSSES.values()}) == len(LOSSES)
    assert all(LOSS_BY_CODE[loss.code] is loss for loss in LOSSES.values())
    with pytest.raises(ValueError, match="hinge, smoothed-hinge, logistic, squared"):
        get_loss("cubic")


@settings(max_examples=300, deadline=None)
@given(loss_and_dual(), margins)
def test_fenchel_young_inequality(pair, z):
    """l(z) + l*(-a) >= -a z for every margin z and every a in the dual domain."""
    name, a = pair
    loss = LOSSES[name]
    lz = float(loss.value(np.array([z]))[0])
    conj = float(loss.conjugate(np.array([-a]))[0])
    assert lz + conj >= -a * z - 1e-12 * (1 + abs(lz) + abs(conj) + abs(a * z))
    assert lz == pytest.approx(independent_loss(name, z), rel=1e-12, abs=1e-300)


@settings(max_examples=300, deadline=None)
@given(loss_and_dual(), margins, curvatures)
def test_coordinate_step_is_the_exact_maximiser_with_fenchel_young_equality(pair, z, q):
    """The step maximises f(a) = D(a) - z (a - a_old) - (q/2)(a - a_old)^2 over the domain, and
    at the maximiser the moved margin z' = z + q (a* - a_old) and a* are a Fenchel-Young pair:
    l(z') - D(a*) + a* z' = 0 (the local optimality SDCA reaches per coordinate)."""
    name, a_old = pair
    loss = LOSSES[name]
    a_new = loss.sdca_step(a_old, z, q)
    assert loss.feasible_mask(np.array([a_new]))[0]

    def f(a):
        return float(loss.dual(np.array([a]))[0]) - z * (a - a_old) - 0.5 * q * (a - a_old) ** 2

    best = f(a_new)
    lo, hi = loss.dual_domain
    probe = np.linspace(max(lo, a_new - 5), min(hi, a_new + 5), 201)
    scale = 1 + abs(best)
    assert best >= f(a_old) - 1e-12 * scale  # the step never lowers the 1-D dual
    assert all(best >= f(a) - 1e-9 * scale for a in probe)
    z_new = z + q * (a_new - a_old)
    slack = (float(loss.value(np.array([z_new]))[0]) - float(loss.dual(np.array([a_new]))[0])
             + a_new * z_new)
    assert abs(slack) <= 1e-7 * (1 + abs(z_new) + abs(a_new * z_new))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.floats(-8.0, 8.0, allow_nan=False))
def test_conjugate_of_the_conjugate_is_the_loss(name, z):
    """l**(z) = sup_u (u z - l*(u)) = sup_a (D(a) - a z) equals l(z) (l is closed convex)."""
    loss = LOSSES[name]
    lo, hi = loss.dual_domain
    lo, hi = max(lo, -abs(z) - 10), min(hi, abs(z) + 10)
    res = minimize_scalar(lambda a: -(float(loss.dual(np.array([a]))[0]) - a * z),
                          bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    candidates = [-res.fun] + [float(loss.dual(np.array([a]))[0]) - a * z for a in (lo, hi)]
    assert max(candidates) == pytest.approx(independent_loss(name, z), rel=1e-7, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(loss_and_dual(), margins)
def test_scalar_kernels_equal_the_vectorised_values(pair, z):
    name, a = pair
    loss = LOSSES[name]
    assert loss_value.py_func(loss.code, z) == pytest.approx(
        float(loss.value(np.array([z]))[0]), rel=1e-12, abs=1e-300)
    assert dual_value.py_func(loss.code, a) == pytest.approx(
        float(loss.dual(np.array([a]))[0]), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_zero_row_rule_is_the_step_at_zero_curvature(name):
    loss = LOSSES[name]
    for a_old in (loss.dual_domain[0] if math.isfinite(loss.dual_domain[0]) else -3.0, 0.3):
        assert loss.sdca_step(a_old, 0.0, 0.0) == loss.peak
    assert loss.peak == pytest.approx(
        max(np.linspace(0, 1, 10001), key=lambda a: float(loss.dual(np.array([a]))[0])),
        abs=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_dual_range_and_value_bound(name):
    """``dual-mean`` lies in dual_range (the certificate's box) and value_bound(B) bounds the
    loss at every margin |z| <= B (the server's loss-mean bound)."""
    loss = LOSSES[name]
    lo, hi = loss.dual_domain
    a = np.linspace(max(lo, -50), min(hi, 50), 20001)
    d = loss.dual(a)
    assert d.min() >= loss.dual_range[0] - 1e-12 and d.max() <= loss.dual_range[1] + 1e-12
    assert d.max() == pytest.approx(loss.dual_range[1], abs=1e-6)
    for bound in (0.0, 0.5, 3.0, 40.0):
        z = np.linspace(-bound, bound, 101)
        assert np.all(loss.value(z) <= loss.value_bound(np.array(bound)) + 1e-12)
    for outside in (-hi - 1.0, -lo + 1.0):  # l*(u) = +inf for -u outside the domain
        if math.isfinite(outside):
            assert np.isinf(loss.conjugate(np.array([outside])))[0]
    assert np.isfinite(loss.conjugate(np.array([-0.5])))[0]


def test_logistic_step_is_exact_near_the_box_ends():
    """Large margins put the logistic maximiser within 1e-13 of 0 or 1: safeguarded Newton in
    the logit still lands on the root (no bisection crawl, no log(0))."""
    loss = LOSSES["logistic"]
    for z, a_old, q in ((40.0, 0.0, 1e-3), (-40.0, 1.0, 1e-3), (35.0, 1.0, 1e3), (0.0, 0.0, 0.0)):
        a = loss.sdca_step(a_old, z, q)
        assert 0.0 <= a <= 1.0
        z_new = z + q * (a - a_old)
        if 0.0 < a < 1.0:  # log((1-a)/a) = z' at the root
            assert math.log1p(-a) - math.log(a) == pytest.approx(z_new, rel=1e-9, abs=1e-9)
    assert coordinate_step.py_func(loss.code, 0.2, 0.0, 0.0) == 0.5


def test_the_kernels_work_estimates_scale_with_the_losses_numpy_step_cost():
    """``auto`` picks numba per call from the numpy run time it estimates: a logistic step
    (a Newton solve in Python) costs about 10 hinge steps, so numba is chosen 10x sooner."""
    from fmtl_flower.core.baselines.cocoa import _cocoa_kernel
    from fmtl_flower.core.baselines.mbsdca import _mbsdca_kernel
    from fmtl_flower.core.sdca import _sdca_kernel

    X, z, order = np.zeros((50, 7)), np.zeros(50), np.arange(50)
    for loss in LOSSES.values():
        sdca = _sdca_kernel.work(X, z, z, z, np.zeros(7), order, 1000, 1.0, z, np.zeros(7),
                                 loss.code)
        hinge = _sdca_kernel.work(X, z, z, z, np.zeros(7), order, 1000, 1.0, z, np.zeros(7),
                                  LOSSES["hinge"].code)
        assert sdca == pytest.approx(loss.numpy_step_cost * hinge)
        cocoa = _cocoa_kernel.work(X, z, z, z, order, 1.0, 0.5, 1000, 50, z, np.zeros(7),
                                   loss.code)
        assert cocoa > sdca
        mbsdca = _mbsdca_kernel.work(X, z, z, z, np.zeros(7), order, 50, 1.0, z, loss.code)
        assert (mbsdca < 50) == (loss.name == "hinge")  # vectorised only for the hinge
    assert LOSSES["logistic"].numpy_step_cost >= 5 * LOSSES["hinge"].numpy_step_cost
