"""The deployment kit in ``deploy/``: certificates, node keys, start/stop scripts, real runs.

Fast tests (default suite): every script parses (``bash -n``) and prints its help;
``make-certs.sh`` makes a CA and a server certificate that ``openssl verify`` accepts, with
the requested subjectAltNames; ``make-node-keys.sh`` makes keys Flower's own loaders accept;
``stop.sh`` stops exactly the PIDs of a run directory (escalating to SIGKILL, sparing a
recycled PID and anything not listed).

Slow tests (``-m slow``), real loopback deployments started by ``deploy/start-local.sh``:

* TLS: a MOCHA run over two TLS SuperNodes, submitted with ``flwr run`` through the
  ``FLWR_HOME`` the script wrote (CA in ``root-certificates``), completes;
* node authentication: with ``--auth`` the two registered SuperNodes serve the run, while a
  SuperNode with an unregistered key and one with no key are refused by the SuperLink;
* after each, ``stop.sh`` leaves none of the started processes (nor their children) alive.

Each test stops what it started by PID in ``finally`` (``stop.sh``, then a check by PID of
everything recorded, every descendant and every process carrying a test ``FLWR_HOME``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .processes import free_port, stop_processes

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
SCRIPTS = ("make-certs.sh", "make-fleet-proxy.sh", "make-node-keys.sh", "start-local.sh",
           "stop.sh")
NUM_NODES = 2
NUM_ROUNDS = 2
RUN_TIMEOUT_S = 420.0

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PATH": os.pathsep.join([str(BIN), env.get("PATH", "")]),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    })
    env.update(extra)
    return env


def _script(name: str, *args: str | Path, env: dict[str, str] | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / name), *map(str, args)], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _start_time(pid: int) -> str:
    """Field 22 of ``/proc/PID/stat`` (what the scripts record against PID reuse)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(") ", 1)[1].split()[19]


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ----------------------------------------------------------------------------- fast tests

def test_scripts_parse_and_have_help() -> None:
    assert sorted(p.name for p in DEPLOY.glob("*.sh")) == sorted(SCRIPTS)
    for name in SCRIPTS:
        path = DEPLOY / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, f"{name}: {check.stderr}"
        helped = _script(name, "--help")
        assert helped.returncode == 0 and "deploy/" + name in helped.stdout, helped
        bare = _script(name)  # no arguments: usage on stderr, exit 2
        assert bare.returncode == 2 and "deploy/" + name in bare.stderr, bare


