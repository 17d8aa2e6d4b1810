"""Seconds per round over a real loopback deployment vs the same computation in-process.

Starts one ``flower-superlink`` and four ``flower-supernode`` processes (``task-id=0..3``) on
free ports of 127.0.0.1 with a private ``FLWR_HOME`` (``tests/apps/loopback.py``), submits
one short ``flwr run . loopback --stream`` per strategy (mocha, fedem, ofmtl, fsvrg; small
data, 4 tasks), one after the other, then runs the very same config with ``fmtl run
<strategy> --engine inprocess`` (same ServerApp and ClientApp handlers, no Flower processes,
no polling). The difference per round is Flower's deployment overhead: polling (SuperNode,
SuperExec, the ServerApp's grid), one ``flwr-clientapp`` process started per message
(imports, data regeneration, numba cache load), HTTP on loopback.

What a "round" is, per strategy (``unit`` in the output), both sides measured by the
strategy's own per-round ``wall_time_s`` (the server's configure -> aggregate), median over
the rounds after the first (the first adds discovery, the ``whoami`` query round):

* mocha, fedem: one training round (one round trip to every device);
* fsvrg: one round (two round trips: the gradient exchange, then the local SVRG pass);
* ofmtl: one newcomer round trip (the newcomer event's ``event_time_s`` / 10; one device).

With ``mocha`` among the strategies, a trivial Flower App (``benchmarks/trivial_flower_app``:
one train message per node per round, answered at once with a vector of the same size, flwr
and numpy only) runs on the same SuperNodes just before it, with the same rounds and ``dim``:
Flower's own floor per round on these nodes. MOCHA's line then adds ``trivial_round_s`` and
``mocha_vs_trivial_round_ratio`` (MOCHA's loopback seconds per round over the trivial app's).

Polling. flwr 1.42's ``HttpGrid.send_and_receive`` (``flwr/superlink/grid/http_grid.py``)
pulls the replies right after pushing and then every 3 s (``time.sleep(3)``), so with it a
round lasts a whole number of 3 s steps plus the last pull, and extra work per message of a
fraction of a second costs either nothing or a whole step (ratios jumped between about 1.0 and
1.5). fmtl-flower's ServerApp pulls every ``reply-poll-interval`` s instead (run config,
default 0.5; :mod:`fmtl_flower.polling`), and so does the trivial app here, through the same
module (copied into it as ``reply_polling.py``): like with like. ``--reply-poll-interval
3,0.5`` runs both apps once per value on the same SuperNodes (3 is Flower's own pause: the
same loop as Flower's) and every line says its ``reply_poll_interval``. Not a setting of
ours: a SuperNode with nothing to do asks the SuperLink for a message every 3 s
(``flwr/supernode/start_client_internal.py``), so each message waits 0-3 s before its node
sees it; a SuperExec looks for new tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s (1 s by
default; read from the environment, not in Flower's docs).

Measured (``--strategies mocha --rounds 4 --reply-poll-interval 3,0.5``, six runs, one of them
``0.5,3``; the shared 2-core machine at load average 3-12; seconds per round, median of rounds
2-4; ratio = MOCHA / trivial). At 3 s both apps land on 3 s steps (push, pulls at about 0.3,
3.3, 6.3, 9.3 s): MOCHA 9.28-9.83 s, trivial 6.22-9.52 s, ratios 1.03, 1.05, 1.01, 1.03, 0.99
and 1.49 (the least loaded run: the trivial app on the 6 s step, MOCHA on the 9 s one). At
0.5 s: MOCHA 7.02-10.23 s, trivial 6.05-9.00 s, ratios 1.14, 1.01, 1.16, 1.07, 1.11, 1.16.
CPU per message process, MOCHA against trivial: 1.48-1.72 s against 1.33-1.59 s (MOCHA's
extra 0.11-0.29 s; both inflated by the load). What is left of a round is the SuperNodes' 3 s
idle poll and one ``flwr-clientapp`` process started per message, four nodes sharing two busy
cores.

CPU per message (every line, and the trivial app's): the CPU time (user + system) of the
``flwr-clientapp`` processes the SuperNodes' SuperExecs started during the run (each one's
own, read every 0.2 s until it has finished: :class:`MessageCPU`), divided by the number of
those processes (each handles one message). It covers the whole per-message
process: Flower's runtime imports, the app, the data, the solver, the reply. The same polls
record the largest RSS and PSS seen of a SuperNode, a SuperExec and a ClientApp process
(``peak_rss_mb``, ``peak_pss_mb``; a sample every 0.2 s, so a short peak can be missed).
(Before, the SuperExecs' reaped-children CPU was read instead; but a finished ClientApp is
only reaped at its SuperExec's next launch, so each run's window held the previous run's
last four processes (MOCHA after the trivial app: 28 processes counted for its 24 messages)
and not its own last four.)

With ``--phases``, every ClientApp process runs under ``benchmarks/clientapp_phases.py`` (put
first on the SuperNodes' ``PATH`` as ``flwr-clientapp``) and each line adds ``cpu_phases_s``:
the mean CPU seconds per process of each phase of a message (Flower's runtime imports, pulling
the message and the FAB, installing the FAB, importing the app, the handler, the reply).

Prints ONE JSON line per strategy and interval: {"strategy", "unit", "reply_poll_interval",
"round_trips_per_round",
"rounds_measured", "loopback_round_s", "loopback_first_round_s", "loopback_run_wall_s",
"inprocess_round_s", "inprocess_run_wall_s", "overhead_round_s", "overhead_ratio",
"messages", "cpu_per_message_s", "peak_rss_mb", "peak_pss_mb", "load_avg_1m"} (mocha also
"trivial_round_s", "trivial_cpu_per_message_s", "mocha_vs_trivial_round_ratio"), and one for
the trivial app (strategy "trivial-flower-app"). Every process it started is stopped by PID
at the end (none by name).

Usage: python benchmarks/loopback_rounds.py [--rounds 3] [--strategies mocha,fedem,ofmtl,fsvrg]
                                            [--no-trivial] [--phases] [--keep DIR]
                                            [--reply-poll-interval 0.5 | 3,0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fmtl_flower.polling import check_interval  # noqa: E402
from tests.apps.loopback import BIN, LoopbackFederation  # noqa: E402

NUM_NODES = 4
TRIVIAL_APP = ROOT / "benchmarks" / "trivial_flower_app"
OFMTL_OUTER = 10  # OFMTL's newcomer round trips
UNITS = {"mocha": ("training round", 1), "fedem": ("training round", 1),
         "fsvrg": ("round (gradient exchange + local pass)", 2),
         "ofmtl": ("newcomer round trip", 1)}


def configs(rounds: int, interval: float) -> dict[str, dict[str, object]]:
    small = {"num-tasks": NUM_NODES, "dim": 5, "samples-per-task": 30}
    common = {"round-timeout": 120.0, "seed": 0, "reply-poll-interval": interval}
    return {
        "mocha": {"strategy": "mocha", **small, "num-server-rounds": rounds, **common},
        "fedem": {"strategy": "fedem", "dataset": "fedem-synthetic", "num-tasks": NUM_NODES,
                  "n-test": 50, "num-server-rounds": rounds, **common},
        "ofmtl": {"strategy": "ofmtl", **small, "ofmtl.initial-tasks": NUM_NODES - 1,
                  "num-server-rounds": 2, **common},
        "fsvrg": {"strategy": "fsvrg", "dataset": "sparse-federated", "num-tasks": NUM_NODES,
                  "num-server-rounds": rounds, **common},
    }


def toml_value(value: object) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value)


def round_times(results: dict, strategy: str) -> tuple[list[float], float | None]:
    """(per-round seconds after the first, the first round's seconds)."""
    rounds = results["rounds"]
    if strategy == "ofmtl":
        newcomers = [r for r in rounds if r.get("event") == "newcomer"]
        return [r["event_time_s"] / OFMTL_OUTER for r in newcomers], None
    times = [r["wall_time_s"] for r in rounds if r.get("wall_time_s") is not None]
    return times[1:], (times[0] if times else None)


class MessageCPU:
    """CPU time and count of the ``flwr-clientapp`` processes the SuperNodes start while it is
    active (``with MessageCPU(fed) as cpu: ...``; then ``cpu.messages``, ``cpu.seconds``).

    Every 0.2 s it reads the CPU time (user + system) of each ClientApp process under a
    SuperExec, keeping the last value per process. A finished ClientApp stays a zombie, its
    CPU time still readable, until its SuperExec's next launch reaps it (flwr 1.42's
    SuperExec starts them with ``subprocess.Popen`` and never waits): so the last message of
    each node is counted in full, and a previous run's zombies, there when this one starts,
    are left out."""

    def __init__(self, fed: LoopbackFederation) -> None:
        self.fed = fed
        self.cpu_s: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds
        self._earlier: set[tuple[int, float]] = set()  # a previous run's processes
        #: the largest RSS and PSS seen (MB) of a SuperNode, a SuperExec, a ClientApp process
        self.rss_mb = {"supernode": 0.0, "superexec": 0.0, "message_process": 0.0}
        self.pss_mb = dict(self.rss_mb)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _superexecs(self) -> list[psutil.Process]:
        found = []
        for node in self.fed.nodes.values():
            try:
                found += psutil.Process(node.pid).children()
            except psutil.NoSuchProcess:
                continue
        return found

    def _clientapps(self) -> list[psutil.Process]:
        found = []
        for superexec in self._superexecs():
            try:
                found += superexec.children()
            except psutil.NoSuchProcess:
                continue
        return found

    def _rss(self, role: str, proc: psutil.Process) -> None:
        try:
            memory = proc.memory_full_info()  # PSS needs /proc/PID/smaps (same user)
            pss = memory.pss / 2**20
        except psutil.AccessDenied:
            memory, pss = proc.memory_info(), 0.0
        self.rss_mb[role] = round(max(self.rss_mb[role], memory.rss / 2**20), 1)
        self.pss_mb[role] = round(max(self.pss_mb[role], pss), 1)

    def _sample(self, proc: psutil.Process) -> None:
        key = (proc.pid, proc.create_time())
        if key in self._earlier:
            return
        times = proc.cpu_times()
        self.cpu_s[key] = max(self.cpu_s.get(key, 0.0), times.user + times.system)
        if proc.status() != psutil.STATUS_ZOMBIE:
            self._rss("message_process", proc)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for node in self.fed.nodes.values():
                try:
                    self._rss("supernode", psutil.Process(node.pid))
                except psutil.NoSuchProcess:
                    continue
            for superexec in self._superexecs():
                try:
                    self._rss("superexec", superexec)
                except psutil.NoSuchProcess:
                    continue
            for proc in self._clientapps():
                try:
                    self._sample(proc)
                except psutil.NoSuchProcess:
                    continue
            self._stop.wait(0.2)

    def __enter__(self) -> MessageCPU:
        for proc in self._clientapps():
            try:
                self._earlier.add((proc.pid, proc.create_time()))
            except psutil.NoSuchProcess:
                continue
        self._thread.start()
        return self

    def _busy(self) -> bool:
        """Whether a ClientApp process is still running (zombies have finished)."""
        for proc in self._clientapps():
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 30.0  # let the last ClientApps finish
        while time.monotonic() < deadline and self._busy():
            time.sleep(0.2)
        time.sleep(0.5)  # a last sample of the last ones
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def messages(self) -> int:
        return len(self.cpu_s)

    def per_message(self) -> float | None:
        return round(self.seconds / self.messages, 3) if self.messages else None


class Phases:
    """Per-phase CPU of the ClientApp processes (``--phases``): the SuperNodes start
    ``benchmarks/clientapp_phases.py`` as ``flwr-clientapp``; it writes one JSON file per
    process into ``<workdir>/phases``."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "phases"
        self.bin = workdir / "phases-bin"

    def install(self, fed: LoopbackFederation) -> None:
        """Put the timing ``flwr-clientapp`` first on ``fed``'s PATH (before ``fed.start``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin.mkdir(parents=True, exist_ok=True)
        shim = self.bin / "flwr-clientapp"
        shim.write_text(f'#!/bin/sh\nexec "{BIN / "python"}" '
                        f'"{ROOT / "benchmarks" / "clientapp_phases.py"}" "$@"\n')
        shim.chmod(0o755)
        fed.env["PATH"] = os.pathsep.join([str(self.bin), fed.env["PATH"]])
        fed.env["FMTL_PHASES_DIR"] = str(self.dir)

    def take(self, name: str) -> dict[str, float]:
        """The mean of each phase over the processes recorded since the last call (their
        files move to ``phases/<name>/``)."""
        done = self.dir / name
        done.mkdir(exist_ok=True)
        rows = []
        for path in sorted(self.dir.glob("cpu-*.json")):
            rows.append(json.loads(path.read_text()))
            path.rename(done / path.name)
        keys = dict.fromkeys(key for row in rows for key in row)
        return {key: round(float(np.mean([row.get(key, 0.0) for row in rows])), 3)
                for key in keys} | {"processes": len(rows)}


def trivial_run(fed: LoopbackFederation, workdir: Path, rounds: int, dim: int,
                interval: float, phases: Phases | None = None) -> dict:
    """The trivial Flower App on the federation's SuperNodes, pulling its replies every
    ``interval`` s through MOCHA's own module (copied in): its JSON line's figures."""
    app = workdir / "trivial-app"
    shutil.copytree(TRIVIAL_APP, app, dirs_exist_ok=True)
    shutil.copy(ROOT / "LICENSE", app / "LICENSE")
    shutil.copy(ROOT / "fmtl_flower" / "polling.py",  # the very module MOCHA's ServerApp uses
                app / "trivial_flower_app" / "reply_polling.py")
    results = workdir / f"trivial-loopback-{interval:g}.json"
    config = (f"num-nodes={NUM_NODES} num-server-rounds={rounds} dim={dim} "
              f"round-timeout=120.0 reply-poll-interval={interval} results-file='{results}'")
    with MessageCPU(fed) as cpu:
        sub = fed.submit(config, name="trivial", results=results, app=app)
        wall = sub.wait(1800.0, fed.context())
    out = sub.read_results()
    if sub.popen.returncode != 0 or not out["final"]["complete"]:
        raise RuntimeError(f"trivial app run failed ({sub.popen.returncode})\n{fed.context()}")
    times = [r["wall_time_s"] for r in out["rounds"]]
    extra = {} if phases is None else {"cpu_phases_s": phases.take("trivial")}
    return {"strategy": "trivial-flower-app", "unit": "training round",
            "reply_poll_interval": interval, "rounds_measured": len(times) - 1,
            "loopback_round_s": round(float(np.median(times[1:])), 3),
            "loopback_first_round_s": round(times[0], 3), "loopback_run_wall_s": round(wall, 1),
            "messages": cpu.messages, "cpu_per_message_s": cpu.per_message(),
            "peak_rss_mb": cpu.rss_mb, "peak_pss_mb": cpu.pss_mb, **extra,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def inprocess(cfg: dict[str, object], out: Path) -> tuple[dict, float]:
    cfg = dict(cfg)
    args = [str(BIN / "fmtl"), "run", str(cfg.pop("strategy")), "--engine", "inprocess",
            "--rounds", str(cfg.pop("num-server-rounds")), "--quiet", "--out", str(out)]
    for key, value in cfg.items():
        args += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text()), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per run (mocha, fedem, fsvrg; default 3)")
    parser.add_argument("--strategies", default="mocha,fedem,ofmtl,fsvrg")
    parser.add_argument("--no-trivial", action="store_true",
                        help="skip the trivial Flower App run before mocha")
    parser.add_argument("--phases", action="store_true",
                        help="time each phase of every ClientApp process (clientapp_phases.py)")
    parser.add_argument("--reply-poll-interval", default="0.5",
                        help="seconds between pulls of the replies, both apps (run-config key "
                             "reply-poll-interval); a comma list runs every strategy (and the "
                             "trivial app) once per value on the same SuperNodes, e.g. 3,0.5 "
                             "(3: Flower's own pause; default 0.5)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work directory to keep (logs, results); default: a temp dir")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(UNITS))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {sorted(UNITS)}")
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is discovery)")
    try:
        intervals = [check_interval(v) for v in args.reply_poll_interval.split(",") if v]
    except ValueError as err:
        parser.error(f"--reply-poll-interval: {err}")
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="loopback-rounds-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fed = LoopbackFederation(workdir / "federation", NUM_NODES)
    phases = Phases(workdir) if args.phases else None
    if phases is not None:
        phases.install(fed)
    survivors: list[int] = []
    try:
        started = time.perf_counter()
        fed.start()
        fed.wait_nodes_registered()
        print(f"# SuperLink + {NUM_NODES} SuperNodes up in {time.perf_counter() - started:.1f} s "
              f"(work dir {workdir})", file=sys.stderr, flush=True)
        for interval in intervals:
            trivial = None
            all_configs = configs(args.rounds, interval)
            for strategy in strategies:
                cfg = all_configs[strategy]
                if strategy == "mocha" and not args.no_trivial:
                    trivial = trivial_run(fed, workdir, args.rounds, int(cfg["dim"]), interval,
                                          phases)
                    print(json.dumps(trivial), flush=True)
                results_path = workdir / f"{strategy}-loopback-{interval:g}.json"
                run_config = " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())
                with MessageCPU(fed) as cpu:
                    sub = fed.submit(f"{run_config} results-file='{results_path}'", name=strategy,
                                     results=results_path)
                    wall = sub.wait(3600.0, fed.context())
                if sub.popen.returncode != 0:
                    raise RuntimeError(f"flwr run {strategy} exited {sub.popen.returncode}\n"
                                       f"{fed.context()}")
                loop = sub.read_results()
                if not loop["final"].get("complete"):
                    raise RuntimeError(f"{strategy}: loopback run incomplete: {loop['final']}")
                versus: dict[str, object] = {}
                if phases is not None:
                    versus["cpu_phases_s"] = phases.take(strategy)
                local, local_wall = inprocess(cfg, workdir / f"{strategy}-inprocess.json")
                loop_rounds, loop_first = round_times(loop, strategy)
                local_rounds, _ = round_times(local, strategy)
                loop_s = float(np.median(loop_rounds))
                local_s = float(np.median(local_rounds))
                unit, trips = UNITS[strategy]
                if strategy == "mocha" and trivial is not None:
                    versus.update({"trivial_round_s": trivial["loopback_round_s"],
                                   "trivial_cpu_per_message_s": trivial["cpu_per_message_s"],
                                   "mocha_vs_trivial_round_ratio":
                                       round(loop_s / trivial["loopback_round_s"], 2)})
                print(json.dumps({
                    "strategy": strategy, "unit": unit, "reply_poll_interval": interval,
                    "round_trips_per_round": trips,
                    "rounds_measured": len(loop_rounds),
                    "loopback_round_s": round(loop_s, 3),
                    "loopback_first_round_s": None if loop_first is None else round(loop_first, 3),
                    "loopback_run_wall_s": round(wall, 1),
                    "inprocess_round_s": round(local_s, 5),
                    "inprocess_run_wall_s": round(local_wall, 2),
                    "overhead_round_s": round(loop_s - local_s, 3),
                    "overhead_ratio": round(loop_s / local_s, 1) if local_s > 0 else None,
                    "messages": cpu.messages, "cpu_per_message_s": cpu.per_message(),
                    "peak_rss_mb": cpu.rss_mb, "peak_pss_mb": cpu.pss_mb, **versus,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }), flush=True)
    finally:
        survivors = fed.stop()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if survivors:
        print(f"# processes still alive: {survivors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
