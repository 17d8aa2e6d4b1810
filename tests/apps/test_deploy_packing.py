"""Task packing on a real loopback deployment: two SuperNodes host three tasks each.

One ``flower-superlink`` and two ``flower-supernode`` processes on 127.0.0.1 (private
``FLWR_HOME``, :mod:`tests.apps.loopback`), started with ``--node-config "task-ids='0,1,2'"``
and ``"task-ids='3,4,5'"``: a device with several users, or a silo with several sites. A MOCHA
run with ``tasks-per-node=3`` over them completes with all six tasks replying in every round,
sends one message per node and round (counted in the SuperNodes' logs), and its records equal the
in-process engine's run of the same config with one task per node. Every process is stopped by
PID in the teardown; none may survive.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from fmtl_flower.core.jit import KERNELS_ENV

from .loopback import BIN, LoopbackFederation

pytestmark = pytest.mark.slow

ROUNDS = 3
RUN_CONFIG = (f"strategy='mocha' num-tasks=6 dim=5 samples-per-task=30 num-server-rounds={ROUNDS} "
              "mocha.omega-every=2 seed=2 round-timeout=90.0 tasks-per-node=3")


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s")}


def test_two_supernodes_host_three_tasks_each(tmp_path) -> None:
    fed = LoopbackFederation(tmp_path, 2, node_configs=["task-ids='0,1,2'", "task-ids='3,4,5'"])
    # the same kernels on both sides, so that the records can be compared bit for bit: a
    # deployment's ClientApps choose per call (auto), `fmtl run` is a simulation (numba for
    # every call unless FMTL_KERNELS says otherwise)
    fed.env[KERNELS_ENV] = "auto"
    try:
        fed.start()
        fed.wait_nodes_registered()
        results = tmp_path / "packed.json"
        sub = fed.submit(f"{RUN_CONFIG} results-file='{results}'", results=results)
        sub.wait(1200.0, fed.context())
        assert sub.popen.returncode == 0, fed.context()
        out = sub.read_results()
        logs = [fed.node_logs[0].read_text(), fed.node_logs[1].read_text()]
    finally:
        survivors = fed.stop()
    assert not survivors, f"processes still alive: {survivors}"
    final = out["final"]
    assert final["complete"] is True and final["num_replies"] == 6
    assert all(r["num_replies"] == 6 for r in out["rounds"][1:])
    # per node: the slots query, whoami, one train message per round and the final evaluate
    # (a SuperNode logs "Sent successfully" after each reply); unpacked it would be 3x that
    for log in logs:
        assert log.count("Sent successfully") == ROUNDS + 3, log[-3000:]
    # the same federation with one task per node, in-process
    ref = tmp_path / "inprocess.json"
    args = [str(BIN / "fmtl"), "run", "mocha", "--rounds", str(ROUNDS), "--quiet", "--out",
            str(ref)]
    for pair in re.findall(r"([\w.-]+)=('[^']*'|\S+)", RUN_CONFIG):
        key, value = pair[0], pair[1].strip("'")
        if key not in ("strategy", "num-server-rounds", "tasks-per-node"):
            args += ["--set", f"{key}={value}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, KERNELS_ENV: "auto"})  # as the deployment's
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    expected = json.loads(ref.read_text())
    assert [_untimed(r) for r in out["rounds"]] == [_untimed(r) for r in expected["rounds"]]
