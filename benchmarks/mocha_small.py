"""MOCHA, 500 rounds on small.mat in-process: where the time of `fmtl run` goes.

Configuration (the issue's): omega=identity, local-frac=1.0, lambda=1e-4, 75/25 split,
eval-every=1, 29 tasks = 29 simulated nodes (``tasks-per-node=1``), and packed on one node.
Reported, in seconds (wall, and CPU time where noted: a loaded machine inflates wall time):

* ``whole_process``: wall time of the command `fmtl run mocha ... --quiet` in a subprocess;
* ``interpreter``: `python -c pass`; ``imports``: importing what `fmtl run mocha` imports (the
  CLI, Flower, the app builders, MOCHA's strategy and ClientApp with numba and the kernels'
  module); ``heavy_modules_imported``: any of Ray, torch, scikit-learn, matplotlib, pandas,
  TensorFlow that a short `fmtl run` loaded (none expected);
* ``jit``: the first calls of the compiled kernels in a fresh process (numba cache load, or
  compilation when the cache is cold);
* ``rounds``: the federation itself in this process (engine + compute), after warm-up;
* ``compute``: the same rounds as a bare loop calling core directly
  (:func:`fmtl_flower.centralized.fit_mocha` with per-round objectives and test errors: the
  same arithmetic, bit-identical results), so ``engine = rounds - compute``;
* ``flower_floor_per_node_round_ms``: building a Flower Message and calling a trivial ClientApp
  in-process (the cost any Flower strategy pays per node and round on this machine);
* ``packed_*``: the same run with every task packed on ONE Flower node
  (``tasks-per-node`` = number of tasks: one stacked message per round,
  :mod:`fmtl_flower.packing`): its whole `fmtl run` process, its rounds in this process, and
  whether its final primal equals the unpacked run's (bit for bit).

Ratios against the authors' MATLAB code (28.1 s for these 500 rounds under Octave on this
machine kind, per the issue) are printed; the last line is JSON.

Usage: python benchmarks/mocha_small.py [--rounds 500] [--data PATH_TO_small.mat]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import time

import numpy as np

MATLAB_SECONDS_500 = 28.1
#: What `fmtl run mocha` imports before its first round (cli imports the rest lazily).
IMPORTS = ("import fmtl_flower.cli, fmtl_flower.apps.common, flwr.serverapp, flwr.clientapp, "
           "fmtl_flower.strategies.mocha, fmtl_flower.clients.mocha, fmtl_flower.core.jit")
#: Modules a MOCHA run on the in-process engine has no use for.
HEAVY = frozenset({"ray", "torch", "sklearn", "matplotlib", "pandas", "tensorflow"})


def timed_subprocess(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def cpu_subprocess(args: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of a command; CPU = user + system time of the child, which a
    loaded machine inflates far less than wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = timed_subprocess(args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def modules_loaded_by_run(cli_args: list[str]) -> list[str]:
    """The heavy top-level modules (:data:`HEAVY`) loaded by a short `fmtl run` (run in a
    subprocess through ``runpy``, then ``sys.modules`` read)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['fmtl', *{cli_args!r}]\n"
            "try:\n    runpy.run_module('fmtl_flower.cli', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    return [m for line in out[-2:] for m in line.split()]