@needs_openssl
def test_make_certs_verify_against_ca(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    made = _script("make-certs.sh", certs, "192.168.1.10", "superlink.local")
    assert made.returncode == 0, made.stderr
    verified = subprocess.run(["openssl", "verify", "-CAfile", certs / "ca.crt",
                               certs / "server.crt"], capture_output=True, text=True)
    assert verified.returncode == 0 and verified.stdout.strip().endswith(": OK"), verified
    san = subprocess.run(["openssl", "x509", "-in", certs / "server.crt", "-noout", "-ext",
                          "subjectAltName"], capture_output=True, text=True, check=True).stdout
    for entry in ("DNS:localhost", "IP Address:127.0.0.1", "IP Address:192.168.1.10",
                  "DNS:superlink.local"):
        assert entry in san, san
    # a server certificate, not a CA; private keys readable by the owner only
    text = subprocess.run(["openssl", "x509", "-in", certs / "server.crt", "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "CA:FALSE" in text and "TLS Web Server Authentication" in text
    for key in ("ca/ca.key", "server.key"):
        assert (certs / key).stat().st_mode & 0o077 == 0, key
    # the key belongs to the certificate
    pub = [subprocess.run(cmd, capture_output=True, check=True).stdout for cmd in (
        ["openssl", "x509", "-in", certs / "server.crt", "-noout", "-pubkey"],
        ["openssl", "pkey", "-in", certs / "server.key", "-pubout"])]
    assert pub[0] == pub[1]


def test_make_node_keys_load_with_flwr(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    keys = tmp_path / "keys"
    made = _script("make-node-keys.sh", keys, "2", "3")  # tasks 3 and 4
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in keys.iterdir()) == \
        ["node-3", "node-3.pub", "node-4", "node-4.pub"]
    for task in (3, 4):
        private = load_ssh_private_key((keys / f"node-{task}").read_bytes(), None)
        # what `flwr supernode register` sends == what the SuperNode derives from its key
        assert try_load_public_key(keys / f"node-{task}.pub") == \
            public_key_to_bytes(private.public_key())
        assert private.curve.name == "secp384r1"
        assert (keys / f"node-{task}").stat().st_mode & 0o077 == 0
    before = (keys / "node-3").read_bytes()
    again = _script("make-node-keys.sh", keys, "3", "3")  # keeps 3, 4; adds 5
    assert again.returncode == 0 and (keys / "node-3").read_bytes() == before
    assert (keys / "node-5.pub").is_file()


def test_start_local_refuses_bad_setups_before_starting(tmp_path: Path) -> None:
    import socket

    keys = tmp_path / "keys"
    keys.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases = {
            "auth without TLS": (["--auth", keys], "--auth needs --tls"),
            "missing certificates": (["--tls", tmp_path / "none"], "no ca.crt"),
            "port in use": (["--port", port], f"already listens on port {port}"),
            "node port in use": (["--node-ports", port], f"already listens on port {port}"),
            "unknown option": (["--frobnicate", "1"], "unknown option --frobnicate"),
        }
        for name, (args, message) in cases.items():
            run_dir = tmp_path / name.replace(" ", "-")
            out = _script("start-local.sh", "1", "--run-dir", run_dir, *args, timeout=60)
            assert out.returncode == 2 and message in out.stderr, (name, out)
            pids = run_dir / "pids"
            assert not pids.exists() or pids.read_text() == "", name  # nothing started


def test_stop_sh_stops_exactly_the_recorded_pids(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    popen = dict(start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    polite = subprocess.Popen(["sleep", "300"], **popen)
    # ignores SIGTERM (so does its child): needs the SIGKILL, and leaves an orphan behind
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300 & wait"], **popen)
    bystander = subprocess.Popen(["sleep", "300"], **popen)
    procs = [polite, stubborn, bystander]
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(stubborn.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        orphan = psutil.Process(stubborn.pid).children()[0]
        (run_dir / "pids").write_text(
            f"superlink {polite.pid} {_start_time(polite.pid)}\n"
            f"supernode-0 {stubborn.pid} {_start_time(stubborn.pid)}\n"
            # a recycled PID: same number, other start time -> must be left alone
            f"supernode-1 {bystander.pid} 1\n")
        t0 = time.perf_counter()
        out = _script("stop.sh", run_dir, "1", timeout=60)
        elapsed = time.perf_counter() - t0
        assert out.returncode == 0, out.stdout + out.stderr
        for proc in (polite, stubborn):
            proc.wait(timeout=5)
        assert _dead(orphan.pid), "the SIGTERM-proof child survived"
        assert bystander.poll() is None, "stop.sh killed a PID whose start time differs"
        assert "SIGKILL" in out.stderr
        assert not (run_dir / "pids").exists() and (run_dir / "pids.stopped").is_file()
        assert elapsed < 15, elapsed
    finally:
        leftover = [psutil.Process(p.pid) for p in procs if p.poll() is None]
        try:
            leftover.append(orphan)
        except NameError:
            pass
        stop_processes([p for p in leftover if not _dead(p.pid)], grace=2)
        for p in procs:
            p.wait(timeout=10)


def test_stop_sh_stops_the_orphan_of_a_process_killed_before(tmp_path: Path) -> None:
    """A SuperLink SIGKILLed by hand leaves its flwr-serverapp behind (reparented to init):
    stop.sh finds it through the session start-local.sh gave the SuperLink."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    popen = dict(start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    leader = subprocess.Popen(["bash", "-c", "sleep 300 & wait"], **popen)
    bystander = subprocess.Popen(["sleep", "300"], **popen)  # another session: left alone
    orphan = None
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        orphan = psutil.Process(leader.pid).children()[0]
        (run_dir / "pids").write_text(f"superlink {leader.pid} {_start_time(leader.pid)}\n")
        leader.kill()  # the SuperLink dies; its child now belongs to init
        leader.wait(timeout=5)
        assert orphan.is_running() and orphan.ppid() != leader.pid
        out = _script("stop.sh", run_dir, "1", timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert _dead(orphan.pid), "the orphan of the killed SuperLink survived stop.sh"
        assert bystander.poll() is None
    finally:
        leftover = [psutil.Process(bystander.pid)] if bystander.poll() is None else []
        if orphan is not None and not _dead(orphan.pid):
            leftover.append(orphan)
        stop_processes(leftover, grace=2)
        bystander.wait(timeout=10)


def _unit(name: str) -> dict[str, list[str]]:
    """``key -> values`` of a systemd unit file of the kit."""
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd" / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_units_restart_whatever_the_exit_status() -> None:
    """A SuperNode refused by a SuperLink restarted without --database exits with status 0:
    Restart=on-failure would leave it down. The SuperLink's unit kills its whole control
    group, so no flwr-serverapp outlives it, and keeps its state in --database."""
    for name in ("supernode@.service", "superlink.service"):
        unit = _unit(name)
        assert unit["Restart"] == ["always"], name
        assert unit["StartLimitIntervalSec"] == ["0"], name
    link = _unit("superlink.service")
    assert link["KillMode"] == ["control-group"]
    assert "--database" in (DEPLOY / "systemd" / "superlink.service").read_text()


# ----------------------------------------------------------------------------- slow tests

class Kit:
    """Deployments and extra processes of one test; all stopped by PID in ``close``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.run_dirs: list[Path] = []
        self.extra: list[subprocess.Popen] = []
        self.handles: list = []

    def start(self, *args: str | Path) -> tuple[Path, str]:
        run_dir = self.tmp / f"run{len(self.run_dirs)}"
        self.run_dirs.append(run_dir)
        out = _script("start-local.sh", str(NUM_NODES), "--run-dir", run_dir, *args,
                      timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr + self.logs(run_dir)
        return run_dir, out.stdout

    def popen(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in close)
        self.handles.append(log)
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.extra.append(proc)
        return proc

    @staticmethod
    def recorded(run_dir: Path) -> list[int]:
        for name in ("pids", "pids.stopped"):
            if (run_dir / name).is_file():
                return [int(line.split()[1]) for line in
                        (run_dir / name).read_text().splitlines() if line.strip()]
        return []

    @staticmethod
    def logs(run_dir: Path, chars: int = 2500) -> str:
        return "".join(f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-chars:]}"
                       for p in sorted((run_dir / "logs").glob("*.log")))

    def stop(self, run_dir: Path) -> tuple[float, list[int]]:
        """``stop.sh RUN_DIR``; its wall time and the started PIDs (+ children) still alive."""
        started: dict[int, psutil.Process] = {}
        for pid in self.recorded(run_dir):
            try:
                proc = psutil.Process(pid)
                started[pid] = proc
                started.update((c.pid, c) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        t0 = time.perf_counter()
        out = _script("stop.sh", run_dir, timeout=120)
        elapsed = time.perf_counter() - t0
        assert out.returncode == 0, out.stdout + out.stderr
        return elapsed, [pid for pid in started if not _dead(pid)]

    def _ours(self) -> list[psutil.Process]:
        pids = {pid for d in self.run_dirs for pid in self.recorded(d)}
        pids |= {p.pid for p in self.extra}
        found: dict[int, psutil.Process] = {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                found[pid] = proc
                found.update((c.pid, c) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        mark = str(self.tmp)
        for proc in psutil.process_iter():
            if proc.pid == os.getpid() or proc.pid in found:
                continue
            try:
                if proc.environ().get("FLWR_HOME", "").startswith(mark):
                    found[proc.pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return [p for p in found.values() if not _dead(p.pid)]

    def close(self) -> None:
        try:
            for run_dir in self.run_dirs:
                if (run_dir / "pids").is_file():
                    _script("stop.sh", run_dir, timeout=120)
            survivors = stop_processes(self._ours())
            leftover = self._ours()
            assert not survivors and not leftover, (
                f"processes still alive: {survivors} {[p.pid for p in leftover]}")
        finally:
            for handle in self.handles:
                handle.close()


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[Kit]:
    k = Kit(tmp_path)
    try:
        yield k
    finally:
        k.close()


def _flwr_run(run_dir: Path, results: Path, seed: int = 1) -> tuple[dict, float, str]:
    """``flwr run . local --stream`` (MOCHA) against the deployment in ``run_dir``."""
    run_config = (f"num-tasks={NUM_NODES} dim=5 samples-per-task=30 "
                  f"num-server-rounds={NUM_ROUNDS} seed={seed} mocha.omega-every=2 "
                  f"round-timeout=120.0 results-file='{results}'")
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "flwr"), "run", ".", "local", "--stream",
                           "--run-config", run_config],
                          cwd=ROOT, env=_env(FLWR_HOME=str(run_dir / "flwr-home")),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    wall = time.perf_counter() - t0
    context = (f"flwr run: exit {proc.returncode}, {wall:.1f} s\n{proc.stdout[-3000:]}"
               f"{proc.stderr[-3000:]}{Kit.logs(run_dir)}")
    assert proc.returncode == 0, context
    assert results.is_file(), f"no results file\n{context}"
    assert (ROOT / "pyproject.toml").read_bytes() == pyproject, "flwr run rewrote pyproject"
    out = json.loads(results.read_text())
    rounds = out["rounds"]
    assert [r["round"] for r in rounds] == list(range(NUM_ROUNDS + 1)), context
    assert all(r["num_replies"] == NUM_NODES for r in rounds[1:]), rounds
    assert out["final"]["complete"] is True and out["final"]["gap"] >= 0.0
    return out, wall, context


def _task_nodes(out: dict) -> dict[str, int]:
    """Which node id served which task (``health.task_nodes`` of the results)."""
    nodes = out.get("health", {}).get("task_nodes")
    assert nodes is not None, f"no task_nodes in the results: {sorted(out)}"
    return nodes


def _per_round(out: dict) -> str:
    return ", ".join(f"{r['wall_time_s']:.1f}" for r in out["rounds"][1:])


@pytest.mark.slow
@needs_openssl
def test_tls_deployment_runs_mocha(kit: Kit, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    certs = tmp_path / "certs"
    assert _script("make-certs.sh", certs).returncode == 0
    run_dir, printed = kit.start("--tls", certs)
    t_started = time.perf_counter() - t0
    assert "flwr run . local" in printed and str(run_dir / "env.sh") in printed
    config = (run_dir / "flwr-home" / "config.toml").read_text()
    assert f'root-certificates = "{certs.resolve() / "ca.crt"}"' in config
    assert "insecure" not in config
    link_log = (run_dir / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on https://127.0.0.1:" in link_log, link_log

    out, wall, context = _flwr_run(run_dir, tmp_path / "res.json")
    assert sorted(_task_nodes(out)) == ["0", "1"], context
    stop_s, alive = kit.stop(run_dir)
    assert alive == [], f"alive after stop.sh: {alive}"
    total = time.perf_counter() - t0
    print(f"\nTLS deployment: certs + start {t_started:.1f} s, flwr run {wall:.1f} s "
          f"(per-round wall {_per_round(out)} s), stop.sh {stop_s:.1f} s; total {total:.1f} s")


@pytest.mark.slow
@needs_openssl
def test_node_auth_refuses_unregistered_supernode(kit: Kit, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    certs, keys, rogue_keys = tmp_path / "certs", tmp_path / "keys", tmp_path / "rogue"
    assert _script("make-certs.sh", certs).returncode == 0
    assert _script("make-node-keys.sh", keys, str(NUM_NODES)).returncode == 0
    assert _script("make-node-keys.sh", rogue_keys, "1", str(NUM_NODES)).returncode == 0
    run_dir, _ = kit.start("--tls", certs, "--auth", keys)
    link_log = run_dir / "logs" / "superlink.log"
    registered = {}
    for task in range(NUM_NODES):
        text = (run_dir / "logs" / f"register-{task}.log").read_text()
        match = re.search(r"SuperNode (\d+) registered successfully", text)
        assert match, text
        registered[str(task)] = int(match.group(1))
    t_started = time.perf_counter() - t0

    # two intruders, knocking while the run goes: an unregistered key, and no key at all
    address = re.search(r'address = "([^"]+)"',
                        (run_dir / "flwr-home" / "config.toml").read_text()).group(1)
    base = [str(BIN / "flower-supernode"), "--superlink", address,
            "--root-certificates", str(certs / "ca.crt"),
            "--node-config", f"task-id={NUM_NODES}"]
    intruders = {
        "rogue": kit.popen("rogue", base + [
            "--port", str(free_port()),
            "--auth-supernode-private-key", str(rogue_keys / f"node-{NUM_NODES}")],
            _env(FLWR_HOME=str(tmp_path / "rogue-home"))),
        "keyless": kit.popen("keyless", base + ["--port", str(free_port())],
                             _env(FLWR_HOME=str(tmp_path / "keyless-home"))),
    }
    out, wall, context = _flwr_run(run_dir, tmp_path / "res.json")
    # the run was served by exactly the registered nodes, task by task
    assert _task_nodes(out) == registered, context

    for name, proc in intruders.items():
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the {name} SuperNode was not refused\n"
                                 f"{(tmp_path / f'{name}.log').read_text()}") from None
        assert proc.returncode != 0, name
    rogue_log = (tmp_path / "rogue.log").read_text()
    keyless_log = (tmp_path / "keyless.log").read_text()
    assert "Failed to activate SuperNode" in rogue_log, rogue_log
    assert "SuperNode authentication is enabled. All SuperNodes must be registered" \
        in keyless_log, keyless_log
    link_text = link_log.read_text()
    assert "No SuperNode found with the given public key" in link_text, link_text[-3000:]
    assert "[/v1/fleet/register-node][ApiError:2001]" in link_text, link_text[-3000:]
    assert link_text.count("[Fleet.ActivateNode] Activated node_id=") == NUM_NODES
    stop_s, alive = kit.stop(run_dir)
    assert alive == [], f"alive after stop.sh: {alive}"
    total = time.perf_counter() - t0
    print(f"\nnode-auth deployment: certs + keys + start + register {t_started:.1f} s, "
          f"flwr run {wall:.1f} s (per-round wall "
          f"{_per_round(out)} s), stop.sh {stop_s:.1f} s; total {total:.1f} s")
