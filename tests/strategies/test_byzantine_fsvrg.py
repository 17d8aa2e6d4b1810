"""One hostile device among 10 against the FSVRG family (issue 25): well-formed replies that pass
every per-reply bound, from the device of task ``HOSTILE``, on one task per node and on packed
nodes (stacked replies).

With robust mode (the default) the honest devices' objective after the run stays within 5 % of
the run in which the hostile device's replies are lost; with ``robust=False`` the same attack
does the damage the issue reports (asserted, so the test shows the attack is real).

The honest objective is ``f_H(w) = (1/n_H) sum_{i in honest} l_i(w) + (lam/2) |w|^2`` with
``lam = 1/n`` of the true counts, computed here from the data, never from the strategy's
records (which the hostile device can bend).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.packed_fsvrg import PackedFSVRG
from fmtl_flower.core.fsvrg import logistic_objective
from fmtl_flower.core.fsvrg.robust import GRADIENT_PAIRING_FLOOR
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.round_state import FSVRGSentExchange
from fmtl_flower.wire import from_array, to_array

from .helpers import ServerKilled, killed_in
from .hostile import HostileGrid

TASKS, DIM, ROUNDS, PER_NODE = 10, 300, 8, 4
HOSTILE = 9
CLAIMED_N = 1_000_000_000  # the discovery limit max_n
METHODS = {"fsvrg": {}, "gd": {}, "cocoa-plus": {}, "dane": {"local_epochs": 1},
           "fsvrg-naive": {"h": 0.05}}


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def data():
    return make_sparse_federated(num_tasks=TASKS, dim=DIM, seed=0)


def honest_objective(data, w: np.ndarray) -> float:
    """``f_H(w)`` (module docstring)."""
    honest = [data.task(t) for t in range(TASKS) if t != HOSTILE]
    X = sp.vstack([t.X_train for t in honest])
    y = np.concatenate([t.y_train for t in honest])
    return logistic_objective(X, y, w, 1.0 / float(data.n_train.sum()))


# ------------------------------------------------------------------ the hostile device
def _direction(dim: int) -> np.ndarray:
    u = np.random.default_rng(25).normal(size=dim)
    return u / np.linalg.norm(u)


def _sent(message: Message, key: str) -> np.ndarray:
    return from_array(message.content["arrays"][key])


def _w_local_at_the_ratio_bound(values: dict, message: Message, strategy: FSVRG) -> None:
    """``w-local`` at ``max_update_ratio x max(|w_t|, 1)`` from ``w_t``, a fixed direction."""
    if "w-local" in values:
        w = _sent(message, "w")
        size = 0.999 * strategy.max_update_ratio * max(float(np.linalg.norm(w)), 1.0)
        values["w-local"] = w + size * _direction(w.size)


def _gradient_x1e3(values: dict, message: Message, strategy: FSVRG) -> None:
    """Gradients x1e3 in a fixed direction at the bound, with a matching ``sq-norm-sum``."""
    if "grad-sum" in values:
        values["sq-norm-sum"] *= 1e6
        size = 0.999 * math.sqrt(values["n-train"] * values["sq-norm-sum"])
        values["grad-sum"] = size * _direction(values["grad-sum"].size)


def _gradient_at_the_robust_edge(values: dict, message: Message, strategy: FSVRG) -> None:
    """Gradients at their bound ``sqrt(n-train sq-norm-sum)`` in a fixed direction, with a
    ``sq-norm-sum`` x3 (inside the federation's fence of mean squared row norms)."""
    if "grad-sum" in values:
        values["sq-norm-sum"] *= 3.0
        size = 0.999 * math.sqrt(values["n-train"] * values["sq-norm-sum"])
        values["grad-sum"] = size * _direction(values["grad-sum"].size)


def _gradient_on_the_pairing_floor(values: dict, message: Message, strategy: FSVRG) -> None:
    """:func:`_gradient_at_the_robust_edge` bent, each round, just enough to meet robust
    mode's pairing check ``w . grad-sum >= -W(1/e) n-train`` (its component along ``w_t``
    raised to the floor; ``loss-sum`` raised to ``w . grad-sum`` if below): the push stays
    as close to one direction as the check allows."""
    _gradient_at_the_robust_edge(values, message, strategy)
    _bent_onto_the_pairing_floor(values, message)


def _bent_onto_the_pairing_floor(values: dict, message: Message) -> None:
    """``grad-sum`` with its component along ``w_t`` raised just enough to meet the pairing
    check's floor ``w . grad-sum >= -W(1/e) n-train``; ``loss-sum`` raised to ``w .
    grad-sum`` if below."""
    if "grad-sum" in values:
        w, g = _sent(message, "w"), values["grad-sum"]
        floor = -0.999 * GRADIENT_PAIRING_FLOOR * values["n-train"]
        if float(w @ g) < floor:
            g = g + (floor - float(w @ g)) / float(w @ w) * w
        values["grad-sum"] = g
        values["loss-sum"] = max(values["loss-sum"], 1.001 * float(w @ g))


def _gradient_orthogonal_to_w(values: dict, message: Message, strategy: FSVRG) -> None:
    """:func:`_gradient_at_the_robust_edge` without its component along ``w_t``
    (``w . grad-sum = 0``: inside the pairing check whatever the round)."""
    _gradient_at_the_robust_edge(values, message, strategy)
    _turned_orthogonal_to_w(values, message)


def _turned_orthogonal_to_w(values: dict, message: Message) -> None:
    """``grad-sum`` without its component along ``w_t``, at the same norm."""
    if "grad-sum" in values:
        w, g = _sent(message, "w"), values["grad-sum"]
        if float(w @ w) > 0:
            g = g - float(w @ g) / float(w @ w) * w
            values["grad-sum"] = g * (np.linalg.norm(values["grad-sum"]) / np.linalg.norm(g))


def _claims_200_rows(values: dict, message: Message, strategy: FSVRG) -> None:
    """``n-train`` = 200 (4.8x the median: inside the count fence, cut by max-weight-share to
    160) and the gradient at its bound in a fixed direction."""
    if "n-train" in values:
        values["n-train"] = 200
    if "grad-sum" in values:
        size = 0.999 * math.sqrt(values["n-train"] * values["sq-norm-sum"])
        values["grad-sum"] = size * _direction(values["grad-sum"].size)


def _claims_200_rows_on_the_pairing_floor(values: dict, message: Message,
                                          strategy: FSVRG) -> None:
    """:func:`_claims_200_rows` bent each round onto the pairing floor
    (:func:`_bent_onto_the_pairing_floor`): the weight of 160 trusted rows, a per-row
    gradient below the clip radius, one direction every round as far as the checks allow."""
    _claims_200_rows(values, message, strategy)
    _bent_onto_the_pairing_floor(values, message)


def _claims_200_rows_orthogonal_to_w(values: dict, message: Message,
                                     strategy: FSVRG) -> None:
    """:func:`_claims_200_rows` turned orthogonal to ``w_t`` each round
    (:func:`_turned_orthogonal_to_w`; ``w . grad-sum = 0``, inside the pairing check)."""
    _claims_200_rows(values, message, strategy)
    _turned_orthogonal_to_w(values, message)


def _gram_negative(values: dict, message: Message, strategy: FSVRG) -> None:
    """GD's power iteration answered with ``gram-v = -1e3 v`` (the step becomes 1/lambda)."""
    if "gram-v" in values:
        values["gram-v"] = -1e3 * _sent(message, "v")


def _d_w_at_the_bound(values: dict, message: Message, strategy: FSVRG) -> None:
    """CoCoA+'s ``d-w`` at its largest allowed norm (``sq-norm-sum`` x1e6), a fixed
    direction, with ``state-ok`` = 1."""
    if "d-w" in values:
        values["sq-norm-sum"] *= 1e6
        w = _sent(message, "w")
        limit = min(strategy.max_update_ratio * max(float(np.linalg.norm(w)), 1.0),
                    math.sqrt(values["n-train"] * values["sq-norm-sum"])
                    / (strategy.lam * strategy.n_total))
        values["d-w"] = 0.999 * limit * _direction(w.size)
        values["state-ok"] = 1


def _share_at_the_verifiable_bound(values: dict, message: Message, strategy: FSVRG) -> None:
    """CoCoA+'s share of ``w`` kept at ``0.999 sqrt(n-train sq-norm-sum) / (lam n)`` (all of
    the device's ``y alpha`` at 1, the bound the server can verify) in a fixed direction, with
    its true ``sq-norm-sum`` and ``state-ok`` = 1."""
    if "d-w" in values:
        limit = math.sqrt(values["n-train"] * values["sq-norm-sum"]) / (
            strategy.lam * strategy.n_total)
        share = strategy.ledger.share(HOSTILE)
        values["d-w"] = 0.999 * limit * _direction(share.size) - share
        values["state-ok"] = 1


def _d_w_at_the_robust_edge(values: dict, message: Message, strategy: FSVRG) -> None:
    """CoCoA+'s ``d-w`` just inside robust mode's bounds, in a fixed direction: 2.9 x the
    median per-row size of the honest ``d-w`` of the round (an omniscient attacker: the
    tamper sees the others' replies first), ``sq-norm-sum`` x 3 (inside the federation's
    fence), ``state-ok`` = 1."""
    if "d-w" in values:
        values["sq-norm-sum"] *= 3.0
        size = 2.9 * float(np.median(_HONEST_D_W_PER_ROW)) * values["n-train"]
        values["d-w"] = size * _direction(values["d-w"].size)
        values["state-ok"] = 1


#: The per-row sizes ``|d-w| / n-train`` of the honest replies of the current exchange.
_HONEST_D_W_PER_ROW: list[float] = []


def _note_honest_d_w(message: Message, reply: Message) -> None:
    content = reply.content
    if "arrays" not in content or "d-w" not in content["arrays"]:
        return
    if "stack" in content:
        ids = from_array(content["arrays"]["task-id"])
        rows = from_array(content["arrays"]["d-w"])
        n = from_array(content["arrays"]["n-train"])
    else:
        ids = np.array([content["metrics"]["task-id"]])
        rows = from_array(content["arrays"]["d-w"])[None, :]
        n = np.array([content["metrics"]["n-train"]])
    if ids.size and ids[0] == 0:  # a new exchange starts with task 0
        _HONEST_D_W_PER_ROW.clear()
    _HONEST_D_W_PER_ROW.extend((np.linalg.norm(rows, axis=1) / n)[ids != HOSTILE].tolist())


def _claims_a_billion_rows(values: dict, message: Message, strategy: FSVRG) -> None:
    """``n-train`` = 1e9 at discovery and in every reply (lambda = 1/n for everyone), with
    the gradient then at its bound in a fixed direction."""
    if "n-train" in values:
        values["n-train"] = CLAIMED_N
    if "grad-sum" in values:
        size = 0.999 * math.sqrt(values["n-train"] * values["sq-norm-sum"])
        values["grad-sum"] = size * _direction(values["grad-sum"].size)


ATTACKS: dict[str, Callable[[dict, Message, FSVRG], None]] = {
    "w-local-ratio": _w_local_at_the_ratio_bound,
    "gradient-x1e3": _gradient_x1e3,
    "gradient-robust-edge": _gradient_at_the_robust_edge,
    "gradient-pairing-floor": _gradient_on_the_pairing_floor,
    "gradient-orthogonal": _gradient_orthogonal_to_w,
    "n-train-200-pairing-floor": _claims_200_rows_on_the_pairing_floor,
    "n-train-200-orthogonal": _claims_200_rows_orthogonal_to_w,
    "n-train-200": _claims_200_rows,
    "gram-v-negative": _gram_negative,
    "d-w-bound": _d_w_at_the_bound,
    "d-w-robust-edge": _d_w_at_the_robust_edge,
    "share-verifiable-bound": _share_at_the_verifiable_bound,
    "n-train-1e9": _claims_a_billion_rows,
    "honest": lambda values, message, strategy: None,
}


def _edit_one_task_reply(reply: Message, edit: Callable[[dict], None]) -> None:
    content = reply.content
    if "info" in content:  # whoami
        info = dict(content["info"].items())
        edit(info)
        content["info"] = ConfigRecord(info)
        return
    values: dict[str, Any] = dict(content["metrics"].items())
    arrays = content["arrays"] if "arrays" in content else None
    if arrays is not None:
        values.update({k: from_array(v) for k, v in arrays.items()})
    keys = set(values)
    edit(values)
    assert set(values) == keys
    content["metrics"] = MetricRecord({k: v for k, v in values.items()
                                       if not isinstance(v, np.ndarray)})
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: to_array(v) for k, v in values.items()
                                         if isinstance(v, np.ndarray)})