def flower_floor(num_nodes: int, rounds: int, dim: int) -> float:
    """Seconds per node-round of a trivial Flower round trip through the in-process grid."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fmtl_flower.engine import InProcessGrid
    from fmtl_flower.wire import from_array, to_array

    app = ClientApp()

    @app.train()
    def train(msg, context):
        w = from_array(msg.content["arrays"]["w"])
        return Message(RecordDict({"arrays": ArrayRecord({"dv": to_array(w + 1)}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    grid = InProcessGrid(app, num_nodes)
    nodes = list(grid.get_node_ids())
    W = np.zeros((num_nodes, dim))
    t = time.perf_counter()
    for r in range(rounds):
        msgs = [Message(RecordDict({"arrays": ArrayRecord({"w": to_array(W[i])}),
                                    "config": ConfigRecord({"server-round": r})}),
                        dst_node_id=n, message_type=MessageType.TRAIN)
                for i, n in enumerate(nodes)]
        for reply in grid.send_and_receive(msgs):
            from_array(reply.content["arrays"]["dv"])
    return (time.perf_counter() - t) / (rounds * num_nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--data", default="small")
    args = parser.parse_args()
    sets = ["--set", "mocha.omega=identity", "--set", "mocha.local-frac=1.0",
            "--set", "mocha.lambda=1e-4",
            "--set", "test-frac=0.25", "--set", "eval-every=1"]
    py = sys.executable
    run_cmd = [py, "-m", "fmtl_flower.cli", "run", "mocha", "--dataset", args.data,
               "--rounds", str(args.rounds), "--quiet", *sets]
    whole, whole_cpu = cpu_subprocess([*run_cmd, "--set", "tasks-per-node=1"])
    interpreter, interpreter_cpu = cpu_subprocess([py, "-c", "pass"])
    load_start = os.getloadavg()[0]
    imports, imports_cpu = cpu_subprocess([py, "-c", IMPORTS])
    heavy = modules_loaded_by_run([*run_cmd[3:7], "--rounds", "2", *run_cmd[9:]])
    imports, imports_cpu = imports - interpreter, imports_cpu - interpreter_cpu
    jit, jit_cpu = (float(v) for v in subprocess.run([py, "-c", (
        "import time, numpy as np\n"
        "from fmtl_flower.core.sdca import sdca_local_update\n"
        "from fmtl_flower.core.rng import coordinate_order\n"
        "t, c = time.perf_counter(), time.process_time()\n"
        "o = coordinate_order(0, 0, 1, 3)\n"
        "sdca_local_update(np.ones((3, 2)), np.ones(3), np.zeros(3), np.zeros(2), budget=3,"
        " m_tt=1.0, sigma_prime=1.0, order=o)\n"
        "print(time.perf_counter() - t, time.process_time() - c)")], check=True,
        capture_output=True, text=True).stdout.split())

    from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
    from fmtl_flower.centralized import fit_mocha
    from fmtl_flower.cli import config_from_args

    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = config_from_args(argparse.Namespace(strategy="mocha", dataset=args.data,
                                              rounds=args.rounds, seed=0, run_config=None,
                                              set=[s for s in sets if s != "--set"]
                                              + ["tasks-per-node=1"]))
    data = dataset_for(cfg)
    m = data.num_tasks
    whole_packed, whole_packed_cpu = cpu_subprocess([*run_cmd, "--set",
                                                     f"tasks-per-node={m}"])
    packed_cfg = dataclasses.replace(cfg, tasks_per_node=m)
    from fmtl_flower.engine import run_inprocess

    run_inprocess(make_server_app(cfg), make_client_app(cfg), m)  # warm-up (caches, JIT)
    box: dict = {}
    t, c = time.perf_counter(), time.process_time()
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg), m)
    rounds, rounds_cpu = time.perf_counter() - t, time.process_time() - c
    run_inprocess(make_server_app(packed_cfg), make_client_app(packed_cfg), 1)  # warm-up
    packed: dict = {}
    t, c = time.perf_counter(), time.process_time()
    run_inprocess(make_server_app(packed_cfg, on_done=packed.update),
                  make_client_app(packed_cfg), 1)
    rounds_packed, rounds_packed_cpu = time.perf_counter() - t, time.process_time() - c
    tasks = [(d.X_train, d.y_train) for d in data.tasks]
    test = [(d.X_test, d.y_test) for d in data.tasks]
    t, c = time.perf_counter(), time.process_time()
    fit = fit_mocha(tasks, lam=1e-4, rounds=args.rounds, omega="identity", omega_every=0,
                    local_frac=1.0, seed=0, record_every=1, test=test)
    compute, compute_cpu = time.perf_counter() - t, time.process_time() - c
    same = fit.history[-1]["primal"] == box["final"]["primal"]
    c = time.process_time()
    floor = flower_floor(m, 100, data.dim)
    floor_cpu = (time.process_time() - c) / (100 * m)
    node_rounds = args.rounds * m
    engine = rounds - compute
    scale = args.rounds / 500
    out = {
        "rounds_run": args.rounds, "tasks": m, "whole_process_s": whole,
        "interpreter_s": interpreter, "imports_s": imports, "jit_first_call_s": jit,
        "rounds_s": rounds, "compute_s": compute, "engine_s": engine,
        "engine_overhead_per_node_round_ms": engine / node_rounds * 1e3,
        "flower_floor_per_node_round_ms": floor * 1e3,
        "engine_overhead_vs_floor": engine / node_rounds / floor,
        "speedup_rounds_vs_matlab": MATLAB_SECONDS_500 * scale / rounds,
        "speedup_whole_vs_matlab": MATLAB_SECONDS_500 * scale / whole,
        "bare_loop_speedup_vs_matlab": MATLAB_SECONDS_500 * scale / compute,
        "final_primal_identical_to_bare_loop": bool(same),
        "final_relative_gap": box["final"]["gap"] / box["final"]["primal"],
        "packed_whole_process_s": whole_packed, "packed_rounds_s": rounds_packed,
        "packed_engine_s": rounds_packed - compute,
        "packed_rounds_vs_bare_loop": rounds_packed / compute,
        "packed_speedup_whole_vs_matlab": MATLAB_SECONDS_500 * scale / whole_packed,
        "packed_final_primal_identical_to_unpacked":
            packed["final"]["primal"] == box["final"]["primal"],
        "packed_rounds_identical_to_unpacked":
            _untimed(packed["rounds"]) == _untimed(box["rounds"]),
        "whole_process_cpu_s": whole_cpu, "packed_whole_process_cpu_s": whole_packed_cpu,
        "interpreter_cpu_s": interpreter_cpu, "imports_cpu_s": imports_cpu,
        "jit_first_call_cpu_s": jit_cpu,
        "rounds_cpu_s": rounds_cpu, "packed_rounds_cpu_s": rounds_packed_cpu,
        "compute_cpu_s": compute_cpu,
        "engine_overhead_vs_floor_cpu": (rounds_cpu - compute_cpu) / node_rounds / floor_cpu,
        "heavy_modules_imported": heavy,
        "load_average_1min_start": load_start,
        "load_average_1min": os.getloadavg()[0],
    }
    print(f"whole `fmtl run` process: {whole:.2f} s = interpreter {interpreter:.2f} + imports "
          f"{imports:.2f} + JIT {jit:.2f} + rounds {rounds:.2f} (+ data, CLI)")
    print(f"rounds {rounds:.2f} s = compute {compute:.2f} s (bare loop) + engine {engine:.2f} s "
          f"= {out['engine_overhead_per_node_round_ms']:.3f} ms per node-round "
          f"(Flower message + trivial ClientApp here: {floor * 1e3:.3f} ms)")
    print(f"vs MATLAB/Octave {MATLAB_SECONDS_500 * scale:.1f} s: rounds "
          f"{out['speedup_rounds_vs_matlab']:.1f}x, whole process "
          f"{out['speedup_whole_vs_matlab']:.1f}x, bare loop "
          f"{out['bare_loop_speedup_vs_matlab']:.1f}x")
    print(f"packed on one node ({m} tasks, one message per round): whole process "
          f"{whole_packed:.2f} s ({out['packed_speedup_whole_vs_matlab']:.1f}x MATLAB), rounds "
          f"{rounds_packed:.2f} s = {out['packed_rounds_vs_bare_loop']:.2f}x the bare loop; "
          f"final primal identical to unpacked: {out['packed_final_primal_identical_to_unpacked']}")
    print(f"CPU time (less sensitive to load): whole process {whole_cpu:.2f} s unpacked, "
          f"{whole_packed_cpu:.2f} s packed = interpreter {interpreter_cpu:.2f} + imports "
          f"{imports_cpu:.2f} + JIT {jit_cpu:.2f} + rounds {rounds_packed_cpu:.2f} (+ data, "
          f"CLI); engine overhead vs floor {out['engine_overhead_vs_floor_cpu']:.2f}")
    print(f"heavy modules imported: {out['heavy_modules_imported'] or 'none'}")
    print(f"load average (1 min) at the start: {load_start:.2f}, at the end: "
          f"{out['load_average_1min']:.2f}")
    print(json.dumps(out))


def _untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


if __name__ == "__main__":
    main()
