"""Slow test: ``fmtl run --engine ray --ray-address HOST:PORT`` joins a running Ray cluster.

A one-node Ray cluster is started with ``ray start --head --block`` on 127.0.0.1 (its own port,
Ray Client port and temp dir); ``fmtl run mocha`` then joins it as a driver, and must give the
in-process engine's numbers. ``--block`` keeps ``ray start`` in the foreground, so the fixture
stops it and every process under it by PID; it also stops any process whose command line names
the cluster's private temp dir (Ray's processes all do), and asserts that none is left.

The temp dir is made directly under ``/tmp``: Ray puts unix sockets in it, and a socket path
must stay under ~107 bytes (pytest's ``tmp_path`` can be longer).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from fmtl_flower.cli import main
from fmtl_flower.core.jit import KERNELS_ENV, numba_available, using

from .processes import free_port, stop_processes

pytestmark = pytest.mark.slow

VENV_BIN = Path(sys.executable).parent
ROUNDS = 3
# round-timeout: the first round waits for the cluster to start its actors (a parity test);
# sizes whose records differ between numba and numpy (fast-math dot products of 20 features),
# so that the parity below also shows which kernels the cluster's workers ran
RUN_ARGS = ["mocha", "--rounds", str(ROUNDS), "--set", "round-timeout=600.0", "--seed", "3",
            "--set", "num-tasks=4", "--set", "dim=20", "--set", "samples-per-task=30"]
START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 600.0
HEAD_CPUS = 2


@dataclass
class RayHead:
    """A running ``ray start --head --block``: its process, address and environment."""

    proc: subprocess.Popen
    address: str
    temp_dir: str
    log: Path
    env: dict[str, str]

    def raylet(self) -> psutil.Process:
        """The head node's raylet (a child of ``ray start``)."""
        for child in psutil.Process(self.proc.pid).children():
            if child.name() == "raylet":
                return child
        raise AssertionError(f"no raylet under `ray start` (pid {self.proc.pid})")


