"""The Control API out of the devices' reach: ``deploy/start-local.sh --fleet-proxy``.

flwr 1.41/1.42 serves the Fleet, Control and runtime APIs on one HTTP port, and the Control
API has no authentication in open-source flwr: whoever reaches the devices' port could
register node keys, submit runs or unregister devices. The kit binds the SuperLink to
127.0.0.1 and puts nginx in front of it, forwarding only ``/v1/fleet/``.

Fast: the rendered nginx configuration forwards ``/v1/fleet/`` alone and nginx accepts it.
Slow (``-m slow``, needs nginx and openssl): a TLS + node-auth deployment behind the proxy
trains MOCHA with SuperNodes that dial the proxy, while from the devices' side (the proxy's
address) no Control API route answers: ``flwr ls`` and ``flwr supernode register`` fail, raw
requests get nginx's 404, the same requests sent to the SuperLink on loopback reach FastAPI;
the SuperLink listens on loopback only and its SQLite state is private (0600).
"""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .test_deploy_kit import BIN, NUM_NODES, ROOT, Kit, _env, _flwr_run, _script, _task_nodes

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="no nginx (apt-get install nginx-light; .ci/run installs it)")
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")

#: Routes a device must not reach: the Control API (runs, node registry), the ServerApp's
#: runtime API, FastAPI's own pages, and a path-traversal attempt from an allowed prefix.
FORBIDDEN = ("/v1/control/list-runs", "/v1/control/register-node",
             "/v1/control/unregister-node", "/v1/control/start-run", "/v1/control/stop-run",
             "/v1/runtime/get-run", "/docs", "/openapi.json", "/health",
             "/v1/fleet/../control/list-runs", "/v1/fleet/%2e%2e/control/list-runs")


def _post(url: str, ca: Path) -> tuple[int, str]:
    """POST an empty protobuf body; (status, body) whatever the status."""
    request = urllib.request.Request(url, data=b"", method="POST",
                                     headers={"content-type": "application/protobuf"})
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


@needs_openssl
def test_rendered_proxy_forwards_the_fleet_api_only(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    assert _script("make-certs.sh", certs).returncode == 0
    out = _script("make-fleet-proxy.sh", certs, "--listen", "127.0.0.1:18443",
                  "--upstream", "127.0.0.1:18000")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "listen 127.0.0.1:18443 ssl;" in text
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    blocks = re.split(r"\blocation\s+", code)[1:]  # each starts with its prefix
    forwarded = [(block.split()[0], target) for block in blocks
                 for target in re.findall(r"proxy_pass\s+(\S+);", block)]
    assert forwarded == [("/v1/fleet/", "https://127.0.0.1:18000/v1/fleet/")], forwarded
    assert re.search(r"location\s+/\s*\{\s*return 404;\s*\}", text), text
    assert f"proxy_ssl_trusted_certificate {certs.resolve() / 'ca.crt'};" in text
    bad = _script("make-fleet-proxy.sh", certs, "--listen", "8443; include /etc/passwd")
    assert bad.returncode == 2 and "--listen must be" in bad.stderr
    if NGINX is not None:
        conf = _script("make-fleet-proxy.sh", certs, "--standalone", tmp_path / "ng")
        assert conf.returncode == 0, conf.stderr
        checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path / "ng"), "-c",
                                  conf.stdout.strip(), "-e", str(tmp_path / "ng" / "e.log")],
                                 capture_output=True, text=True, check=False)
        assert checked.returncode == 0, checked.stderr


