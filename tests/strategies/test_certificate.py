"""The duality-gap certificate (issue 25, item 3): the server checks each task's reported loss
and dual against what it holds itself (Fenchel-Young with w_t . b_t, and the dual's box,
:mod:`fmtl_flower.core.certificate`), so a gap built from devices' words cannot be forged below
0: a reply whose pair fails is rejected like any invalid reply (a drop), and the records say
whether their gap is certified and how many replies failed the check.

Every forgery below is made by one hostile device (task ``HOSTILE``) on a
:class:`~tests.strategies.hostile.HostileGrid`, one task per node and packed (two tasks per
node, stacked replies). Honest runs (several formulations, CoCoA, Mb-SDCA, drop-outs, a device
that restarts, CoCoA+) have no rejection and the same records as with the check switched off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

from fmtl_flower import make_mocha_client_app
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.packed_fsvrg import PackedFSVRG
from fmtl_flower.clients.packed_mocha import PackedMOCHA
from fmtl_flower.core.certificate import PAIR_SLACK
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.packing import STACK, PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies import fsvrg as fsvrg_module
from fmtl_flower.strategies import mocha as mocha_module
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem
from .hostile import HostileGrid, Tamper, untouched

TASKS, DIM, ROUNDS = 6, 5, 5
HOSTILE = 2
PACKINGS = [1, 2]  # tasks per node: 1 = one-task replies, 2 = stacked replies
#: max_failures = 0: a failing task is never excluded, so every exchange asks it again.
RUN = {"lam": 0.05, "omega": "mean", "lam2": 0.5, "omega_every": 0, "max_failures": 0}

#: ``forgery(values, coupling) -> changes``: the hostile task's new loss and dual values, from
#: its true ones (``values``) and the coupling term the server holds for it.
Forgery = Callable[[dict[str, float], float], dict[str, float]]


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=40, seed=7)


# ------------------------------------------------------------------------------ the grid
def _replace_metrics(reply: Message, message: Message, changes: dict[str, float]) -> Message:
    """A one-task reply with some metric values replaced."""
    content = reply.content
    metrics = dict(content["metrics"])
    metrics.update(changes)
    return Message(RecordDict({**dict(content.items()), "metrics": MetricRecord(metrics)}),
                   reply_to=message)


def _replace_rows(reply: Message, message: Message, task: int,
                  changes: dict[str, float]) -> Message:
    """A stacked reply with some values of ``task``'s row replaced."""
    content = reply.content
    arrays = {key: from_array(value) for key, value in content["arrays"].items()}
    row = arrays["task-id"] == task
    for key, value in changes.items():
        column = np.array(arrays[key])
        column[row] = value
        arrays[key] = column
    return Message(RecordDict({**dict(content.items()), "arrays": ArrayRecord(
        {key: to_array(value) for key, value in arrays.items()})}), reply_to=message)


def forging(forgery: Forgery, names: tuple[str, str],
            coupling: Callable[[Message, dict[str, float]], float]) -> Tamper:
    """A tamper making task ``HOSTILE``'s replies (one-task or its row of a stacked one) say
    ``forgery``'s values for the metrics ``names`` (loss, dual); ``coupling(message, values)``
    is the server's coupling term for the task as the message was sent."""
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or reply.has_error():
            return untouched(message, reply)
        if STACK in reply.content:
            arrays = reply.content["arrays"]
            if names[0] not in arrays:
                return [reply]
            tasks = from_array(arrays["task-id"]).tolist()
            if HOSTILE not in tasks:
                return [reply]
            i = tasks.index(HOSTILE)
            values = {key: float(from_array(arrays[key])[i])
                      for key in (*names, "state-ok", "n-train")}
            changes = forgery(values, coupling(message, values))
            return [_replace_rows(reply, message, HOSTILE, changes)]
        metrics = reply.content.get("metrics")
        if metrics is None or names[0] not in metrics or int(metrics["task-id"]) != HOSTILE:
            return [reply]
        values = {key: float(metrics[key]) for key in (*names, "state-ok", "n-train")}
        return [_replace_metrics(reply, message, forgery(values, coupling(message, values)))]
    return tamper


def losing(message: Message, reply: Message | None) -> list[Message]:
    """Task ``HOSTILE``'s one-task replies are lost."""
    if reply is not None and not reply.has_error() and "metrics" in reply.content \
            and int(reply.content["metrics"]["task-id"]) == HOSTILE:
        return []
    return untouched(message, reply)