def _edit_stacked_row(reply: Message, task: int, edit: Callable[[dict], None]) -> None:
    arrays = {k: from_array(v).copy() for k, v in reply.content["arrays"].items()}
    rows = np.flatnonzero(arrays["task-id"] == task)
    if rows.size == 0:
        return
    i = int(rows[0])
    values = {k: (v[i].copy() if v.ndim == 2 else v[i].item()) for k, v in arrays.items()}
    edit(values)
    for key, value in values.items():
        arrays[key][i] = value
    reply.content["arrays"] = ArrayRecord({k: to_array(v) for k, v in arrays.items()})


def _drop_stacked_row(reply: Message, task: int) -> None:
    """The stacked reply without ``task``'s row (its slot failed)."""
    arrays = reply.content["arrays"]
    ids = from_array(arrays["task-id"]).tolist()
    if task not in ids:
        return
    keep = [i for i, t in enumerate(ids) if t != task]
    slots = reply.content["stack"]["slots"]
    reply.content["stack"] = ConfigRecord({"protocol": "fsvrg",
                                           "slots": [slots[i] for i in keep]})
    reply.content["stack-errors"] = ConfigRecord({"slots": [slots[ids.index(task)]],
                                                  "reasons": ["lost"]})
    reply.content["arrays"] = ArrayRecord({k: to_array(from_array(v)[keep])
                                           for k, v in arrays.items()})


