"""``fmtl-supernode`` (:mod:`fmtl_flower.supernode_launcher`) against a fake ``flower-supernode``.

The fake is a Python script that prints what flwr 1.42's SuperNode prints in each case and
exits as it does (the real one against a real SuperLink: ``test_deploy_rejoin.py``, slow):

* refused (``[code: 2004]``, exit 1) on its first starts, then activated: the launcher tries
  again with a pause and ends with the SuperNode's own status; it records the node id;
* refused for good: exit 2 after ``--activation-wait`` with the register hint;
* activated, then ``401 Unauthorized`` and exit 0 (a SuperLink that lost its database): exit 3
  with the ``flwr supernode register`` command and the device's public key;
* "Run ID ... is not in `RUNNING` status. Ignoring message ...": the ``flwr-clientapp`` of
  that message, started before the line (SuperExec did not wait for the content) or after
  it, would wait for hours and is stopped; those of messages the SuperNode did not give up
  are left alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fmtl_flower import supernode_launcher as launcher

FAKE_SUPERNODE = textwrap.dedent('''\
    #!{python}
    """A stand-in for flower-supernode: behaviour from FAKE_MODE, attempts counted in a file."""
    import os, subprocess, sys, time
    from pathlib import Path

    count_file = Path(os.environ["FAKE_COUNT"])
    count = int(count_file.read_text()) + 1 if count_file.exists() else 1
    count_file.write_text(str(count))
    mode = os.environ["FAKE_MODE"]
    print("INFO :      Starting Flower SuperNode", flush=True)
    refusals = int(os.environ.get("FAKE_REFUSALS", "0"))
    if mode == "refused" or (mode == "refused-then-ok" and count <= refusals):
        print("ERROR :     Exit Code: 305\\nFailed to initialize the connection to the "
              "SuperLink.\\n[code: 2004] Failed to activate SuperNode.", flush=True)
        sys.exit(1)
    print("INFO :      SuperNode ID: 4242", flush=True)
    if mode == "unauthorized":
        print("httpx.HTTPStatusError: Client error '401 Unauthorized' for url "
              "'https://127.0.0.1:9092/v1/fleet/pull-messages'", flush=True)
        sys.exit(0)
    if mode == "orphans":
        app = os.environ["FAKE_CLIENTAPP"]

        def receiving(message):
            print(f"INFO :      Receiving: train message (ID: {{message}})", flush=True)
            time.sleep(1.0)

        def ignoring(message):
            print(f"INFO :      Run ID 7 is not in `RUNNING` status. Ignoring message "
                  f"{{message}}.", flush=True)
            time.sleep(1.0)

        def start():
            proc = subprocess.Popen([app])
            time.sleep(1.5)
            return proc

        receiving("aaa")
        kept = start()  # served aaa, still exiting when bbb is pulled
        receiving("bbb")
        early = start()  # SuperExec started bbb's ClientApp before its content came
        ignoring("bbb")
        receiving("ccc")
        ignoring("ccc")
        late = start()  # ccc's ClientApp, started after the SuperNode gave ccc up
        receiving("ddd")
        kept2 = start()
        deadline = time.monotonic() + 8
        while (early.poll() is None or late.poll() is None) and time.monotonic() < deadline:
            time.sleep(0.1)
        procs = dict(kept=kept, early=early, late=late, kept2=kept2)
        print("FAKE " + " ".join(f"{{k}}={{p.pid}},{{p.poll()}}" for k, p in procs.items()),
              flush=True)
        for proc in (kept, kept2):
            proc.terminate()
            proc.wait()
        sys.exit(0)
    sys.exit(0)
''')


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    """Environment for the launcher with the fake on PATH (as ``flower-supernode``)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "flower-supernode"
    exe.write_text(FAKE_SUPERNODE.format(python=sys.executable))
    exe.chmod(0o755)
    app = bindir / "flwr-clientapp"
    app.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    app.chmod(0o755)
    env = dict(os.environ)
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", FLWR_HOME=str(tmp_path / "home"),
               FAKE_COUNT=str(tmp_path / "count"), FAKE_CLIENTAPP=str(app),
               PYTHONPATH=os.pathsep.join(sys.path))
    return env


