"""OFMTL's factored server side (core/ofmtl_factored.py) against the dense functions of
core/ofmtl.py: the extension, Omega = Sigma^-1, the newcomer's (omega, c), the Omega-step, and
the whole newcomer protocol (``add_task``) on both representations."""

import numpy as np
import pytest

from fmtl_flower.core.factored import FactoredMatrix, sigma_probabilistic_factored
from fmtl_flower.core.ofmtl import (
    add_task,
    extend_sigma,
    newcomer_server_quantities,
    ofmtl_omega_step,
    omega_from_sigma,
)
from fmtl_flower.core.ofmtl_factored import (
    DENSE_OPS,
    FACTORED_OPS,
    extend_sigma_factored,
    newcomer_server_quantities_factored,
    ofmtl_omega_step_factored,
    omega_from_sigma_factored,
    server_ops,
)

from .numerics import assert_close as close_to

RTOL = 1e-10

# (d, m, rank of W or None): m < d, m = d, m > d, rank-deficient, m = 1, m ~ 300
SIZES = [(5, 1, None), (30, 10, None), (12, 12, None), (12, 12, 4), (10, 40, None),
         (8, 64, 3), (10, 300, None), (3, 299, None)]


def assert_close(actual, expected, rtol=RTOL):
    """:func:`tests.core.numerics.assert_close` with this module's default tolerance."""
    close_to(actual, expected, rtol)


def models(d, m, rank=None, seed=0):
    rng = np.random.default_rng(seed)
    if rank is None:
        W = rng.normal(size=(d, m))
    else:
        W = rng.normal(size=(d, rank)) @ rng.normal(size=(rank, m))
    return W * rng.lognormal(0.0, 1.0, size=m)  # unequal task norms


def sigma_pair(d, m, rank=None, seed=0):
    """A Sigma as the server holds it (an Omega-step of some W): factored and dense."""
    factor = sigma_probabilistic_factored(models(d, m, rank, seed), 1e-3)
    return factor, factor.dense()


def newcomer(d, n=40, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.where(X @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
    return X, y


# ----------------------------------------------------------------------------- extension


@pytest.mark.parametrize(("d", "m", "rank"), SIZES)
def test_extension_equals_the_dense_one(d, m, rank):
    factor, dense = sigma_pair(d, m, rank)
    ext = extend_sigma_factored(factor)
    assert ext.num_tasks == m + 1 and ext.rank == factor.rank + 1
    ext.check()
    assert_close(ext.dense(), extend_sigma(dense))
    # the c I part does not leak into the new entry: 1/(m+1) to one ulp, also as an eigenvalue
    new = 1.0 / (m + 1)
    assert abs(ext.diag()[m] - new) <= np.spacing(new)
    assert abs(ext.eigenvalues()[0][-1] - new) <= np.spacing(new)
    assert ext.trace() == pytest.approx(1.0, abs=1e-13)
    np.testing.assert_array_equal(ext.dense()[m, :m], 0.0)


@pytest.mark.parametrize("c", [0.0, 1e-9, 3e-4, 0.0123])
def test_new_diagonal_entry_is_one_over_m_plus_one_for_any_identity_part(c):
    rng = np.random.default_rng(5)
    for m in range(1, 400, 3):
        r = int(rng.integers(0, min(m, 4) + 1))
        V = np.linalg.qr(rng.normal(size=(m, r)))[0] if r else np.zeros((m, 0))
        s = rng.uniform(0.1, 1.0, size=r)
        cc = min(c, 0.5 / m) if r else 1.0 / m  # a unit trace, s > 0
        s *= (1.0 - m * cc) / s.sum() if r else 1.0
        ext = extend_sigma_factored(FactoredMatrix(V, s, cc))
        new = 1.0 / (m + 1)
        assert ext.c == cc * (m / (m + 1))
        assert abs(ext.diag()[m] - new) <= np.spacing(new), m  # not new + c: the c I part
        assert abs(ext.s[-1] + ext.c - new) <= np.spacing(new), m
        if cc == 0.0:
            assert ext.diag()[m] == new


def test_extension_of_no_task_and_of_a_full_rank_factor():
    empty = extend_sigma_factored(FactoredMatrix(np.zeros((0, 0)), np.zeros(0), 0.0))
    np.testing.assert_array_equal(empty.dense(), extend_sigma(np.zeros((0, 0))))
    rng = np.random.default_rng(2)
    A = rng.normal(size=(7, 7))
    Sigma = A @ A.T + 0.1 * np.eye(7)
    Sigma /= np.trace(Sigma)
    full = FactoredMatrix.from_dense(Sigma)  # r = m, c = 0
    ext = extend_sigma_factored(full)
    assert ext.rank == 8
    assert_close(ext.dense(), extend_sigma(Sigma))
    assert_close(omega_from_sigma_factored(ext).dense(), omega_from_sigma(extend_sigma(Sigma)))


def test_extension_refuses_what_the_dense_one_refuses():
    factor, _ = sigma_pair(4, 20)
    with pytest.raises(ValueError, match="unit trace"):
        extend_sigma_factored(factor.scale(1.5))
    V = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 2)))[0]
    with pytest.raises(ValueError, match="positive semidefinite"):
        extend_sigma_factored(FactoredMatrix(V, np.array([1.0, -0.5]), 0.5 / 6))
    with pytest.raises(TypeError, match="FactoredMatrix"):
        extend_sigma_factored(np.eye(3) / 3)


