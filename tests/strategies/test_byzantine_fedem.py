"""One hostile device among 10 tasks against the FedEM family (issue 25, items 1 and 2).

The hostile device sends well-formed replies that pass every bound of the wire contract
(:mod:`fmtl_flower.strategies.fedem`): its components at the update-ratio bound in a fixed
direction, its honest update sign-flipped or scaled to that bound, or ``n-train`` = the
discovery limit claimed at ``whoami`` (and repeated in every reply) with a sign-flipped
update. The runs go through the public API (run config, ServerApp, ClientApp) on a
:class:`~tests.strategies.hostile.HostileGrid`, one task per node or four (stacked messages).

With robust mode on (the default) the honest tasks' mean test accuracy stays within 0.02 of
the run where the hostile device's replies are lost; with ``robust = false`` the same attack
costs far more (asserted, so the suite shows the damage it guards against). The attacker
may also claim its ``responsibility`` (``n-train-direction``: all of it for one component).
FedEM is also asserted on seeds 2 to 5 of the run (:data:`OTHER_SEEDS`), so that a defence
that holds on the suite's seed by luck does not pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fmtl_flower.apps.common import make_client_app, make_server_app
from fmtl_flower.config import RunConfig
from fmtl_flower.strategies.discovery import MAX_N
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.wire import from_array, to_array

from .hostile import HostileGrid

TASKS, HOSTILE = 10, 3
#: FedEM's synthetic generator, 10 tasks of 67 to 1000 training examples (one device in four
#: of a real federation is not this skewed), 500 test examples each.
BASE = {"dataset": "fedem-synthetic", "num-tasks": TASKS, "dim": 10, "n-test": 500,
        "num-server-rounds": 40, "eval-every": 40, "fedem.M": 3, "fedem.batch-size": 32,
        "fedem.lr": 0.3, "seed": 1}
#: The update-ratio bound a reply must stay within (the default ``fedem.max-update-ratio``),
#: approached from below.
RATIO = 1e4 * (1 - 1e-6)
ATTACKS = ("direction", "sign-flip", "scaled", "n-train", "n-train-direction")


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------- the attacks
def _at_bound(sent: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """Each component moved along its row of ``direction`` to just inside the update-ratio
    bound, max(|theta_m|, 1) times ``RATIO``."""
    size = np.linalg.norm(direction, axis=1, keepdims=True)
    unit = direction / np.where(size > 0, size, 1.0)
    reach = RATIO * np.maximum(np.linalg.norm(sent, axis=1, keepdims=True), 1.0)
    return sent + unit * reach


def hostile_components(attack: str, sent: np.ndarray, honest: np.ndarray) -> np.ndarray:
    """The hostile device's components (M, P) for the components ``sent`` and the ones it
    trained honestly: ``direction`` (a fixed direction at the bound, every round),
    ``sign-flip`` (its update reversed, at the bound), ``scaled`` (its update at the bound),
    ``n-train`` (its update reversed at its own size: the lie is its weight),
    ``n-train-direction`` (the lie and the fixed direction)."""
    delta = honest - sent
    if attack in ("direction", "n-train-direction"):
        return _at_bound(sent, np.ones_like(sent))
    if attack == "sign-flip":
        return _at_bound(sent, -delta)
    if attack == "scaled":
        return _at_bound(sent, delta)
    if attack == "n-train":
        return sent - delta
    raise ValueError(attack)


def _hostile_row(attack: str, sent: np.ndarray, theta: np.ndarray, weights: np.ndarray,
                 responsibility: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The hostile row's components, weights and responsibility (``n-train-direction``
    also claims all the responsibility for the first component it trained)."""
    trained = weights > 0  # an untouched component (IFCA) stays untouched
    out = theta.copy()
    out[trained] = hostile_components(attack, sent, theta)[trained]
    if attack == "n-train-direction" and responsibility is not None:
        responsibility = np.zeros_like(responsibility)
        responsibility[int(np.argmax(trained))] = 1.0
    return (out, np.where(trained, float(MAX_N), 0.0) if lies(attack) else weights,
            responsibility)


