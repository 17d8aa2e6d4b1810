"""Issue 25 items 5 and 6: state bound to the run, resume that checks, a strict envelope.

* a finished run resumed with more rounds continues (every family);
* ``start`` refuses ``num_rounds <= 0`` and ``timeout <= 0``;
* a device's dual state written by another run is reset (not adopted), also through a
  shared ``client-state-dir``; a resumed run keeps its run token so its devices' state is
  still adopted;
* a resumed FSVRG / CoCoA+ run rediscovers n and refuses other data;
* replies with records, keys or arrays the contract does not name, with more array bytes
  than the contract's shapes, or from another Flower run are rejected.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import default_task_id, make_mocha_client_app
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import make_problem

MOCHA = {"lam": 0.05, "omega": "probabilistic", "omega_every": 2, "seed": 3,
         "local_frac": 0.5, "discovery_timeout": 5.0}


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=5, dim=4, samples_per_task=40, seed=11)


@pytest.fixture(scope="module")
def sparse():
    return make_sparse_federated(num_tasks=6, dim=300, seed=1)


def _run(strategy, client_app, num_nodes: int, rounds: int, **start):
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, **{"timeout": 60.0, **start})

    return run_inprocess(server_app, client_app, num_nodes)


def _mocha_app(problem, devices: Path | None):
    return make_mocha_client_app(problem.load,
                                 state_dir=None if devices is None else str(devices))


def _fsvrg_app(data, devices: Path | None):
    return make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays(),
                                 state_dir=None if devices is None else str(devices))


# ------------------------------------------------------------------ resume with more rounds
def _finished_then_extended(make, app, num_nodes: int, tmp_path: Path, first: int, more: int):
    """A run of ``first`` rounds that finishes (checkpoints on), then the same run resumed
    from its last checkpoint with ``more`` rounds; returns (resumed, uninterrupted ``more``)."""
    finished = make()
    finished.enable_checkpoints(tmp_path / "ckpt")
    _run(finished, app(), num_nodes, first)
    resumed = make()
    resumed.enable_checkpoints(tmp_path / "ckpt")
    _run(resumed, app(), num_nodes, more)
    assert resumed.resumed_from == first
    straight = make()
    _run(straight, app(), num_nodes, more)
    return resumed, straight


def test_finished_mocha_run_resumed_with_more_rounds_continues(problem, tmp_path):
    devices = tmp_path / "devices"
    resumed, straight = _finished_then_extended(
        lambda: MOCHA(problem.num_tasks, **MOCHA), lambda: _mocha_app(problem, devices),
        problem.num_tasks, tmp_path, 3, 6)
    got, want = resumed.results(), straight.results()
    assert [r["round"] for r in got["rounds"]] == list(range(7))
    assert got["final"]["complete"] and got["final"]["num_resets"] == 0
    for a, b in zip(got["rounds"], want["rounds"], strict=True):
        assert a["primal"] == pytest.approx(b["primal"], rel=1e-12), a["round"]
        assert a["gap"] == pytest.approx(b["gap"], rel=1e-9, abs=1e-15), a["round"]
    np.testing.assert_allclose(resumed.state.W, straight.state.W, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("method", ["cocoa", "mb-sdca"])
def test_finished_cocoa_and_mbsdca_runs_resumed_with_more_rounds(problem, tmp_path, method):
    devices = tmp_path / "devices"
    settings = {**MOCHA, "method": method, "omega": "identity", "omega_every": 0}
    resumed, straight = _finished_then_extended(
        lambda: MOCHA(problem.num_tasks, **settings), lambda: _mocha_app(problem, devices),
        problem.num_tasks, tmp_path, 2, 4)
    assert [r["round"] for r in resumed.results()["rounds"]] == list(range(5))
    np.testing.assert_allclose(resumed.state.W, straight.state.W, rtol=1e-12, atol=1e-15)


def test_finished_mbsgd_run_resumed_with_more_rounds_continues(problem, tmp_path):
    settings = {"lam": 0.05, "seed": 3, "discovery_timeout": 5.0}
    resumed, straight = _finished_then_extended(
        lambda: MbSGD(problem.num_tasks, **settings),
        lambda: make_mbsgd_client_app(problem.load), problem.num_tasks, tmp_path, 3, 5)
    got = resumed.results()
    assert [r["round"] for r in got["rounds"]] == list(range(6)) and got["final"]["complete"]
    np.testing.assert_array_equal(resumed.W, straight.W)
    assert got["final"]["primal"] == straight.results()["final"]["primal"]


@pytest.mark.parametrize("method", ["fsvrg", "cocoa-plus"])
def test_finished_fsvrg_run_resumed_with_more_rounds_continues(sparse, tmp_path, method):
    devices = tmp_path / "devices"
    options = {"method": method, "seed": 2, "discovery_timeout": 5.0}
    resumed, straight = _finished_then_extended(
        lambda: FSVRG(sparse.num_tasks, **options), lambda: _fsvrg_app(sparse, devices),
        sparse.num_tasks, tmp_path, 2, 4)
    got, want = resumed.results(), straight.results()
    assert [r["round"] for r in got["rounds"]] == [r["round"] for r in want["rounds"]]
    assert got["final"]["objective"] == pytest.approx(want["final"]["objective"], rel=1e-12)


def test_finished_fedem_run_resumed_with_more_rounds_continues(tmp_path):
    from .test_fedem_strategy import mixture_problem

    data = mixture_problem(num_tasks=6, seed=1)
    devices = tmp_path / "devices"
    settings = {"num_components": 2, "lr": 0.5, "batch_size": 32, "seed": 5,
                "eval_every": 1, "discovery_timeout": 5.0}
    resumed, straight = _finished_then_extended(
        lambda: FedEM(len(data), **settings),
        lambda: make_fedem_client_app(lambda ctx: data[default_task_id(ctx)],
                                      state_dir=str(devices)),
        len(data), tmp_path, 2, 4)
    got, want = resumed.results(), straight.results()
    assert [r["round"] for r in got["rounds"]] == [r["round"] for r in want["rounds"]]
    assert got["final"]["accuracy_mean"] is not None
    assert got["final"]["accuracy_mean"] == want["final"]["accuracy_mean"]


# ------------------------------------------------------------------ start's arguments
@pytest.mark.parametrize(("argument", "value"), [("num_rounds", 0), ("num_rounds", -1),
                                                  ("timeout", 0.0), ("timeout", -5.0)])
def test_start_refuses_no_rounds_and_no_time(problem, sparse, argument, value):
    start = {"num_rounds": 2, "timeout": 60.0, argument: value}
    for strategy in (MOCHA(problem.num_tasks, **MOCHA), FSVRG(sparse.num_tasks, seed=2)):
        with pytest.raises(ValueError, match=argument):
            strategy.start(grid=None, **start)  # refused before the grid is used


@pytest.mark.parametrize(("argument", "value"), [("num_rounds", -1), ("timeout", 0.0)])
def test_ofmtl_start_refuses_negative_rounds_and_no_time(argument, value):
    from fmtl_flower.strategies.ofmtl import OFMTL

    strategy = OFMTL(4, initial_tasks=2, lam=0.1)
    with pytest.raises(ValueError, match=argument):
        strategy.start(grid=None, **{argument: value})


# ------------------------------------------------------------------ state bound to the run
def test_client_state_dir_written_by_another_run_is_reset_not_adopted(problem, tmp_path):
    """Run A is killed in round 5 (checkpoint of round 4); run B (other settings) uses the
    same devices and client-state-dir for 4 rounds; A resumes: its devices' state files are
    B's, of the round A last accepted, and must be reset, not adopted."""
    from .helpers import Run, ServerKilled, assert_b_consistent, killed_in

    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    first = killed_in(MOCHA, 5)(problem.num_tasks, **MOCHA)
    first.enable_checkpoints(ckpt)
    with pytest.raises(ServerKilled):
        _run(first, _mocha_app(problem, devices), problem.num_tasks, 8)
    other = MOCHA(problem.num_tasks, **{**MOCHA, "lam": 0.2, "seed": 9})
    _run(other, _mocha_app(problem, devices), problem.num_tasks, 4)
    resumed = MOCHA(problem.num_tasks, **MOCHA)
    resumed.enable_checkpoints(ckpt)
    grid = _run(resumed, _mocha_app(problem, devices), problem.num_tasks, 8)
    assert resumed.resumed_from == 4
    rounds = resumed.results()["rounds"]
    assert rounds[5]["num_resets"] == problem.num_tasks  # every task: the other run's state
    assert all(r["gap"] is None or r["gap"] >= 0 for r in rounds)
    assert rounds[-1]["gap"] >= 0
    assert_b_consistent(Run(resumed, grid, problem))


