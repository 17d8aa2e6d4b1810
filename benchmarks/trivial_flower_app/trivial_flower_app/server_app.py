"""Waits for ``num-nodes`` SuperNodes, then ``num-server-rounds`` rounds of one train message
per node; writes per-round wall times to ``results-file`` (JSON).

``reply-poll-interval`` > 0: the replies are pulled every that many seconds, through the very
module fmtl-flower's ServerApp uses (``fmtl_flower/polling.py``, which
``benchmarks/loopback_rounds.py`` copies here as ``reply_polling.py``); 0 (the default): by
Flower's own ``send_and_receive`` (a pull every 3 s on a deployment)."""

import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    """The node ids once ``count`` SuperNodes are connected (RuntimeError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while len(ids := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(ids)} of {count} SuperNodes after {timeout:.0f} s")
        time.sleep(0.5)
    return ids[:count]


def _content(dim: int, rnd: int) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(dim))}),
                       "config": ConfigRecord({"server-round": rnd})})


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The rounds, timed like a strategy's ``wall_time_s`` (send -> all replies)."""
    cfg = context.run_config
    interval = float(cfg.get("reply-poll-interval", 0.0))
    if interval > 0:  # like fmtl-flower's ServerApp (the same module)
        from .reply_polling import poll_replies

        grid = poll_replies(grid, interval)
    nodes = wait_for_nodes(grid, int(cfg["num-nodes"]), max(60.0, float(cfg["round-timeout"])))
    rounds = []
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        started = time.perf_counter()
        messages = [Message(_content(int(cfg["dim"]), rnd), dst_node_id=node,
                            message_type=MessageType.TRAIN, group_id=str(rnd)) for node in nodes]
        replies = list(grid.send_and_receive(messages, timeout=float(cfg["round-timeout"])))
        good = sum(not reply.has_error() for reply in replies)
        rounds.append({"round": rnd, "wall_time_s": time.perf_counter() - started,
                       "num_replies": good})
    if str(cfg["results-file"]):
        with open(str(cfg["results-file"]), "w") as handle:
            json.dump({"rounds": rounds, "final": {"complete": all(
                r["num_replies"] == len(nodes) for r in rounds)}}, handle)