# ------------------------------------------------------------------------------ MOCHA runs
def run_mocha(problem, per_node: int, tamper: Callable[[MOCHA], Tamper] | None = None,
              rounds: int = ROUNDS, wrap=None, **kwargs: Any) -> MOCHA:  # noqa: ANN001
    """MOCHA over ``problem`` on a HostileGrid whose replies pass ``tamper(strategy)``,
    ``per_node`` tasks per node."""
    options = {**RUN, **kwargs} if "omega" not in kwargs else \
        {"lam": RUN["lam"], "omega_every": 0, "max_failures": 0, **kwargs}
    strategy = MOCHA(TASKS, discovery_timeout=5.0, **options)
    app = make_mocha_client_app(problem.load)
    if wrap is not None:
        app = wrap(app)
    if per_node > 1:
        handler = PackedMOCHA(make_mocha_client_app(problem.load).mocha_client)
        app = packed_client_app(app, lambda ctx: tasks_of_node(ctx.node_config, per_node, TASKS),
                                {handler.protocol: handler}, {"query.whoami": handler.whoami})
    inner = HostileGrid(app, math.ceil(TASKS / per_node))
    if tamper is not None:
        inner.tamper = tamper(strategy)
    grid = PackedGrid(inner, query_timeout=5.0) if per_node > 1 else inner
    strategy.start(grid=grid, num_rounds=rounds, timeout=30.0)
    return strategy


def mocha_coupling(strategy: MOCHA) -> Callable[[Message, dict[str, float]], float]:
    """w_t . b_t of task HOSTILE as the server holds them when it sends ``message`` (what
    its device can compute itself: the w_t it received, its own alpha); 0 after a restart."""
    def coupling(message: Message, values: dict[str, float]) -> float:
        arrays = message.content["arrays"]
        w = from_array(arrays["w"])
        if w.ndim == 2:
            w = w[from_array(arrays["task-id"]).tolist().index(HOSTILE)]
        assert strategy.state is not None
        return float(w @ strategy.state.B[:, HOSTILE]) if values["state-ok"] else 0.0
    return coupling


MOCHA_NAMES = ("loss-mean", "dual-mean")

#: Forgeries the check rejects: the issue's (loss 0, dual 1), the box broken, and a pair just
#: below Fenchel-Young's bound.
REJECTED: dict[str, Forgery] = {
    "issue-loss-0-dual-1": lambda v, c: {"loss-mean": 0.0, "dual-mean": 1.0},
    "dual-above-box": lambda v, c: {"dual-mean": 1.5},
    "negative-loss": lambda v, c: {"loss-mean": -0.1},
    "just-below-fenchel-young": lambda v, c: {"loss-mean": v["dual-mean"] - c - 1e-3},
}

#: Forgeries consistent with Fenchel-Young (so accepted): a lower loss than the true one, or a
#: higher dual, on the bound.
CONSISTENT: dict[str, Forgery] = {
    "lower-loss-on-the-bound": lambda v, c: {"loss-mean": max(0.0, v["dual-mean"] - c)},
    "higher-dual-on-the-bound": lambda v, c: {"dual-mean": min(1.0, v["loss-mean"] + c)},
}


def public(strategy) -> list[dict[str, Any]]:  # noqa: ANN001
    """The records without wall times."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")}
            for r in strategy.results()["rounds"]]


def assert_no_gap_below_zero(strategy) -> None:  # noqa: ANN001
    gaps = [r["gap"] for r in strategy.results()["rounds"] if r["gap"] is not None]
    assert all(g >= 0 for g in gaps), gaps


@pytest.fixture(scope="module")
def lost_run(problem):
    """The run where the hostile device's replies are lost."""
    return run_mocha(problem, 1, lambda s: losing)


@pytest.mark.parametrize("per_node", PACKINGS)
@pytest.mark.parametrize("name", sorted(REJECTED))
def test_forged_mocha_pairs_are_rejected_like_lost_replies(problem, lost_run, name, per_node):
    """Every forged reply of the hostile task is rejected (counted in the records), no record
    has a gap (the task is missing from every one), no gap anywhere is below 0, and the run is
    the run where those replies were lost, bit for bit. Before, the issue's forgery (loss 0,
    dual 1) was accepted and the gap came out at about -0.7 x rounds."""
    strategy = run_mocha(problem, per_node,
                         lambda s: forging(REJECTED[name], MOCHA_NAMES, mocha_coupling(s)))
    rounds = strategy.results()["rounds"]
    assert_no_gap_below_zero(strategy)
    assert [r["certificate_rejections"] for r in rounds] == [1] * (ROUNDS + 1)
    assert not any(r["gap_certified"] for r in rounds)
    assert all(r["gap"] is None and HOSTILE in r["tasks_missing"] for r in rounds)
    assert strategy.results()["final"]["certificate_rejections_total"] == ROUNDS + 1
    assert np.array_equal(strategy.state.W, lost_run.state.W)
    lost = public(lost_run)
    for record in lost:
        record["certificate_rejections"] = 1
    assert public(strategy) == lost


