"""Byzantine devices against the MOCHA family (MOCHA, CoCoA, Mb-SDCA, Mb-SGD), in-process.

One device (for MOCHA also two) among 10 tasks sends, every round, the worst reply the
server's bounds allow: an omniscient attacker that knows which bound the server will check
(the row norm it claimed at discovery, as robust mode caps it by the federation's fence,
:func:`fmtl_flower.core.robust.log_upper_fence`) and pushes its task's update in one fixed
direction, against the honest tasks' common model, at the largest size that passes (for
MOCHA: |delta-b| at its step bound and, in robust mode, b_t within its dual-image bound; for
Mb-SGD: |grad| = count x R). Its loss and dual values stay the real device's. A fence-aware
attacker also knows every task's b_t and robust mode's decoupling fences
(:class:`~fmtl_flower.core.decoupling.OutlierWatch`), and keeps its b_t just under the size
fence ("size") or under every fence ("every": also near the federation's consensus;
"pull": also under the fence on its pull through a learned Omega; "coupling": also, as
far as it can predict the next Omega-step, under the fence on its coupling weight), so that
it is never decoupled by what it knows.

The honest tasks' mean test error is compared with the run where the hostile devices'
replies are lost: with robust mode on it must be within 2 points (0.02); with robust mode off
the damage must be there (so robust mode is what helps). Packed nodes (2 tasks a node, the
hostile one sharing its node with an honest one) behave as unpacked ones.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fmtl_flower import MOCHA, MbSGD, make_mbsgd_client_app, make_mocha_client_app
from fmtl_flower.clients.common import default_task_id
from fmtl_flower.clients.packed_mbsgd import PackedMbSGD
from fmtl_flower.clients.packed_mocha import PackedMOCHA
from fmtl_flower.core.decoupling import (
    IMAGE_FENCE_FACTOR,
    PULL_FENCE_FACTOR,
    PULL_FENCE_MADS,
    coupled_models,
    coupling_fence,
    coupling_weights,
    decoupled_inverse,
    federation_scale,
)
from fmtl_flower.core.robust import log_upper_fence
from fmtl_flower.data import load_dataset
from fmtl_flower.data.digits import validation_split
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.wire import from_array, to_array

from .helpers import Problem, ServerKilled, killed_in, make_problem
from .hostile import HostileGrid

TASKS, DIM = 10, 10
CLAIMED = 1e8  # the row norm a lying device reports at discovery
SLACK = 0.999  # the attacker stays just inside every bound
COUPLING_MARGIN = 0.9  # the share of the coupling fence a "coupling" attacker aims at


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=80, seed=3)


def true_row_norms(problem: Problem) -> np.ndarray:
    return np.array([float(np.linalg.norm(X, axis=1).max()) for X in problem.Xs])


def attack_direction(problem: Problem, hostile: list[int]) -> np.ndarray:
    """Unit vector against the honest tasks' common direction (mean of y x)."""
    honest = [t for t in range(problem.num_tasks) if t not in hostile]
    common = np.mean([(problem.ys[t][:, None] * problem.Xs[t]).mean(axis=0) for t in honest],
                     axis=0)
    return -common / np.linalg.norm(common)


