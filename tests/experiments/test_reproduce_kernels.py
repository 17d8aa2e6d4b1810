"""``fmtl reproduce`` runs the local solvers compiled at every size (the committed results were
made so), unless ``FMTL_KERNELS`` says otherwise, and leaves the environment as it found it."""

from __future__ import annotations

import os
import sys
import types

import pytest

import fmtl_flower.experiments as experiments
from fmtl_flower.core import jit


@pytest.fixture
def fake_reproduction(monkeypatch: pytest.MonkeyPatch) -> dict:
    seen: dict = {}
    module = types.ModuleType("fake_reproduction")

    def run(out_dir, quick=False):  # noqa: ANN001, ANN202
        seen["mode"] = jit.mode()
        seen["env"] = os.environ.get(jit.KERNELS_ENV)
        return {"rows": []}

    module.run = run
    monkeypatch.setitem(sys.modules, "fake_reproduction", module)
    monkeypatch.setitem(experiments.REPRODUCTIONS, "fake", "fake_reproduction")
    return seen


def test_reproductions_run_compiled_kernels(fake_reproduction: dict, tmp_path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jit.KERNELS_ENV, raising=False)
    experiments.reproduce("fake", tmp_path)
    assert fake_reproduction == {"mode": "numba", "env": "numba"}
    assert jit.KERNELS_ENV not in os.environ


def test_an_explicit_setting_wins(fake_reproduction: dict, tmp_path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.KERNELS_ENV, "numpy")
    experiments.reproduce("fake", tmp_path)
    assert fake_reproduction == {"mode": "numpy", "env": "numpy"}
    assert os.environ[jit.KERNELS_ENV] == "numpy"