def _key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path = tmp_path / "node-0"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    return path


def _launch(env: dict[str, str], *args: str, timeout: float = 120.0
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fmtl_flower.supernode_launcher", *args],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_refused_activation_is_retried_until_the_node_joins(fake, tmp_path):
    fake.update(FAKE_MODE="refused-then-ok", FAKE_REFUSALS="2")
    t0 = time.monotonic()
    out = _launch(fake, "--superlink", "127.0.0.1:9", "--insecure")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "count").read_text() == "3"
    assert out.stdout.count("activation refused") == 2, out.stdout
    assert time.monotonic() - t0 >= launcher.BACKOFF_S[0] + launcher.BACKOFF_S[1]
    record = json.loads((tmp_path / "home" / "fmtl-supernode.json").read_text())
    assert record == {"superlink": "127.0.0.1:9", "public_key": None, "node_id": 4242}


def test_refused_for_good_exits_2_with_the_register_hint(fake, tmp_path):
    fake.update(FAKE_MODE="refused")
    key = _key(tmp_path)
    out = _launch(fake, "--activation-wait", "1", "--superlink", "127.0.0.1:9",
                  "--root-certificates", str(tmp_path / "ca.crt"),
                  "--auth-supernode-private-key", str(key))
    assert out.returncode == launcher.EXIT_NOT_ACTIVATED, out.stdout + out.stderr
    assert int((tmp_path / "count").read_text()) >= 2
    assert f"flwr supernode register {key}.pub <connection>" in out.stdout, out.stdout
    assert launcher.public_key_line(str(key)) in out.stdout


def test_a_forgotten_node_exits_3_with_the_register_command(fake, tmp_path):
    fake.update(FAKE_MODE="unauthorized")
    key = _key(tmp_path)
    out = _launch(fake, "--superlink", "127.0.0.1:9", "--root-certificates",
                  str(tmp_path / "ca.crt"), "--auth-supernode-private-key", str(key))
    assert out.returncode == launcher.EXIT_UNAUTHORIZED, out.stdout + out.stderr
    assert "no longer recognises node 4242 (401 Unauthorized)" in out.stdout, out.stdout
    assert f"flwr supernode register {key}.pub <connection>" in out.stdout
    assert launcher.public_key_line(str(key)) in out.stdout


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_the_clientapp_of_an_ignored_message_is_stopped_and_no_other(fake):
    fake.update(FAKE_MODE="orphans")
    out = _launch(fake, "--superlink", "127.0.0.1:9", "--insecure")
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(li for li in out.stdout.splitlines() if li.startswith("FAKE "))
    procs = {k: v.split(",") for k, v in (item.split("=") for item in line.split()[1:])}
    assert procs["early"][1] == procs["late"][1] == "-15", out.stdout  # SIGTERM
    assert procs["kept"][1] == procs["kept2"][1] == "None", out.stdout  # still running
    stopped = sorted(int(pid) for pid in
                     re.findall(r"fmtl-supernode: stopping flwr-clientapp (\d+)", out.stdout))
    assert stopped == sorted([int(procs["early"][0]), int(procs["late"][0])]), out.stdout


def test_arguments_go_to_flower_supernode_and_the_state_file_defaults_to_flwr_home(
        monkeypatch, tmp_path):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    args, rest, node = launcher.parse_args([
        "--superlink", "10.0.0.1:8443", "--node-config", "task-id=3",
        "--activation-wait", "30", "--root-certificates", "/c/ca.crt",
        "--auth-supernode-private-key=/k/node-3"])
    assert rest == ["--superlink", "10.0.0.1:8443", "--node-config", "task-id=3",
                    "--root-certificates", "/c/ca.crt", "--auth-supernode-private-key=/k/node-3"]
    assert args.activation_wait == 30.0
    assert args.state_file == tmp_path / "fmtl-supernode.json"
    assert node == launcher.SuperNodeArgs("10.0.0.1:8443", False, "/c/ca.crt", "/k/node-3")