@pytest.fixture(scope="module")
def honest_run(problem):
    return run_mocha(problem, 1)


@pytest.mark.parametrize("per_node", PACKINGS)
@pytest.mark.parametrize("name", sorted(CONSISTENT))
def test_pairs_consistent_with_fenchel_young_keep_the_gap_nonnegative(problem, honest_run,
                                                                      name, per_node):
    """A device that claims a lower loss (or a higher dual) than its true one while keeping
    its pair consistent passes the check; it can understate the gap but not below 0."""
    strategy = run_mocha(problem, per_node,
                         lambda s: forging(CONSISTENT[name], MOCHA_NAMES, mocha_coupling(s)))
    rounds, honest = strategy.results()["rounds"], honest_run.results()["rounds"]
    assert all(r["gap_certified"] and r["certificate_rejections"] == 0 for r in rounds)
    assert_no_gap_below_zero(strategy)
    assert all(r["gap"] <= h["gap"] + 1e-12 for r, h in zip(rounds, honest, strict=True))
    assert any(r["gap"] < h["gap"] for r, h in zip(rounds, honest, strict=True))


@pytest.mark.parametrize("per_node", PACKINGS)
def test_a_forged_restart_keeps_its_numbers_out_of_the_gap(problem, per_node):
    """A device claiming it restarted (``state-ok`` 0, so its pair is checked with b_t = 0)
    with loss 0 and dual 0 passes the check, but a restarted task's numbers never enter a
    gap: the records have none, none below 0, and the server resets the task each round."""
    strategy = run_mocha(problem, per_node, lambda s: forging(
        lambda v, c: {"state-ok": 0, "loss-mean": 0.0, "dual-mean": 0.0}, MOCHA_NAMES,
        mocha_coupling(s)))
    rounds = strategy.results()["rounds"]
    assert all(r["gap"] is None and HOSTILE in r["tasks_missing"] for r in rounds)
    assert all(r["certificate_rejections"] == 0 for r in rounds)
    assert all(r["num_resets"] == 1 for r in rounds[1:])


def _check_off(monkeypatch) -> None:  # noqa: ANN001
    """Switch the certificate's check off (as before it existed)."""
    monkeypatch.setattr(mocha_module, "pair_problems", lambda *args: {})


HONEST = {
    "identity": {"omega": "identity"},
    "mean": {},
    "probabilistic": {"omega": "probabilistic", "omega_every": 2},
    "clustered": {"omega": "clustered", "eta": 1.0, "clusters": 2, "omega_every": 2},
    "graphical": {"omega": "graphical", "s2": 1.0, "lam2": 0.01, "omega_every": 2},
    "cocoa": {"method": "cocoa", "theta": 0.5},
    "mb-sdca": {"method": "mb-sdca", "beta": 1.0},
    "drops-and-gamma": {"drop_prob": 0.3, "gamma": 0.5},
    "factored": {"omega": "probabilistic", "omega_every": 2, "server_path": "factored"},
}


@pytest.mark.parametrize("per_node", PACKINGS)
@pytest.mark.parametrize("case", sorted(HONEST))
def test_honest_runs_pass_every_check_and_keep_their_records(problem, monkeypatch, case,
                                                             per_node):
    """Honest devices never fail the check: no rejection, every record certified, and the
    same records and models, bit for bit, as with the check switched off."""
    strategy = run_mocha(problem, per_node, **HONEST[case])
    rounds = strategy.results()["rounds"]
    assert all(r["certificate_rejections"] == 0 and r["gap_certified"] for r in rounds)
    assert_no_gap_below_zero(strategy)
    with monkeypatch.context() as patch:
        _check_off(patch)
        unchecked = run_mocha(problem, per_node, **HONEST[case])
    assert public(strategy) == public(unchecked)
    assert np.array_equal(strategy.state.W, unchecked.state.W)