@dataclass
class Attacker:
    """The hostile devices of one run: what they claimed, and what each has pushed so far."""

    problem: Problem
    hostile: list[int]
    claim: float | None  # None: the true row norm
    robust: bool
    family: str
    lost: bool = False  # its replies are lost instead
    share: float = SLACK  # the share of its step bound it uses
    image: float = SLACK  # the share of its dual-image bound it fills (robust mode)
    #: keep b_t just under robust mode's fences: "size" (|b_t| under the size fence, as the
    #: attacker robust mode was first tried against) or "every" (every fence: the size and
    #: the distance from the federation's consensus) or "pull" (every fence and the pull
    #: fence of a learned Omega) or "coupling" (those and the coupling fence: b_t scaled so
    #: that an Omega-step now would leave its coupling weight under it); None: no fence
    fence_aware: str | None = None
    claim_n: int | None = None  # the n-train it claims (None: its own)
    strategy: Any = None  # the server: a fence-aware attacker reads every task's b_t
    sent: dict[int, np.ndarray] = field(default_factory=dict)
    budgets: list[int] = field(default_factory=list)  # the budgets it was sent
    server_round: int = 0  # the round of the message it answers
    scale_cache: tuple[int, float] | None = None  # the round's coupling_scale

    @property
    def dual(self) -> bool:
        """Whether it attacks a dual method (delta-b replies; Mb-SGD's are grad)."""
        return self.family != "mbsgd"

    def __post_init__(self) -> None:
        self.u = attack_direction(self.problem, self.hostile)
        reported = true_row_norms(self.problem)
        if self.claim is not None:
            reported[self.hostile] = self.claim
        self.reported = reported
        fence = log_upper_fence(reported) if self.robust else math.inf
        self.bound = np.minimum(reported, fence)  # the R the server checks against

    # -- the replies ---------------------------------------------------------------------
    def info(self, info: ConfigRecord) -> ConfigRecord:
        task = int(info["task-id"])
        if task in self.hostile:
            info = ConfigRecord(dict(info))
            if self.claim is not None:
                info["max-row-norm"] = float(self.claim)
            if self.claim_n is not None:
                info["n-train"] = self.claim_n
        return info

    def mocha_delta(self, task: int, budget: int, n: int) -> np.ndarray:
        """The largest delta-b along u the server's bounds let through (fence-aware: toward
        :meth:`fence_aware_target` in robust mode; robust off there is no fence and it
        pushes to its bound)."""
        step = self.bound[task] * min(budget, n) / n * self.share
        if self.fence_aware and self.robust:
            return self.fence_aware_delta(task, step)
        pushed = self.sent.get(task, np.zeros(DIM))
        if self.robust:  # |b_t + delta| <= R: b_t is along u, of size pushed . u
            step = min(step, max(0.0, self.image_limit(task) - float(pushed @ self.u)))
        delta = step * self.u
        self.sent[task] = pushed + delta
        return delta

    def image_limit(self, task: int) -> float:
        """How far b_t may go: its dual-image bound."""
        return self.bound[task] * self.image

    def fence_aware_delta(self, task: int, step: float) -> np.ndarray:
        """A step of at most ``step`` from the task's b_t (as the server holds it) toward
        :meth:`fence_aware_target`, within its dual-image bound."""
        b = self.strategy.state.B[:, task].copy()
        delta = self.fence_aware_target(task, step) - b
        size = float(np.linalg.norm(delta))
        if size > step:
            delta *= step / size
        total = float(np.linalg.norm(b + delta))
        if total > self.image_limit(task):
            delta = (b + delta) * (self.image_limit(task) / total) - b
        return delta

    def fence_aware_target(self, task: int, step: float) -> np.ndarray:
        """:meth:`under_pull_target`, for a "coupling" attacker scaled by
        :meth:`coupling_scale`."""
        target = self.under_pull_target(task)
        if self.fence_aware == "coupling":
            target = target * self.coupling_scale(step)
        return target

    def coupling_scale(self, step: float) -> float:
        """The largest share of their :meth:`under_pull_target` the hostile tasks' b_t may
        head for (the same for all, found by bisection) so that an Omega-step on the B they
        reach this round (each moving at most ``step`` toward it) would leave each one's
        coupling weight at most :data:`COUPLING_MARGIN` (0.9) of the coupling fence
        (:func:`~fmtl_flower.core.decoupling.coupling_fence`); 1 under a fixed formulation.
        Computed once per server round (the colluders agree)."""
        state = self.strategy.state
        if state.formulation.fixed:
            return 1.0
        if self.scale_cache is not None and self.scale_cache[0] == self.server_round:
            return self.scale_cache[1]
        targets = {h: self.under_pull_target(h) for h in self.hostile}

        def fits(kappa: float) -> bool:
            B = state.B.copy()
            for h, target in targets.items():
                delta = kappa * target - B[:, h]
                size = float(np.linalg.norm(delta))
                B[:, h] += delta * min(1.0, step / size) if size > 0 else 0.0
            decoupled = self.strategy.decoupled
            formulation = copy.deepcopy(state.formulation)
            formulation.omega_step(coupled_models(B @ state.M, decoupled))
            coupling = coupling_weights(decoupled_inverse(formulation.inverse_matrix(),
                                                          decoupled))
            fence = coupling_fence(coupling, np.linalg.norm(B, axis=0) > 0, decoupled)
            return bool(np.all(coupling[self.hostile] <= COUPLING_MARGIN * fence))

        low, high = 0.0, 1.0
        if fits(high):
            low = high
        else:
            for _ in range(20):
                middle = 0.5 * (low + high)
                low, high = (middle, high) if fits(middle) else (low, middle)
        self.scale_cache = (self.server_round, low)
        return low

    def under_pull_target(self, task: int) -> np.ndarray:
        """Where an attacker that knows robust mode's fences
        (:class:`~fmtl_flower.core.decoupling.OutlierWatch`) and every task's b_t puts its
        b_t, never crossing a fence it knows, so never decoupled by it: "size", along u at
        0.9 of the size fence on the honest tasks' |b_t| / min(R_t, median R); "every", from
        the federation's consensus (:func:`~fmtl_flower.core.decoupling.consensus_fence`)
        along u, at 0.9 of the distance its fence allows, and within 0.9 of the size fence;
        "pull", as "every" and also at most 0.9 of the pull fence (:meth:`pull_limit`)."""
        state = self.strategy.state
        scale = federation_scale(self.bound)
        honest = [t for t in range(TASKS) if t not in self.hostile]
        fill = np.linalg.norm(state.B[:, honest], axis=0) / scale[honest]
        if not np.any(fill > 0):
            return np.zeros(DIM)
        most = 0.9 * log_upper_fence(fill[fill > 0], factor=IMAGE_FENCE_FACTOR) * scale[task]
        if self.fence_aware == "size":
            return most * self.u
        from fmtl_flower.core.decoupling import consensus_fence  # not in robust mode's first cut
        center, fence, _ = consensus_fence(state.B, scale, self.strategy.decoupled)
        if not np.isfinite(fence):
            return np.zeros(DIM)
        target = (center + 0.9 * fence * self.u) * scale[task]
        if self.fence_aware in ("pull", "coupling"):
            most = min(most, self.pull_limit(task, scale))
        size = float(np.linalg.norm(target))
        return target * (most / size) if size > most else target

    def pull_limit(self, task: int, scale: np.ndarray) -> float:
        """The largest |b_t| that keeps the task's pull (its normalised |b_t| times its
        coupling weight in the current M) at 0.9 of the pull fence on the honest tasks' pulls
        (``inf`` under a fixed formulation, where there is no such fence)."""
        state = self.strategy.state
        if state.formulation.fixed:
            return math.inf
        coupling = coupling_weights(state.M)
        honest = [t for t in range(TASKS) if t not in self.hostile]
        pull = np.linalg.norm(state.B[:, honest], axis=0) / scale[honest] * coupling[honest]
        if int((pull > 0).sum()) < 3 or coupling[task] <= 0:
            return math.inf
        fence = log_upper_fence(pull[pull > 0], factor=PULL_FENCE_FACTOR, k=PULL_FENCE_MADS)
        return 0.9 * fence / coupling[task] * scale[task]

    def mbsgd_grad(self, task: int, count: int) -> np.ndarray:
        """The largest summed subgradient the bound lets through, moving w_t along -u."""
        return self.bound[task] * count * self.share * self.u


