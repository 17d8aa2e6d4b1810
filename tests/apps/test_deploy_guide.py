"""``deploy/README.md`` walked through as written: every loopback command block of the guide
(each top-level fenced ``bash`` block without ``sudo``) runs in a fresh ``bash -e`` from the
repository root, with ``/tmp/`` replaced by a temporary directory, and succeeds. The blocks
submit with ``deploy/bin/fmtl-submit`` (a failed run fails the block) or, in the quickstart,
with plain ``flwr run`` and a ``results-file`` checked here.

Fast: the guide has the blocks this test expects (quickstart, TLS, node authentication, the
fleet proxy). Slow (``-m slow``; nginx and openssl needed): they all run. Whatever a block
started is stopped by PID afterwards (``stop.sh`` of every run directory left with a
``pids`` file, then every process carrying one of the test's ``FLWR_HOME`` directories).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .test_deploy_kit import DEPLOY, ROOT, Kit, _env

GUIDE = DEPLOY / "README.md"
needs_tools = pytest.mark.skipif(
    shutil.which("openssl") is None or (shutil.which("nginx") is None
                                        and not Path("/usr/sbin/nginx").is_file()),
    reason="needs openssl and nginx (apt-get install nginx-light; .ci/run installs it)")


def loopback_blocks() -> list[str]:
    """The guide's top-level ``bash`` blocks that run on one machine (no ``sudo``)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", GUIDE.read_text(), re.S | re.M)
    return [block for block in blocks if "sudo " not in block]


def test_guide_has_the_loopback_walkthrough() -> None:
    blocks = loopback_blocks()
    assert len(blocks) == 4, blocks
    assert "start-local.sh 3 --run-dir /tmp/fmtl-run" in blocks[0]
    assert "--tls /tmp/fmtl-certs --run-dir" in blocks[1]
    assert "--auth /tmp/fmtl-keys" in blocks[2]
    assert "--fleet-proxy 0" in blocks[3]
    for block in blocks[1:]:
        assert "deploy/bin/fmtl-submit" in block and "deploy/stop.sh" in block


@pytest.mark.slow
@needs_tools
def test_guide_blocks_run_as_written(tmp_path: Path) -> None:
    kit = Kit(tmp_path)
    timings = []
    try:
        for number, block in enumerate(loopback_blocks(), start=1):
            script = block.replace("/tmp/", f"{tmp_path}/")
            t0 = time.perf_counter()
            out = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=_env(),
                                 capture_output=True, text=True, timeout=900, check=False)
            kit.run_dirs += [p.parent for p in tmp_path.glob("fmtl-*/pids*")
                             if p.parent not in kit.run_dirs]
            logs = "".join(Kit.logs(d) for d in kit.run_dirs)
            assert out.returncode == 0, (f"block {number} failed ({out.returncode}):\n{script}\n"
                                         f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}{logs}")
            timings.append(f"block {number} {time.perf_counter() - t0:.0f} s")
        results = json.loads((tmp_path / "fmtl-run" / "res.json").read_text())
        assert results["final"]["complete"] is True
        assert [r["num_replies"] for r in results["rounds"][1:]] == [3, 3, 3]
        assert not any((d / "pids").exists() for d in kit.run_dirs), "a block left processes"
        print("\nguide walkthrough: " + ", ".join(timings))
    finally:
        kit.close()
