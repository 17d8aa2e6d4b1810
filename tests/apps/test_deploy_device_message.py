"""``benchmarks/device_message.py`` on a device without numba: the numba variant is skipped
with a line saying why (the deploy guide tells armv7 operators to run it), not a crash."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_message",
                                                  ROOT / "benchmarks" / "device_message.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_numba_the_numba_variant_is_skipped_with_a_reason() -> None:
    bench = _benchmark()
    variants, skipped = bench.plan_variants(numba_installed=False)
    assert "mocha-numba" not in variants and set(variants) == {"trivial", "mocha", "mocha-numpy"}
    assert "numba is not installed" in skipped["mocha-numba"]
    assert all(env.get("FMTL_KERNELS") != "numba" for env in variants.values())


def test_with_numba_every_variant_runs() -> None:
    variants, skipped = _benchmark().plan_variants(numba_installed=True)
    assert set(variants) == {"trivial", "mocha", "mocha-numba", "mocha-numpy"}
    assert skipped == {}