def _tamper_one(attacker: Attacker, message: Message, reply: Message) -> list[Message]:
    """A one-task node's reply, rewritten if its task is hostile."""
    content = reply.content
    if "info" in content:
        return [Message(RecordDict({"info": attacker.info(content["info"])}),
                        reply_to=message)]
    if "metrics" not in content or int(content["metrics"]["task-id"]) not in attacker.hostile:
        return [reply]
    if attacker.lost:
        return []
    metrics = dict(content["metrics"])
    if attacker.claim_n is not None:
        metrics["n-train"] = attacker.claim_n
    if "arrays" not in content or not len(content["arrays"]):
        return [Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)]
    task = int(content["metrics"]["task-id"])
    config = message.content["config"]
    budget = 0 if bool(config["dropped"]) else int(config["budget"])
    attacker.budgets.append(int(config["budget"]))
    if attacker.dual:
        arrays = {"delta-b": to_array(attacker.mocha_delta(
            task, budget, int(metrics["n-train"])))}
    else:
        arrays = {"grad": to_array(attacker.mbsgd_grad(task, int(content["metrics"]["count"])))}
    return [Message(RecordDict({"metrics": MetricRecord(metrics),
                                "arrays": ArrayRecord(arrays)}), reply_to=message)]


def _tamper_stacked(attacker: Attacker, message: Message, reply: Message) -> list[Message]:
    """A packed node's replies: its slots' whoami infos, or the hostile rows of a stacked
    train reply."""
    content = reply.content
    if any(key.endswith("/info") for key in content):
        records = {key: attacker.info(value) if key.endswith("/info") else value
                   for key, value in content.items()}
        return [Message(RecordDict(records), reply_to=message)]
    if "stack" not in content or "arrays" not in content:
        return [reply]
    arrays = {key: np.array(from_array(value)) for key, value in content["arrays"].items()}
    key = "delta-b" if attacker.dual else "grad"
    if attacker.claim_n is not None:
        hostile_rows = np.isin(arrays["task-id"], attacker.hostile)
        arrays["n-train"][hostile_rows] = attacker.claim_n
    if key not in arrays:
        records = dict(content.items())
        records["arrays"] = ArrayRecord({k: to_array(v) for k, v in arrays.items()})
        return [Message(RecordDict(records), reply_to=message)]
    budgets = from_array(message.content["arrays"]["budget"])
    dropped = from_array(message.content["arrays"]["dropped"])
    for row, task in enumerate(arrays["task-id"].tolist()):
        if task not in attacker.hostile:
            continue
        if attacker.dual:
            budget = 0 if dropped[row] else int(budgets[row])
            arrays[key][row] = attacker.mocha_delta(task, budget, int(arrays["n-train"][row]))
        else:
            arrays[key][row] = attacker.mbsgd_grad(task, int(arrays["count"][row]))
    records = dict(content.items())
    records["arrays"] = ArrayRecord({k: to_array(v) for k, v in arrays.items()})
    return [Message(RecordDict(records), reply_to=message)]


def tamper_for(attacker: Attacker) -> Callable[[Message, Message | None], list[Message]]:
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or reply.has_error():
            return [] if reply is None else [reply]
        config = message.content.get("config")
        if config is not None and "server-round" in config:
            attacker.server_round = int(config["server-round"])
        if "stack" in reply.content or "packing" in reply.content:
            return _tamper_stacked(attacker, message, reply)
        return _tamper_one(attacker, message, reply)
    return tamper


# ------------------------------------------------------------------------------ runs
def honest_error(problem: Problem, W: np.ndarray, hostile: list[int]) -> float:
    """The honest tasks' mean test error of the models W (d, m)."""
    errors = [float(np.mean(np.sign(problem.Xt[t] @ W[:, t]) != problem.yt[t]))
              for t in range(problem.num_tasks) if t not in hostile]
    return float(np.mean(errors))


def run(problem: Problem, family: str, *, hostile: list[int], claim: float | None,
        robust: bool, lost: bool = False, per_node: int = 1, rounds: int = 40,
        share: float = SLACK, image: float = SLACK, fence_aware: str | None = None,
        claim_n: int | None = None, naive: bool = False, **options: Any
        ) -> tuple[float, Any]:
    """One federation with ``hostile`` devices; the honest tasks' mean test error and the
    strategy (its ``attacker`` attribute: the :class:`Attacker`). A ``naive`` attacker
    ignores robust mode's caps (it pushes at the bound it claimed, past its dual-image
    bound)."""
    attacker = Attacker(problem, hostile, claim, robust and not naive, family, lost, share,
                        image, fence_aware, claim_n=claim_n)
    options.setdefault("lam", 0.01)
    if family == "mbsgd":
        strategy = MbSGD(TASKS, discovery_timeout=5.0, robust=robust, **options)
        app = make_mbsgd_client_app(problem.load)
        handler = PackedMbSGD(app.mbsgd_client)
    else:
        strategy = MOCHA(TASKS, discovery_timeout=5.0, robust=robust,
                         max_failures=0, method=family, **options)
        app = make_mocha_client_app(problem.load)
        handler = PackedMOCHA(app.mocha_client)
    attacker.strategy = strategy
    strategy.attacker = attacker
    if per_node == 1:
        grid = HostileGrid(app, TASKS)
        grid.tamper = tamper_for(attacker)
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)
    else:
        packed = packed_client_app(
            app, lambda ctx: tasks_of_node(ctx.node_config, per_node, TASKS),
            {handler.protocol: handler}, {"query.whoami": handler.whoami})
        inner = HostileGrid(packed, math.ceil(TASKS / per_node))
        inner.tamper = tamper_for(attacker)
        strategy.start(grid=PackedGrid(inner, query_timeout=5.0), num_rounds=rounds,
                       timeout=60.0)
    W = strategy.W if family == "mbsgd" else strategy.state.W
    return honest_error(problem, W, hostile), strategy


# ------------------------------------------------------------------------------ the tests
DAMAGE = 0.1  # robust off: at least this much worse than the replies-lost run
CLOSE = 0.02  # robust on: within this of the replies-lost run
MEAN = {"omega": "mean", "lam2": 0.1}
STRONG_MEAN = {"omega": "mean", "lam": 0.1, "lam2": 0.01}  # tasks pulled hard to their mean


def lost_error(problem: Problem, family: str, hostile: list[int], **options: Any) -> float:
    """The honest tasks' mean test error when the hostile devices' replies are lost."""
    return run(problem, family, hostile=hostile, claim=None, robust=True, lost=True,
               **options)[0]