def _hostile_tamper(attack: str | None, strategy: FSVRG):
    """``HostileGrid.tamper``: task HOSTILE's replies edited by ``attack`` (None: its replies
    lost after discovery)."""
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or reply.has_error():
            return [] if reply is None else [reply]
        content = reply.content
        whoami = message.metadata.message_type == "query.whoami"
        if attack is None:
            if whoami:
                return [reply]
            if "stack" in content:
                _drop_stacked_row(reply, HOSTILE)
                return [reply]
            tid = content["metrics"]["task-id"] if "metrics" in content else None
            return [] if tid == HOSTILE else [reply]

        def edit(values: dict) -> None:
            ATTACKS[attack](values, message, strategy)

        _note_honest_d_w(message, reply)

        if "stack" in content:
            _edit_stacked_row(reply, HOSTILE, edit)
        elif whoami:
            for name in [k for k in content if k.endswith("info")]:
                if content[name]["task-id"] == HOSTILE:
                    info = dict(content[name].items())
                    edit(info)
                    content[name] = ConfigRecord(info)
        elif "metrics" in content and content["metrics"]["task-id"] == HOSTILE:
            _edit_one_task_reply(reply, edit)
        return [reply]
    return tamper


def federate(data, method: str, attack: str | None, robust: bool, packed: bool = False,
             rounds: int = ROUNDS, **kwargs: Any) -> FSVRG:
    """A run of ``method`` in which task HOSTILE's device mounts ``attack`` (None: its
    replies are lost), on one task per node or ``PER_NODE`` tasks per packed node."""
    strategy = FSVRG(TASKS, method=method, robust=robust, discovery_timeout=5.0,
                     **{**METHODS[method], **kwargs})
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    if packed:
        stacked = PackedFSVRG(app.fsvrg_client)
        app = packed_client_app(app, lambda ctx: tasks_of_node(ctx.node_config, PER_NODE,
                                                               TASKS),
                                {"fsvrg": stacked}, {"query.whoami": stacked.whoami})
    grid = HostileGrid(app, math.ceil(TASKS / PER_NODE) if packed else TASKS)
    grid.tamper = _hostile_tamper(attack, strategy)
    strategy.start(grid=PackedGrid(grid, query_timeout=5.0) if packed else grid,
                   num_rounds=rounds, timeout=30.0)
    return strategy


