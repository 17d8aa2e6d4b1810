"""The MOCHA strategy with its ClientApp, run in-process.

* parity: the federation computes exactly what :func:`fmtl_flower.centralized.fit_mocha` does;
* invariants with a fixed Omega: the dual never decreases, the gap is >= 0 and shrinks;
* faults (design decisions 4 and 8): every bad or missing reply is logged, leaves the round's
  accepted state untouched, and B stays equal to the devices' X^T alpha / n;
* lost device state, silent nodes, drop-outs and node discovery.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.clients.mocha import STATE_ARRAYS, STATE_META
from fmtl_flower.engine import FIRST_NODE_ID, InProcessGrid

from .helpers import (
    ClientCallable,
    Problem,
    Run,
    assert_b_consistent,
    corrupt,
    device_alpha,
    fault_at,
    is_train,
    late_at,
    make_problem,
    msg_round,
    run_centralized,
    run_federation,
    with_metrics,
)

TARGET_TASK = 1
TARGET_NODE = FIRST_NODE_ID + TARGET_TASK  # node i serves partition (task) i by default
FAULT_ROUND = 3
FAULT_RUN = {"omega": "probabilistic", "omega_every": 2, "lam": 1e-2, "seed": 1}
FAULT_ROUNDS = 6

CONV_RUN = {"omega": "identity", "lam": 0.05, "seed": 0}
CONV_ROUNDS = 60
REL_TOL = 1e-3
GAP_TOL = 1e-12  # round-off: at the optimum P - D is a difference of equal numbers


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem(num_tasks=6, dim=5, samples_per_task=30, seed=0)


@pytest.fixture(scope="module")
def reference(problem) -> Run:
    """The fault-free run the convergence tests compare with."""
    run = run_federation(problem, CONV_ROUNDS, **CONV_RUN)
    final = run.final
    assert final["complete"]
    assert final["gap"] / final["primal"] < 1e-8
    return run


@pytest.fixture(scope="module")
def lost_reply_run(problem) -> Run:
    """The fault runs' reference: the target's round-3 reply simply never arrives."""
    return run_federation(problem, FAULT_ROUNDS,
                          wrap=fault_at("raise-before", TARGET_NODE, {FAULT_ROUND}), **FAULT_RUN)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_converged_to(run: Run, reference: Run) -> None:
    final = run.final
    assert final["complete"], final
    assert final["gap"] >= -GAP_TOL
    assert final["gap"] / final["primal"] < REL_TOL
    assert relative(final["primal"], reference.final["primal"]) < REL_TOL


def assert_gaps_nonnegative(run: Run) -> None:
    for record in run.rounds:
        if record["gap"] is not None:
            assert record["gap"] >= -GAP_TOL, record
            assert record["primal"] - record["dual"] == record["gap"]


def assert_round_untouched(run: Run, server_round: int, task: int) -> None:
    """The task's reply of ``server_round`` was not added; the other tasks' replies were."""
    trace = run.strategy.trace[server_round]
    assert np.array_equal(trace["B_after"][:, task], trace["B_before"][:, task])
    assert trace["last_after"][task] == trace["last_before"][task] == server_round - 1
    others = np.arange(run.problem.num_tasks) != task
    assert np.all(trace["last_after"][others] == server_round)
    # round r's replies complete the record of the state after r - 1 rounds
    record = run.rounds[server_round - 1]
    assert record["tasks_missing"] == [task]
    assert record["primal"] is None and record["dual"] is None and record["gap"] is None
    assert run.rounds[server_round]["num_replies"] == run.problem.num_tasks - 1


# ------------------------------------------------------------------------------ parity
PARITY_CASES = {
    "identity": {"omega": "identity"},
    "probabilistic-every-3": {"omega": "probabilistic", "omega_every": 3},
    "sys-het-high": {"sys_het": "high"},
    "drop-0.3": {"drop_prob": 0.3},
    "mixed": {"omega": "probabilistic", "omega_every": 2, "sigma_mode": "per-task",
              "sys_het": "low", "sys_het_base": "n_t", "drop_prob": 0.2, "local_frac": 0.5},
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_federation_is_bit_identical_to_centralized(problem, case):
    kwargs: dict[str, Any] = {"lam": 1e-2, "seed": 7, **PARITY_CASES[case]}
    rounds = 12
    run = run_federation(problem, rounds, **kwargs)
    fit = run_centralized(problem, rounds, **kwargs)
    state = run.strategy.state
    assert np.array_equal(state.W, fit.W)
    assert np.array_equal(state.B, fit.state.B)
    assert np.array_equal(state.M, fit.state.M)
    assert len(run.rounds) == len(fit.history) == rounds + 1
    for record, expected in zip(run.rounds, fit.history, strict=True):
        assert record["round"] == expected["round"]
        for key in ("primal", "dual", "gap", "test_error", "test_error_pooled",
                    "accuracy_bottom_decile"):
            assert record[key] == expected[key], (record["round"], key)
    for t in range(problem.num_tasks):
        assert np.array_equal(device_alpha(run, t), fit.alphas[t])
    assert run.final["complete"] and run.final["tasks_never_replied"] == []
    if kwargs.get("drop_prob"):
        assert sum(r["num_dropped"] for r in run.rounds[1:]) > 0
    if kwargs.get("omega") == "probabilistic":
        assert not np.allclose(state.M * state.lam, np.eye(problem.num_tasks) / problem.num_tasks)


# ------------------------------------------------------------------------------ invariants
@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), num_tasks=st.integers(2, 5), dim=st.integers(2, 6),
       samples=st.integers(10, 30), lam=st.sampled_from([1e-3, 1e-2, 1e-1]),
       drop_prob=st.sampled_from([0.0, 0.3]), sys_het=st.sampled_from(["none", "high"]))
def test_fixed_omega_dual_ascends_and_gap_is_nonnegative(seed, num_tasks, dim, samples, lam,
                                                         drop_prob, sys_het):
    problem = make_problem(num_tasks=num_tasks, dim=dim, samples_per_task=samples, seed=seed)
    run = run_federation(problem, 15, omega="identity", lam=lam, seed=seed,
                         drop_prob=drop_prob, sys_het=sys_het)
    records = run.rounds
    assert all(r["gap"] is not None for r in records)
    dual = np.array([r["dual"] for r in records])
    gap = np.array([r["gap"] for r in records])
    assert dual[0] == 0.0 and records[0]["primal"] == num_tasks  # alpha = 0, W = 0
    assert np.all(np.diff(dual) >= -GAP_TOL * np.maximum(1.0, np.abs(dual[1:])))
    assert np.all(gap >= -GAP_TOL)
    assert gap[-1] < gap[0]


def test_fixed_omega_gap_shrinks_to_zero(reference):
    gap = np.array([r["gap"] for r in reference.rounds])
    primal = np.array([r["primal"] for r in reference.rounds])
    dual = np.array([r["dual"] for r in reference.rounds])
    assert np.all(np.diff(dual) >= -GAP_TOL)
    assert np.all(gap >= -GAP_TOL)
    checkpoints = gap[[0, 5, 15, 30, CONV_ROUNDS]]
    assert np.all(np.diff(checkpoints) < 0), checkpoints
    assert gap[-1] / primal[-1] < 1e-8


# ------------------------------------------------------------------------------ bad replies
FAULTS = {
    "raise-before": r"node 1002 failed: RuntimeError: injected crash",
    "raise-after": r"node 1002 failed: RuntimeError: injected crash",
    "error-reply": r"node 1002 failed: injected error reply",
    "nan": r"'delta-b' has non-finite values",
    "inf": r"'delta-b' has non-finite values",
    "wrong-shape": r"'delta-b' must be float64 of shape \(5,\), got float64 \(6,\)",
    "wrong-shape-2d": r"'delta-b' must be float64 of shape \(5,\), got float64 \(5, 1\)",
    # rejected by the envelope's size cap before it is decoded (5 floats + one header)
    "oversized": r"arrays of 32000128 bytes, above the wire contract's 1064",
    "wrong-dtype": r"'delta-b' must be float64 of shape \(5,\), got float32 \(5,\)",
    "missing-delta": r"array 'db' is not in the wire contract",  # ('delta-b' renamed)
    "missing-arrays": r"array 'delta-b' missing",
    "missing-metrics": r"no 'metrics' record",
    "missing-loss": r"metric 'loss-mean' missing",
    "missing-state-ok": r"metric 'state-ok' missing",
    "inf-loss": r"metric 'loss-mean' is not finite",
    "bad-dual": r"dual-mean in \[0, 1\]",
    "wrong-n": r"n-train \d+ differs",
    "wrong-round": r"reply for task 1 round 2, expected task 1 round 3",
    "wrong-task": r"reply for task 2 round 3, expected task 1 round 3",
    "replayed": r"reply for task 1 round 2, expected task 1 round 3",
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_bad_reply_is_logged_rejected_and_state_stays_consistent(problem, lost_reply_run,
                                                                 caplog, kind):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, FAULT_ROUNDS,
                             wrap=fault_at(kind, TARGET_NODE, {FAULT_ROUND}), **FAULT_RUN)
    warnings = warnings_of(caplog)
    assert any(re.search(FAULTS[kind], w) for w in warnings), warnings
    assert all(f"round {FAULT_ROUND}:" in w for w in warnings), warnings
    assert_round_untouched(run, FAULT_ROUND, TARGET_TASK)
    # the run completes: every record, the final one complete, no reset was needed
    assert len(run.rounds) == FAULT_ROUNDS + 1
    assert run.final["complete"] and run.final["gap"] >= -GAP_TOL
    assert all(r["num_resets"] == 0 for r in run.rounds[1:])
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    # a rejected reply is exactly a lost reply: same models, bit for bit
    assert np.array_equal(run.strategy.state.W, lost_reply_run.strategy.state.W)


def test_late_reply_is_discarded(problem, lost_reply_run):
    run = run_federation(problem, FAULT_ROUNDS, timeout=1.0,
                         wrap=late_at(TARGET_NODE, {FAULT_ROUND}, delay=1.3), **FAULT_RUN)
    assert_round_untouched(run, FAULT_ROUND, TARGET_TASK)
    assert run.final["complete"]
    assert all(r["num_resets"] == 0 for r in run.rounds[1:])
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert np.array_equal(run.strategy.state.W, lost_reply_run.strategy.state.W)


def test_late_reply_is_logged(problem, caplog):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_federation(problem, 4, timeout=1.0,
                       wrap=late_at(TARGET_NODE, {FAULT_ROUND}, delay=1.3), **FAULT_RUN)
    warnings = warnings_of(caplog)
    assert any(f"round {FAULT_ROUND}" in w and ("task 1" in w or "1002" in w)
               for w in warnings), warnings


@pytest.mark.parametrize("changes", [{"state-ok": 2}, {"state-ok": 0.5}, {"task-id": 1.0}])
def test_int_metrics_are_type_checked(problem, caplog, changes):
    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if context.node_id == TARGET_NODE and is_train(msg) and msg_round(msg) == 3:
                return with_metrics(reply, msg, **changes)
            return reply
        return client

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, 4, wrap=wrap, **FAULT_RUN)
    assert run.rounds[2]["tasks_missing"] == [TARGET_TASK]
    assert any("rejected" in w for w in warnings_of(caplog))


def test_intermittent_faults_reach_the_same_optimum(problem, reference, caplog):
    """Node of task 2 fails every third train call, in turn in four different ways."""
    kinds = ["raise-before", "nan", "raise-after", "wrong-round"]
    node = FIRST_NODE_ID + 2
    faulty_rounds: list[int] = []

    def wrap(app: ClientCallable) -> ClientCallable:
        calls = {"n": 0}

        def client(msg: Message, context: Context) -> Message:
            if context.node_id == node and is_train(msg):
                calls["n"] += 1
                if calls["n"] % 3 == 0:
                    faulty_rounds.append(msg_round(msg))
                    kind = kinds[(calls["n"] // 3 - 1) % len(kinds)]
                    return corrupt(kind, app, msg, context, {})
            return app(msg, context)

        return client

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, CONV_ROUNDS, wrap=wrap, **CONV_RUN)
    assert len(faulty_rounds) == CONV_ROUNDS // 3
    assert len(warnings_of(caplog)) == len(faulty_rounds)
    missing = [r["round"] + 1 for r in run.rounds if r["tasks_missing"]]
    assert missing == faulty_rounds  # round r's fault leaves the record of r - 1 incomplete
    for r in faulty_rounds:
        assert_round_untouched(run, r, 2)
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert_converged_to(run, reference)


# ------------------------------------------------------------------------------ lost state
def _copy_state(context: Context) -> RecordDict:
    saved = RecordDict()
    for key in (STATE_ARRAYS, STATE_META):
        record = context.state[key]
        saved[key] = type(record)(dict(record.items()))
    return saved


@pytest.mark.parametrize("how", ["wipe", "revert"])
def test_lost_device_state_resets_the_task_and_run_converges(problem, reference, how):
    """At round 6 the target node restarts (empty state) or its state reverts to round 3."""
    lost_round = 6
    saved: dict[str, RecordDict] = {}

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if context.node_id == TARGET_NODE and is_train(msg):
                if msg_round(msg) == 3:
                    saved["state"] = _copy_state(context)
                if msg_round(msg) == lost_round:
                    for key in list(context.state.keys()):
                        del context.state[key]
                    if how == "revert":
                        for key, record in saved["state"].items():
                            context.state[key] = record
            return app(msg, context)

        return client

    run = run_federation(problem, CONV_ROUNDS, wrap=wrap, **CONV_RUN)
    records = run.rounds
    assert records[lost_round]["num_resets"] == 1
    assert all(r["num_resets"] == 0 for r in records[1:] if r["round"] != lost_round)
    # the replies of the reset round describe an inconsistent pair: no objective for it
    inconsistent = records[lost_round - 1]
    assert inconsistent["tasks_missing"] == [TARGET_TASK]
    assert inconsistent["primal"] is None and inconsistent["dual"] is None
    assert inconsistent["gap"] is None
    assert all(r["gap"] is not None for r in records if r["round"] != lost_round - 1)
    # b_t was reset and holds exactly the restarted device's first update
    trace = run.strategy.trace[lost_round]
    assert trace["last_after"][TARGET_TASK] == lost_round
    assert not np.array_equal(trace["B_after"][:, TARGET_TASK],
                              trace["B_before"][:, TARGET_TASK])
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert_converged_to(run, reference)


# ------------------------------------------------------------------------------ silent nodes
@pytest.mark.parametrize("how", ["silent", "whoami-only"])
def test_node_that_never_replies(problem, caplog, how):
    silent_task = 4
    node = FIRST_NODE_ID + silent_task
    rounds = 8

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if context.node_id == node and (how == "silent" or "whoami" not in
                                            msg.metadata.message_type):
                raise ConnectionError("node down")
            return app(msg, context)

        return client

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, rounds, wrap=wrap, discovery_timeout=0.3,
                             min_tasks=problem.num_tasks - 1, **CONV_RUN)
    final = run.final
    assert final["tasks_never_replied"] == [silent_task]
    assert final["complete"] is False
    assert final["primal"] is None and final["gap"] is None and final["dual"] is None
    assert len(run.rounds) == rounds + 1
    assert all(r["tasks_missing"] == [silent_task] for r in run.rounds)
    warnings = warnings_of(caplog)
    if how == "silent":
        assert any("running without task ids 4" in w for w in warnings), warnings
        assert any("whoami failed on node 1005" in w for w in warnings), warnings
    else:
        assert any("node 1005 failed: ConnectionError: node down" in w for w in warnings)
    # the other tasks train; with Omega = I they train exactly as they would alone
    state = run.strategy.state
    others = [t for t in range(problem.num_tasks) if t != silent_task]
    assert np.all(run.strategy.last_accepted[others] == rounds)
    assert np.all(state.B[:, silent_task] == 0.0)
    assert np.all(np.linalg.norm(state.B[:, others], axis=0) > 0)
    fit = run_centralized(problem, rounds, **CONV_RUN)
    np.testing.assert_allclose(state.W[:, others], fit.W[:, others], rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------ drop-outs
def test_drop_half_reaches_the_same_optimum(problem, reference):
    run = run_federation(problem, 80, drop_prob=0.5, **CONV_RUN)
    dropped = [r["num_dropped"] for r in run.rounds[1:]]
    assert 0.3 < sum(dropped) / (80 * problem.num_tasks) < 0.7
    dual = np.array([r["dual"] for r in run.rounds])
    assert np.all(np.diff(dual) >= -GAP_TOL)
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert_converged_to(run, reference)


# ------------------------------------------------------------------------------ discovery
def test_tasks_are_keyed_by_task_id_not_node_id(problem):
    perm = [3, 0, 5, 1, 4, 2]
    kwargs = {"omega": "probabilistic", "omega_every": 3, "lam": 1e-2, "seed": 2}
    run = run_federation(problem, 8, node_configs=[{"task-id": t} for t in perm], **kwargs)
    assert run.strategy.task_to_node == {t: FIRST_NODE_ID + i for i, t in enumerate(perm)}
    assert np.array_equal(run.strategy.n_train, [len(y) for y in problem.ys])
    fit = run_centralized(problem, 8, **kwargs)
    assert np.array_equal(run.strategy.state.W, fit.W)
    assert [r["primal"] for r in run.rounds] == [h["primal"] for h in fit.history]
    for t in range(problem.num_tasks):
        assert np.array_equal(device_alpha(run, t), fit.alphas[t])
        meta = run.grid.contexts[FIRST_NODE_ID + perm.index(t)].state[STATE_META]
        assert meta["task-id"] == t


BAD_WHOAMI = {
    "task-id-too-large": ({"task-id": 99}, r"bad whoami reply: task-id 99 outside 0\.\.5"),
    "task-id-negative": ({"task-id": -1}, r"bad whoami reply: task-id -1 outside 0\.\.5"),
    "task-id-str": ({"task-id": "3"}, r"bad whoami reply: 'task-id' must be an int"),
    "task-id-bool": ({"task-id": True}, r"bad whoami reply: 'task-id' must be an int"),
    "no-dim": ({"dim": None}, r"bad whoami reply: 'dim' must be an int"),
    "n-train-zero": ({"n-train": 0}, r"bad whoami reply: n-train and dim must be >= 1"),
    "other-dim": ({"task-id": 2, "dim": 4}, r"node 1007 \(task 2\) has 4 features"),
}


@pytest.mark.parametrize("case", list(BAD_WHOAMI))
def test_bad_whoami_reply_is_logged_and_ignored(problem, caplog, case):
    changes, pattern = BAD_WHOAMI[case]
    rogue = FIRST_NODE_ID + problem.num_tasks  # a 7th node

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if context.node_id == rogue:
                assert "whoami" in msg.metadata.message_type  # it never gets work
                info: dict[str, Any] = {"task-id": 3, "n-train": 30, "n-test": 0, "dim": 5}
                info.update(changes)
                info = {k: v for k, v in info.items() if v is not None}
                return Message(RecordDict({"info": ConfigRecord(info)}), reply_to=msg)
            return app(msg, context)

        return client

    kwargs = {"omega": "probabilistic", "omega_every": 2, "lam": 1e-2, "seed": 4}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, 4, wrap=wrap, num_nodes=problem.num_tasks + 1, **kwargs)
    assert any(re.search(pattern, w) for w in warnings_of(caplog)), warnings_of(caplog)
    assert rogue not in run.strategy.node_to_task
    assert run.strategy.task_to_node == {t: FIRST_NODE_ID + t for t in range(problem.num_tasks)}
    fit = run_centralized(problem, 4, **kwargs)
    assert np.array_equal(run.strategy.state.W, fit.W)
    assert run.final["complete"]


# ------------------------------------------------------------------------------ node churn
def test_node_offline_for_some_rounds_rejoins_without_reset(problem, reference):
    task = 3
    node = FIRST_NODE_ID + task

    def before_round(server_round: int, grid: InProcessGrid) -> None:
        if server_round == 4:
            grid.offline.add(node)
        if server_round == 7:
            grid.offline.discard(node)

    run = run_federation(problem, CONV_ROUNDS, before_round=before_round, **CONV_RUN)
    # rounds 4..6 got no reply from it: records 3..5 lack the task
    assert [r["round"] for r in run.rounds if r["tasks_missing"]] == [3, 4, 5]
    assert all(r["tasks_missing"] == [task] for r in run.rounds[3:6])
    for server_round in (4, 5, 6):
        assert run.strategy.trace[server_round]["last_after"][task] == 3
    # its state is still the one the server knows: it commits, no reset
    assert run.strategy.trace[7]["last_after"][task] == 7
    assert all(r["num_resets"] == 0 for r in run.rounds[1:])
    assert run.strategy.task_to_node[task] == node
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert_converged_to(run, reference)


def test_restarted_device_with_new_node_id_takes_over_its_task(problem, reference):
    """Design decision 6: everything is keyed by task id; node ids change on restarts."""
    task = 3
    old, new = FIRST_NODE_ID + task, FIRST_NODE_ID + 10

    def before_round(server_round: int, grid: InProcessGrid) -> None:
        if server_round == 5:
            grid.offline.add(old)
            grid.contexts[new] = Context(run_id=1, node_id=new,
                                         node_config={"task-id": task}, state=RecordDict(),
                                         run_config={})

    run = run_federation(problem, CONV_ROUNDS, before_round=before_round, **CONV_RUN)
    assert run.strategy.task_to_node[task] == new
    assert run.strategy.node_to_task == {**{FIRST_NODE_ID + t: t for t in range(6) if t != task},
                                         new: task}
    assert run.rounds[5]["num_resets"] == 1  # the new device starts from alpha = 0
    assert run.rounds[4]["tasks_missing"] == [task] and run.rounds[4]["primal"] is None
    assert all(r["num_resets"] == 0 for r in run.rounds[1:] if r["round"] != 5)
    assert_gaps_nonnegative(run)
    assert_b_consistent(run)
    assert_converged_to(run, reference)


def test_two_live_nodes_claiming_one_task_do_not_thrash(problem):
    """Two live nodes claim task 0: neither holds it (issue 25: a node answering first with
    another device's task id must not get it) and nothing thrashes; pinned by the operator
    (``task_owners``), the task runs on its node."""
    configs = [{"task-id": t} for t in range(problem.num_tasks)] + [{"task-id": 0}]
    run = run_federation(problem, 8, num_nodes=problem.num_tasks + 1, node_configs=configs,
                         min_tasks=problem.num_tasks - 1, **CONV_RUN)
    assert 0 not in run.strategy.task_to_node
    assert all(r["tasks_missing"] == [0] for r in run.rounds[1:])
    assert sum(r["num_resets"] for r in run.rounds[1:]) == 0
    pinned = run_federation(problem, 8, num_nodes=problem.num_tasks + 1, node_configs=configs,
                            task_owners={0: FIRST_NODE_ID + problem.num_tasks}, **CONV_RUN)
    assert pinned.strategy.task_to_node[0] == FIRST_NODE_ID + problem.num_tasks
    assert sum(r["num_resets"] for r in pinned.rounds[1:]) <= 1
    assert all(r["primal"] is not None for r in pinned.rounds[3:])