# ----------------------------------------------------------------------------- Omega


@pytest.mark.parametrize(("d", "m", "rank"), SIZES)
def test_omega_equals_the_dense_inverse(d, m, rank):
    factor, dense = sigma_pair(d, m, rank, seed=3)
    for f, D in ((factor, dense), (extend_sigma_factored(factor), extend_sigma(dense))):
        omega = omega_from_sigma_factored(f)
        assert omega.V is f.V  # Woodbury: the same eigenvectors, no copy
        assert_close(omega.dense(), omega_from_sigma(D))


def test_omega_refuses_a_singular_or_indefinite_sigma():
    V = np.linalg.qr(np.random.default_rng(1).normal(size=(5, 2)))[0]
    for s, c in (([0.5, 0.5], 0.0), ([0.7, -0.3], 0.2)):
        with pytest.raises(ValueError, match="positive definite"):
            omega_from_sigma_factored(FactoredMatrix(V, np.array(s), c))
    with pytest.raises(ValueError, match="positive definite"):
        omega_from_sigma(FactoredMatrix(V, np.array([0.5, 0.5]), 0.0).dense())


# ----------------------------------------------------------------------------- (omega, c)


@pytest.mark.parametrize(("d", "m", "rank"), SIZES)
def test_newcomer_quantities_equal_the_dense_ones(d, m, rank):
    W_old = models(d, m, rank, seed=4)
    factor, dense = sigma_pair(d, m, rank, seed=4)
    # right after the extension (c = 0), and after an Omega-step that correlates the newcomer
    W_ext = np.hstack([W_old, np.random.default_rng(4).normal(size=(d, 1))])
    pairs = [(omega_from_sigma_factored(extend_sigma_factored(factor)),
              omega_from_sigma(extend_sigma(dense))),
             (ofmtl_omega_step_factored(W_ext)[1], ofmtl_omega_step(W_ext)[1])]
    for Omega_f, Omega_d in pairs:
        omega_f, c_f = newcomer_server_quantities_factored(W_old, Omega_f)
        omega_d, c_d = newcomer_server_quantities(W_old, Omega_d)
        assert_close(omega_f, omega_d)
        assert_close(c_f, c_d, rtol=1e-9 if m > 100 else RTOL)  # sums of m cancelling terms
    assert np.abs(c_d).max() > 0  # the second case is not trivially 0


def test_newcomer_quantities_validation():
    W_old = models(3, 6)
    Omega = omega_from_sigma_factored(extend_sigma_factored(sigma_pair(3, 6)[0]))
    with pytest.raises(ValueError, match="Omega_ext must be"):
        newcomer_server_quantities_factored(W_old[:, :5], Omega)
    with pytest.raises(ValueError, match="non-finite"):
        newcomer_server_quantities_factored(np.full((3, 6), np.nan), Omega)
    with pytest.raises(ValueError, match=r"Omega_ext\[m, m\]"):
        newcomer_server_quantities_factored(W_old, Omega.scale(-1.0))
    with pytest.raises(TypeError):
        newcomer_server_quantities_factored(W_old, Omega.dense())