CASES = [("fsvrg", "w-local-ratio"), ("fsvrg", "gradient-x1e3"), ("fsvrg", "n-train-1e9"),
         ("fsvrg", "gradient-robust-edge"),
         ("gd", "gradient-x1e3"), ("gd", "gram-v-negative"), ("gd", "n-train-1e9"),
         ("gd", "gradient-robust-edge"),
         ("cocoa-plus", "d-w-bound"), ("cocoa-plus", "share-verifiable-bound"),
         ("dane", "w-local-ratio"),
         ("fsvrg-naive", "w-local-ratio")]


@pytest.mark.parametrize("packed", [False, True], ids=["one-task", "packed"])
@pytest.mark.parametrize(("method", "attack"), CASES)
def test_one_hostile_device_cannot_steer_the_model(data, method, attack, packed):
    lost = honest_objective(data, federate(data, method, None, robust=False).w)
    robust = federate(data, method, attack, robust=True, packed=packed)
    assert np.all(np.isfinite(robust.w))
    assert honest_objective(data, robust.w) <= 1.05 * lost
    plain = federate(data, method, attack, robust=False, packed=packed)
    assert not (honest_objective(data, plain.w) <= 1.05 * lost)  # the attack is real


@pytest.mark.parametrize(("method", "lam_ratio"), [("fsvrg", 0.75), ("gd", 0.75),
                                                  ("cocoa-plus", 0.5)])