def check(problem: Problem, family: str, hostile: list[int], claim: float | None,
          per_node: int = 1, damage: float = DAMAGE, **options: Any) -> None:
    """Robust on: within CLOSE of the replies-lost run, the hostile tasks (only) decoupled;
    robust off: ``damage`` worse."""
    lost = lost_error(problem, family, hostile, **options)
    on, strategy = run(problem, family, hostile=hostile, claim=claim, robust=True,
                       per_node=per_node, **options)
    off, _ = run(problem, family, hostile=hostile, claim=claim, robust=False,
                 per_node=per_node, **options)
    assert abs(on - lost) <= CLOSE, (on, lost)
    assert off >= lost + damage, (off, lost)
    assert np.flatnonzero(strategy.decoupled).tolist() == hostile
    assert strategy.records[-1]["tasks_decoupled"] == hostile


@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("claim", [CLAIMED, None], ids=["claims-1e8", "true-norm"])
@pytest.mark.parametrize("family", ["mocha", "cocoa", "mb-sdca"])
def test_one_device_pushing_at_its_bound_does_not_steer_the_others(problem, family, claim,
                                                                  per_node):
    """The issue's attack (omega=mean, 10 tasks): a device that claims max-row-norm 1e8 (or
    tells the truth) and sends the largest delta-b its bound allows in one direction. Before
    robust mode the honest tasks' error went from 0.14 (its replies lost) to 0.50 and more;
    now its R is capped by the federation's fence, its b_t by its dual-image bound, and its
    updates, outliers against the federation's, decouple it in round 1."""
    check(problem, family, [3], claim, per_node, **MEAN)


@pytest.mark.parametrize("claim", [CLAIMED, None], ids=["claims-1e8", "true-norm"])
@pytest.mark.parametrize("options", [MEAN, {"omega": "probabilistic", "omega_every": 5}],
                         ids=["mean", "probabilistic"])
def test_two_devices_pushing_together_do_not_steer_the_others(problem, options, claim):
    """2 of 10 devices push the same direction: both are decoupled, the others unharmed."""
    check(problem, "mocha", [3, 7], claim, **options)


@pytest.mark.parametrize("options", [
    {"omega": "probabilistic", "omega_every": 5},
    {"omega": "graphical", "s2": 10.0, "lam2": 1e-3, "omega_every": 5},
], ids=["probabilistic", "graphical"])
def test_learned_relationships_ignore_a_decoupled_task(problem, options):
    """For a learned Omega the liar also shapes the relationships through its model in the
    Omega-step; decoupled, the step sees its model as 0 and M' has no coupling to it."""
    check(problem, "mocha", [3], None, **options)


FACTORED = {"mean": MEAN, "probabilistic": {"omega": "probabilistic", "omega_every": 5},
            "clustered": {"omega": "clustered", "eta": 0.1, "clusters": 3, "omega_every": 5}}


@pytest.mark.parametrize("hostile", [[3], [3, 7]], ids=["one", "two"])
@pytest.mark.parametrize("formulation", FACTORED)
def test_the_factored_server_path_decouples_as_the_dense_one(problem, formulation, hostile):
    """``server-path=factored`` (M kept as V diag(s) V^T + c I, the path of m > 1000 tasks)
    decouples the same tasks in the same rounds as the dense path, and its M' is the dense
    one's: the same W at the end (to 1e-10). Before, the factored path only logged the
    outliers and let them pull the others."""
    options = {**FACTORED[formulation], "claim": None}
    dense_error, dense = run(problem, "mocha", hostile=hostile, server_path="dense",
                             robust=True, **options)
    factored_error, factored = run(problem, "mocha", hostile=hostile, server_path="factored",
                                   robust=True, **options)
    assert [r.get("tasks_decoupled") for r in factored.records] == \
        [r.get("tasks_decoupled") for r in dense.records]
    assert np.flatnonzero(factored.decoupled).tolist() == hostile
    np.testing.assert_allclose(factored.state.W, dense.state.W, rtol=0, atol=1e-10)
    assert factored_error == dense_error


@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("options, claim", [
    (MEAN, CLAIMED), (STRONG_MEAN, CLAIMED), (STRONG_MEAN, None),
    (FACTORED["probabilistic"], CLAIMED), (FACTORED["probabilistic"], None),
], ids=["mean-claims-1e8", "strong-mean-claims-1e8", "strong-mean-true-norm",
        "probabilistic-claims-1e8", "probabilistic-true-norm"])
def test_a_factored_run_decouples_a_device_pushing_at_its_bound(problem, options, claim,
                                                               per_node):
    """One liar of 10 on the factored server path, unpacked and packed (2 tasks a node):
    decoupled, the honest tasks' error within 2 points of the run where its replies are lost
    (robust off: 10 points worse). Before, it was only listed: 0.257 against 0.141 lost
    (``mean``, claiming R = 1e8), 0.371 against 0.162 (lam / lam2 = 10, true R), 0.214
    against 0.115 (``probabilistic``, true R). (``mean`` with the true R did little harm
    even then: 0.143.)"""
    check(problem, "mocha", [3], claim, per_node, server_path="factored", **options)


def test_clustered_relationships_with_a_liar_stay_as_without_it(problem):
    """``clustered`` (where this attack does little harm even without robust mode: off
    0.14-0.15 against 0.147 lost): decoupled, the honest tasks end as with its replies
    lost."""
    options = {"omega": "clustered", "eta": 0.1, "clusters": 3, "omega_every": 5}
    lost = lost_error(problem, "mocha", [3], **options)
    on, strategy = run(problem, "mocha", hostile=[3], claim=CLAIMED, robust=True, **options)
    assert abs(on - lost) <= CLOSE and strategy.decoupled.tolist().count(True) == 1


