"""The kernels by process role (:mod:`fmtl_flower.apps.kernels`, :mod:`fmtl_flower.core.jit`).

A simulation (``fmtl run``, ``run_federation``, a ClientApp inside Flower's simulation engine)
runs numba for every call when numba is installed; the user's ``FMTL_KERNELS`` wins; a
deployment's ClientApp process keeps the per-call ``auto`` rule (a small message does not
import numba); Ray workers make the driver's choice. The ``fmtl run`` checks run in a fresh
process each (``core.jit`` reads the environment once per process, and whether numba got
imported is the observable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fmtl_flower.core import jit

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("device_child.py")
TINY = ["run", "mocha", "--rounds", "2", "--set", "num-tasks=3", "--set", "dim=4",
        "--set", "samples-per-task=20"]
needs_numba = pytest.mark.skipif(not jit.numba_available(), reason="numba is not installed")


def _fmtl_run(args: list[str], env: dict[str, str] | None = None,
              prelude: str = "") -> dict[str, Any]:
    """``fmtl run ARGS`` in a fresh process: its stdout, stderr and whether numba got
    imported."""
    code = (f"{prelude}\nimport json, sys\nfrom fmtl_flower.cli import main\n"
            f"code = main({args!r})\n"
            "print(json.dumps({'code': code, 'numba': sys.modules.get('numba') is not None}))")
    environ = {k: v for k, v in os.environ.items() if k != jit.KERNELS_ENV}
    environ.update({"PYTHONPATH": str(ROOT), **(env or {})})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *lines, last = proc.stdout.strip().splitlines()
    return {**json.loads(last), "out": "\n".join(lines), "err": proc.stderr}


def _kernels_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("kernels: ")]
    return line


@needs_numba
def test_fmtl_run_simulates_with_numba_by_default() -> None:
    run = _fmtl_run(TINY)
    assert run["code"] == 0
    assert _kernels_line(run["out"]) == ("kernels: numba (simulation default; FMTL_KERNELS=auto "
                                         "to pick per call as a device does)")
    # calls far below the break-even: only the simulation default makes them run numba
    assert run["numba"]


def test_the_users_fmtl_kernels_wins() -> None:
    run = _fmtl_run(TINY, env={jit.KERNELS_ENV: "auto"})
    assert _kernels_line(run["out"]).startswith("kernels: auto (FMTL_KERNELS=auto in the "
                                                "environment")
    assert not run["numba"]  # per call, as a device: these calls are numpy's
    run = _fmtl_run(TINY, env={jit.KERNELS_ENV: "numpy"})
    assert _kernels_line(run["out"]).startswith("kernels: numpy (FMTL_KERNELS=numpy")
    assert not run["numba"]


def test_fmtl_run_without_numba_runs_numpy_with_one_warning() -> None:
    blocked = "import sys\nsys.modules['numba'] = None  # not installed (armv7)"
    run = _fmtl_run(TINY, prelude=blocked)
    assert run["code"] == 0 and not run["numba"]
    assert _kernels_line(run["out"]) == ("kernels: auto (numba is not installed: numpy at "
                                         "every size)")
    assert run["err"].count("numba is not installed") == 1


def test_a_deployment_message_does_not_import_numba_even_with_flowers_simulation_loaded(
        tmp_path: Path) -> None:
    """The device child of the device-install tests (``flwr run``'s ClientApp, a whoami and
    two small train messages) in a process that also imported Ray and Flower's simulation
    actor module, as a user's ClientApp module might: not inside Flower's simulation engine
    (no Ray actor), so the per-call rule stays and numba is not imported."""
    code = ("import runpy, sys\nimport ray, flwr.simulation.ray_transport.ray_actor\n"
            f"sys.argv = [{str(CHILD)!r}, '', 'mocha', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(CHILD)!r}, run_name='__main__')")
    environ = {k: v for k, v in os.environ.items() if k != jit.KERNELS_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ray" in out["top_level"] and out["rounds"][1]["state-ok"] == 1
    assert "numba" not in out["top_level"]


def test_in_flower_simulation_is_false_outside_rays_actors() -> None:
    from fmtl_flower.apps.kernels import in_flower_simulation

    assert not in_flower_simulation()


def test_pinned_choice_must_be_a_kernel_setting() -> None:
    from fmtl_flower.apps.common import make_client_app
    from fmtl_flower.apps.kernels import pin_kernels

    with pytest.raises(ValueError, match="auto, numba or numpy"):
        pin_kernels(make_client_app(), "fast")


def test_simulation_keeps_an_enclosing_using_block(monkeypatch: pytest.MonkeyPatch) -> None:
    before = jit.mode()  # read (and kept) before the environment changes below
    monkeypatch.setenv(jit.KERNELS_ENV, "numba")
    with jit.using("numpy"), jit.simulation() as (choice, why):
        assert choice == "numpy" == jit.mode() and "caller" in why
    monkeypatch.setenv(jit.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="FMTL_KERNELS='fast'"):
        jit.simulation_choice()
    assert jit.mode() == before  # nothing left behind for the tests that follow


# Ray: a config whose numba and numpy records differ (dim 20: fast-math dot products), so
# that equal records show which kernels the workers ran
RAY_CONFIG = {"strategy": "mocha", "dataset": "synthetic", "num-tasks": 4, "dim": 20,
              "samples-per-task": 30, "num-server-rounds": 3, "seed": 3, "tasks-per-node": 1,
              "round-timeout": 600.0}
TIMINGS = {"wall_time_s", "estimated_time_s"}


def _records(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMINGS}
            for r in [*results["rounds"], results["final"]]]


def _inprocess(choice: str) -> list[dict[str, Any]]:
    from fmtl_flower.apps.common import dataset_for
    from fmtl_flower.apps.run import run_federation
    from fmtl_flower.config import RunConfig

    cfg = RunConfig.from_mapping(RAY_CONFIG)
    with jit.using(choice):
        return _records(run_federation(cfg, dataset_for(cfg), "inprocess"))


@needs_numba
def test_ray_workers_make_the_drivers_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_federation`` on Ray with the default: every worker runs numba, as the driver does
    in-process (the choice travels with the ClientApp, not through the workers'
    environment, which here says nothing)."""
    from fmtl_flower.apps.common import dataset_for
    from fmtl_flower.apps.run import run_federation
    from fmtl_flower.config import RunConfig

    monkeypatch.delenv(jit.KERNELS_ENV, raising=False)
    numba, numpy = _inprocess("numba"), _inprocess("numpy")
    assert numba != numpy  # the kernels can be told apart by the records
    cfg = RunConfig.from_mapping(RAY_CONFIG)
    assert _records(run_federation(cfg, dataset_for(cfg), "ray")) == numba


@pytest.mark.slow  # a second Ray start (about 9 s)
@needs_numba
def test_flwr_run_app_simulates_inside_flowers_simulation_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flwr run``'s ClientApp wrapping (:func:`role_kernels`) in Flower's Ray simulation
    (``run_simulation``: the Ray actors ``flwr run`` uses): numba for every call, as
    ``fmtl run`` in-process; the same app outside Flower's engine runs per call (numpy
    here)."""
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.apps.kernels import role_kernels
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess, run_ray

    monkeypatch.delenv(jit.KERNELS_ENV, raising=False)
    numba, numpy = _inprocess("numba"), _inprocess("numpy")
    cfg = RunConfig.from_mapping(RAY_CONFIG)
    nodes = RAY_CONFIG["num-tasks"]
    with jit.using("auto"):  # outside Flower's engine: the per-call rule (a device's)
        box: dict[str, Any] = {}
        run_inprocess(make_server_app(cfg, on_done=box.update),
                      role_kernels(make_client_app(cfg)), nodes)
        assert _records(box) == numpy
    box = {}
    run_ray(make_server_app(cfg, on_done=box.update), role_kernels(make_client_app(cfg)), nodes)
    assert _records(box) == numba