def test_a_claimed_billion_rows_does_not_set_lambda(data, method, lam_ratio):
    """``n-train`` = 1e9 from one device: robust mode keeps ``lam = 1/n`` at least
    ``lam_ratio`` times the true ``1/n`` (the claim is cut to the federation's fence, 10x the
    median count here, and, but for CoCoA+ whose rows all weigh 1/n, to max-weight-share) and
    the honest objective within 5 % of the run without the device's replies; without it,
    ``lam`` is 1e-9 for everyone."""
    true_lam = 1.0 / float(data.n_train.sum())
    lost = honest_objective(data, federate(data, method, None, robust=False).w)
    robust = federate(data, method, "n-train-1e9", robust=True, packed=method == "gd")
    assert lam_ratio * true_lam <= robust.lam <= true_lam
    assert honest_objective(data, robust.w) <= 1.05 * lost
    plain = federate(data, method, "n-train-1e9", robust=False)
    assert plain.lam < 1e-6 * true_lam


@pytest.mark.xfail(strict=True, reason="known limit of robust mode (core.fsvrg.robust): a "
                   "plausible-size update that keeps inside every check while pushing one way "
                   "is not voted down on sparse non-IID data")
@pytest.mark.parametrize(("method", "attack", "rounds"),
                         [("fsvrg", "gradient-pairing-floor", ROUNDS),
                          ("gd", "gradient-pairing-floor", ROUNDS),
                          ("fsvrg", "n-train-200", ROUNDS),
                          ("fsvrg", "n-train-200-pairing-floor", ROUNDS),
                          ("gd", "n-train-200-pairing-floor", ROUNDS),
                          ("fsvrg", "n-train-200-orthogonal", ROUNDS),
                          ("gd", "n-train-200-orthogonal", ROUNDS),
                          ("cocoa-plus", "d-w-robust-edge", 30)])
def test_known_limit_an_update_at_the_robust_edge(data, method, attack, rounds):
    """Inside every check, pushing one way as far as they allow (``python
    benchmarks/fsvrg_byzantine.py floor``): FSVRG's gradient at 2 x the median per-row
    gradient (the clip radius) with its component along ``w_t`` kept on the pairing floor
    moves the honest objective to 1.58x in 8 rounds (2.01x with the 3x clip; the fixed
    direction alone: 1.02, held above), GD's 1.16x (1.33x); 200 claimed rows (cut to 160 by
    max-weight-share) and a gradient at its bound: 1.14x, bent onto the pairing floor as
    well 3.79x (GD 1.33x), turned orthogonal to ``w_t`` instead 7.87x (GD 1.68x; the worst
    found); CoCoA+'s share of ``w`` as large as honest shares are (2.9 x the median ``d-w``
    a round) by 38 % in 30 rounds, as much as without robust mode. A device that answers
    truthfully for label-flipped rows already moves it by 8 % (FSVRG, GD) and 18 %
    (CoCoA+), for its rows repeated to 200 by 53 % (FSVRG): no check of the replies holds
    5 % against every reply the bounds allow (module docstring of
    :mod:`fmtl_flower.core.fsvrg.robust`)."""
    lost = honest_objective(data, federate(data, method, None, robust=False, rounds=rounds).w)
    robust = federate(data, method, attack, robust=True, rounds=rounds)
    assert honest_objective(data, robust.w) <= 1.05 * lost


