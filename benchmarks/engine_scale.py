"""MOCHA (or FedEM's family) rounds at scale on an engine: seconds per round and peak memory.

Runs ``fmtl run mocha`` (``--strategy``: any strategy of MOCHA's or FedEM's family) on the
``synthetic`` dataset (FSVRG's family: ``sparse-federated``) with ``nodes x tasks-per-node`` tasks
(lazy per-task generation above 2,000 tasks) on the in-process engine or Flower's Ray
simulation, with task packing when ``--tasks-per-node`` > 1 (one Flower message per node and
round carries all of its tasks, :mod:`fmtl_flower.packing`).

Figures (one JSON line, printed last):

* ``seconds_per_round``: median wall time of rounds 2..R (round 1 includes the discovery of
  every task, and on Ray the start of the workers: ``first_round_s``);
* ``total_s``: the whole run, dataset set-up included;
* ``peak_mb``: the largest resident size of this process plus all its descendants (Ray's
  raylet, GCS and workers; descendants only on Ray), sampled every 0.5 s with psutil;
  ``peak_self_mb``: this process's ``ru_maxrss``;
* ``final_primal``, ``final_gap``, ``num_replies`` (of the final metrics round; FedEM's
  family: ``final_train_loss`` and ``final_test_error``; FSVRG's: ``final_objective``);
* with ``--versus-unpacked``: the same run again with one task per node (``unpacked``: its
  figures) and ``packed_vs_unpacked``, unpacked seconds per round / packed seconds per round,
  both measured in this process one after the other, and ``same_results`` (the two runs'
  records equal, measured durations aside);
* ``cpu_seconds_per_round``: the median over rounds 2..R of the CPU time (user + system) of
  this process and, on Ray, its descendants, sampled as each round's progress line is
  printed: what a round costs the machine, which a loaded machine inflates far less than
  wall time; ``kernels``: what the local solvers ran (a simulation: numba for every call
  unless ``FMTL_KERNELS`` says otherwise, :func:`fmtl_flower.core.jit.simulation`);
  ``load_average_1min`` at the end.

Usage: python benchmarks/engine_scale.py --nodes 200 --engine ray --tasks-per-node 50
       [--rounds 20] [--dim 20] [--samples-per-task 20] [--lam 1e-5] [--ray-address H:P]
       [--strategy fedem] [--versus-unpacked]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import threading
import time

import psutil


class RoundCPU:
    """Stands in for stdout and notes the CPU time (this process, plus its descendants when
    ``children``) each time a round's progress line is printed."""

    def __init__(self, stream, children: bool) -> None:
        self.stream = stream
        self.children = children
        self.marks: list[float] = []

    def cpu(self) -> float:
        me = psutil.Process()
        total = sum(me.cpu_times()[:2])
        if self.children:
            for proc in me.children(recursive=True):
                try:
                    total += sum(proc.cpu_times()[:2])
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        return total

    def write(self, text: str) -> int:
        if text.startswith("round "):
            self.marks.append(self.cpu())
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class PeakMemory:
    """Samples the resident size of this process and its descendants in a thread (listing
    descendants scans /proc: costly, so only where there are some, i.e. on Ray)."""

    def __init__(self, every: float = 0.5, children: bool = True) -> None:
        self.every = every
        self.children = children
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        me = psutil.Process()
        total = 0
        for proc in [me, *(me.children(recursive=True) if self.children else [])]:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.every)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True, help="Flower nodes")
    parser.add_argument("--engine", choices=("inprocess", "ray"), default="inprocess")
    parser.add_argument("--tasks-per-node", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=None,
                        help="features (default 20; FSVRG's family: 2000, at least 202)")
    parser.add_argument("--samples-per-task", type=int, default=20)
    parser.add_argument("--lam", type=float, default=None,
                        help="lambda (default 0.03 / m: with tr(Sigma) = 1, Omega ~ m I)")
    parser.add_argument("--strategy", default="mocha",
                        help="mocha, cocoa, mb-sdca, mb-sgd, FedEM's family (fedem, fedavg, "
                        "fedprox, fedavg-ft, clustered, local: logistic model, M = 3), or "
                        "FSVRG's (fsvrg, fsvrg-naive, gd, cocoa-plus, dane: sparse-federated "
                        "data of --dim features, at least 202, default 2000)")
    parser.add_argument("--versus-unpacked", action="store_true",
                        help="also run one task per node and print the ratio")
    parser.add_argument("--ray-address", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.tasks_per_node < 1 or args.rounds < 2:
        parser.error("--nodes and --tasks-per-node must be >= 1, --rounds >= 2")

    from fmtl_flower.config import FSVRG_FAMILY, RunConfig

    fsvrg = args.strategy in FSVRG_FAMILY  # sparse logistic regression, lambda 1/n
    if args.dim is None:
        args.dim = 2000 if fsvrg else 20
    elif fsvrg and args.dim < 202:
        parser.error(f"--dim must be >= 202 for {args.strategy} (sparse-federated data), "
                     f"got {args.dim}")

    logging.getLogger("flwr").setLevel(logging.ERROR)
    m = args.nodes * args.tasks_per_node
    lam = args.lam if args.lam is not None else 0.03 / m
    values = {"strategy": args.strategy, "dataset": "synthetic", "num-tasks": m,
              "dim": args.dim, "samples-per-task": args.samples_per_task,
              "num-server-rounds": args.rounds, "tasks-per-node": args.tasks_per_node,
              "seed": args.seed, "round-timeout": 3600.0}
    fedem = RunConfig.from_mapping({**values, "model": "logistic"}).is_fedem_family
    values.update({"model": "logistic", "fedem.M": 3} if fedem else {"mocha.lambda": lam})
    if fsvrg:
        values.pop("mocha.lambda")
        values.update({"dataset": "sparse-federated", "dim": args.dim, "samples-per-task": 0,
                       **({"fsvrg.h": 0.05} if args.strategy == "fsvrg-naive" else {})})
    out = {"benchmark": "engine_scale", "engine": args.engine, "strategy": args.strategy,
           "nodes": args.nodes, "tasks_per_node": args.tasks_per_node, "tasks": m,
           "dim": args.dim, "samples_per_task": None if fsvrg else args.samples_per_task,
           **({} if fedem or fsvrg else {"lambda": lam}), "rounds": args.rounds,
           **_measure(RunConfig.from_mapping(values), args)}
    if args.versus_unpacked:
        unpacked = _measure(RunConfig.from_mapping({**values, "tasks-per-node": 1}), args)
        out["packed_vs_unpacked"] = (unpacked["seconds_per_round"]
                                     / out["seconds_per_round"])
        out["same_results"] = unpacked.pop("_records") == out["_records"]
        out["unpacked"] = unpacked
    out.pop("_records")
    from fmtl_flower.core import jit

    out["kernels"] = jit.simulation_choice()[0]  # run_federation's (FMTL_KERNELS, else numba)
    out["load_average_1min"] = os.getloadavg()[0]
    print(json.dumps(out), flush=True)
    return 0


def _measure(cfg, args: argparse.Namespace) -> dict:
    """One run of ``cfg``: its figures (see the module docstring)."""
    from fmtl_flower.apps.common import dataset_for
    from fmtl_flower.cli import run_federation

    started = time.perf_counter()
    cpu = RoundCPU(sys.stdout, children=args.engine == "ray")
    with PeakMemory(children=args.engine == "ray") as memory:
        data = dataset_for(cfg)
        sys.stdout = cpu
        try:
            results = run_federation(cfg, data, args.engine, print_every=1, quiet=False,
                                     ray_address=args.ray_address)
        finally:
            sys.stdout = cpu.stream
    total = time.perf_counter() - started
    rounds = [r for r in results["rounds"] if r["round"] >= 1 and r.get("wall_time_s")]
    final = results["final"]
    return {
        "seconds_per_round": statistics.median(r["wall_time_s"] for r in rounds[1:]),
        "first_round_s": rounds[0]["wall_time_s"],
        "round_s": [round(r["wall_time_s"], 3) for r in rounds],
        "total_s": total, "peak_mb": memory.peak / 2**20,
        "peak_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_primal": final.get("primal"), "final_gap": final.get("gap"),
        "final_objective": final.get("objective"),
        "final_train_loss": final.get("train_loss"),
        "final_test_error": final.get("test_error"), "num_replies": final.get("num_replies"),
        # marks: record k is printed in round k + 1 (k < R), record R after the final
        # metrics round; round r (2 <= r <= R) runs from mark r - 2 to mark r - 1
        "cpu_seconds_per_round": statistics.median(
            b - a for a, b in zip(cpu.marks[:-2], cpu.marks[1:-1], strict=True))
        if len(cpu.marks) >= 3 else None,
        "_records": [{k: v for k, v in r.items() if not k.endswith("_s")}
                     for r in results["rounds"]],
    }


if __name__ == "__main__":
    sys.exit(main())
