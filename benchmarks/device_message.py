"""Per-message cost of a device: one train message handled the way a SuperNode handles it.

Flower starts a fresh ``flwr-clientapp`` process for every message. Each measured process
here does what that process does for one MOCHA ``train`` message: import Flower's ClientApp
runtime and the app (``fmtl_flower.apps.client_app:app``, the ``flwr run`` ClientApp), load
the task's data, load the dual state from the device's ``client-state-dir``, commit the
previous round, run local SDCA, build the reply and write the state file. The same run
measures a trivial ClientApp (the same runtime imports, a ``train`` handler that answers with
an empty update of the same size) in fresh processes of its own.

Variants: ``trivial``; ``mocha`` (the default ``FMTL_KERNELS=auto``: numba only for a
message whose local work passes the break-even of :mod:`fmtl_flower.core.jit`, else numpy
without importing numba); ``mocha-numba`` (``FMTL_KERNELS=numba``, its on-disk cache warm: a
first, unmeasured process compiled the kernels into ``<client-state-dir>/numba-cache``);
``mocha-numpy`` (``FMTL_KERNELS=numpy``: numba is never imported). Without numba (an
install where it has no wheels, e.g. armv7) ``mocha-numba`` is skipped with a line saying so
(and listed under ``skipped`` in the JSON). Each figure is the
median over ``--repeats`` processes: wall time from spawn to exit, CPU time (user + system)
and peak RSS of the process (``wait4``). Prints a table, the ratios to the trivial ClientApp,
and one JSON line.

    python benchmarks/device_message.py [--repeats 7] [--samples-per-task N] [--dim D]

Target (issue 15): the MOCHA client within 1.3x of the trivial ClientApp's time and RSS with
numba installed and its cache warm (the ``mocha`` variant; ``mocha-numba`` shows what
importing numba costs a message).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = 3


def child(kind: str, state_dir: str, server_round: int, samples: int, dim: int) -> None:
    """One message in this (fresh) process; prints the reply's size and the steps done."""
    import flwr.supernode.runtime.run_clientapp  # noqa: F401  - what flwr-clientapp imports
    import numpy as np
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MessageType,
        RecordDict,
    )
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, server_round
    run_config = {"strategy": "mocha", "dataset": "synthetic", "seed": 0}
    if samples:
        run_config["samples-per-task"] = samples
    if dim:
        run_config["dim"] = dim
    context = Context(run_id=1, node_id=7, node_config={"task-id": TASK,
                                                        "client-state-dir": state_dir},
                      state=RecordDict(), run_config=run_config)
    meta = json.loads((Path(state_dir) / "task.json").read_text())
    config = {"task-id": TASK, "server-round": server_round,
              "last-accepted-round": server_round - 1, "m-tt": 2.0, "sigma-prime": 1.0,
              "budget": meta["n"], "seed": 0, "dropped": False, "eval": True,
              "method": "mocha"}
    w = Array(np.zeros(meta["dim"]))
    msg = Message(RecordDict({"arrays": ArrayRecord({"w": w}), "config": ConfigRecord(config)}),
                  dst_node_id=7, message_type=MessageType.TRAIN, group_id=str(server_round))
    if kind == "trivial":
        from flwr.app import MetricRecord
        from flwr.clientapp import ClientApp

        app = ClientApp()

        @app.train()
        def train(message: Message, ctx: Context) -> Message:
            update = Array(np.zeros(meta["dim"]))
            return Message(RecordDict({"arrays": ArrayRecord({"delta-b": update}),
                                       "metrics": MetricRecord({"steps": 0})}),
                           reply_to=message)
    else:
        from fmtl_flower.apps.client_app import app
    reply = app(msg, context)
    steps = int(reply.content["metrics"]["steps"])
    size = len(reply.content["arrays"]["delta-b"].data)
    print(json.dumps({"steps": steps, "reply_bytes": size, "numba": "numba" in sys.modules}))