def lies(attack: str | None) -> bool:
    """Whether ``attack`` claims ``n-train`` = the discovery limit."""
    return attack is not None and attack.startswith("n-train")


def make_tamper(attack: str | None, seen: dict[int, tuple[int, int]],
                hostile: frozenset[int] = frozenset({HOSTILE})
                ) -> Callable[[Message, Message | None], list[Message]]:
    """The grid's tamper for the ``hostile`` tasks (one-task messages, or stacked ones with
    the one hostile task ``HOSTILE``): ``attack`` None loses their train and evaluate
    replies; every honest evaluate row is recorded in ``seen`` as
    ``{task: (test-correct, test-n)}``."""
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or reply.has_error():
            return [] if reply is None else [reply]
        content = reply.content
        infos = [name for name in content if name.split("/")[-1] == "info"]
        if infos:  # whoami: one task's ("info") or a packed node's slots' ("<slot>/info")
            if not lies(attack):
                return [reply]  # a device whose replies are lost was discovered
            records = dict(content.items())
            for name in infos:
                info = dict(records[name])
                if int(info["task-id"]) in hostile:
                    info["n-train"] = MAX_N
                records[name] = ConfigRecord(info)
            return [Message(RecordDict(records), reply_to=message)]
        if "stack" in content:
            assert hostile == {HOSTILE}, "stacked messages: one hostile task"
            return _tamper_stacked(attack, message, reply, seen)
        if "metrics" in content:
            return _tamper_one(attack, message, reply, seen, hostile)
        return [reply]  # the slots query of a packed node
    return tamper


def _tamper_one(attack: str | None, message: Message, reply: Message,
                seen: dict[int, tuple[int, int]], hostile: frozenset[int]) -> list[Message]:
    metrics = dict(reply.content["metrics"])
    task = int(metrics["task-id"])
    if task not in hostile:
        if "test-n" in metrics:
            seen[task] = (int(metrics["test-correct"]), int(metrics["test-n"]))
        return [reply]
    if attack is None:
        return []
    if lies(attack):
        metrics["n-train"] = MAX_N
    records: dict[str, Any] = {"metrics": MetricRecord(metrics)}
    if "arrays" in reply.content:
        sent = from_array(message.content["arrays"]["components"])
        arrays = reply.content["arrays"]
        given = arrays["responsibility"] if "responsibility" in arrays else None
        rows = _hostile_row(attack, sent, from_array(arrays["components"]),
                            from_array(arrays["weights"]),
                            None if given is None else from_array(given))
        records["arrays"] = ArrayRecord({key: to_array(value) for key, value in zip(
            ("components", "weights", "responsibility"), rows, strict=True)
            if value is not None})
    return [Message(RecordDict(records), reply_to=message)]


def _tamper_stacked(attack: str | None, message: Message, reply: Message,
                    seen: dict[int, tuple[int, int]]) -> list[Message]:
    arrays = {key: from_array(value) for key, value in reply.content["arrays"].items()}
    tasks = arrays["task-id"]
    if "test-n" in arrays:
        for i, task in enumerate(tasks.tolist()):
            if task != HOSTILE:
                seen[task] = (int(arrays["test-correct"][i]), int(arrays["test-n"][i]))
    rows = np.flatnonzero(tasks == HOSTILE)
    if rows.size == 0:
        return [reply]
    row = int(rows[0])
    stack = dict(reply.content["stack"])
    if attack is None:  # the hostile slot's row lost (its slot reported failed)
        keep = tasks != HOSTILE
        arrays = {key: value[keep] for key, value in arrays.items()}
        stack["slots"] = [s for s, k in zip(stack["slots"], keep.tolist(), strict=True) if k]
    else:
        arrays = {key: value.copy() for key, value in arrays.items()}
        if lies(attack):
            arrays["n-train"][row] = MAX_N
        if "components" in arrays:
            sent_of = from_array(message.content["arrays"]["components-of"])
            sent_tasks = from_array(message.content["arrays"]["task-id"])
            which = int(sent_of[int(np.flatnonzero(sent_tasks == HOSTILE)[0])])
            sent = from_array(message.content["arrays"][f"components-{which}"])
            keys = ("components", "weights", "responsibility")
            for key, value in zip(keys, _hostile_row(
                    attack, sent, *(arrays[key][row] if key in arrays else None
                                    for key in keys)), strict=True):
                if value is not None:
                    arrays[key][row] = value
    content = RecordDict({**dict(reply.content.items()), "stack": ConfigRecord(stack),
                          "arrays": ArrayRecord({k: to_array(v) for k, v in arrays.items()})})
    return [Message(content, reply_to=message)]