@pytest.mark.parametrize("options", [MEAN, STRONG_MEAN], ids=["mean", "strong-mean"])
@pytest.mark.parametrize("hostile", [[3], [3, 7]], ids=["one", "two"])
def test_devices_creeping_under_the_step_floor(problem, hostile, options):
    """Devices that step at 45 % of their bound (never a step outlier: under
    STEP_SHARE_FLOOR) in one direction, until b_t reaches its bound: caught by their
    accumulated dual images, outliers three rounds running, and decoupled; the honest tasks
    end within 2 points of the hostile replies lost, also with tasks pulled hard to their
    mean (lam / lam2 = 10)."""
    check(problem, "mocha", hostile, None, share=0.45, **options)


@pytest.mark.parametrize("fence_aware", ["size", "every"])
def test_two_devices_under_the_fences_with_strong_coupling(problem, fence_aware):
    """2 of 10 devices that know robust mode's fences and every task's b_t, with the tasks
    pulled hard to their mean (lam / lam2 = 10), stepping under the step floor. "size":
    |b_t| kept at 0.9 of the size fence, against the honest tasks' common direction; with
    the size fence alone this took the honest tasks' error from 0.164 (replies lost) to
    0.510; their distance from the federation's consensus now decouples them. "every":
    also kept under the consensus fence, so never decoupled, but then each can pull the
    others only by a deviation the honest tasks make plausible: within 2 points. Robust off
    (no fence: they push to their bounds) the damage is there."""
    hostile = [3, 7]
    lost = lost_error(problem, "mocha", hostile, **STRONG_MEAN)
    on, strategy = run(problem, "mocha", hostile=hostile, claim=None, robust=True,
                       share=0.45, fence_aware=fence_aware, **STRONG_MEAN)
    off, _ = run(problem, "mocha", hostile=hostile, claim=None, robust=False, share=0.45,
                 fence_aware=fence_aware, **STRONG_MEAN)
    assert abs(on - lost) <= CLOSE, (on, lost)
    assert off >= lost + DAMAGE, (off, lost)
    decoupled = np.flatnonzero(strategy.decoupled).tolist()
    assert decoupled == (hostile if fence_aware == "size" else []), decoupled


def test_two_devices_under_every_fence_with_a_learned_omega(problem):
    """2 of 10 devices under the size and consensus fences with ``probabilistic``
    (lam = 0.01), whose honest tasks point different ways (so the consensus fence is wide):
    through the learned Sigma their dual images entered every honest model with 10 to 20
    times an honest task's weight (honest error 0.242 against 0.130 with their replies
    lost); that pull (|b_s| times sum_t |M_ts|) is now fenced and decouples them. Robust
    off (no fence: they push to their bounds) the damage is there."""
    hostile = [3, 7]
    options = {"omega": "probabilistic", "omega_every": 5}
    lost = lost_error(problem, "mocha", hostile, **options)
    on, strategy = run(problem, "mocha", hostile=hostile, claim=None, robust=True,
                       share=0.45, fence_aware="every", **options)
    off, _ = run(problem, "mocha", hostile=hostile, claim=None, robust=False, share=0.45,
                 fence_aware="every", **options)
    assert abs(on - lost) <= CLOSE, (on, lost)
    assert off >= lost + DAMAGE, (off, lost)
    assert np.flatnonzero(strategy.decoupled).tolist() == hostile


PROBABILISTIC = {"omega": "probabilistic", "omega_every": 5}


def problem_of_seed(problem: Problem, seed: int) -> Problem:
    """The module's problem (seed 3) or the same kind of problem drawn with ``seed``."""
    if seed == 3:
        return problem
    return make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=80, seed=seed)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_two_devices_under_the_pull_fence_with_a_learned_omega(problem, seed):
    """2 of 10 colluders that know every fence, the pull fence too, and keep their pull at
    0.9 of it (``probabilistic``, lam = 0.01). Before, they were never decoupled: the
    Omega-step's power iteration on their identical, never-shrinking b_t gave them 9 to 12
    times the honest median M_ss and 6 to 7 times its coupling weight (seed 3: honest error
    0.155 against 0.130 with their replies lost). The coupling fence (2.5 times the median
    coupling weight, honest ones at most 3.3 times where their spread widens the fence)
    decouples both; the honest tasks end within 2 points of the replies-lost run on every
    seed (0.128, 0.139, 0.143 against 0.130, 0.130, 0.124)."""
    problem = problem_of_seed(problem, seed)
    hostile = [3, 7]
    lost = lost_error(problem, "mocha", hostile, **PROBABILISTIC)
    on, strategy = run(problem, "mocha", hostile=hostile, claim=None, robust=True,
                       share=0.45, fence_aware="pull", **PROBABILISTIC)
    assert abs(on - lost) <= CLOSE, (on, lost)
    assert np.flatnonzero(strategy.decoupled).tolist() == hostile


def test_two_devices_under_the_coupling_fence_with_a_learned_omega(problem):
    """2 of 10 colluders that also know the coupling fence: before every round they scale
    their b_t so that an Omega-step on the B they reach would leave their coupling weights
    at 0.9 of the fence (:meth:`Attacker.coupling_scale`). Held to a few honest tasks'
    coupling they cannot outweigh the honest tasks: within 2 points of their replies lost
    (0.135 against 0.130; they cannot predict the Omega-step exactly, the honest tasks'
    updates of the round being unknown to them, and on this seed one step takes them over
    the fence: decoupled; on seeds 4 and 5 they are never decoupled and end at 0.125 and
    0.131 against 0.130 and 0.124)."""
    hostile = [3, 7]
    lost = lost_error(problem, "mocha", hostile, **PROBABILISTIC)
    on, _ = run(problem, "mocha", hostile=hostile, claim=None, robust=True, share=0.45,
                fence_aware="coupling", **PROBABILISTIC)
    assert abs(on - lost) <= CLOSE, (on, lost)