def prepare(state_dir: str, samples: int, dim: int) -> dict:
    """The task's sizes (a whoami in a process of its own), written for the children."""
    code = (
        "import json,sys\n"
        "from flwr.app import Context, RecordDict\n"
        "from fmtl_flower.apps.common import config_from_context, dataset_for\n"
        "from fmtl_flower.config import RunConfig\n"
        f"cfg = RunConfig.from_mapping({{'strategy': 'mocha', 'dataset': 'synthetic', "
        f"'seed': 0, **({{'samples-per-task': {samples}}} if {samples} else {{}}), "
        f"**({{'dim': {dim}}} if {dim} else {{}})}}, ignore_unknown=True)\n"
        f"t = dataset_for(cfg).task({TASK})\n"
        "print(json.dumps({'n': int(t.X_train.shape[0]), 'dim': int(t.X_train.shape[1])}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    meta = json.loads(out.stdout.strip().splitlines()[-1])
    (Path(state_dir) / "task.json").write_text(json.dumps(meta))
    return meta


def run_once(kind: str, state_dir: str, server_round: int, samples: int, dim: int,
             env: dict[str, str]) -> dict:
    """One fresh process; its wall time, CPU time and peak RSS."""
    args = [sys.executable, __file__, "--child", kind, "--state-dir", state_dir,
            "--round", str(server_round), "--samples-per-task", str(samples), "--dim", str(dim)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} process failed ({proc.returncode}):\n{stderr[-3000:]}")
    reply = json.loads(stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "rss_mb": usage.ru_maxrss / 1024.0, **reply}


def plan_variants(numba_installed: bool) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The variants to run (name -> extra environment) and those skipped (name -> why)."""
    variants = {"trivial": {}, "mocha": {}, "mocha-numba": {"FMTL_KERNELS": "numba"},
                "mocha-numpy": {"FMTL_KERNELS": "numpy"}}
    skipped = {}
    if not numba_installed:
        del variants["mocha-numba"]
        skipped["mocha-numba"] = ("numba is not installed here (no wheels for this platform, "
                                  "e.g. armv7): every message runs the numpy kernels")
    return variants, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples-per-task", type=int, default=0,
                        help="synthetic dataset's rows per task (0: its default)")
    parser.add_argument("--dim", type=int, default=0, help="features (0: the default)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.state_dir, args.round, args.samples_per_task, args.dim)
        return
    base_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base_env.pop("FMTL_KERNELS", None)
    base_env.pop("PYTHONDONTWRITEBYTECODE", None)  # a device keeps its bytecode, like its cache
    variants, skipped = plan_variants(importlib.util.find_spec("numba") is not None)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fmtl-device-") as tmp:
        meta = None
        for name, extra in variants.items():
            state_dir = str(Path(tmp) / name)
            Path(state_dir).mkdir()
            meta = prepare(state_dir, args.samples_per_task, args.dim)
            env = {**base_env, **extra}
            kind = "trivial" if name == "trivial" else "mocha"
            # round 1, unmeasured: writes the state file, warms numba's cache and bytecode
            run_once(kind, state_dir, 1, args.samples_per_task, args.dim, env)
            runs = [run_once(kind, state_dir, r, args.samples_per_task, args.dim, env)
                    for r in range(2, 2 + args.repeats)]
            results[name] = {key: statistics.median(run[key] for run in runs)
                             for key in ("wall_s", "cpu_s", "rss_mb")}
            results[name]["steps"] = runs[-1]["steps"]
            results[name]["numba_imported"] = runs[-1]["numba"]
    trivial = results["trivial"]
    load = os.getloadavg()
    print(f"one train message per fresh process; task {TASK}: n={meta['n']}, d={meta['dim']}; "
          f"median of {args.repeats} processes; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")
    print(f"{'variant':<12} {'wall s':>8} {'cpu s':>8} {'peak RSS MB':>12} {'wall x':>8} "
          f"{'cpu x':>7} {'RSS x':>7}")
    for name, res in results.items():
        res["wall_ratio"] = res["wall_s"] / trivial["wall_s"]
        res["cpu_ratio"] = res["cpu_s"] / trivial["cpu_s"]
        res["rss_ratio"] = res["rss_mb"] / trivial["rss_mb"]
        print(f"{name:<12} {res['wall_s']:8.3f} {res['cpu_s']:8.3f} {res['rss_mb']:12.1f} "
              f"{res['wall_ratio']:8.2f} {res['cpu_ratio']:7.2f} {res['rss_ratio']:7.2f}")
    print(json.dumps({"benchmark": "device_message", "n": meta["n"], "dim": meta["dim"],
                      "repeats": args.repeats, "load": round(load[0], 2), "skipped": skipped,
                      **{name: {k: v if isinstance(v, bool) else round(v, 4)
                                for k, v in res.items()}
                         for name, res in results.items()}}))


if __name__ == "__main__":
    main()