def test_honest_run_near_the_optimum_passes_every_check(problem):
    """Near the optimum every pair's Fenchel-Young slack is near 0 (each is >= 0 and they sum
    to the gap): honest rounding must not fail the check there either."""
    strategy = run_mocha(problem, 1, rounds=300, omega="identity", local_frac=1.0)
    rounds = strategy.results()["rounds"]
    assert all(r["certificate_rejections"] == 0 and r["gap_certified"] for r in rounds)
    final = rounds[-1]
    assert 0 <= final["gap"] < 1e-6 * final["primal"]


def test_restarted_device_passes_the_check(problem):
    """A device that loses its state replies ``state-ok`` 0 with alpha = 0: its pair is
    checked with b_t = 0 (the server's b_t is the old one until it resets it) and passes."""
    def wrap(app):  # noqa: ANN001, ANN202
        def client(message: Message, context: Context) -> Message:
            if default_task_id(context) == HOSTILE \
                    and int(message.content["config"].get("server-round", 0)) == 3:
                for key in list(context.state.keys()):
                    del context.state[key]
            return app(message, context)
        return client

    strategy = run_mocha(problem, 1, wrap=wrap)
    rounds = strategy.results()["rounds"]
    assert rounds[3]["num_resets"] == 1  # the restart happened
    assert all(r["certificate_rejections"] == 0 for r in rounds)
    assert rounds[2]["gap"] is None and HOSTILE in rounds[2]["tasks_missing"]  # inconsistent
    assert all(r["gap_certified"] for r in rounds if r["round"] != 2)
    assert_no_gap_below_zero(strategy)


# ------------------------------------------------------------------------------ CoCoA+
K = 7


@pytest.fixture(scope="module")
def data():
    return make_sparse_federated(num_tasks=K, dim=300, seed=3)


def run_cocoa_plus(data, per_node: int, tamper: Callable[[FSVRG], Tamper] | None = None,
                   rounds: int = ROUNDS) -> FSVRG:  # noqa: ANN001
    strategy = FSVRG(K, method="cocoa-plus", lam=0.01, discovery_timeout=5.0)
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    if per_node > 1:
        stacked = PackedFSVRG(app.fsvrg_client)
        app = packed_client_app(app, lambda ctx: tasks_of_node(ctx.node_config, per_node, K),
                                {"fsvrg": stacked}, {"query.whoami": stacked.whoami})
    inner = HostileGrid(app, math.ceil(K / per_node))
    if tamper is not None:
        inner.tamper = tamper(strategy)
    grid = PackedGrid(inner, query_timeout=5.0) if per_node > 1 else inner
    strategy.start(grid=grid, num_rounds=rounds, timeout=30.0)
    return strategy


def cocoa_coupling(strategy: FSVRG) -> Callable[[Message, dict[str, float]], float]:
    """lam n (w . v_k) of task HOSTILE as the server holds them (0 after a restart)."""
    def coupling(message: Message, values: dict[str, float]) -> float:
        assert strategy.ledger is not None and strategy.w is not None
        share = strategy.ledger.share(HOSTILE)
        return strategy.lam * strategy.n_total * float(strategy.w @ share) \
            if values["state-ok"] else 0.0
    return coupling


COCOA_NAMES = ("loss-sum", "dual-sum")
COCOA_REJECTED: dict[str, Forgery] = {
    "dual-sum-above-box": lambda v, c: {"dual-sum": 1e9},
    "just-below-fenchel-young": lambda v, c: {"dual-sum": v["loss-sum"] + c + 1e-3},
}
#: The top of the dual's box, n_k log 2 (the issue's forgery): rejected once w != 0.
BOX_TOP: Forgery = lambda v, c: {"dual-sum": v["n-train"] * math.log(2.0)}  # noqa: E731
ON_THE_BOUND: Forgery = lambda v, c: {"dual-sum": v["loss-sum"] + c}  # noqa: E731


@pytest.fixture(scope="module")
def cocoa_honest(data):
    return run_cocoa_plus(data, 1)