# ----------------------------------------------------------------------------- the runs
def honest_accuracy(method: str, attack: str | None, *, robust: bool = True,
                    per_node: int = 1, hostile: frozenset[int] = frozenset({HOSTILE}),
                    **extra: Any) -> float:
    """The honest tasks' mean test accuracy after a run of ``method`` where the ``hostile``
    tasks play ``attack`` (None: their replies are lost), ``per_node`` tasks to a node."""
    cfg = RunConfig.from_mapping({**BASE, "strategy": method, "robust": robust,
                                  "tasks-per-node": per_node, **extra})
    grid = HostileGrid(make_client_app(cfg), math.ceil(TASKS / per_node))
    seen: dict[int, tuple[int, int]] = {}
    grid.tamper = make_tamper(attack, seen, hostile)
    make_server_app(cfg)(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                       state=RecordDict(), run_config={}))
    assert sorted(seen) == [t for t in range(TASKS) if t not in hostile]
    return float(np.mean([correct / n for correct, n in seen.values()]))


_LOST: dict[tuple[str, int, bool, frozenset[int], int], float] = {}


def lost_accuracy(method: str, per_node: int = 1, robust: bool = True,
                  hostile: frozenset[int] = frozenset({HOSTILE}),
                  seed: int | None = None) -> float:
    """The honest tasks' accuracy when the hostile devices' replies are lost (``seed``:
    the run's, default ``BASE``'s)."""
    seed = BASE["seed"] if seed is None else seed
    key = (method, per_node, robust, hostile, seed)
    if key not in _LOST:
        _LOST[key] = honest_accuracy(method, None, per_node=per_node, robust=robust,
                                     hostile=hostile, seed=seed)
    return _LOST[key]


#: Attacks that do little harm even to an unprotected run: a logistic model moved along
#: one device's own honest update keeps roughly that device's decision boundary (the single
#: model's honest accuracy 0.667 against 0.678 when the device is lost). Robust mode is
#: asserted against them all the same.
HARMLESS_UNPROTECTED = {("fedavg", "scaled"), ("fedprox", "scaled"),
                        ("fedavg-ft", "scaled")}
TOLERANCE = 0.02  # the honest tasks' accuracy, robust mode against the lost replies
DAMAGE = 0.05  # what the attacks take at least from an unprotected run (its replies lost)


def check_attack(method: str, attack: str, per_node: int = 1) -> None:
    lost = lost_accuracy(method, per_node)
    robust = honest_accuracy(method, attack, per_node=per_node)
    assert abs(robust - lost) <= TOLERANCE, (method, attack, robust, lost)
    if (method, attack) not in HARMLESS_UNPROTECTED:
        unprotected = honest_accuracy(method, attack, robust=False, per_node=per_node)
        lost = lost_accuracy(method, per_node, robust=False)
        assert unprotected < lost - DAMAGE, (method, attack, unprotected, lost)


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("per_node", [1, 4])
@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("method", ["fedem", "fedavg"])
def test_one_hostile_device_among_ten_cannot_steer_the_shared_models(method, attack,
                                                                     per_node):
    """FedEM's components and FedAvg's model, one task per node or four (stacked)."""
    check_attack(method, attack, per_node)


