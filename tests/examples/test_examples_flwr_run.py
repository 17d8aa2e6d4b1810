"""Each example app runs with ``flwr run .`` as it is (Flower's default local simulation:
2 SuperNodes), in a sandbox: private ``FLWR_HOME`` and SuperLink ports, no runtime
dependency installation; every process the run caused is stopped by PID afterwards."""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..apps.test_flwr_run import flwr_sandbox  # noqa: F401 - the sandbox fixture
from .helpers import EXAMPLES, NAMES
from .test_examples import FINAL

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 420.0


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_with_flwr_run(name: str, flwr_sandbox: dict[str, str]) -> None:  # noqa: F811
    folder = EXAMPLES / name
    pyproject = hashlib.sha256((folder / "pyproject.toml").read_bytes()).digest()
    command = [str(Path(sys.executable).parent / "flwr"), "run", ".", "--stream"]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=folder, env=flwr_sandbox, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    elapsed = time.perf_counter() - started
    output = proc.stdout + proc.stderr
    context = f"$ {shlex.join(command)} (in {folder}; exit {proc.returncode}, " \
              f"{elapsed:.1f} s)\n{output[-5000:]}"
    assert proc.returncode == 0, context
    assert FINAL[name] in output, context
    assert "Traceback" not in output, context
    assert hashlib.sha256((folder / "pyproject.toml").read_bytes()).digest() == pyproject
    print(f"{name}: flwr run . in {elapsed:.1f} s")