# ----------------------------------------------------------------------------- Omega-step


@pytest.mark.parametrize(("d", "m", "rank"), SIZES)
def test_omega_step_equals_the_dense_one(d, m, rank):
    W = models(d, m + 1, rank, seed=6)
    for eps in (1e-3, 1e-2):
        sigma_f, omega_f = ofmtl_omega_step_factored(W, eps)
        sigma_d, omega_d = ofmtl_omega_step(W, eps)
        assert_close(sigma_f.dense(), sigma_d)
        assert_close(omega_f.dense(), omega_d, rtol=1e-9)
        assert sigma_f.rank <= min(d, m + 1)


def test_omega_step_of_zero_models_and_validation():
    sigma_f, omega_f = ofmtl_omega_step_factored(np.zeros((3, 9)))
    sigma_d, omega_d = ofmtl_omega_step(np.zeros((3, 9)))
    assert_close(sigma_f.dense(), sigma_d)
    assert_close(omega_f.dense(), omega_d)
    for bad in (np.zeros(4), np.zeros((3, 0)), np.full((2, 3), np.inf)):
        with pytest.raises(ValueError):
            ofmtl_omega_step_factored(bad)


# ----------------------------------------------------------------------------- the protocol


def test_server_ops_dispatch_on_the_representation():
    factor, dense = sigma_pair(3, 5)
    assert server_ops(factor) is FACTORED_OPS and server_ops(dense) is DENSE_OPS
    assert DENSE_OPS.extend_sigma is extend_sigma  # the dense path runs the dense functions
    assert DENSE_OPS.omega_step is ofmtl_omega_step
    W = models(3, 5)
    Omega = omega_from_sigma_factored(factor)
    assert FACTORED_OPS.quad_trace(W, Omega) == pytest.approx(
        DENSE_OPS.quad_trace(W, Omega.dense()), rel=RTOL)


@pytest.mark.parametrize(("d", "m", "rank", "outer"),
                         [(5, 0, None, 3), (5, 1, None, 3), (30, 10, None, 4), (12, 12, 4, 3),
                          (10, 40, None, 4), (6, 150, None, 3), (4, 300, None, 2),
                          (10, 40, None, 1)])
def test_add_task_gives_the_same_state_on_both_paths(d, m, rank, outer):
    W_old = models(d, m, rank, seed=8) if m else np.zeros((d, 0))
    if m:
        factor, dense = sigma_pair(d, m, rank, seed=8)
    else:
        factor, dense = FactoredMatrix(np.zeros((0, 0)), np.zeros(0), 0.0), np.zeros((0, 0))
    X, y = newcomer(d, seed=m)
    kw = {"lam": 0.05, "outer": outer, "inner": 15, "local_frac": 0.5, "seed": 3,
          "task_id": m}
    ref = add_task(W_old, dense, X, y, **kw)
    fac = add_task(W_old, factor, X, y, **kw)
    assert isinstance(fac.Sigma, FactoredMatrix) and isinstance(fac.Omega, FactoredMatrix)
    np.testing.assert_array_equal(fac.W[:, :m], W_old)  # old columns frozen, bit for bit
    assert_close(fac.W, ref.W, rtol=1e-9)
    assert_close(fac.Sigma.dense(), ref.Sigma, rtol=1e-9)
    assert_close(fac.Omega.dense(), ref.Omega, rtol=1e-9)
    assert_close(fac.alpha, ref.alpha, rtol=1e-9)
    assert_close(fac.primals, ref.primals, rtol=1e-9)
    assert_close(fac.omega, ref.omega, rtol=1e-9)
    assert_close(fac.c, ref.c, rtol=1e-8)
    assert (fac.floats_sent, fac.floats_received) == (ref.floats_sent, ref.floats_received)
    if outer == 1:
        assert fac.Sigma.rank == factor.rank + 1  # the extension only


def test_add_task_checks_the_factored_shape():
    factor, _ = sigma_pair(3, 6)
    X, y = newcomer(3)
    with pytest.raises(ValueError, match=r"Sigma_old must have shape \(5, 5\)"):
        add_task(models(3, 5), factor, X, y, lam=0.1)