#: Seeds of the run (data, initial components, mini-batches) other than the suite's seed 1,
#: with the number of tasks per node, on which FedEM is asserted too: compared at their own
#: scale (not per local step), its updates' honest spread was the big devices' and the sign
#: flip took 5.0 / 5.6 / 7.8 / 3.4 points on seeds 2 / 3 / 4 / 5.
OTHER_SEEDS = [(2, 1), (3, 1), (4, 1), (5, 1), (2, 4), (3, 4)]


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize(("seed", "per_node"), OTHER_SEEDS)
def test_fedem_resists_one_hostile_device_on_other_seeds(seed, per_node, attack):
    """Not a lucky seed: FedEM's components within ``TOLERANCE`` of the lost replies on
    seeds 2 to 5 (one task per node) and 2, 3 (four, stacked)."""
    lost = lost_accuracy("fedem", per_node, seed=seed)
    robust = honest_accuracy("fedem", attack, per_node=per_node, seed=seed)
    assert abs(robust - lost) <= TOLERANCE, (seed, attack, robust, lost)


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("method", ["fedprox", "fedavg-ft", "clustered", "pfedme", "cfl"])
def test_the_other_shared_models_resist_one_hostile_device(method, attack):
    """FedProx's and FedAvg+'s model, IFCA's cluster models, pFedMe's global model, CFL's
    cluster models and splits."""
    check_attack(method, attack)




@pytest.mark.parametrize("method", ["fedem", "fedavg", "fedprox", "fedavg-ft", "clustered",
                                    "pfedme", "cfl"])
def test_robust_mode_costs_an_honest_federation_nothing(method):
    """Nobody attacking (the hostile device's replies lost): robust mode's honest accuracy
    is within ``TOLERANCE`` of ``robust = false`` or above it (IFCA's clusters of ~3
    devices were averaged as medians with equal weights: 0.749 against 0.787)."""
    assert lost_accuracy(method) >= lost_accuracy(method, robust=False) - TOLERANCE


@pytest.mark.parametrize("robust", [True, False])
def test_a_claimed_n_train_enters_the_weights_capped_by_the_federation(robust):
    """Robust mode: a device's n-train enters the weights as at most the log-scale fence of
    the training tasks' n-train (10 times their median here, the honest sizes alike), and
    its share of the aggregate is at most ``max_weight_share``; ``robust = false`` takes its
    claim (the attack's lever: the discovery limit holds all the weight)."""
    strategy = FedEM(TASKS, method="fedem", robust=robust, unseen_tasks=[9])
    claims = np.full(TASKS, 100, dtype=np.int64)
    claims[HOSTILE] = MAX_N
    claims[9] = 10 * MAX_N  # held out: neither weighs nor sets the fence
    strategy.directory.n_train[:] = claims
    n = strategy.trusted_n_train()
    if robust:
        assert n[HOSTILE] == pytest.approx(1000.0)
        assert np.all(n[[t for t in range(9) if t != HOSTILE]] == 100)
    else:
        assert n[HOSTILE] == MAX_N
        assert n[HOSTILE] / n[:9].sum() > 0.99


def print_table(methods: list[str], hostile: frozenset[int] = frozenset({HOSTILE})) -> None:
    """The honest tasks' accuracy, attack x {robust off, robust on} and the lost replies,
    as a markdown table (``python -m tests.strategies.test_byzantine_fedem fedem fedavg``;
    ``--hostile 3,7``: two hostile devices; ``--seed 2``: another seed of the run)."""
    print("| method | attack | robust off | robust on | replies lost (off / on) |")
    print("|---|---|---|---|---|")
    for method in methods:
        lost = (f"{lost_accuracy(method, robust=False, hostile=hostile):.3f} / "
                f"{lost_accuracy(method, hostile=hostile):.3f}")
        for attack in ATTACKS:
            off = honest_accuracy(method, attack, robust=False, hostile=hostile)
            on = honest_accuracy(method, attack, hostile=hostile)
            print(f"| {method} | {attack} | {off:.3f} | {on:.3f} | {lost} |", flush=True)


