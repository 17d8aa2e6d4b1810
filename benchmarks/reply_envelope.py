"""The reply envelope's cost: microseconds per reply of ``ReplyBoundary.read`` over 1000
MOCHA ``train`` replies (7 metrics, ``delta-b`` of d floats), parsed as MOCHA's
``_parse_reply`` reads them, without reply contracts (the checks before the envelope: type,
run id) and with MOCHA's (:mod:`fmtl_flower.strategies.trust`'s envelope), and
``check_envelope`` alone. Minimum of interleaved repeats (a shared machine).

Usage: ``python benchmarks/reply_envelope.py [d]`` (default d = 50).
"""
import sys
import time

import numpy as np
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fmtl_flower.strategies.discovery import arrays_of, read_metrics
from fmtl_flower.strategies.mocha import REPLY_CONTRACTS
from fmtl_flower.strategies.trust import ReplyBoundary, check_envelope
from fmtl_flower.wire import array_record, from_array, metric_record

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
d, m = int(sys.argv[1]) if len(sys.argv) > 1 else 50, 1000
sent, replies = [], []
for t in range(m):
    msg = Message(RecordDict({}), dst_node_id=100 + t, message_type="train")
    msg.metadata.__dict__["_message_id"] = f"m{t}"
    rep = Message(RecordDict({"metrics": metric_record(
        {"task-id": t, "round": 1, "n-train": 10, "state-ok": 1, "loss-mean": 0.5,
         "dual-mean": 0.2, "steps": 5}), "arrays": array_record({"delta-b": np.zeros(d)})}),
        reply_to=msg)
    rep.metadata.__dict__["_src_node_id"] = 100 + t
    sent.append(msg)
    replies.append(rep)


def parse(reply, task):
    """What MOCHA's _parse_reply reads (its metrics, typed; delta-b decoded)."""
    out = read_metrics(reply, ints=("task-id", "round", "n-train", "state-ok"),
                       numbers=("loss-mean", "dual-mean"),
                       optional_ints=("test-errors", "test-n", "steps"))
    out["delta-b"] = from_array(arrays_of(reply)["delta-b"])
    return out


def per_reply(contracts) -> float:
    best = float("inf")
    for _ in range(3):
        b = ReplyBoundary("b", contracts, lambda: {"d": d})
        b.begin()
        for t, msg in enumerate(sent):
            b.track(t, 100 + t, msg)
        start = time.perf_counter()
        out = b.read("r", replies, parse)
        best = min(best, time.perf_counter() - start)
        assert len(out.accepted) == m
    return best / m * 1e6


contract = REPLY_CONTRACTS["train"]
limit = contract.array_bytes({"d": d})
alone = float("inf")
for _ in range(7):
    start = time.perf_counter()
    for r in replies:
        check_envelope(r.content, contract, limit)
    alone = min(alone, (time.perf_counter() - start) / m * 1e6)
plain = envelope = float("inf")
for _ in range(10):  # interleaved, min of each: the machine is shared
    plain = min(plain, per_reply(None))
    envelope = min(envelope, per_reply(REPLY_CONTRACTS))
print(f"d={d}: read without contracts {plain:.2f} us/reply, with MOCHA's contract "
      f"{envelope:.2f} us/reply; check_envelope alone {alone:.2f} us/reply")