def test_cocoa_plus_state_written_by_another_run_is_reset_not_adopted(sparse, tmp_path):
    """CoCoA+ (the FSVRG family's dual method): as for MOCHA, a resumed run whose devices'
    state files were overwritten by another run resets every task, and its gaps stay >= 0."""
    from .helpers import ServerKilled, killed_in

    options = {"method": "cocoa-plus", "seed": 2, "discovery_timeout": 5.0}
    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    first = killed_in(FSVRG, 4)(sparse.num_tasks, **options)
    first.enable_checkpoints(ckpt)
    with pytest.raises(ServerKilled):
        _run(first, _fsvrg_app(sparse, devices), sparse.num_tasks, 6)
    other = FSVRG(sparse.num_tasks, **{**options, "seed": 9, "lam": 0.05})
    _run(other, _fsvrg_app(sparse, devices), sparse.num_tasks, 3)
    resumed = FSVRG(sparse.num_tasks, **options)
    resumed.enable_checkpoints(ckpt)
    _run(resumed, _fsvrg_app(sparse, devices), sparse.num_tasks, 6)
    assert resumed.resumed_from == 3
    rounds = resumed.results()["rounds"]
    assert rounds[4]["num_resets"] == sparse.num_tasks
    assert rounds[-1]["gap"] is not None and rounds[-1]["gap"] >= 0


