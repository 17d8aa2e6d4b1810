"""Loopback deployment of OFMTL: a SuperNode started after the run began joins as a newcomer.

A real deployment on 127.0.0.1: one ``flower-superlink`` and two ``flower-supernode`` processes
(``task-id=0`` and ``1``) are started, ``flwr run . loopback --stream`` submits an OFMTL run
(``num-tasks=3 ofmtl.initial-tasks=2``), and only once the initial MOCHA training is over (the
strategy's ``OFMTL: initial -> 2 tasks`` log line, streamed by ``flwr run``) is a third
SuperNode (``task-id=2``) started. The server must find it on the grid and serve it with the
newcomer protocol (``train.ofmtl`` messages), ending with all three tasks.

Everything is sandboxed: a private ``FLWR_HOME`` (holding the ``loopback`` connection), free
ports for the SuperLink and every SuperNode, no runtime dependency installation, no telemetry.
In ``finally`` every process the test started, and every process carrying its ``FLWR_HOME``
(SuperExecs, ServerApp and ClientApp processes inherit it), is stopped by PID; none may survive.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .processes import free_port, stop_processes

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DIM = 5
OUTER = 10  # OFMTL's default newcomer round trips
INITIAL_MARKER = "OFMTL: initial -> 2 tasks"
INITIAL_TIMEOUT_S = 480.0  # submission -> end of the initial MOCHA training
RUN_TIMEOUT_S = 600.0  # third SuperNode started -> `flwr run` returns
STARTUP_TIMEOUT_S = 60.0

pytestmark = pytest.mark.slow


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process {proc.args} exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def _processes_of(flwr_home: str, started: list[subprocess.Popen]) -> list[psutil.Process]:
    """Live processes the test caused: those it started, then any with its ``FLWR_HOME``."""
    own = os.getpid()
    procs: dict[int, psutil.Process] = {}
    for popen in started:
        try:
            procs[popen.pid] = psutil.Process(popen.pid)
        except psutil.NoSuchProcess:
            continue
    for proc in psutil.process_iter():
        if proc.pid == own or proc.pid in procs:
            continue
        try:
            if proc.environ().get("FLWR_HOME") == flwr_home or \
                    flwr_home in " ".join(proc.cmdline()):
                procs[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    alive = []
    for proc in procs.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(missing)"


def test_late_supernode_is_served_as_newcomer(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    link_port = free_port()
    node_ports = [free_port() for _ in range(3)]
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "loopback"\n\n'
        f'[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        # SuperLink and SuperNodes spawn flower-superexec / flwr-* by name from PATH
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
    })
    results = tmp_path / "res.json"
    started: list[subprocess.Popen] = []
    handles = []

    def spawn(name: str, command: list[str], cwd: Path = tmp_path) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "w")  # noqa: SIM115 (closed in finally)
        handles.append(out)
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    def supernode(task: int) -> subprocess.Popen:
        return spawn(f"supernode-{task}", [
            str(BIN / "flower-supernode"), "--insecure", "--superlink",
            f"127.0.0.1:{link_port}", "--port", str(node_ports[task]),
            "--node-config", f"task-id={task}"])

    def context() -> str:
        return "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in sorted(logs.glob("*.log")))

    run_config = (f"strategy='ofmtl' num-tasks=3 ofmtl.initial-tasks=2 dim={DIM} "
                  f"samples-per-task=30 num-server-rounds=3 round-timeout=180.0 "
                  f"results-file='{results}'")
    flwr_cmd = [str(BIN / "flwr"), "run", ".", "loopback", "--stream",
                "--run-config", run_config]
    try:
        link = spawn("superlink", [
            str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
            "--port", str(link_port), "--disable-runtime-dependency-installation"])
        _wait_listening(link_port, link, STARTUP_TIMEOUT_S)
        for task in (0, 1):
            supernode(task)

        t0 = time.perf_counter()
        run = spawn("flwr-run", flwr_cmd, cwd=ROOT)
        run_log = logs / "flwr-run.log"
        while INITIAL_MARKER not in _tail(run_log, 10**7):
            assert run.poll() is None, \
                f"flwr run ended ({run.returncode}) before the initial training\n{context()}"
            assert time.perf_counter() - t0 < INITIAL_TIMEOUT_S, \
                f"no {INITIAL_MARKER!r} after {INITIAL_TIMEOUT_S:.0f} s\n{context()}"
            time.sleep(1.0)
        t_initial = time.perf_counter() - t0
        assert not results.exists(), "the run finished before the newcomer was started"

        late = supernode(2)  # the newcomer: the run is going, MOCHA over tasks 0, 1 is done
        t_late = time.perf_counter() - t0
        try:
            run.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"flwr run still going {RUN_TIMEOUT_S:.0f} s after the "
                                 f"third SuperNode started\n{context()}") from None
        wall = time.perf_counter() - t0
        ctx = f"$ {shlex.join(flwr_cmd)}\n(exit {run.returncode}, {wall:.1f} s)\n{context()}"

        assert run.returncode == 0, ctx
        assert late.poll() is None, f"the late SuperNode died\n{ctx}"
        assert results.is_file(), f"no results file written\n{ctx}"
        # `flwr run` rewrites pyproject.toml only to migrate federations (which it must not find)
        assert "federations" not in (ROOT / "pyproject.toml").read_text()
        out = json.loads(results.read_text())
        rounds, final = out["rounds"], out["final"]
        assert [(r["event"], r["devices"]) for r in rounds] == \
            [("initial", 2), ("newcomer", 3)], ctx
        newcomer = rounds[1]
        assert newcomer["floats_communicated"] == OUTER * (2 * DIM + 1)
        assert newcomer["tasks_missing"] == []
        # the subproblem's duality gap: >= 0 up to roundoff (-5.6e-17 seen)
        assert newcomer["newcomer_gap"] is not None and newcomer["newcomer_gap"] >= -1e-9
        for record in rounds:
            assert record["tasks_missing"] == [], record
            assert 0.0 <= record["test_error"] <= 1.0, record
        assert final["complete"] is True
        # on the wire: the late node got the OUTER newcomer messages, the initial ones none
        received = {task: (logs / f"supernode-{task}.log").read_text(errors="replace")
                    .count("Receiving: train.ofmtl message") for task in range(3)}
        assert received == {0: 0, 1: 0, 2: OUTER}, received
        assert final["devices"] == 3 and final["newcomer_floats"] == [OUTER * (2 * DIM + 1)]

        print(f"\nOFMTL loopback deployment: flwr run {wall:.1f} s wall (submission -> exit); "
              f"initial MOCHA over 2 tasks logged at {t_initial:.1f} s (event_time_s "
              f"{rounds[0]['event_time_s']:.1f}, strategy wall_time_s "
              f"{rounds[0]['wall_time_s']:.1f}); third SuperNode started at {t_late:.1f} s; "
              f"newcomer event_time_s {newcomer['event_time_s']:.1f} s, recorded at strategy "
              f"wall_time_s {newcomer['wall_time_s']:.1f}; run ended {wall - t_late:.1f} s "
              f"after the late start; test error {rounds[0]['test_error']:.3f} -> "
              f"{newcomer['test_error']:.3f}")
    finally:
        # flwr run first, then SuperNodes and SuperLink, then whatever carries FLWR_HOME
        procs = _processes_of(str(home), list(reversed(started)))
        survivors = stop_processes(procs)
        leftover = _processes_of(str(home), started)
        for handle in handles:
            handle.close()
        assert not survivors and not leftover, (
            f"processes still alive: {survivors} {[p.pid for p in leftover]}")
