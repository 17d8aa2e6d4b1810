"""A record is completed and published once, also across a finished run resumed with more
rounds (strategies/records.py): the resumed run publishes only its new records, and the last
record of the finished run stays as its final metrics round completed it.

Before the record lifecycle had one home, FSVRG's family (FSVRG, GD, CoCoA+) completed the
finished run's last record a second time in the resumed run's first round and passed it to
``on_round`` again; MOCHA_KWARGS's family kept it (and crashed on it before that, KeyError '_reg').
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import make_problem
from .test_state_and_envelope import MOCHA_KWARGS, _fsvrg_app, _mocha_app, _run


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=4, dim=4, samples_per_task=30, seed=11)


@pytest.fixture(scope="module")
def sparse():
    return make_sparse_federated(num_tasks=4, dim=300, seed=1)


def _published(make, app, num_nodes: int, ckpt: Path, first: int, more: int):
    """Run ``first`` rounds to the end (checkpoints on), then resume with ``more``; returns
    (records the first run published, those the resumed run published, the resumed run)."""
    published: tuple[list, list] = ([], [])
    runs = []
    for rounds, seen in zip((first, more), published, strict=True):
        strategy = make()
        strategy.on_round = seen.append
        strategy.enable_checkpoints(ckpt)
        _run(strategy, app(), num_nodes, rounds)
        runs.append(strategy)
    assert runs[1].resumed_from == first
    return published[0], published[1], runs[1]


def _check_published_once(first_run, resumed_run, resumed, first: int, rounds: list[int]):
    """Every record published once, in order; the resumed run's results hold them all and
    the finished run's last record as that run published it."""
    assert [r["round"] for r in first_run + resumed_run] == rounds
    got = resumed.results()["rounds"]
    assert [r["round"] for r in got] == rounds
    assert got[rounds.index(first)] == first_run[-1]


@pytest.mark.parametrize("method", ["fsvrg", "gd", "cocoa-plus"])
def test_fsvrg_family_publishes_the_finished_runs_last_record_once(sparse, tmp_path, method):
    devices = tmp_path / "devices"
    options = {"method": method, "seed": 2, "discovery_timeout": 5.0}
    first_run, resumed_run, resumed = _published(
        lambda: FSVRG(sparse.num_tasks, **options), lambda: _fsvrg_app(sparse, devices),
        sparse.num_tasks, tmp_path / "ckpt", 2, 4)
    _check_published_once(first_run, resumed_run, resumed, 2, list(range(5)))


@pytest.mark.parametrize("method", ["mocha", "mb-sdca"])
def test_mocha_family_publishes_the_finished_runs_last_record_once(problem, tmp_path, method):
    devices = tmp_path / "devices"
    settings = {**MOCHA_KWARGS, "method": method}
    first_run, resumed_run, resumed = _published(
        lambda: MOCHA(problem.num_tasks, **settings), lambda: _mocha_app(problem, devices),
        problem.num_tasks, tmp_path / "ckpt", 2, 4)
    _check_published_once(first_run, resumed_run, resumed, 2, list(range(5)))


def test_mbsgd_publishes_the_finished_runs_last_record_once(problem, tmp_path):
    first_run, resumed_run, resumed = _published(
        lambda: MbSGD(problem.num_tasks, lam=0.05, seed=3, discovery_timeout=5.0),
        lambda: make_mbsgd_client_app(problem.load), problem.num_tasks, tmp_path / "ckpt",
        2, 4)
    _check_published_once(first_run, resumed_run, resumed, 2, list(range(5)))


def test_fedem_publishes_each_round_once(tmp_path):
    from .test_fedem_strategy import mixture_problem

    data = mixture_problem(num_tasks=4, seed=1)
    devices = tmp_path / "devices"
    settings = {"num_components": 2, "lr": 0.5, "batch_size": 32, "seed": 5,
                "eval_every": 1, "discovery_timeout": 5.0}
    first_run, resumed_run, resumed = _published(
        lambda: FedEM(len(data), **settings),
        lambda: make_fedem_client_app(lambda ctx: data[default_task_id(ctx)],
                                      state_dir=str(devices)),
        len(data), tmp_path / "ckpt", 2, 4)
    _check_published_once(first_run, resumed_run, resumed, 2, list(range(1, 5)))
