"""What a SuperNode's ClientApp process pays for every message besides the handler itself.

Flower starts a fresh ``flwr-clientapp`` process per message. Before the app runs, that process
receives the whole FAB, unzips it into a temporary directory and hashes every file in it
(``flwr.cli.install.install_from_fab``); then it imports the app. So:

* the FAB ``flwr run .`` builds from this repository holds the package and its licence only
  (``fab-include`` in ``pyproject.toml``): the docs' results, tests, benchmarks and examples
  made it 7.4 MB (236 files) and cost each MOCHA message 0.15 s of CPU;
* a MOCHA-family message (whoami, two train rounds), handled with every optional package
  installed, imports none of the packages a device does not need (``test_device_install``
  blocks them, which a ``try: import ...`` fallback would hide; here they are importable and
  must stay out of ``sys.modules``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("device_child.py")
#: Packages installed here (the simulation and datasets extras) that a MOCHA device never needs.
NOT_ON_A_DEVICE = ("scipy", "sklearn", "matplotlib", "pandas", "ray", "torch", "numba",
                   "llvmlite", "datasets", "flwr_datasets", "pyarrow")
#: What the FAB may hold besides the package: Flower's manifest and rewritten pyproject.toml.
FAB_EXTRAS = {"LICENSE", "pyproject.toml", ".info/CONTENT"}
FAB_LIMIT_BYTES = 3 * 2**20  # the package is 1.6 MB; Flower refuses a FAB over 10 MB


def _fab_names() -> tuple[list[str], int]:
    fab = build_fab_from_disk(ROOT)
    return zipfile.ZipFile(io.BytesIO(fab)).namelist(), len(fab)


def test_fab_holds_the_package_and_its_licence_only() -> None:
    names, size = _fab_names()
    package = {path.relative_to(ROOT).as_posix() for path in (ROOT / "fmtl_flower").rglob("*.py")
               if "__pycache__" not in path.parts}
    outside = sorted(set(names) - package - FAB_EXTRAS)
    assert outside == [], f"{len(outside)} files outside the package, e.g. {outside[:5]}"
    assert package <= set(names), sorted(package - set(names))[:5]
    assert "LICENSE" in names
    assert size < FAB_LIMIT_BYTES, f"FAB of {size} bytes"


@pytest.mark.parametrize("strategy", ["mocha", "cocoa", "mb-sdca"])
def test_mocha_messages_import_nothing_a_device_does_not_need(strategy: str,
                                                              tmp_path: Path) -> None:
    for package in ("scipy", "numba", "pandas"):  # the check below is not vacuous here
        assert subprocess.run([sys.executable, "-c", f"import {package}"],
                              capture_output=True).returncode == 0, f"{package} not installed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FMTL_KERNELS", None)  # a device's default: numba only past the break-even
    proc = subprocess.run([sys.executable, str(CHILD), "", strategy, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["finite"] for r in out["rounds"]] == [True, True]
    assert out["rounds"][1]["state-ok"] == 1
    assert sorted(set(out["top_level"]) & set(NOT_ON_A_DEVICE)) == []