@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("claim", [CLAIMED, None], ids=["claims-1e8", "true-norm"])
def test_mbsgd_device_pushing_at_its_bound(problem, claim, per_node):
    """Mb-SGD: a device sending |grad| = count x R in one direction. Before, its column grew
    until the shared projection shrank every honest model (to |w| ~ 1e-8 with R = 1e8) and
    the coupling pulled them off; now it is decoupled (K block diagonal, each block
    projected onto its own ball) and the honest models end as with its replies lost."""
    hostile = [3]
    lost = lost_error(problem, "mbsgd", hostile, **STRONG_MEAN)
    on, strategy = run(problem, "mbsgd", hostile=hostile, claim=claim, robust=True,
                       per_node=per_node, **STRONG_MEAN)
    off, weak = run(problem, "mbsgd", hostile=hostile, claim=claim, robust=False,
                    per_node=per_node, **STRONG_MEAN)
    assert abs(on - lost) <= CLOSE, (on, lost)
    assert off >= lost + 0.05, (off, lost)
    assert np.flatnonzero(strategy.decoupled).tolist() == hostile
    honest = [t for t in range(TASKS) if t not in hostile]
    size_on = np.linalg.norm(strategy.W[:, honest])
    size_off = np.linalg.norm(weak.W[:, honest])
    if claim == CLAIMED:  # the shared projection crushed the honest models
        assert size_off < 1e-3 * size_on, (size_off, size_on)


def rejections(caplog: pytest.LogCaptureFixture, task: int) -> list[str]:
    """The logged reasons the replies of ``task`` were rejected for."""
    pattern = re.compile(rf"reply of task {task} \(node \d+\) rejected: (.*)")
    found = [pattern.search(r.getMessage()) for r in caplog.records]
    return [m.group(1) for m in found if m]


@pytest.mark.parametrize("family", ["mocha", "mbsgd"])
def test_a_claimed_row_norm_is_capped_by_the_federations_fence(problem, caplog, family):
    """A device claiming max-row-norm 1e8 and sending replies that size: robust mode checks
    them against R~ = the fence of all tasks' claims (about 10 times their median) and
    rejects every train reply; its dual image (MOCHA) stays 0. Robust off: all accepted."""
    fence = log_upper_fence(np.r_[true_row_norms(problem)[:3], CLAIMED,
                                  true_row_norms(problem)[4:]])
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, strategy = run(problem, family, hostile=[3], claim=CLAIMED, robust=True,
                          naive=True, rounds=5, **MEAN)
    reasons = rejections(caplog, 3)
    key = "|delta-b|" if family == "mocha" else "|grad|"
    assert len(reasons) == 5 and all(r.startswith(key) and f"max-row-norm {fence:g}" in r
                                     for r in reasons), reasons
    if family == "mocha":
        assert not strategy.state.B[:, 3].any()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run(problem, family, hostile=[3], claim=CLAIMED, robust=False, rounds=5, **MEAN)
    assert rejections(caplog, 3) == []


def test_the_dual_image_stays_within_the_row_norm(problem, caplog):
    """b_t = X_t^T alpha_t / n_t with |alpha_ti| <= 1, so |b_t| <= R_t: a device that keeps
    pushing one way at its step bound has its replies rejected once b_t would leave that
    ball (robust mode), and |b_t| never exceeds R_t; robust off it grows without end."""
    R = true_row_norms(problem)[3]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, strategy = run(problem, "mocha", hostile=[3], claim=None, robust=True,
                          naive=True, **MEAN)
    reasons = rejections(caplog, 3)
    assert reasons and all(r.startswith("|b_t + delta-b|") for r in reasons)
    assert np.linalg.norm(strategy.state.B[:, 3]) <= R * (1 + 1e-9)
    _, weak = run(problem, "mocha", hostile=[3], claim=None, robust=False, **MEAN)
    assert np.linalg.norm(weak.state.B[:, 3]) > 2 * R


def test_a_claimed_n_train_is_capped_for_the_budgets(problem):
    """A device claiming n-train = 1e9 (Mb-SDCA: its budget enters every task's update
    scale through the round's total of steps) is given budgets from the fence of the tasks'
    n-train in robust mode, from 1e9 without."""
    sizes = np.array([len(y) for y in problem.ys])
    sizes[3] = 10**9
    fence = log_upper_fence(sizes)
    _, strategy = run(problem, "mb-sdca", hostile=[3], claim=None, robust=True,
                      claim_n=10**9, share=0.0, rounds=3, **MEAN)
    assert 0 < max(strategy.attacker.budgets) <= fence
    _, weak = run(problem, "mb-sdca", hostile=[3], claim=None, robust=False,
                  claim_n=10**9, share=0.0, rounds=3, **MEAN)
    assert min(weak.attacker.budgets) >= 10**8


@pytest.mark.parametrize("family", ["mocha", "mocha-factored", "mbsgd"])
def test_decoupling_survives_a_checkpoint(problem, family):
    """A resumed server keeps the decoupled tasks (sticky for the run): M' (MOCHA, on
    either server path) or the block-diagonal K (Mb-SGD), and the Omega-step stays blind
    to their models."""
    options = {"omega": "probabilistic", "omega_every": 2}
    if family == "mocha-factored":
        family, options["server_path"] = "mocha", "factored"
    _, strategy = run(problem, family, hostile=[3], claim=None, robust=True, rounds=6,
                      **options)
    arrays, meta = strategy.checkpoint_state()
    if family == "mocha":
        fresh = MOCHA(TASKS, lam=0.01, robust=True, max_failures=0, **options)
    else:
        fresh = MbSGD(TASKS, lam=0.01, robust=True, **options)
    fresh.restore_state(arrays, meta)
    assert fresh.decoupled.tolist() == strategy.decoupled.tolist()
    if family == "mocha":
        assert fresh.state.decoupled.tolist() == strategy.decoupled.tolist()
        fresh.state.omega_step()
        M = fresh.state.M if isinstance(fresh.state.M, np.ndarray) else fresh.state.M.dense()
        assert not M[3, np.arange(TASKS) != 3].any()
    else:
        assert np.array_equal(fresh.K, strategy.K)
        assert not fresh.K[3, np.arange(TASKS) != 3].any()