def _naming(marker: str) -> list[psutil.Process]:
    """Processes (not this one) whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if marker in " ".join(proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (those alive now)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def ray_head() -> Iterator[RayHead]:
    """A one-node Ray cluster on 127.0.0.1, stopped (and checked gone) by PID at the end."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_USAGE_STATS_ENABLED": "0",
                "PATH": os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])})
    # the cluster's workers inherit the cluster's environment, not the driver's: here one
    # that says numpy, while the driver (no FMTL_KERNELS) runs a simulation's numba; the
    # workers must make the driver's choice (fmtl_flower.apps.kernels.pin_kernels)
    env[KERNELS_ENV] = "numpy"
    log = Path(temp_dir) / "ray-start.log"
    command = [str(VENV_BIN / "ray"), "start", "--head", "--block",
               "--node-ip-address", "127.0.0.1", "--port", str(port),
               "--num-cpus", str(HEAD_CPUS), "--include-dashboard", "false",
               "--ray-client-server-port", str(free_port()),  # not the shared default 10001
               "--temp-dir", temp_dir, "--disable-usage-stats"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=temp_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None, (f"`ray start` exited with {proc.returncode}:\n"
                                         f"{log.read_text()[-3000:]}")
            assert time.monotonic() < deadline, (f"Ray head not ready in {START_TIMEOUT_S} s:"
                                                 f"\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield RayHead(proc, f"127.0.0.1:{port}", temp_dir, log, env)
    finally:
        procs = {p.pid: p for p in [*_tree(proc.pid), *_naming(temp_dir)]}
        survivors = stop_processes(list(procs.values()), grace=20.0)
        proc.wait(timeout=10)
        leftover = [p.pid for p in _naming(temp_dir)]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not survivors and not leftover, (
            f"processes of the Ray head still alive: {survivors} {leftover}")


def _run_on_cluster(head: RayHead, out: Path, cwd: Path) -> tuple[dict, str]:
    """``fmtl run ... --engine ray --ray-address``; watches where the ClientApp actors run."""
    command = [str(VENV_BIN / "fmtl"), "run", *RUN_ARGS, "--engine", "ray",
               "--ray-address", head.address, "--out", str(out)]
    raylet = head.raylet()
    actors_on_cluster: set[int] = set()
    own_ray: set[str] = set()
    started = time.perf_counter()
    with (cwd / "fmtl.log").open("w") as log:
        driver_env = {k: v for k, v in head.env.items() if k != KERNELS_ENV}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=driver_env,
                                cwd=cwd)
        try:
            while proc.poll() is None:
                # the cluster's raylet hosts the actors; the driver must start no Ray of its own
                for child in raylet.children():
                    try:
                        if child.cmdline()[0].startswith("ray::ClientAppActor"):
                            actors_on_cluster.add(child.pid)
                    except (psutil.Error, IndexError):
                        continue
                for child in _tree(proc.pid)[1:]:
                    try:
                        if child.name() in ("raylet", "gcs_server"):
                            own_ray.add(f"{child.pid} {child.name()}")
                    except psutil.Error:
                        continue
                assert time.perf_counter() - started < RUN_TIMEOUT_S, "fmtl run timed out"
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                stop_processes(_tree(proc.pid))
    elapsed = time.perf_counter() - started
    output = (cwd / "fmtl.log").read_text()
    context = f"$ {' '.join(command)}\n(exit {proc.returncode}, {elapsed:.1f} s)\n{output[-4000:]}"
    print(f"fmtl run on the cluster: {elapsed:.1f} s, {len(actors_on_cluster)} actors")

    assert proc.returncode == 0, context
    assert not own_ray, f"the driver started its own Ray: {own_ray}\n{context}"
    assert 1 <= len(actors_on_cluster) <= HEAD_CPUS, (actors_on_cluster, context)
    # the driver registered with this cluster: Ray logs it in the cluster's session dir
    drivers = list(Path(head.temp_dir).glob(f"session_*/logs/python-core-driver-*_{proc.pid}.log"))
    assert drivers, f"no driver log of pid {proc.pid} in {head.temp_dir}\n{context}"
    assert out.is_file(), context
    return json.loads(out.read_text()), context


def test_fmtl_run_joins_a_running_ray_cluster(ray_head: RayHead, tmp_path: Path) -> None:
    results, context = _run_on_cluster(ray_head, tmp_path / "r.json", tmp_path)

    # the run only disconnected: the cluster is still up
    assert ray_head.proc.poll() is None and ray_head.raylet().is_running()

    num_tasks = results["final"]["num_replies"]
    rounds = results["rounds"]
    assert results["engine"] == "ray"
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1)), context
    assert num_tasks > 1 and all(r["num_replies"] == num_tasks for r in rounds[1:]), rounds
    assert all(r["tasks_missing"] == [] for r in rounds[1:]), rounds
    final = results["final"]
    assert final["round"] == ROUNDS and final["complete"] is True
    assert final["tasks_never_replied"] == []
    assert final["primal"] is not None and math.isfinite(final["primal"])
    assert final["gap"] is not None and final["gap"] >= 0.0

    # the same config on the in-process engine (no Ray) gives the same numbers: the same
    # kernels (the simulation default) ran on the cluster's workers as in this process
    assert results["kernels"] == "numba" or not numba_available(), context
    reference_out = tmp_path / "inprocess.json"
    with using(results["kernels"]):
        assert main(["run", *RUN_ARGS, "--quiet", "--out", str(reference_out)]) == 0
    reference = json.loads(reference_out.read_text())
    assert reference["final"]["num_replies"] == num_tasks
    for got, want in zip(rounds, reference["rounds"], strict=True):
        # primal/dual are sums in task order: exactly equal whatever order replies came in
        for key in ("primal", "dual", "gap"):
            assert got[key] == want[key], (got["round"], key, got[key], want[key])
        # error summaries are summed in reply order: equal up to rounding
        if want["test_error"] is not None:
            assert math.isclose(got["test_error"], want["test_error"], rel_tol=1e-12)
    assert final["primal"] == reference["final"]["primal"]
