"""A device install: the ``flwr run`` ClientApp on a base install (no scipy, scikit-learn, Ray,
matplotlib; with and without numba) imports only what the run's strategy needs and trains.

Each case runs :mod:`tests.apps.device_child` in a fresh process (as Flower starts a
ClientApp process per message) with the missing packages made unimportable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("device_child.py")
ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("scipy", "sklearn", "ray", "matplotlib")
NO_NUMBA = ("numba", "llvmlite")
#: Modules of other strategy families a MOCHA device must not load.
OTHER_FAMILIES = ("fmtl_flower.strategies", "fmtl_flower.clients.fedem",
                  "fmtl_flower.clients.fsvrg", "fmtl_flower.clients.mbsgd",
                  "fmtl_flower.clients.ofmtl", "fmtl_flower.core.fedem",
                  "fmtl_flower.core.fsvrg", "fmtl_flower.core.ofmtl",
                  "fmtl_flower.core.formulations", "fmtl_flower.core.models")


def run_device(blocked: tuple[str, ...], strategy: str, state_dir: Path,
               env: dict[str, str] | None = None) -> dict:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, str(CHILD), ",".join(blocked), strategy,
                           str(state_dir)], capture_output=True, text=True, timeout=300,
                          env=environ, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_trained(out: dict) -> None:
    first, second = out["rounds"]
    assert first["finite"] and second["finite"]
    assert first["delta-b-norm"] > 0.0 and 0 < first["steps"] <= out["n"]
    assert second["state-ok"] == 1  # the committed state of round 1 was found and used


@pytest.mark.parametrize("strategy", ["mocha", "cocoa", "mb-sdca"])
def test_dual_client_on_base_install_imports_no_server_packages(strategy: str,
                                                                 tmp_path: Path) -> None:
    out = run_device(SERVER_ONLY, strategy, tmp_path)
    check_trained(out)
    assert not set(out["top_level"]) & set(SERVER_ONLY)
    assert not [m for m in out["fmtl_modules"] if m.startswith(OTHER_FAMILIES)]
    # a message this small (far below core.jit's break-even) runs numpy without loading numba
    assert "numba" not in out["top_level"]
    # with numba chosen, its compiled kernels are kept under the client-state-dir for the next
    # process
    out = run_device(SERVER_ONLY, strategy, tmp_path / "numba", env={"FMTL_KERNELS": "numba"})
    check_trained(out)
    assert list((tmp_path / "numba" / "numba-cache").rglob("*.nbi"))
def test_every_dense_client_imports_on_a_base_install(tmp_path: Path) -> None:
    """MOCHA's, OFMTL's, Mb-SGD's and FedEM's ClientApps (FSVRG's data are scipy matrices:
    its devices install the simulation extra), with and without numba."""
    modules = "import:" + ",".join(f"fmtl_flower.clients.{name}"
                                   for name in ("mocha", "ofmtl", "mbsgd", "fedem"))
    for blocked in (SERVER_ONLY, SERVER_ONLY + NO_NUMBA):
        out = run_device(blocked, modules, tmp_path)
        assert not set(out["top_level"]) & set(blocked)
    # the ClientApp module and FedEM's client (no SDCA kernels) do not even load numba
    out = run_device(SERVER_ONLY, "import:fmtl_flower.apps.client_app,fmtl_flower.clients.fedem",
                     tmp_path)
    assert "numba" not in out["top_level"]


def test_mocha_client_trains_without_numba(tmp_path: Path) -> None:
    out = run_device(SERVER_ONLY + NO_NUMBA, "mocha", tmp_path)
    check_trained(out)
    assert "numba" not in out["top_level"]
    assert not (tmp_path / "numba-cache").exists()
    # one warning says which path runs
    assert sum("numba" in w for w in out["warnings"]) == 1, out["warnings"]


def test_numpy_path_and_numba_path_agree(tmp_path: Path) -> None:
    """The same two messages on the numpy path (numba missing) and the compiled one."""
    fast = run_device(SERVER_ONLY, "mocha", tmp_path / "numba", env={"FMTL_KERNELS": "numba"})
    slow = run_device(SERVER_ONLY + NO_NUMBA, "mocha", tmp_path / "numpy")
    for a, b in zip(fast["rounds"], slow["rounds"], strict=True):
        assert a["steps"] == b["steps"] and a["state-ok"] == b["state-ok"]
        assert a["delta-b-norm"] == pytest.approx(b["delta-b-norm"], rel=1e-10)