@needs_openssl
def test_start_local_fleet_proxy_refuses_bad_setups(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    assert _script("make-certs.sh", certs).returncode == 0
    cases = {
        "no tls": (["--fleet-proxy", "0"], "--fleet-proxy needs --tls"),
        "no nginx": (["--fleet-proxy", "0", "--tls", certs, "--nginx", tmp_path / "nope"],
                     "apt-get install nginx-light"),
        "bad port": (["--fleet-proxy", "x", "--tls", certs], "must be a port number"),
    }
    for name, (args, message) in cases.items():
        run_dir = tmp_path / name.replace(" ", "-")
        out = _script("start-local.sh", "1", "--run-dir", run_dir, *args, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (name, out)
        assert not (run_dir / "pids").exists() or (run_dir / "pids").read_text() == "", name


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[Kit]:
    k = Kit(tmp_path)
    try:
        yield k
    finally:
        k.close()


def _listening(pid: int) -> set[str]:
    """The addresses a process (and its children) listens on."""
    proc = psutil.Process(pid)
    found = set()
    for p in [proc, *proc.children(recursive=True)]:
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.add(conn.laddr.ip)
    return found


@pytest.mark.slow
@needs_openssl
@needs_nginx
def test_devices_train_through_the_proxy_and_reach_no_control_api(kit: Kit,
                                                                  tmp_path: Path) -> None:
    t0 = time.perf_counter()
    certs, keys, rogue = tmp_path / "certs", tmp_path / "keys", tmp_path / "rogue"
    assert _script("make-certs.sh", certs).returncode == 0
    assert _script("make-node-keys.sh", keys, str(NUM_NODES)).returncode == 0
    assert _script("make-node-keys.sh", rogue, "1", str(NUM_NODES)).returncode == 0
    database = tmp_path / "state.db"
    run_dir, printed = kit.start("--tls", certs, "--auth", keys, "--fleet-proxy", "0",
                                 "--database", database)
    proxy = re.search(r"SuperNodes dial (127\.0\.0\.1:\d+)", printed).group(1)
    link = re.search(r'address = "([^"]+)"',
                     (run_dir / "flwr-home" / "config.toml").read_text()).group(1)
    assert proxy != link
    pids = dict(line.split()[:2] for line in (run_dir / "pids").read_text().splitlines())
    assert _listening(int(pids["superlink"])) == {"127.0.0.1"}
    assert database.stat().st_mode & 0o077 == 0, oct(database.stat().st_mode)
    for task in range(NUM_NODES):
        log = (run_dir / "logs" / f"supernode-{task}.log").read_text()
        assert proxy in " ".join(psutil.Process(int(pids[f"supernode-{task}"])).cmdline()), log

    # the devices join and train through the proxy
    out, wall, context = _flwr_run(run_dir, tmp_path / "res.json")
    assert sorted(_task_nodes(out)) == [str(t) for t in range(NUM_NODES)], context
    access = (run_dir / "nginx" / "access.log").read_text()
    for task in range(NUM_NODES):  # the devices kept their state (client-state-dir)
        state = run_dir / "nodes" / f"node-{task}" / "state"
        assert any(p.is_file() for p in state.iterdir()), sorted(state.iterdir())
    assert re.search(r'"POST /v1/fleet/push-messages HTTP/1.1" 200', access), access[-2000:]

    # from the devices' side, no Control API: the flwr CLI pointed at the proxy fails ...
    device_home = tmp_path / "device-home"
    device_home.mkdir()
    (device_home / "config.toml").write_text(
        '[superlink]\ndefault = "devices"\n\n[superlink.devices]\n'
        f'address = "{proxy}"\nroot-certificates = "{certs.resolve() / "ca.crt"}"\n')
    device_env = _env(FLWR_HOME=str(device_home))
    for args in (["ls", "devices"],
                 ["supernode", "register", str(rogue / f"node-{NUM_NODES}.pub"), "devices"],
                 ["supernode", "list", "devices"]):
        cli = subprocess.run([str(BIN / "flwr"), *args], cwd=ROOT, env=device_env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert cli.returncode != 0 and "404 Not Found" in cli.stdout + cli.stderr, (args, cli)
    # ... while on loopback it works, and the rogue key was never registered
    listed = subprocess.run([str(BIN / "flwr"), "supernode", "list", "local"], cwd=ROOT,
                            env=_env(FLWR_HOME=str(run_dir / "flwr-home")),
                            capture_output=True, text=True, timeout=120, check=False)
    assert listed.returncode == 0, listed
    registered = {re.search(r"SuperNode (\d+) registered",
                            (run_dir / "logs" / f"register-{t}.log").read_text()).group(1)
                  for t in range(NUM_NODES)}
    assert set(re.findall(r"\b(\d{6,})\b", listed.stdout)) == registered, listed.stdout
    # raw requests: nginx answers 404 itself; the SuperLink has every route (not a 404 for
    # the Control API's)
    for path in FORBIDDEN:
        status, body = _post(f"https://{proxy}{path}", certs / "ca.crt")
        assert status == 404 and "<center>nginx</center>" in body, (path, status, body)
    for path in ("/v1/control/list-runs", "/v1/control/register-node"):
        status, body = _post(f"https://{link}{path}", certs / "ca.crt")
        assert status != 404 and "nginx" not in body, (path, status, body)
    # and nothing but the Fleet API ever reached the SuperLink through the proxy
    forwarded = re.findall(r"uri=(\S+) upstream=(\S+)",
                           (run_dir / "nginx" / "access.log").read_text())
    assert len(forwarded) > len(FORBIDDEN)
    leaked = [uri for uri, upstream in forwarded
              if upstream != "-" and not uri.startswith("/v1/fleet/")]
    assert leaked == [], leaked

    stop_s, alive = kit.stop(run_dir)
    assert alive == [], f"alive after stop.sh: {alive}"
    print(f"\nfleet-proxy deployment: flwr run {wall:.1f} s, stop.sh {stop_s:.1f} s, "
          f"total {time.perf_counter() - t0:.1f} s")

