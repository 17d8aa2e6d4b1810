"""A sandboxed loopback deployment: one ``flower-superlink`` and N ``flower-supernode`` processes.

Shared by the slow deployment tests (``test_deploy_faults.py``) and
``benchmarks/loopback_rounds.py``. Everything runs on 127.0.0.1 on free ports with a private
``FLWR_HOME`` (holding the ``loopback`` connection), no runtime dependency installation, no
telemetry and no update check. Runs are submitted with ``flwr run . loopback --stream`` from
the repository root (the repository is the Flower App).

Processes are only ever stopped by PID: those this object started, their descendants (recorded
while they were alive) and any process carrying this ``FLWR_HOME`` in its environment or
command line (SuperExecs, ServerApp and ClientApp processes inherit it). Nothing is looked up
or stopped by name.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from .processes import free_port, stop_processes

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 60.0


def kill_and_wait(procs: list[psutil.Process], timeout: float = 15.0) -> None:
    """SIGKILL ``procs`` by PID and wait until each is gone or a zombie (a killed child of a
    process that has not reaped it yet)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in procs):
        if time.monotonic() > deadline:
            raise AssertionError(f"still alive after SIGKILL: {[p.pid for p in procs]}")
        time.sleep(0.1)


def tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a text file (or ``(missing)``)."""
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(missing)"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Submission:
    """One ``flwr run . loopback --stream`` process and its log."""

    name: str
    popen: subprocess.Popen
    log: Path
    command: list[str]
    results: Path | None
    started: float = field(default_factory=time.perf_counter)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    @property
    def run_id(self) -> int | None:
        """The run id ``flwr run`` printed (``Successfully started run <id>``), if any yet."""
        match = re.search(r"started run (\d+)", self.text())
        return int(match.group(1)) if match else None

    def wait_for(self, pattern: str, timeout: float, context: str = "") -> re.Match:
        """Wait until the log matches the regex ``pattern``; AssertionError on timeout or if
        ``flwr run`` exits before."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.text())
            if match:
                return match
            if self.popen.poll() is not None:
                match = regex.search(self.text())  # written just before exiting
                if match:
                    return match
                raise AssertionError(f"flwr run {self.name} exited ({self.popen.returncode}) "
                                     f"before logging {pattern!r}\n{context}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in flwr run {self.name} after "
                                     f"{timeout:.0f} s\n{context}")
            time.sleep(0.5)

    def wait(self, timeout: float, context: str = "") -> float:
        """Wait for ``flwr run`` to exit; its wall seconds since submission."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"flwr run {self.name} still going after {timeout:.0f} s\n"
                                 f"{context}") from None
        return time.perf_counter() - self.started

    def read_results(self) -> dict:
        assert self.results is not None and self.results.is_file(), \
            f"flwr run {self.name}: no results file {self.results}"
        return json.loads(self.results.read_text())


class LoopbackFederation:
    """SuperLink + SuperNodes on 127.0.0.1 under ``workdir`` (see the module docstring).

    Parameters
    ----------
    workdir : Path
        Holds ``flwr-home/``, ``logs/`` and, per node, ``state/node-<task>/`` (its
        ``client-state-dir`` when ``state_dirs`` is on).
    num_nodes : int
        SuperNodes started with ``--node-config "task-id=<i>"``, i = 0 .. num_nodes - 1.
    state_dirs : bool
        Also pass ``client-state-dir=<workdir>/state/node-<i>`` in each node config.
    node_configs : list of str, optional
        Node i's ``--node-config`` instead of ``task-id=<i>`` (e.g. ``task-ids='0,1,2'`` for
        a node hosting several tasks).
    launcher : bool
        Start each SuperNode through ``fmtl-supernode`` (this repository's
        :mod:`fmtl_flower.supernode_launcher`, run as ``python -m``) rather than
        ``flower-supernode`` itself.
    """

    def __init__(self, workdir: Path, num_nodes: int, state_dirs: bool = False,
                 node_configs: list[str] | None = None, launcher: bool = False) -> None:
        self.workdir = Path(workdir)
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.num_nodes = int(num_nodes)
        self.state_dirs = state_dirs
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        self.node_configs = node_configs
        self.launcher = launcher
        self.link_port = free_port()
        self.env = dict(os.environ)
        self.env.update({
            "FLWR_HOME": str(self.home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            # SuperLink and SuperNodes spawn flower-superexec / flwr-* by name from PATH
            "PATH": os.pathsep.join([str(BIN), self.env.get("PATH", "")]),
        })
        # A device keeps the bytecode of the app it unpacked (Python writes it next to the
        # FAB's sources under FLWR_HOME on the first message): without it every ClientApp
        # process compiled the app from source (0.06 s of CPU per MOCHA message here).
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        if launcher:  # `python -m fmtl_flower.supernode_launcher` imports this repository's
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT), *filter(None, [self.env.get("PYTHONPATH")])])
        self.started: list[subprocess.Popen] = []
        self.known: dict[int, psutil.Process] = {}  # every process seen, by PID
        self.link: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.node_logs: dict[int, Path] = {}
        self.node_starts: dict[int, int] = {}
        self._handles: list[IO[str]] = []
        self._submissions = 0

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, command: list[str], cwd: Path | None = None
               ) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        out = open(log, "w")  # noqa: SIM115 (closed in stop)
        self._handles.append(out)
        proc = subprocess.Popen(command, cwd=cwd or self.workdir, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        self._remember(proc.pid)
        return proc, log

    def _remember(self, pid: int) -> None:
        try:
            self.known.setdefault(pid, psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass

    def state_dir(self, task: int) -> Path:
        return self.workdir / "state" / f"node-{task}"

    def start(self) -> LoopbackFederation:
        """Write the connection, start the SuperLink, wait for it, start every SuperNode."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "loopback"\n\n'
            f'[superlink.loopback]\naddress = "127.0.0.1:{self.link_port}"\ninsecure = true\n')
        self.link, _ = self._spawn("superlink", [
            str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
            "--port", str(self.link_port), "--disable-runtime-dependency-installation"])
        self._wait_listening(self.link_port, self.link)
        for task in range(self.num_nodes):
            self.start_node(task)
        return self

    def _wait_listening(self, port: int, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"nothing listens on 127.0.0.1:{port} after "
                             f"{STARTUP_TIMEOUT_S:.0f} s")

    def clear_state(self) -> None:
        """Delete the devices' state files (before a run that must start from scratch); numba's
        compiled-kernel cache (``numba-cache/``) is a cache, not state, and stays."""
        for task in range(self.num_nodes):
            directory = self.state_dir(task)
            if directory.is_dir():
                for path in directory.iterdir():
                    if path.is_file():
                        path.unlink()

    def start_node(self, task: int) -> subprocess.Popen:
        """Start the SuperNode of ``task`` (a fresh Runtime API port each time)."""
        config = f"task-id={task}" if self.node_configs is None else self.node_configs[task]
        if self.state_dirs:
            self.state_dir(task).mkdir(parents=True, exist_ok=True)
            config += f" client-state-dir='{self.state_dir(task)}'"
        count = self.node_starts.get(task, 0)
        self.node_starts[task] = count + 1
        name = f"supernode-{task}" + (f"-restart{count}" if count else "")
        supernode = ([sys.executable, "-m", "fmtl_flower.supernode_launcher"] if self.launcher
                     else [str(BIN / "flower-supernode")])
        proc, log = self._spawn(name, [
            *supernode, "--insecure", "--superlink",
            f"127.0.0.1:{self.link_port}", "--port", str(free_port()),
            "--node-config", config])
        self.nodes[task] = proc
        self.node_logs[task] = log
        return proc

    def node_id(self, task: int) -> int | None:
        """The Flower node id of the current SuperNode of ``task`` (``SuperNode ID: <id>`` in
        its log), or None if it has not registered yet."""
        match = re.search(r"SuperNode ID: (\d+)", tail(self.node_logs[task], 10**6))
        return int(match.group(1)) if match else None

    def ensure_nodes(self) -> list[int]:
        """Restart the SuperNode of any task whose process died; the tasks restarted."""
        dead = [t for t, p in self.nodes.items() if p.poll() is not None]
        for task in dead:
            self.start_node(task)
        return dead

    def kill_node(self, task: int) -> list[int]:
        """SIGKILL the SuperNode of ``task`` and its descendants (its SuperExec, a ClientApp
        in progress), all by PID, as if the device lost power; the PIDs killed."""
        proc = self.nodes[task]
        try:
            root = psutil.Process(proc.pid)
            victims = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            victims = []
        for victim in victims:
            self.known.setdefault(victim.pid, victim)
        kill_and_wait(victims)
        proc.wait(timeout=10.0)
        return [v.pid for v in victims]

    def processes(self) -> list[psutil.Process]:
        """Live processes of this federation: started or seen ones, descendants, and any with
        this ``FLWR_HOME`` (environment or command line)."""
        own = os.getpid()
        home = str(self.home)
        for proc in list(self.known.values()):
            try:
                for child in proc.children(recursive=True):
                    self.known.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue
        for proc in psutil.process_iter():
            if proc.pid == own or proc.pid in self.known:
                continue
            try:
                if proc.environ().get("FLWR_HOME") == home or home in " ".join(proc.cmdline()):
                    self.known[proc.pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return [p for p in self.known.values() if _alive(p)]

    def serverapp_processes(self) -> list[psutil.Process]:
        """The live ServerApp processes (``flwr-serverapp``) of this federation."""
        found = []
        for proc in self.processes():
            try:
                cmd = proc.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if any(Path(part).name == "flwr-serverapp" for part in cmd[:2]):
                found.append(proc)
        return found

    def stop(self) -> list[int]:
        """Stop everything by PID (``flwr run`` first, then SuperNodes, SuperLink, the rest);
        the PIDs still alive afterwards (should be none)."""
        order = [psutil.Process(p.pid) for p in reversed(self.started) if p.poll() is None]
        procs = {p.pid: p for p in order}
        for proc in self.processes():
            procs.setdefault(proc.pid, proc)
        survivors = stop_processes(list(procs.values()))
        # reap the Popen objects (no zombies of ours)
        for popen in self.started:
            try:
                popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                survivors.append(popen.pid)
        leftover = [p.pid for p in self.processes()]
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        return sorted(set(survivors) | set(leftover))

    # ------------------------------------------------------------------ runs
    def submit(self, run_config: str, name: str | None = None,
               results: Path | None = None, app: Path | str = ".") -> Submission:
        """``flwr run <app> loopback --stream --run-config <run_config>`` from the repo root
        (``app``: this repository's Flower App by default, or another app's directory)."""
        self._submissions += 1
        name = name or f"run{self._submissions}"
        command = [str(BIN / "flwr"), "run", str(app), "loopback", "--stream",
                   "--run-config", run_config]
        popen, log = self._spawn(f"flwr-run-{name}", command, cwd=ROOT)
        return Submission(name, popen, log, command, results)

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Another ``flwr`` CLI command against this federation (e.g. ``stop <run-id>``)."""
        return subprocess.run([str(BIN / "flwr"), *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def context(self, chars: int = 2500) -> str:
        """The tails of every log, for assertion messages."""
        return "\n".join(f"--- {p.name} ---\n{tail(p, chars)}"
                         for p in sorted(self.logs.glob("*.log")))

    def wait_nodes_registered(self, timeout: float = 120.0) -> None:
        """Wait until every SuperNode has registered (logged its node id) and started its
        SuperExec."""
        deadline = time.monotonic() + timeout
        while True:
            ready = 0
            for task, proc in self.nodes.items():
                assert proc.poll() is None, \
                    f"SuperNode {task} exited ({proc.returncode})\n{self.context()}"
                if self.node_id(task) is not None and \
                        "Starting Flower SuperExec" in tail(self.node_logs[task], 10**6):
                    ready += 1
            if ready == len(self.nodes):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{ready} of {len(self.nodes)} SuperNodes ready after "
                                     f"{timeout:.0f} s\n{self.context()}")
            time.sleep(0.5)