@pytest.mark.parametrize("method", sorted(METHODS))
def test_honest_runs_without_binding_caps_are_unchanged_by_robust_mode(data, method):
    """On this federation (largest share 0.17, updates within 3 x their median) no cap or
    clip binds: robust mode gives the run of ``robust=False`` bit for bit."""
    on = federate(data, method, "honest", robust=True)
    off = federate(data, method, "honest", robust=False)
    np.testing.assert_array_equal(on.w, off.w)
    assert on.lam == off.lam


def _losing_in(server_round: int, kept: set[int], tamper):
    """``tamper``, with the replies of ``server_round`` from the tasks not in ``kept`` lost."""
    def lossy(message: Message, reply: Message | None) -> list[Message]:
        return [r for r in tamper(message, reply)
                if "metrics" not in r.content
                or r.content["metrics"].get("round") != server_round
                or r.content["metrics"]["task-id"] in kept]
    return lossy


def test_a_resumed_robust_run_equals_the_uninterrupted_one(data, tmp_path):
    """The federation's fence on ``sq-norm-sum`` also uses the tasks' earlier mean squared row
    norms: in round 4 only task 8 and the hostile device (``sq-norm-sum`` x1e6) reply, and
    the fence of the ten tasks' values still rejects the hostile reply. A server killed in
    round 4 and resumed from round 3's checkpoint must know those values too: before, the
    checkpoint lacked them, the fence of the two replies let the hostile one in, and ``w``
    left the uninterrupted run's."""
    def start(strategy: FSVRG, grid: HostileGrid) -> None:
        grid.tamper = _losing_in(4, {8, HOSTILE}, _hostile_tamper("gradient-x1e3", strategy))
        strategy.start(grid=grid, num_rounds=6, timeout=30.0)

    def grid() -> HostileGrid:
        return HostileGrid(make_fsvrg_client_app(
            lambda ctx: data.task(default_task_id(ctx)).arrays()), TASKS)

    options = {"method": "fsvrg", "robust": True, "discovery_timeout": 5.0}
    plain = FSVRG(TASKS, **options)
    start(plain, grid())
    killed, resumed, devices = killed_in(FSVRG, 4)(TASKS, **options), FSVRG(TASKS, **options), \
        grid()
    for strategy in (killed, resumed):
        strategy.enable_checkpoints(tmp_path, every=1)
    with pytest.raises(ServerKilled):
        start(killed, devices)
    start(resumed, devices)
    assert resumed.resumed_from == 3
    np.testing.assert_array_equal(resumed.w, plain.w)
    np.testing.assert_array_equal(resumed.mean_sq_norm, plain.mean_sq_norm)
    got, want = resumed.results()["rounds"], plain.results()["rounds"]
    assert want[3]["tasks_missing"] == [*range(8), HOSTILE]  # round 4's gradients: rejected

    def numbers(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rounds]
    assert numbers(got) == numbers(want)


def _next_train(strategy: FSVRG) -> FSVRGSentExchange:
    """The sent state of a train exchange at the finished run's ``w`` (the replies built by
    hand below answer it)."""
    assert strategy.w is not None
    return strategy._sent_exchange("train", len(strategy.records), {}, {"w": strategy.w})


def test_a_reply_the_d_w_fence_rejects_leaves_the_sq_norm_fence_unmoved(data, caplog):
    """CoCoA+: a reply with ``sq-norm-sum`` x3 (inside the fence of mean squared row norms)
    whose ``d-w`` is 90 times the others' per row is rejected by the fence on the tasks'
    shares of ``w``; its ``sq-norm-sum`` must not enter the mean squared row norms the next
    fences are built from (before, it did: they were updated before the ``d-w`` fence ran)."""
    strategy = federate(data, "cocoa-plus", "honest", robust=True, rounds=2)
    before = strategy.mean_sq_norm.copy()
    u = _direction(DIM)
    replies = {}
    for task in range(TASKS):
        X, n = data.task(task).X_train, int(strategy.n_weight[task])
        sq = float(X.multiply(X).sum()) * (3.0 if task == HOSTILE else 1.0)
        limit = math.sqrt(n * sq) / (strategy.lam * strategy.n_total)
        replies[task] = {"n-train": n, "sq-norm-sum": sq, "loss-sum": 0.5 * n * math.log(2),
                         "d-w": (0.9 if task == HOSTILE else 0.01) * limit * u, "state-ok": 0}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        accepted = strategy._federation_checks("test", replies, _next_train(strategy))
    assert sorted(accepted) == [t for t in range(TASKS) if t != HOSTILE]
    rejected = [m for m in caplog.messages if "rejected" in m]
    assert len(rejected) == 1 and f"task {HOSTILE} " in rejected[0], rejected
    assert "|the task's share of w| / n-train" in rejected[0], rejected  # the d-w fence
    assert strategy.mean_sq_norm[HOSTILE] == before[HOSTILE]
    honest = [t for t in range(TASKS) if t != HOSTILE]
    np.testing.assert_array_equal(strategy.mean_sq_norm[honest],
                                  [replies[t]["sq-norm-sum"] / replies[t]["n-train"]
                                   for t in honest])