def test_resumed_run_keeps_its_token_and_its_devices_state(problem, tmp_path):
    """The token is in the checkpoint: the resumed run's devices adopt their state (no reset)."""
    from .helpers import ServerKilled, killed_in

    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    first = killed_in(MOCHA, 5)(problem.num_tasks, **MOCHA)
    first.enable_checkpoints(ckpt)
    with pytest.raises(ServerKilled):
        _run(first, _mocha_app(problem, devices), problem.num_tasks, 8)
    token = first.run_token
    resumed = MOCHA(problem.num_tasks, **MOCHA)
    resumed.enable_checkpoints(ckpt)
    _run(resumed, _mocha_app(problem, devices), problem.num_tasks, 8)
    assert resumed.run_token == token and resumed.run_identity() == first.run_identity()
    assert sum(r.get("num_resets") or 0 for r in resumed.results()["rounds"]) == 0


def test_dual_state_of_another_run_counts_as_none_stored_packed_or_not():
    """reconcile: state of another run-token is reset (lagging: ok False; the server then
    resets b_t), of the same run adopted; a stacked node's record keeps each slot's run."""
    from fmtl_flower.clients.dual_state import encode, reconcile
    from fmtl_flower.clients.packed_mocha import StackedState

    n = 3
    mine = reconcile(None, None, task_id=2, n=n, last_accepted=0, run="A.x")
    mine.alpha = np.array([0.5, -0.25, 1.0])
    duals, meta = encode(mine, 2, np.zeros(n), 1, "data")
    assert meta["run"] == "A.x"
    same = reconcile(duals, meta, task_id=2, n=n, last_accepted=1, fingerprint="data",
                     run="A.x")
    assert same.ok and same.committed == 1 and same.alpha.tolist() == [0.5, -0.25, 1.0]
    other = reconcile(duals, meta, task_id=2, n=n, last_accepted=1, fingerprint="data",
                      run="B.y")
    assert not other.ok and other.note == "other run" and not other.alpha.any()
    unbound = reconcile(duals, {k: v for k, v in meta.items() if k != "run"}, task_id=2,
                        n=n, last_accepted=1, fingerprint="data", run="A.x")
    assert not unbound.ok and unbound.note == "other run"
    # a stacked node's record: the slot's run survives encoding and decoding
    stacked = StackedState(None)
    stacked.slots[7] = (duals, meta)
    again = StackedState(stacked.record())
    assert again.slots[7][1]["run"] == "A.x"


