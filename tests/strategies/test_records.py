"""strategies/records.py: a record is opened, completed once and published; checkpoints keep
the format they always had (a pending record carries ``_reg``; FSVRG's older ones ``_open``)."""

from __future__ import annotations

import pytest

from fmtl_flower.checkpoint import read_checkpoint
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.records import PENDING_KEY, Pending, RoundRecords, public_record

from .helpers import make_problem
from .test_state_and_envelope import MOCHA_KWARGS, _mocha_app, _run


def _book(*regularisers):
    book = RoundRecords()
    for k, reg in enumerate(regularisers):
        book.open({"round": k, "primal": None}, regulariser=reg)
    return book


def test_a_record_is_pending_until_completed_then_completed_once():
    book = _book(0.5, 0.25)
    assert book.is_pending(0) and book.is_pending(1)
    assert book.complete(0) == Pending(0.5)
    assert not book.is_pending(0) and book.is_pending(1)
    assert book.complete(0) is None  # completed already: the caller leaves it as it is
    with pytest.raises(IndexError, match="no record 2"):
        book.complete(2)


def test_only_completed_records_are_published_without_internal_fields():
    book = _book(0.5, 0.25)
    book.records[0]["_scratch"] = 1
    book.complete(0)
    assert book.published() == [{"round": 0, "primal": None}]
    seen = []
    book.publish(book.records[0], seen.append)
    book.publish(book.records[0], None)  # no callback: nothing to do
    assert seen == [{"round": 0, "primal": None}]
    assert public_record({"a": 1, "_b": 2}) == {"a": 1}


def test_added_records_are_complete():
    book = RoundRecords()
    book.add({"round": 0, "event": "initial"})
    assert len(book) == 1 and not book.pending
    assert book.published() == [{"round": 0, "event": "initial"}]


def test_checkpoint_meta_marks_pending_records_and_loads_back():
    book = _book(0.5, None, 0.125)
    book.complete(0)
    meta = book.to_meta()
    assert meta == [{"round": 0, "primal": None},
                    {"round": 1, "primal": None, PENDING_KEY: None},
                    {"round": 2, "primal": None, PENDING_KEY: 0.125}]
    assert all(PENDING_KEY not in r for r in book.records)  # the records stay clean
    loaded = RoundRecords()
    loaded.load(meta)
    assert loaded.records == book.records
    assert loaded.pending == {1: Pending(None), 2: Pending(0.125)}


def test_records_of_checkpoints_written_before_the_module_load():
    """MOCHA_KWARGS's and Mb-SGD's pending records held ``_reg`` (a float), FSVRG's ``_open``."""
    mocha, fsvrg = RoundRecords(), RoundRecords()
    mocha.load([{"round": 0, "primal": 1.5, "objective": 2.0},
                {"round": 1, "primal": None, "objective_omega": 0.1, "_reg": 0.75}])
    fsvrg.load([{"round": 0, "objective": 0.6}, {"round": 1, "objective": None,
                                                 "_open": True}])
    assert mocha.pending == {1: Pending(0.75)} and fsvrg.pending == {1: Pending(None)}
    assert mocha.records[1] == {"round": 1, "primal": None, "objective_omega": 0.1}
    assert fsvrg.records[1] == {"round": 1, "objective": None}
    assert [r["round"] for r in mocha.published()] == [0]


def test_assigning_records_loads_them():
    strategy = MOCHA(3, lam=0.1)
    strategy.records = [{"round": 0, "gap": 1.0}, {"round": 1, "gap": None, "_reg": 0.5}]
    assert strategy.book.pending == {1: Pending(0.5)}
    assert strategy.records == [{"round": 0, "gap": 1.0}, {"round": 1, "gap": None}]


def test_mocha_checkpoint_holds_the_pending_record_with_its_regulariser(tmp_path):
    """A MOCHA_KWARGS checkpoint is written after round k's evaluation, while record k waits for
    round k + 1's replies: it holds ``_reg`` = R(W, Omega) of state k, and a run resumed
    from it completes that record with it."""
    problem = make_problem(num_tasks=4, dim=4, samples_per_task=30, seed=11)
    ckpt, devices = tmp_path / "ckpt", tmp_path / "devices"
    strategy = MOCHA(problem.num_tasks, **MOCHA_KWARGS)
    strategy.enable_checkpoints(ckpt, every=1)
    killed_after = 2

    class Stop(Exception):
        pass

    def stop(record):
        if record["round"] == killed_after:  # record 2 completed in round 3: stop there
            raise Stop

    strategy.on_round = stop
    with pytest.raises(Stop):
        _run(strategy, _mocha_app(problem, devices), problem.num_tasks, 5)
    checkpoint = read_checkpoint(ckpt)
    assert checkpoint.server_round == killed_after
    saved = checkpoint.meta["records"]
    assert [PENDING_KEY in r for r in saved] == [False, False, True]
    assert isinstance(saved[-1][PENDING_KEY], float) and saved[-1][PENDING_KEY] > 0
    resumed = MOCHA(problem.num_tasks, **MOCHA_KWARGS)
    resumed.enable_checkpoints(ckpt)
    _run(resumed, _mocha_app(problem, devices), problem.num_tasks, 5)
    straight = MOCHA(problem.num_tasks, **MOCHA_KWARGS)
    _run(straight, _mocha_app(problem, devices), problem.num_tasks, 5)
    got, want = resumed.results()["rounds"], straight.results()["rounds"]
    assert [r["primal"] for r in got] == pytest.approx([r["primal"] for r in want],
                                                       rel=1e-12)
