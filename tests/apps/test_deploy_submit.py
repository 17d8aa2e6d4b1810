"""``deploy/bin/fmtl-submit``: a failed run is a failed command.

``flwr run --stream`` exits 0 whatever becomes of the ServerApp (an exception, or the process
killed: the run then ends ``finished:failed`` on the SuperLink), so a cron job or CI step
cannot see a failure. The wrapper submits with ``flwr run``, then reads the run's final
status with ``flwr ls --run-id ID --format json``.

Fast: usage errors. Slow (``-m slow``, one SuperNode on loopback): a run whose ServerApp
raises at once exits 1 and names the status and the exception, where plain ``flwr run``
exits 0; a good run exits 0; a run stopped with ``flwr stop`` exits 3.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from .loopback import ROOT, LoopbackFederation

SUBMIT = ROOT / "deploy" / "bin" / "fmtl-submit"
BAD_CONFIG = "num-tasks=-1 num-server-rounds=1"  # the ServerApp raises ConfigError at start
GOOD_CONFIG = "num-tasks=1 dim=5 samples-per-task=30 num-server-rounds=1 round-timeout=120.0"
LONG_CONFIG = "num-tasks=1 dim=5 samples-per-task=30 num-server-rounds=200 round-timeout=120.0"


def _submit(fed: LoopbackFederation | None, *args: str, timeout: float = 420.0
            ) -> subprocess.CompletedProcess:
    env = fed.env if fed is not None else None
    return subprocess.run(["bash", str(SUBMIT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_usage_errors() -> None:
    assert SUBMIT.is_file() and SUBMIT.stat().st_mode & 0o111, "fmtl-submit is not executable"
    helped = _submit(None, "--help")
    assert helped.returncode == 0 and "finished:failed" in helped.stdout
    assert _submit(None).returncode == 2
    bad = _submit(None, "--poll", "soon", ".")
    assert bad.returncode == 2 and "--poll needs whole seconds" in bad.stderr


@pytest.mark.slow
def test_exit_status_follows_the_run(tmp_path: Path) -> None:
    fed = LoopbackFederation(tmp_path, num_nodes=1).start()
    try:
        fed.wait_nodes_registered()
        # plain flwr run: exit 0 although the ServerApp raised
        plain = fed.flwr("run", ".", "loopback", "--stream", "--run-config", BAD_CONFIG,
                         timeout=300)
        plain_id = re.search(r"started run (\d+)", plain.stdout).group(1)
        status = fed.flwr("ls", "loopback", "--run-id", plain_id, "--format", "json")
        assert plain.returncode == 0 and "finished:failed" in status.stdout, \
            (plain.stdout[-2000:], status.stdout)

        failed = _submit(fed, "--poll", "2", ".", "loopback", "--run-config", BAD_CONFIG)
        last = failed.stderr.strip().splitlines()[-1]
        assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr
        assert re.fullmatch(r"fmtl-submit: run \d+ finished:failed \(ServerApp failed.*", last), \
            last
        assert "num-tasks: must be >= 0" in last, last

        t0 = time.perf_counter()
        good = _submit(fed, "--poll", "2", ".", "loopback", "--run-config", GOOD_CONFIG)
        assert good.returncode == 0, good.stdout[-3000:] + good.stderr + fed.context()
        assert "finished:completed" in good.stderr.strip().splitlines()[-1]
        good_s = time.perf_counter() - t0

        long_run = subprocess.Popen(["bash", str(SUBMIT), "--poll", "2", ".", "loopback",
                                     "--run-config", LONG_CONFIG], cwd=ROOT, env=fed.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            run_id = None
            while run_id is None and time.monotonic() < deadline:
                listed = fed.flwr("ls", "loopback", "--format", "json").stdout
                running = re.findall(r'"run-id": "(\d+)",[^}]*?"status": "running"', listed,
                                     re.S)
                run_id = running[0] if running else None
                time.sleep(2)
            assert run_id is not None, fed.context()
            assert fed.flwr("stop", run_id, "loopback").returncode == 0
            _, err = long_run.communicate(timeout=300)
        finally:
            if long_run.poll() is None:
                long_run.kill()
                long_run.wait(timeout=30)
        assert long_run.returncode == 3, err
        assert "finished:stopped" in err.strip().splitlines()[-1]
        print(f"\nfmtl-submit: a good 1-round run {good_s:.1f} s; failed -> 1, stopped -> 3")
    finally:
        left = fed.stop()
        assert left == [], f"still alive: {left}"