RESUMED = {  # family: (hostile, attack, options, the round they are decoupled in)
    "mocha": ([3, 7], {"share": 0.45, "fence_aware": "size"}, STRONG_MEAN, 6),
    "mbsgd": ([3], {"share": 0.3}, MEAN, 5),
}


@pytest.mark.parametrize("family", sorted(RESUMED))
def test_a_resumed_run_decouples_when_the_uninterrupted_one_does(problem, tmp_path, family):
    """MOCHA: two devices under the size fence (lam / lam2 = 10) are away from the consensus
    in rounds 4, 5 and 6; Mb-SGD: one stepping at 30 % of its bound is an outlier by its
    size and its distance in rounds 3, 4 and 5. Each is decoupled in the third. A server
    killed in that round and resumed from the previous round's checkpoint must carry the
    two-round streaks (and every other count and last-round value of the watch) over:
    before, the checkpoint held only ``decoupled``, the streaks restarted at 0 and the
    resumed run decoupled them later, with other models."""
    hostile, attack, options, decoupled_in = RESUMED[family]
    rounds = decoupled_in + 2
    _, uninterrupted = run(problem, family, hostile=hostile, claim=None, robust=True,
                           rounds=rounds, **attack, **options)
    got = [r["tasks_decoupled"] for r in uninterrupted.records[decoupled_in - 2:decoupled_in + 1]]
    assert got == [[], [], hostile], got

    attacker = Attacker(problem, hostile, None, True, family, **attack)
    if family == "mbsgd":
        cls, app = MbSGD, make_mbsgd_client_app(problem.load)
        settings = {"lam": 0.01, **options}
    else:
        cls, app = MOCHA, make_mocha_client_app(problem.load)
        settings = {"lam": 0.01, "max_failures": 0, "method": family, **options}
    grid = HostileGrid(app, TASKS)  # the devices keep running
    grid.tamper = tamper_for(attacker)
    for make in (killed_in(cls, decoupled_in), cls):
        strategy = make(TASKS, discovery_timeout=5.0, robust=True, **settings)
        strategy.enable_checkpoints(tmp_path, every=1)
        attacker.strategy = strategy
        try:
            strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)
        except ServerKilled:
            continue
    assert strategy.resumed_from == decoupled_in - 1
    W = (lambda s: s.W) if family == "mbsgd" else (lambda s: s.state.W)
    np.testing.assert_array_equal(W(strategy), W(uninterrupted))
    np.testing.assert_array_equal(strategy.decoupled, uninterrupted.decoupled)

    def numbers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]
    assert numbers(strategy.records) == numbers(uninterrupted.records)


LEARNED = {"probabilistic": {"omega": "probabilistic", "omega_every": 5},
           "graphical": {"omega": "graphical", "s2": 10.0, "lam2": 1e-3, "omega_every": 5},
           "clustered": {"omega": "clustered", "eta": 0.1, "clusters": 3, "omega_every": 5}}


#: MOCHA's other losses on the honest synthetic problem (``mean``).
LOSSES = {loss: {**MEAN, "loss": loss} for loss in ("logistic", "squared", "smoothed-hinge")}


def same_records(on: Any, off: Any) -> bool:
    """Whether two runs' records are equal, bit for bit, but for timings and
    ``tasks_decoupled`` (robust mode's key)."""
    def numbers(strategy: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "tasks_decoupled"}
                for r in strategy.records]
    return numbers(on) == numbers(off)


@pytest.mark.parametrize("family", ["mocha", "cocoa", "mb-sdca", "mbsgd", *LEARNED, *LOSSES])
def test_an_honest_federation_runs_as_without_robust_mode(problem, family):
    """Nothing decoupled, nothing rejected: robust mode on an honest federation gives the
    same records, bit for bit, as robust mode off (the caps and fences do not bind; for
    MOCHA's learned formulations also the pull fence, whose honest pulls stay within 2.2
    times their median here, and the coupling fence; also with the logistic, squared and
    smoothed-hinge losses)."""
    options = STRONG_MEAN if family == "mbsgd" else {**LEARNED, **LOSSES}.get(family, MEAN)
    family = "mocha" if family in LEARNED or family in LOSSES else family
    _, on = run(problem, family, hostile=[], claim=None, robust=True, **options)
    _, off = run(problem, family, hostile=[], claim=None, robust=False, **options)
    assert not on.decoupled.any()
    assert same_records(on, off)


def label_skewed_digits(seed: int, fit: bool = False) -> list[Any]:
    """Ten devices of scikit-learn's digits with Dirichlet label skew (10 classes, lifted to
    one-vs-rest blocks of d K features by MOCHA's multi-class lifting); ``fit``: the 80 %
    of each device's training data that ``benchmarks/mocha_multiclass_digits.py --select
    validation`` fits its candidates on."""
    data = load_dataset("digits-dirichlet", num_tasks=TASKS, seed=seed)
    return list((validation_split(data, 0.2, seed) if fit else data).tasks)


@pytest.mark.parametrize("seed, loss, fit", [
    (0, "logistic", False), (0, "squared", False), (0, "smoothed-hinge", False),
    (0, "hinge", False), (1, "logistic", False), (2, "logistic", False), (0, "logistic", True),
    (2, "logistic", True)])