@pytest.mark.parametrize("per_node", PACKINGS)
@pytest.mark.parametrize("name", sorted(COCOA_REJECTED))
def test_forged_cocoa_plus_dual_sums_are_rejected(data, cocoa_honest, name, per_node):
    """A forged ``dual-sum`` is rejected in every exchange (counted), no record has a gap
    and none is below 0. Before, a dual-sum inside its box [0, n log 2] was accepted and the
    gap came out far below the true one (or below 0)."""
    strategy = run_cocoa_plus(
        data, per_node, lambda s: forging(COCOA_REJECTED[name], COCOA_NAMES, cocoa_coupling(s)))
    rounds = strategy.results()["rounds"]
    assert all(r["gap"] is None and HOSTILE in r["tasks_missing"] for r in rounds)
    assert [r["certificate_rejections"] for r in rounds] == [1] * (ROUNDS + 1)
    assert not any(r["gap_certified"] for r in rounds)
    assert strategy.results()["final"]["certificate_rejections_total"] == ROUNDS + 1
    assert all(r["certificate_rejections"] == 0 and r["gap_certified"]
               for r in cocoa_honest.results()["rounds"])


@pytest.mark.parametrize("per_node", PACKINGS)
def test_cocoa_plus_dual_sum_at_its_box_top_cannot_forge_the_gap(data, cocoa_honest, per_node):
    """The issue's forgery, ``dual-sum`` = n_k log 2 (inside its box): at w = 0 (record 0)
    the pair is consistent with Fenchel-Young (any alpha is, at w = 0) and passes, which
    understates that gap but keeps it >= 0; from round 1 on it fails, so those records have
    no gap. Before, it was accepted in every round and the gap came out far below the true
    one."""
    strategy = run_cocoa_plus(data, per_node,
                              lambda s: forging(BOX_TOP, COCOA_NAMES, cocoa_coupling(s)))
    rounds, honest = strategy.results()["rounds"], cocoa_honest.results()["rounds"]
    assert rounds[0]["gap_certified"] and 0 <= rounds[0]["gap"] < honest[0]["gap"]
    assert [r["certificate_rejections"] for r in rounds[1:]] == [1] * ROUNDS
    assert all(r["gap"] is None and not r["gap_certified"] for r in rounds[1:])


@pytest.mark.parametrize("per_node", PACKINGS)
def test_cocoa_plus_pair_on_the_bound_keeps_the_gap_nonnegative(data, cocoa_honest, per_node):
    """The largest dual-sum consistent with Fenchel-Young passes: the gap is understated but
    stays >= 0."""
    strategy = run_cocoa_plus(
        data, per_node,
        lambda s: forging(ON_THE_BOUND, COCOA_NAMES, cocoa_coupling(s)))
    rounds, honest = strategy.results()["rounds"], cocoa_honest.results()["rounds"]
    assert all(r["gap_certified"] and r["certificate_rejections"] == 0 for r in rounds)
    gaps = [r["gap"] for r in rounds]
    assert min(gaps) >= -PAIR_SLACK
    assert all(r["gap"] <= h["gap"] + 1e-12 for r, h in zip(rounds, honest, strict=True))


@pytest.mark.parametrize("per_node", PACKINGS)
def test_honest_cocoa_plus_keeps_its_records(data, cocoa_honest, monkeypatch, per_node):
    """Honest CoCoA+ nodes pass every check; the records are those of the run without it."""
    with monkeypatch.context() as patch:
        patch.setattr(fsvrg_module, "logistic_pair_problem", lambda *args: None)
        unchecked = run_cocoa_plus(data, per_node)
    assert public(cocoa_honest) == public(unchecked)
    assert np.array_equal(cocoa_honest.w, unchecked.w)


def test_cocoa_plus_gap_with_a_late_node_is_not_certified(data):
    """A node found after round 1's setup is not in the dual's n (n_total, fixed then) but
    is in the objective's: the gap mixes two normalisations and is no sum of checked slacks,
    so it is not certified even though every pair passed."""
    trains = [0]

    def late(message: Message, reply: Message | None) -> list[Message]:
        trains[0] += message.metadata.message_type == "train"
        if message.metadata.message_type.endswith("whoami") and trains[0] < K \
                and reply is not None and int(reply.content["info"]["task-id"]) == HOSTILE:
            return []  # task HOSTILE's node answers discovery from round 2 on
        return untouched(message, reply)

    strategy = FSVRG(K, method="cocoa-plus", lam=0.01, discovery_timeout=0.5, min_tasks=K - 1)
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    grid = HostileGrid(app, K)
    grid.tamper = late
    strategy.start(grid=grid, num_rounds=ROUNDS, timeout=30.0)
    rounds = strategy.results()["rounds"]
    assert strategy.n_total < strategy.n_train.sum()
    late_gaps = [r for r in rounds if r["gap"] is not None]
    assert late_gaps and not any(r["gap_certified"] for r in late_gaps)
    assert all(r["certificate_rejections"] == 0 for r in rounds)
