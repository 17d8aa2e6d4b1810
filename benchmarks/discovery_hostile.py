"""What one hostile packed node costs the server at discovery: time and peak memory.

Two scenarios (issue 25, discovery), each in its own process so that its peak RSS is its own:

* ``slots``: a packed node announces 2**20 task slots (its packed whoami fails), next to two
  honest packed nodes holding 2 tasks each (MOCHA, 4 tasks);
* ``dim``: a packed node whose 4 slots claim every task with ``dim`` = 10**7 answers first,
  next to the same honest nodes (d = 5).

Each prints one JSON line: seconds for ``MOCHA.start`` (discovery and 1 round), the peak RSS
growth (ru_maxrss after minus RSS before, MB), the dim the run settled on and the tasks held.
Run: ``python benchmarks/discovery_hostile.py`` (both scenarios, in subprocesses).
Everything runs in one process per scenario (in-process grid): the hostile client's own work
is included; Flower's log is quietened to ERROR so that terminal output is not measured.

Measured (2 shared cores), before issue 25's discovery fixes (main at 994927a) and after:
``dim``: 3.95 s, +1300 MB, dim = 10**7 (the hostile node held every task) -> 0.02 s, +1.7 MB,
dim = 5 (its slots excluded); ``slots``: 49.6 s, +3132 MB -> 0.02 s, +1.8 MB (refused at its
slots reply: 1048576 slots above max_slots_per_node = 4096).
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time

from flwr.app import ConfigRecord, Error, Message, RecordDict

from fmtl_flower import MOCHA
from fmtl_flower.apps.common import make_client_app
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import FIRST_NODE_ID, InProcessGrid
from fmtl_flower.packing import SLOTS_QUERY, PackedGrid, pack_content, unpack_content

NUM_TASKS, DIM = 4, 5
HOSTILE = FIRST_NODE_ID  # the first node of an InProcessGrid: it answers first


def hostile_client(scenario: str):
    honest = make_client_app(RunConfig.from_mapping({
        "strategy": "mocha", "num-tasks": NUM_TASKS, "dim": DIM, "samples-per-task": 20,
        "tasks-per-node": 2}))

    def client(message: Message, context):
        if context.node_id != HOSTILE:
            return honest(message, context)
        if message.metadata.message_type == SLOTS_QUERY:
            count = 1 << 20 if scenario == "slots" else NUM_TASKS
            return Message(RecordDict({"slots": ConfigRecord({"count": count})}),
                           reply_to=message)
        if scenario == "slots" or "whoami" not in message.metadata.message_type:
            return Message(Error(code=1, reason="hostile"), reply_to=message)
        parts = unpack_content(message.content)
        claims = {slot: RecordDict({"info": ConfigRecord(
            {"task-id": slot % NUM_TASKS, "n-train": 20, "n-test": 0, "dim": 10**7})})
            for slot in parts}
        return Message(pack_content(claims), reply_to=message)

    return client


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run(scenario: str) -> dict:
    logging.getLogger("flwr").setLevel(logging.ERROR)
    configs = [{}, {"task-ids": "0,1"}, {"task-ids": "2,3"}]
    grid = PackedGrid(InProcessGrid(hostile_client(scenario), 3, node_configs=configs),
                      query_timeout=600.0)
    strategy = MOCHA(NUM_TASKS, lam=0.1, discovery_timeout=600.0)
    before = rss_mb()
    started = time.perf_counter()
    outcome = "completed"
    try:
        strategy.start(grid=grid, num_rounds=1, timeout=600.0)
    except Exception as err:  # noqa: BLE001 - the outcome is part of the measurement
        outcome = f"{type(err).__name__}: {str(err)[:200]}"
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"scenario": scenario, "seconds": round(seconds, 2),
            "peak_rss_growth_mb": round(peak - before, 1), "dim": strategy.directory.dim,
            "tasks_held": sorted(strategy.task_to_node), "outcome": outcome}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])))
    else:
        for name in ("dim", "slots"):
            subprocess.run([sys.executable, __file__, name], check=False)
