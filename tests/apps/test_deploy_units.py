"""The kit's systemd units: what an operator leaving them running depends on.

* ``supernode@.service`` gives the device a ``client-state-dir`` inside a directory systemd
  creates for the service user (``StateDirectory=``), so a resumed run resumes the device's
  state instead of resetting every task; files are created private (``UMask=0077``);
* ``superlink.service`` binds 127.0.0.1 only (the Control API shares the port and has no
  authentication: devices go through the fleet proxy), creates the directories runs write
  results and checkpoints to, keeps its SQLite state private, and has no ``PrivateTmp`` that
  would hide a results file;
* both restart for ever (a refused SuperNode exits 0; a crashed device is refused until its
  old node id times out, about 60 s, so it must keep trying);
* ``supernode@.service`` runs ``flower-supernode`` under ``fmtl-supernode`` (a crashed device
  rejoins at once; a forgotten one exits non-zero with the register command);
* both pass ``systemd-analyze verify`` (when systemd-analyze is installed).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_deploy_kit import DEPLOY, _unit

UNITS = DEPLOY / "systemd"


def _exec_start(name: str, instance: str = "3") -> list[str]:
    """The unit's ExecStart as argv, continuation lines joined and ``%i`` filled in."""
    text = (UNITS / name).read_text().replace("\\\n", " ")
    line = next(li for li in text.splitlines() if li.startswith("ExecStart="))
    return shlex.split(line.split("=", 1)[1].replace("%i", instance))


def _state_dirs(name: str, instance: str = "3") -> list[Path]:
    return [Path("/var/lib") / entry.replace("%i", instance)
            for value in _unit(name)["StateDirectory"] for entry in value.split()]


def test_supernode_keeps_its_state_in_a_directory_systemd_creates() -> None:
    argv = _exec_start("supernode@.service")
    config = argv[argv.index("--node-config") + 1]
    pairs = dict(item.split("=", 1) for item in shlex.split(config))
    assert pairs["task-id"] == "3"
    state = Path(pairs["client-state-dir"])
    assert state in _state_dirs("supernode@.service"), (state, _state_dirs("supernode@.service"))
    assert Path(argv[0]).name == "fmtl-supernode"
    unit = _unit("supernode@.service")
    assert unit["UMask"] == ["0077"]
    assert unit["Restart"] == ["always"] and unit["StartLimitIntervalSec"] == ["0"]
    # a crashed device is refused for up to 2 heartbeats (60 s): several tries must fit
    assert 0 < int(unit["RestartSec"][0]) <= 30


def test_superlink_is_loopback_only_private_and_writes_where_runs_write() -> None:
    argv = _exec_start("superlink.service")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "0.0.0.0" not in argv
    unit = _unit("superlink.service")
    assert unit["UMask"] == ["0077"]
    assert unit.get("PrivateTmp", ["false"]) == ["false"]
    dirs = _state_dirs("superlink.service")
    database = Path(argv[argv.index("--database") + 1])
    assert database.parent in dirs
    assert {Path("/var/lib/flwr/results"), Path("/var/lib/flwr/checkpoints")} <= set(dirs)
    guide = (DEPLOY / "README.md").read_text()
    assert "results-file='/var/lib/flwr/results/" in guide
    assert "checkpoint-dir='/var/lib/flwr/checkpoints/" in guide


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # the executables the units start, from this venv; fmtl-supernode is the console script
    # of `pip install fmtl-flower` (deploy/bin/fmtl-supernode where this venv predates it)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    real = Path(sys.executable).parent
    for exe in ("flower-superlink", "fmtl-supernode"):
        source = real / exe
        if not source.exists() and exe == "fmtl-supernode":
            source = DEPLOY / "bin" / exe
        (venv / "bin" / exe).symlink_to(source)
    for name in ("superlink.service", "supernode@.service"):
        text = (UNITS / name).read_text().replace("/opt/fmtl/venv", str(venv))
        target = "supernode@3.service" if "@" in name else name
        (tmp_path / target).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          str(tmp_path / "superlink.service"),
                          str(tmp_path / "supernode@3.service")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