def test_an_honest_share_far_above_the_others_per_row_but_small_for_its_rows_is_kept(data):
    """CoCoA+'s share fence in the first rounds of a large federation (K = 1000: 94 of
    10,000 honest replies were refused in 10 rounds): shares start at 0 and are alike, and a
    few devices hold hundreds of times the median share per row, yet within 3.4 % of their
    verifiable bound ``sqrt(n_k S_k) / (lam n)``. Such a share (30 times the
    others per row, 3 % of its bound) is kept; one at 90 % of its bound is still refused."""
    strategy = federate(data, "cocoa-plus", "honest", robust=True, rounds=2)
    u = _direction(DIM)
    replies = {}
    for task in range(TASKS):
        X, n = data.task(task).X_train, int(strategy.n_weight[task])
        sq = float(X.multiply(X).sum())
        limit = math.sqrt(n * sq) / (strategy.lam * strategy.n_total)
        per_row = limit / n
        size = {0: 0.03 * limit, HOSTILE: 0.9 * limit}.get(task, 1e-3 * per_row * n)
        replies[task] = {"n-train": n, "sq-norm-sum": sq, "loss-sum": 0.5 * n * math.log(2),
                         "d-w": size * u, "state-ok": 0}
    accepted = strategy._federation_checks("test", replies, _next_train(strategy))
    assert sorted(accepted) == [t for t in range(TASKS) if t != HOSTILE]


@pytest.mark.parametrize(("method", "attack", "reason"), [
    ("gd", "gram-v-negative", "v . gram-v = "),
    ("gd", "gradient-x1e3", "sq-norm-sum capped by the federation's fence"),
    ("cocoa-plus", "d-w-bound", "sq-norm-sum capped by the federation's fence"),
])
def test_robust_rejections_name_their_reason(data, method, attack, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        federate(data, method, attack, robust=True, rounds=2)
    rejected = [r.getMessage() for r in caplog.records
                if f"reply of task {HOSTILE} " in r.getMessage() and "rejected" in r.getMessage()]
    assert rejected and all(reason in m for m in rejected)


@pytest.mark.parametrize("method", ["fsvrg", "gd"])
def test_a_per_row_gradient_beyond_twice_the_median_is_clipped_to_it(data, method):
    """The per-row gradients ``grad-sum / n-train`` are clipped at 2 x their median norm
    (was 3 x): a push that passes every check then moves ``w`` less (FSVRG's push bent onto
    the pairing floor: 2.01x -> 1.58x the lost run's honest objective; GD 1.33x -> 1.16x),
    while the honest per-row gradients of this federation stay within it (the run is robust
    off's, bit for bit: ``test_honest_runs_without_binding_caps_are_unchanged_by_robust_mode``).
    Nine per-row gradients of norm 1 in distinct directions and one of 2.5 along the first:
    the sum keeps the nine and adds the tenth at norm 2."""
    strategy = federate(data, method, "honest", robust=True, rounds=1)
    eye = np.eye(DIM)
    n = {t: int(strategy.n_weight[t]) for t in range(TASKS)}
    accepted = {t: {"grad-sum": n[t] * eye[t], "n-train": n[t]} for t in range(TASKS - 1)}
    accepted[HOSTILE] = {"grad-sum": 2.5 * n[HOSTILE] * eye[0], "n-train": n[HOSTILE]}
    total = strategy._gradient_sum(accepted)
    want = sum(n[t] * eye[t] for t in range(TASKS - 1)) + 2.0 * n[HOSTILE] * eye[0]
    np.testing.assert_allclose(total, want, rtol=1e-12)