# ------------------------------------------------------------------ FSVRG resumed on other data
@pytest.mark.parametrize("method", ["fsvrg", "cocoa-plus"])
def test_fsvrg_resumed_on_other_data_is_refused(sparse, tmp_path, method):
    """n, lambda = 1/n and the statistics belong to the checkpoint's data: a resumed run whose
    nodes report other sizes stops with an error naming the tasks (it went on silently)."""
    from fmtl_flower.checkpoint import CheckpointError

    options = {"method": method, "seed": 2, "discovery_timeout": 5.0}
    first = FSVRG(sparse.num_tasks, **options)
    first.enable_checkpoints(tmp_path / "ckpt")
    _run(first, _fsvrg_app(sparse, tmp_path / "devices"), sparse.num_tasks, 2)
    other = make_sparse_federated(num_tasks=6, dim=300, seed=7)  # same shape, other sizes
    assert not np.array_equal([other.task(t).arrays()[0].shape[0] for t in range(6)],
                              first.n_train)
    resumed = FSVRG(sparse.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="other data"):
        _run(resumed, _fsvrg_app(other, tmp_path / "devices"), sparse.num_tasks, 4)
    assert resumed.lam == first.lam  # (restored, never used for a round)


# ------------------------------------------------------------------ the strict envelope
def _extra_array(message, reply):
    """The reply with one more array (8 MB) the contract does not name."""
    from flwr.app import ArrayRecord

    from fmtl_flower.wire import to_array

    from .test_fuzz_replies import _rebuild

    arrays = dict(reply.content["arrays"].items()) if "arrays" in reply.content else {}
    arrays["extra"] = to_array(np.zeros(1_000_000))
    return [_rebuild(message, reply, arrays=ArrayRecord(arrays))]


def _extra_metric(message, reply):
    from flwr.app import MetricRecord

    from .test_fuzz_replies import _rebuild

    if "metrics" not in reply.content:  # a stacked reply: its metrics are vectors
        return _extra_array(message, reply)
    return [_rebuild(message, reply, metrics=MetricRecord(
        {**dict(reply.content["metrics"].items()), "extra": 1.0}))]


def _extra_record(message, reply):
    from flwr.app import ConfigRecord

    from .test_fuzz_replies import _rebuild

    return [_rebuild(message, reply, config=ConfigRecord({"note": "x" * 100_000}))]


def _foreign_run(message, reply):
    from flwr.app import Message

    forged = Message(reply.content, reply_to=message)
    forged.metadata.__dict__["_run_id"] = message.metadata.run_id + 1
    return [forged]


ENVELOPE_CASES = {"extra-array": _extra_array, "extra-metric": _extra_metric,
                  "extra-record": _extra_record, "foreign-run-id": _foreign_run}


@pytest.mark.parametrize("case", sorted(ENVELOPE_CASES))
@pytest.mark.parametrize("name", ["mocha", "mb-sgd", "fedem", "cocoa-plus", "ofmtl",
                                  "packed-fsvrg"])
def test_reply_outside_its_envelope_is_rejected_like_a_lost_one(name, case):
    """A reply with a record, metric or array its contract does not name, or from another
    Flower run, changes nothing: the run ends as the one where that reply was lost (each
    was accepted, its unknown parts ignored, on the old code)."""
    from .test_fuzz_replies import FAMILIES, PACKED_FAMILIES, check_hostile_run

    family = {**FAMILIES, **PACKED_FAMILIES}[name]
    where = (family.victim, family.targets[0], 2)
    with _flower_warnings() as logged:
        assert check_hostile_run(family, {where: ENVELOPE_CASES[case]}) == {where}
    reason = "run_id" if case == "foreign-run-id" else "not in the wire contract"
    assert any(reason in line and "rejected" in line for line in logged), logged


