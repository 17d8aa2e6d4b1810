"""Smoke test of the real ``flwr run`` path: managed local SuperLink, Ray simulation, 4 nodes.

Everything is sandboxed: a private ``FLWR_HOME`` (config, SuperLink state and log), private
SuperLink ports, no runtime dependency installation (the app runs in this venv), no telemetry
and no update check. ``flwr run`` leaves its managed SuperLink (and that SuperLink's
``flower-superexec``) running after it returns and Flower writes no pid file, so the test finds
every process it caused (by the private ``FLWR_HOME`` path in its command line or environment)
and stops them by PID in ``finally``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .processes import free_port, stop_processes

ROOT = Path(__file__).resolve().parents[2]
APP_DIR = ROOT  # `flwr run .` from the repository root: the repo is the Flower App
NUM_NODES = 4
NUM_ROUNDS = 3
RUN_TIMEOUT_S = 420.0

_APP_CONFIG = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]

pytestmark = pytest.mark.slow


def _processes_of(psutil, flwr_home: str) -> list:
    """Processes caused by a ``flwr run`` with this ``FLWR_HOME``, SuperLink(s) first.

    The managed SuperLink carries ``--log-file <FLWR_HOME>/local-superlink/superlink.log`` in
    its command line; its ``flower-superexec``, the ServerApp/simulation processes and Ray's
    processes inherit ``FLWR_HOME`` in their environment (even if re-parented to init).
    """
    marker = os.path.join(flwr_home, "local-superlink")
    superlinks, others = [], []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            cmdline = " ".join(proc.cmdline())
            if marker in cmdline:
                superlinks.append(proc)
            elif proc.environ().get("FLWR_HOME") == flwr_home:
                others.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return superlinks + others


@pytest.fixture
def flwr_sandbox(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment of a sandboxed ``flwr`` CLI; stops every process it caused, by PID."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        # flwr spawns flower-superlink / flower-superexec by name from PATH
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    })
    try:
        yield env
    finally:
        procs = _processes_of(psutil, str(home))
        survivors = stop_processes(procs)
        leftover = _processes_of(psutil, str(home))
        assert not survivors and not leftover, (
            f"processes of the flwr run still alive: {survivors} "
            f"{[p.pid for p in leftover]}")


def _flwr_run(sandbox: dict[str, str], run_config: str, results: Path) -> tuple[dict, str]:
    """``flwr run . --stream`` with ``run_config``; the results JSON and a context string."""
    command = [str(Path(sys.executable).parent / "flwr"), "run", ".", "--stream",
               "--run-config", run_config,
               "--federation-config", f"num-supernodes={NUM_NODES} client-resources-num-cpus=1"]
    pyproject = (APP_DIR / "pyproject.toml").read_bytes()

    started = time.perf_counter()
    proc = subprocess.run(command, cwd=APP_DIR, env=sandbox, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    elapsed = time.perf_counter() - started
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    log_file = Path(sandbox["FLWR_HOME"]) / "local-superlink" / "superlink.log"
    log_tail = log_file.read_text()[-3000:] if log_file.is_file() else "(no SuperLink log)"
    context = (f"$ {shlex.join(command)}\n(exit {proc.returncode}, {elapsed:.1f} s)\n"
               f"{output}\n--- superlink.log ---\n{log_tail}")

    assert proc.returncode == 0, context
    assert results.is_file(), f"no results file written\n{context}"
    # `flwr run` must not rewrite the app's pyproject.toml (it does if it finds federations)
    assert hashlib.sha256((APP_DIR / "pyproject.toml").read_bytes()).digest() == \
        hashlib.sha256(pyproject).digest()
    print(f"flwr run: {elapsed:.1f} s")
    return json.loads(results.read_text()), context


def test_flwr_run_mocha_four_nodes(flwr_sandbox: dict[str, str], tmp_path: Path) -> None:
    results = tmp_path / "res.json"
    run_config = (f"num-server-rounds={NUM_ROUNDS} num-tasks={NUM_NODES} dim=5 "
                  f"samples-per-task=30 seed=3 mocha.omega-every=2 round-timeout=120.0 "
                  f"results-file='{results}'")
    # the ClientApp inside Flower's simulation engine runs numba for every call (a
    # simulation's default, fmtl_flower.apps.kernels): these calls, far below the per-call
    # break-even, compile into this cache (a device would run them numpy)
    numba_cache = tmp_path / "numba-cache"
    flwr_sandbox.pop("FMTL_KERNELS", None)
    flwr_sandbox["NUMBA_CACHE_DIR"] = str(numba_cache)
    out, context = _flwr_run(flwr_sandbox, run_config, results)
    assert list(numba_cache.rglob("*.nbi")), f"no numba cache written\n{context}"
    rounds = out["rounds"]
    assert [r["round"] for r in rounds] == list(range(NUM_ROUNDS + 1)), context
    assert all(r["num_replies"] == NUM_NODES for r in rounds[1:]), rounds
    last, final = rounds[-1], out["final"]
    for record in (last, final):
        assert record["primal"] is not None and math.isfinite(record["primal"])
        assert record["gap"] is not None and record["gap"] >= 0.0
    assert final["complete"] is True
    assert out["config"]["num-tasks"] == NUM_NODES


def test_flwr_run_fedem_four_nodes(flwr_sandbox: dict[str, str], tmp_path: Path) -> None:
    results = tmp_path / "res.json"
    run_config = (f"strategy='fedem' dataset='fedem-synthetic' num-server-rounds={NUM_ROUNDS} "
                  f"num-tasks={NUM_NODES} n-test=50 fedem.train-tasks-frac=0.75 seed=3 "
                  f"round-timeout=120.0 results-file='{results}'")
    out, context = _flwr_run(flwr_sandbox, run_config, results)
    rounds = out["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, NUM_ROUNDS + 1)), context
    assert all(r["num_replies"] == NUM_NODES - 1 for r in rounds), rounds  # one held out
    final = out["final"]
    assert final["complete"] is True
    assert 0.0 < final["accuracy_mean"] <= 1.0 and final["unseen_accuracy_mean"] is not None