if __name__ == "__main__":
    import sys

    logging.getLogger("flwr").setLevel(logging.ERROR)
    args = sys.argv[1:]
    chosen = frozenset({HOSTILE})
    if "--hostile" in args:
        at = args.index("--hostile")
        chosen = frozenset(int(t) for t in args[at + 1].split(","))
        del args[at:at + 2]
    if "--seed" in args:
        at = args.index("--seed")
        BASE["seed"] = int(args[at + 1])
        del args[at:at + 2]
    print_table(args or ["fedem", "fedavg"], chosen)


@pytest.mark.parametrize("per_node", [1, 4])
def test_a_responsibility_off_the_simplex_is_rejected(per_node, caplog):
    """The reported responsibility enters a weight: one that is not a point of the simplex
    (here all of it twice) is a rejected reply, alike packed or not."""
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or "info" in reply.content or "arrays" not in reply.content:
            return [] if reply is None else [reply]
        arrays = {key: np.array(from_array(value))
                  for key, value in reply.content["arrays"].items()}
        if "responsibility" not in arrays:
            return [reply]
        rows = np.flatnonzero(np.atleast_1d(arrays["task-id"]) == HOSTILE) \
            if "stack" in reply.content else [None]
        if "stack" not in reply.content and int(reply.content["metrics"]["task-id"]) != HOSTILE:
            return [reply]
        for row in rows:
            arrays["responsibility"][row] = 2.0 * arrays["responsibility"][row]
        content = RecordDict({**dict(reply.content.items()),
                              "arrays": ArrayRecord({k: to_array(v) for k, v in arrays.items()})})
        return [Message(content, reply_to=message)]

    cfg = RunConfig.from_mapping({**BASE, "strategy": "fedem", "num-server-rounds": 1,
                                  "tasks-per-node": per_node})
    grid = HostileGrid(make_client_app(cfg), math.ceil(TASKS / per_node))
    grid.tamper = tamper
    with caplog.at_level(logging.WARNING, logger="flwr"):
        make_server_app(cfg)(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                           state=RecordDict(), run_config={}))
    rejected = [r.getMessage() for r in caplog.records
                if f"task {HOSTILE} " in r.getMessage() and "rejected" in r.getMessage()]
    assert len(rejected) == 1 and "'responsibility' must be" in rejected[0], rejected


def _soft_responsibility(message: Message, reply: Message | None) -> list[Message]:
    """The hostile task's one-task train reply claims equal responsibility for every
    component (a point of the simplex) while its ``weights`` train one (IFCA)."""
    if reply is None or "arrays" not in reply.content or "metrics" not in reply.content \
            or int(reply.content["metrics"]["task-id"]) != HOSTILE:
        return [] if reply is None else [reply]
    arrays = {key: from_array(value) for key, value in reply.content["arrays"].items()}
    assert np.count_nonzero(arrays["weights"]) == 1  # IFCA trains one cluster model
    arrays["responsibility"] = np.full(arrays["weights"].shape, 1.0 / arrays["weights"].size)
    content = RecordDict({**dict(reply.content.items()),
                          "arrays": ArrayRecord({k: to_array(v) for k, v in arrays.items()})})
    return [Message(content, reply_to=message)]


def test_ifca_takes_the_one_hot_of_the_weights_not_a_reported_soft_responsibility():
    """IFCA assigns hard: the server uses the one-hot of a reply's ``weights``, so a reply
    claiming soft responsibilities (on the simplex, so not rejected) aggregates exactly as
    the honest one; it used to switch its cluster's robust aggregation to FedEM's soft path
    (other trimming, clipping and share), moving every cluster member's model."""
    cfg = RunConfig.from_mapping({**BASE, "strategy": "clustered"})
    components = []
    for tamper in (None, _soft_responsibility):
        grid = HostileGrid(make_client_app(cfg), TASKS)
        if tamper is not None:
            grid.tamper = tamper
        strategy = FedEM(TASKS, method="clustered", num_components=3, seed=1)
        strategy.start(grid=grid, num_rounds=2, timeout=30.0)
        assert strategy.robust and [r["num_replies"] for r in
                                    strategy.results()["rounds"]] == [TASKS, TASKS]
        components.append(strategy.components)
    np.testing.assert_array_equal(components[1], components[0])