@contextlib.contextmanager
def _flower_warnings():
    """The WARNING lines Flower's logger writes in the block."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("flwr")
    handler, level = Collect(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_oversized_arrays_are_rejected_before_they_are_decoded(monkeypatch):
    """The size cap reads the serialised bytes: an array above its contract's shape is
    rejected without decoding it (decoding fails the parse here), with the sizes named."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fmtl_flower.strategies.trust import ReplyBoundary, ReplyContract
    from fmtl_flower.wire import to_array

    for key in ("_run_id", "_node_id", "_task_id"):  # a process with an identity (a run's)
        monkeypatch.setattr(TaskIdentity, key, getattr(TaskIdentity, key) or 1)
    contract = ReplyContract.of(("task-id",), {"delta-b": ("d",)})
    boundary = ReplyBoundary("test", {"train": contract}, lambda: {"d": 5})
    sent = Message(RecordDict({}), dst_node_id=7, message_type="train")
    sent.metadata.__dict__["_message_id"] = "m1"

    def read(values: np.ndarray) -> tuple[dict, dict]:
        reply = Message(RecordDict({"metrics": MetricRecord({"task-id": 0}),
                                    "arrays": ArrayRecord({"delta-b": to_array(values)})}),
                        reply_to=sent)
        reply.metadata.__dict__["_src_node_id"] = 7
        boundary.begin()
        boundary.track(0, 7, sent)
        out = boundary.read("round 1", [reply],
                            lambda r, t: {"delta-b": r.content["arrays"]["delta-b"].numpy()})
        return out.accepted, out.failed

    def undecodable(self):
        raise AssertionError("decoded")

    big = np.zeros(100_000)
    with monkeypatch.context() as patch:
        patch.setattr(Array, "numpy", undecodable)
        assert read(big) == ({}, {0: f"arrays of {len(to_array(big).data)} bytes, above the "
                                     f"wire contract's {5 * 8 + 1024}"})
        assert read(np.zeros(5)) == ({}, {0: "AssertionError: decoded"})  # within: decoded
    accepted, failed = read(np.zeros(5))
    assert failed == {} and accepted[0]["delta-b"].shape == (5,)


# ------------------------------------------------------------------ apps: one dispatch
@pytest.mark.parametrize("values", [
    {"strategy": "mocha", "num-tasks": 6, "dim": 4, "samples-per-task": 20,
     "num-server-rounds": 2},
    {"strategy": "mb-sgd", "num-tasks": 6, "dim": 4, "samples-per-task": 20,
     "num-server-rounds": 2},
    {"strategy": "fedem", "dataset": "synthetic", "num-tasks": 6, "dim": 5,
     "samples-per-task": 30, "num-server-rounds": 2, "fedem.M": 2},
    {"strategy": "fsvrg", "dataset": "sparse-federated", "num-tasks": 6, "dim": 300,
     "num-server-rounds": 2},
], ids=["mocha", "mb-sgd", "fedem", "fsvrg"])
def test_flwr_run_app_serves_stacked_messages_as_the_configured_app(values):
    """The app `flwr run` builds (handlers picked per run config) and the app built for one
    configuration reach the same stacked handler (apps/common.py's one dispatch): same
    results on packed nodes."""
    import math

    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig

    values = {**values, "tasks-per-node": 3}
    cfg = RunConfig.from_mapping(values)
    results = []
    for client in (make_client_app(cfg), make_client_app()):
        box: dict = {}
        run_inprocess(make_server_app(cfg, on_done=box.update), client,
                      math.ceil(cfg.num_tasks / 3), run_config=values)
        results.append(box)
    untimed = [[{k: v for k, v in r.items() if not k.endswith("_s")}
                for r in box["rounds"]] for box in results]
    assert untimed[0] == untimed[1] and untimed[0]
