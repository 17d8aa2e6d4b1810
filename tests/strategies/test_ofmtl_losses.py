"""OFMTL under the run's loss (``mocha.loss``): the MOCHA trainings and every newcomer's
subproblem train it, in process, for a loss defined as one class (the toy squared hinge of
``tests/core/test_toy_loss.py``) as for a built-in one; record-level DP stays hinge-only."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.config import RunConfig, settings_from_config
from fmtl_flower.core.ofmtl import add_task
from fmtl_flower.engine import run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings, OFMTLSettings
from fmtl_flower.strategies.ofmtl import OFMTL
from fmtl_flower.strategies.ofmtl_privacy import enable_ofmtl_record_dp
from fmtl_flower.wire import from_array, to_array

from ..core.test_toy_loss import toy  # noqa: F401 - a fixture
from .helpers import make_problem
from .hostile import run_on_hostile_grid, untouched

LAM, SEED = 0.05, 4


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=5, dim=4, samples_per_task=40, seed=7)


def _run(problem, loss: str):
    """OFMTL over ``problem`` with ``loss``: every message's (type, task, loss) and the
    (W, Sigma) after each event."""
    app = make_ofmtl_client_app(problem.load)
    sent: list[tuple[str, int, str | None]] = []
    states: list[tuple[np.ndarray, np.ndarray]] = []
    events: list[dict] = []

    def client(msg: Message, context: Context) -> Message:
        config = msg.content["config"] if "config" in msg.content else {}
        sent.append((msg.metadata.message_type, default_task_id(context), config.get("loss")))
        return app(msg, context)

    def snapshot(record: dict) -> None:
        events.append(record)
        states.append((strategy.W.copy(), strategy.Sigma.copy()))

    strategy = OFMTL(problem.num_tasks, initial_tasks=2, lam=LAM, mocha_rounds=30, inner=30,
                     seed=SEED, retrain_ratio=float("inf"), discovery_timeout=5.0,
                     arrival_timeout=2.0, on_record=snapshot, loss=loss)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, client, problem.num_tasks)
    return strategy, sent, states, events


def test_a_loss_defined_as_one_class_runs_through_ofmtl(problem, toy):  # noqa: F811
    strategy, sent, states, events = _run(problem, toy.name)
    assert strategy.results()["final"]["complete"]
    assert [e["event"] for e in events] == ["initial", "newcomer", "newcomer", "newcomer"]
    trains = [(kind, loss) for kind, _, loss in sent if kind.startswith("train")]
    assert {kind for kind, _ in trains} == {"train", "train.ofmtl"}
    assert all(loss == toy.name for _, loss in trains)  # MOCHA's and the newcomers' alike
    for m in range(2, problem.num_tasks):  # event m - 1 admitted task m from state m - 2
        W_prev, S_prev = states[m - 2]
        ref = add_task(W_prev, S_prev, problem.Xs[m], problem.ys[m], lam=LAM,
                       outer=strategy.outer, inner=strategy.inner,
                       local_frac=strategy.newcomer_frac, seed=SEED, task_id=m, loss=toy)
        np.testing.assert_array_equal(states[m - 1][0], ref.W)
        assert events[m - 1]["newcomer_gap"] == ref.gaps[-1]
        hinge = add_task(W_prev, S_prev, problem.Xs[m], problem.ys[m], lam=LAM,
                         outer=strategy.outer, inner=strategy.inner,
                         local_frac=strategy.newcomer_frac, seed=SEED, task_id=m)
        assert not np.allclose(hinge.w, ref.w)  # the loss changed the newcomer's model
    # the founding MOCHA training trained the toy loss too: its columns differ from a hinge run's
    hinge_run = _run(problem, "hinge")[2]
    assert not np.allclose(hinge_run[0][0], states[0][0])


def test_settings_take_every_loss_and_record_dp_refuses_a_non_hinge_one():
    assert OFMTLSettings(loss="logistic").loss == "logistic"
    cfg = RunConfig.from_mapping({"strategy": "ofmtl", "mocha.loss": "squared"})
    assert settings_from_config(cfg, 4).loss == "squared"
    with pytest.raises(ConfigError, match="mocha.loss .*hinge, smoothed-hinge, logistic"):
        OFMTLSettings(loss="cubic")
    dp = DPSettings(mechanism="record", clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="record-level DP is for the hinge loss only"):
        enable_ofmtl_record_dp(OFMTL(4, loss="logistic"), dp)
    assert enable_ofmtl_record_dp(OFMTL(4), dp).privacy is not None


@pytest.mark.parametrize("loss", ["logistic", "hinge"])
def test_a_newcomers_reply_beyond_its_losss_bound_is_a_logged_drop(problem, loss, caplog):
    """Under a loss with a bounded dual (|y alpha| <= 1) a newcomer's w scaled 1e6 breaks
    |lam omega w + lam c| <= max-row-norm: the attempt fails at the trust boundary, W and
    Sigma stay finite, the next attempt (honest) admits the task."""
    tampered = []

    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or message.metadata.message_type != "train.ofmtl" \
                or "arrays" not in reply.content or tampered:
            return untouched(message, reply)
        tampered.append(True)
        w = from_array(reply.content["arrays"]["w"]) * 1e6
        content = RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                              "metrics": reply.content["metrics"]})
        return [Message(content, reply_to=message)]

    strategy = OFMTL(3, initial_tasks=2, lam=LAM, mocha_rounds=6, outer=3, inner=3,
                     retrain_ratio=float("inf"), max_attempts=2, discovery_timeout=5.0,
                     arrival_timeout=2.0, loss=loss)
    with caplog.at_level(logging.INFO):
        run_on_hostile_grid(lambda grid: strategy.start(grid=grid, timeout=60.0),
                            make_ofmtl_client_app(problem.load), 3, tamper)
    assert tampered
    assert strategy.m == 3 and np.all(np.isfinite(strategy.W))
    assert any("lambda omega w" in r.getMessage() and f"the {loss} loss's dual radius 1"
               in r.getMessage() for r in caplog.records)