def test_an_honest_multiclass_federation_runs_as_without_robust_mode(seed, loss, fit):
    """Multi-class, label-skewed devices with an intercept under ``mean`` (lam = 1e-3,
    lam2 = 1e-5), every loss: robust mode decouples no honest task and the records equal
    robust mode off's. With the logistic loss this failed (seeds 0 and 1: one to two honest
    tasks decoupled in round 3 by the size and consensus fences) until the logistic
    coordinate step converged: it stopped after 60 unconverged Newton steps at large q and
    left single dual variables near 1, so a task's b_t was 14 times the others' median.
    On the benchmark's fitting split (seed 0, logistic) task 4 (2660 lifted samples, 2.5
    times the median) was still decoupled in round 3 by the consensus fence: its image was
    4 times the others' after round 1 and held still while theirs grew toward it, its
    distance from the consensus 2.0, 1.4, 1.1 times the fence in rounds 1 to 3 (0.92 in
    round 4); seed 2's tasks 1 and 8 likewise. A round in which the federation catches up
    no longer counts (:mod:`fmtl_flower.core.decoupling`, "Early rounds")."""
    tasks = label_skewed_digits(seed, fit)

    def load(context: Context) -> tuple[np.ndarray, ...]:
        t = tasks[default_task_id(context)]
        return t.X_train, t.y_train, t.X_test, t.y_test

    def one(robust: bool) -> Any:
        strategy = MOCHA(TASKS, lam=1e-3, lam2=1e-5, omega="mean", fit_intercept=True,
                         loss=loss, seed=seed, discovery_timeout=5.0, robust=robust)
        grid = HostileGrid(make_mocha_client_app(load, labels="auto"), TASKS)
        strategy.start(grid=grid, num_rounds=12, timeout=60.0)
        return strategy

    on, off = one(True), one(False)
    assert not on.decoupled.any()
    assert same_records(on, off)


# ------------------------------------------------------------------------------ the table
TABLE = [  # (attack, family, hostile, claim, options)
    ("1 of 10 claims R=1e8, pushes at its bound (mean)", "mocha", [3], CLAIMED, MEAN),
    ("1 of 10, true R, pushes at its bound (mean)", "mocha", [3], None, MEAN),
    ("CoCoA: 1 of 10 claims R=1e8 (mean)", "cocoa", [3], CLAIMED, MEAN),
    ("Mb-SDCA: 1 of 10 claims R=1e8 (mean)", "mb-sdca", [3], CLAIMED, MEAN),
    ("2 of 10 claim R=1e8 (mean)", "mocha", [3, 7], CLAIMED, MEAN),
    ("2 of 10, true R (probabilistic, Omega every 5)", "mocha", [3, 7], None,
     {"omega": "probabilistic", "omega_every": 5}),
    ("1 of 10, true R (graphical, Omega every 5)", "mocha", [3], None,
     {"omega": "graphical", "s2": 10.0, "lam2": 1e-3, "omega_every": 5}),
    ("1 of 10 creeps at 45% of its bound (lam/lam2 = 10)", "mocha", [3], None,
     {**STRONG_MEAN, "share": 0.45}),
    ("2 of 10 creep at 45% of their bounds (mean)", "mocha", [3, 7], None,
     {**MEAN, "share": 0.45}),
    ("1 of 10 keeps b_t at 0.9 of the size fence (lam/lam2 = 10)", "mocha", [3], None,
     {**STRONG_MEAN, "share": 0.45, "fence_aware": "size"}),
    ("2 of 10 keep b_t at 0.9 of the size fence (mean)", "mocha", [3, 7], None,
     {**MEAN, "share": 0.45, "fence_aware": "size"}),
    ("2 of 10 keep b_t at 0.9 of the size fence (lam/lam2 = 10)", "mocha", [3, 7], None,
     {**STRONG_MEAN, "share": 0.45, "fence_aware": "size"}),
    ("2 of 10 keep b_t under every fence (lam/lam2 = 10)", "mocha", [3, 7], None,
     {**STRONG_MEAN, "share": 0.45, "fence_aware": "every"}),
    ("2 of 10 keep b_t under every fence (mean)", "mocha", [3, 7], None,
     {**MEAN, "share": 0.45, "fence_aware": "every"}),
    ("2 of 10 keep b_t under every fence (probabilistic)", "mocha", [3, 7], None,
     {"omega": "probabilistic", "omega_every": 5, "share": 0.45, "fence_aware": "every"}),
    ("2 of 10 also under the pull fence (probabilistic)", "mocha", [3, 7], None,
     {**PROBABILISTIC, "share": 0.45, "fence_aware": "pull"}),
    ("2 of 10 also under the coupling fence (probabilistic)", "mocha", [3, 7], None,
     {**PROBABILISTIC, "share": 0.45, "fence_aware": "coupling"}),
    ("Mb-SGD: 1 of 10 claims R=1e8 (lam/lam2 = 10)", "mbsgd", [3], CLAIMED, STRONG_MEAN),
    ("Mb-SGD: 1 of 10, true R (lam/lam2 = 10)", "mbsgd", [3], None, STRONG_MEAN),
]


def print_table() -> None:
    """The attack x {robust off, robust on, replies lost} table of honest mean test errors
    (``python -m tests.strategies.test_byzantine_mocha`` from the repository's root). The
    fence-aware attackers know every task's b_t (robust off there is no fence and they push
    to their bounds). Kept under the size fence alone, 2 of 10 took the honest error to 0.51
    with lam / lam2 = 10 before the consensus fence; now they are decoupled. Kept under
    every fence they are never decoupled: with ``mean`` they can then pull the others only
    by a deviation the honest tasks make plausible (within 2 points); with
    ``probabilistic`` (lam = 0.01, clustered tasks whose b_t point different ways, so the
    consensus fence is wide) the learned Sigma coupled their b_t to the others 10 to 20 times
    harder than an honest task's (0.242 against 0.130 lost); the pull fence now decouples
    them. Colluders that know the pull fence too and stay at 0.9 of it were never decoupled
    and cost 2.5 points there (0.155): the Omega-step coupled their identical b_t to
    everybody; the coupling fence now decouples them. Colluders that know that fence too
    stay within 2 points."""
    problem = make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=80, seed=3)
    print("| attack | robust off | robust on | replies lost |")
    print("|---|---|---|---|")
    for name, family, hostile, claim, options in TABLE:
        options = dict(options)
        attack = {"share": options.pop("share", SLACK),
                  "fence_aware": options.pop("fence_aware", None)}
        errors = [run(problem, family, hostile=hostile, claim=claim, robust=robust,
                      **attack, **options)[0] for robust in (False, True)]
        lost = lost_error(problem, family, hostile, **options)
        print(f"| {name} | {errors[0]:.3f} | {errors[1]:.3f} | {lost:.3f} |", flush=True)


if __name__ == "__main__":
    logging.getLogger("flwr").setLevel(logging.ERROR)
    print_table()
