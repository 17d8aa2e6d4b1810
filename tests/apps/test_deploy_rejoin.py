"""Slow loopback tests of a device that crashes, and of a SuperLink that lost its database,
with TLS and node authentication (``deploy/start-local.sh --tls --auth``, whose SuperNodes
run under ``deploy/bin/fmtl-supernode`` as ``supernode@.service`` runs them).

* ``test_crashed_device_restarted_at_once_rejoins``: during a MOCHA run the SuperNode of task 1
  (its launcher, ``flower-supernode``, SuperExec and any ClientApp) is SIGKILLed by PID, as if
  the device lost power, and started again at once with the same command line and
  environment. Its old node id still counts as online for up to 60 s, so ``flower-supernode``
  alone is refused with ``[code: 2004]`` and exits: the task stays missing and the run ends
  with ``primal`` None. The launcher releases the old id and rejoins under the same node id;
  the run ends complete.
* ``test_forgotten_supernode_exits_nonzero_with_the_register_command``: the SuperLink is
  killed and started again without its state (no ``--database``); the SuperNode's next call
  is answered ``401 Unauthorized``. ``flower-supernode`` exits 0 with no hint; the launcher
  exits 3 and prints the ``flwr supernode register`` command with the node's public key.

Every process is stopped by PID (``Kit.close``).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .loopback import kill_and_wait
from .processes import stop_processes
from .test_deploy_kit import BIN, ROOT, Kit, _env, _script, needs_openssl

pytestmark = [pytest.mark.slow, needs_openssl]

NUM_NODES = 2  # Kit.start starts test_deploy_kit.NUM_NODES SuperNodes
VICTIM = 1
ROUNDS = 5
RUN_TIMEOUT_S = 900.0


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[Kit]:
    k = Kit(tmp_path)
    try:
        yield k
    finally:
        k.close()


def _recorded_pid(run_dir: Path, name: str) -> int:
    for line in (run_dir / "pids").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == name:
            return int(fields[1])
    raise AssertionError(f"no {name} in {run_dir / 'pids'}")


def _command_and_env(pid: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a running process (to start it again as it was)."""
    proc = psutil.Process(pid)
    return proc.cmdline(), proc.environ()


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and its descendants, as a power loss would; the PIDs killed."""
    root = psutil.Process(pid)
    victims = [root, *root.children(recursive=True)]
    kill_and_wait(victims)
    return [v.pid for v in victims]


def _wait_log(path: Path, pattern: str, timeout: float, context: str = "") -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.is_file() else ""
        if match := re.search(pattern, text):
            return match
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {path} after {timeout:.0f} s\n{context}")


def _registered(run_dir: Path, task: int) -> int:
    text = (run_dir / "logs" / f"register-{task}.log").read_text()
    match = re.search(r"SuperNode (\d+) registered successfully", text)
    assert match, text
    return int(match.group(1))


def _auth_deployment(kit: Kit, tmp_path: Path) -> Path:
    certs, keys = tmp_path / "certs", tmp_path / "keys"
    assert _script("make-certs.sh", certs).returncode == 0
    assert _script("make-node-keys.sh", keys, str(NUM_NODES)).returncode == 0
    run_dir, _ = kit.start("--tls", certs, "--auth", keys)
    return run_dir


def test_crashed_device_restarted_at_once_rejoins(kit: Kit, tmp_path: Path) -> None:
    run_dir = _auth_deployment(kit, tmp_path)
    node_id = _registered(run_dir, VICTIM)
    results = tmp_path / "res.json"
    run_config = (f"num-tasks={NUM_NODES} dim=5 samples-per-task=30 num-server-rounds={ROUNDS} "
                  f"seed=3 round-timeout=60.0 results-file='{results}'")
    submit = kit.popen("flwr-run", [str(BIN / "flwr"), "run", str(ROOT), "local", "--stream",
                                    "--run-config", run_config],
                       _env(FLWR_HOME=str(run_dir / "flwr-home")))
    run_log = tmp_path / "flwr-run.log"
    _wait_log(run_log, rf"\[ROUND 2/{ROUNDS}\]", RUN_TIMEOUT_S, Kit.logs(run_dir))

    pid = _recorded_pid(run_dir, f"supernode-{VICTIM}")
    command, env = _command_and_env(pid)
    killed = _kill_tree(pid)
    restarted = kit.popen("restarted", command, env)  # at once, as it was started
    try:
        submit.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"flwr run still going\n{Kit.logs(run_dir)}") from None
    node_log = (tmp_path / "restarted.log").read_text(errors="replace")
    context = (f"killed {killed}; restarted as {command}\n--- restarted ---\n"
               f"{node_log[-4000:]}\n--- flwr run ---\n{run_log.read_text()[-3000:]}"
               f"{Kit.logs(run_dir)}")
    assert restarted.poll() is None, f"the restarted SuperNode exited\n{context}"
    assert f"SuperNode ID: {node_id}" in node_log, context  # rejoined under its own id
    out = json.loads(results.read_text())
    final = out["final"]
    assert final["complete"] is True and final["tasks_missing"] == [], context
    assert final["primal"] is not None and final["gap"] >= 0.0, final
    assert out["health"]["task_nodes"][str(VICTIM)] == node_id
    assert out["rounds"][-1]["num_replies"] == NUM_NODES, out["rounds"][-1]
    print(f"\nSuperNode of task {VICTIM} killed at round 2 and restarted at once: rejoined as "
          f"node {node_id}; missed rounds {out['health'].get('missed_rounds')}; "
          f"launcher: {re.findall(r'fmtl-supernode: .*', node_log)}")


def test_forgotten_supernode_exits_nonzero_with_the_register_command(
        kit: Kit, tmp_path: Path) -> None:
    run_dir = _auth_deployment(kit, tmp_path)
    # the SuperNode of task 0 again, as a child of this test (to read its exit status)
    first = _recorded_pid(run_dir, "supernode-0")
    command, env = _command_and_env(first)
    stop_processes([psutil.Process(first)], grace=30.0)
    node = kit.popen("node-0", command, env)
    node_log = tmp_path / "node-0.log"
    _wait_log(node_log, r"SuperNode ID: \d+", 120.0, Kit.logs(run_dir))
    link_pid = _recorded_pid(run_dir, "superlink")
    command, env = _command_and_env(link_pid)
    assert "--database" not in command
    _kill_tree(link_pid)
    kit.popen("superlink-again", command, env)  # a SuperLink that has forgotten every node
    try:
        status = node.wait(timeout=240.0)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the SuperNode did not stop\n{node_log.read_text()}") from None
    text = node_log.read_text(errors="replace")
    context = f"exit {status}\n{text[-4000:]}"
    assert status == 3, context  # flower-supernode alone: 0
    assert "401 Unauthorized" in text, context
    pub = tmp_path / "keys" / "node-0.pub"
    assert f"flwr supernode register {pub}" in text, context
    assert pub.read_text().split()[1] in text, context  # the key itself, to check it
    print(f"\nforgotten SuperNode: exit {status}; "
          f"{re.findall(r'fmtl-supernode: .*', text)}")
