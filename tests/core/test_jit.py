"""The kernels' dispatch (:mod:`fmtl_flower.core.jit`): numba is not imported with the kernels,
``auto`` chooses per call from the call's work alone (not from what the process ran before),
``numpy`` never imports numba, ``numba`` always compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.core import jit
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.core.sdca import sdca_local_update

ROOT = Path(__file__).resolve().parents[2]
needs_numba = pytest.mark.skipif(not jit.numba_available(), reason="numba is not installed")


def _fresh(code: str, **env: str) -> dict:
    environ = {key: value for key, value in os.environ.items() if key != "FMTL_KERNELS"}
    environ.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=environ, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SMALL_MESSAGE = """
import json, sys
import numpy as np
from fmtl_flower.core import baselines, sdca, svm, ofmtl
from fmtl_flower.core.rng import coordinate_order
imported = "numba" in sys.modules
X = np.random.default_rng(0).normal(size=(300, 20)); y = np.sign(X[:, 0] + 0.1)
d_alpha, d_b = sdca.sdca_local_update(X, y, np.zeros(300), np.zeros(20), budget=300,
    m_tt=2.0, sigma_prime=1.0, order=coordinate_order(0, 3, 1, 300))
print(json.dumps({"at_import": imported, "after_call": "numba" in sys.modules,
                  "d_b": d_b.tolist()}))
"""


@needs_numba
def test_a_small_message_never_imports_numba() -> None:
    """A MOCHA-sized local update (300 steps) in a fresh process under ``auto``: neither the
    kernels' modules nor the call import numba (the old jit imported it with the kernels)."""
    out = _fresh(SMALL_MESSAGE)
    assert not out["at_import"] and not out["after_call"]
    forced = _fresh(SMALL_MESSAGE, FMTL_KERNELS="numba")
    assert forced["after_call"]
    # equal up to rounding (numba reassociates sums), not necessarily bit for bit
    np.testing.assert_allclose(out["d_b"], forced["d_b"], rtol=1e-9, atol=1e-13)


def _task(n: int = 60, d: int = 7, seed: int = 1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = rng.choice([-1.0, 1.0], size=n)
    return X, y, coordinate_order(seed, 0, 1, n)


def _update(budget: int):
    X, y, order = _task()
    return sdca_local_update(X, y, np.zeros(X.shape[0]), np.zeros(X.shape[1]), budget=budget,
                             m_tt=3.0, sigma_prime=1.0, order=order)


def test_choice_follows_the_work_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: numpy below BREAK_EVEN, numba at and above it (where installed)."""
    chosen: list[str] = []
    kern = jit.Kernel(lambda n: n, lambda n: chosen.append("numpy") or n, lambda n: n * 10.0, {})
    monkeypatch.setattr(jit, "_wants_numba", _spy(jit._wants_numba, chosen))
    with jit.using("auto"):
        monkeypatch.setattr(jit, "BREAK_EVEN", 100.0)
        kern(9)
        assert chosen[-2:] == ["auto:False", "numpy"]
        kern(10)
        assert chosen[-1] == f"auto:{jit.numba_available()}"
    with jit.using("numpy"):
        kern(10**6)
        assert chosen[-2:] == ["numpy:False", "numpy"]


def _spy(decide, chosen):  # noqa: ANN001, ANN202
    def spy(work, args):  # noqa: ANN001, ANN202
        result = decide(work, args)
        chosen.append(f"{jit.mode()}:{result}")
        return result
    return spy


@needs_numba
def test_choice_does_not_depend_on_the_process_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same call gives the same result bit for bit before and after a large call made this
    process import numba and compile the kernel (same config -> same choice)."""
    monkeypatch.setattr(jit, "BREAK_EVEN", jit.steps_work(100, 7))
    with jit.using("numpy"):
        small_numpy = _update(99)
        large_numpy = _update(100)
    with jit.using("numba"):
        small_numba = _update(99)
        large_numba = _update(100)
    with jit.using("auto"):
        before = _update(99)
        large = _update(100)  # at BREAK_EVEN: compiled
        after = _update(99)  # numba is loaded now; still numpy
    for got, want in [(before, small_numpy), (after, small_numpy), (large, large_numba)]:
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    # the two implementations agree up to rounding
    for a, b in [*zip(small_numpy, small_numba, strict=True),
                 *zip(large_numpy, large_numba, strict=True)]:
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-13)


def test_callees_of_a_python_kernel_run_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """One choice per top-level call: while a kernel runs as Python, the kernels it calls do
    not dispatch on their own work (CoCoA's driver and its SDCA blocks, for example)."""
    seen: list[str] = []
    inner = jit.Kernel(lambda n: n, lambda n: seen.append("python") or n, lambda n: 1e30, {})
    outer = jit.Kernel(lambda n: inner(n), None, lambda n: 0.0, {})
    monkeypatch.setattr(jit, "numba_available", lambda: True)
    monkeypatch.setattr(jit.Kernel, "compiled", lambda self: pytest.fail("compiled"))
    with jit.using("auto"), pytest.raises(pytest.fail.Exception):
        inner(3)  # on its own, inner's work would compile it
    with jit.using("auto"):
        outer(3)
    assert seen == ["python"]


def test_unknown_choice_is_an_error() -> None:
    with pytest.raises(ValueError, match="choice"):
        with jit.using("fast"):
            pass
    out = subprocess.run([sys.executable, "-c", "from fmtl_flower.core import jit; jit.mode()"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "FMTL_KERNELS": "fast"})
    assert out.returncode != 0 and "FMTL_KERNELS='fast'" in out.stderr


def test_numpy_choice_caches_nothing(tmp_path: Path) -> None:
    with jit.using("numpy"):
        assert jit.use_cache_dir(tmp_path / "cache") is False
    assert not (tmp_path / "cache").exists()


def test_a_using_block_leaves_no_setting_behind() -> None:
    """A ``using`` block entered before the process read ``FMTL_KERNELS`` does not keep the
    value the environment had then (tests change the environment; a leaked setting made later
    tests run other kernels than their Ray workers)."""
    code = ("import os\nfrom fmtl_flower.core import jit\nos.environ['FMTL_KERNELS'] = 'numpy'\n"
            "with jit.using('numba'):\n    pass\ndel os.environ['FMTL_KERNELS']\n"
            "print(jit.mode())")
    environ = {k: v for k, v in os.environ.items() if k != "FMTL_KERNELS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "auto"
