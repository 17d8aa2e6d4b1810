"""A device-side error under Flower's Ray simulation is logged by Flower at every failed
message (the engine's worker logs the exception and its traceback, per Ray worker): the
server log collapses the repeats of one error to a count (issue 27, item 4)."""

from __future__ import annotations

import logging
import traceback

from flwr.app import Context, Message
from flwr.common.logger import log

from fmtl_flower import MOCHA, make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.repeated_errors import (
    RepeatedErrors,
    collapse_repeated_errors,
    is_power_of_ten,
)

from .helpers import make_problem

RAY_ERROR = """ray::ClientAppActor.run() (pid={pid}, ip=10.0.0.{ip}, actor_id={actor}, repr=<flwr.\
simulation.ray_transport.ray_actor.ClientAppActor object at 0x7f{address:x}>)
  File "/venv/lib/python3.11/site-packages/flwr/simulation/ray_transport/ray_actor.py", line 65
    raise ClientAppException(str(ex)) from ex
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: task {task}: labels must be in {{-1, 1}}, \
found {count} label(s) [0]"""


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def a_logger(name: str) -> tuple[logging.Logger, Kept]:
    logger = logging.getLogger(f"tests.repeated_errors.{name}")
    logger.propagate, kept = False, Kept()
    logger.addHandler(kept)
    return logger, kept


def test_one_error_from_many_ray_workers_is_printed_once_then_counted():
    logger, kept = a_logger("ray")
    collapse_repeated_errors(logger)
    errors = [RAY_ERROR.format(pid=4000 + i % 8, ip=i % 8, actor=f"{i % 8:032x}", address=i,
                               task=i % 40, count=10 + i % 7)
              for i in range(1000)]  # 1000 failed messages of 40 devices over 8 Ray workers
    for error in errors:
        logger.error(error)
    texts = [r.getMessage() for r in kept.records]
    assert texts[0] == errors[0] and len(texts) == 4
    for text, repeat, times in zip(texts[1:], (1, 10, 100), ("once", "10 times", "100 times"),
                                   strict=True):
        assert text == (f"(the error above repeated {times}; further repeats are counted, "
                        "not printed: " + errors[repeat].splitlines()[-1] + ")")
    assert texts[1].endswith("task 1: labels must be in {-1, 1}, found 11 label(s) [0])")


def test_distinct_errors_each_printed_and_lower_levels_untouched():
    logger, kept = a_logger("distinct")
    collapse_repeated_errors(logger)
    for _ in range(3):
        logger.error("KeyError: 'task-id'")
        logger.error("ValueError: dim = 0")
        logger.warning("a warning, every time")
    assert [r.getMessage() for r in kept.records] == [
        "KeyError: 'task-id'", "ValueError: dim = 0", "a warning, every time",
        "(the error above repeated once; further repeats are counted, not printed: KeyError: "
        "'task-id')",
        "(the error above repeated once; further repeats are counted, not printed: "
        "ValueError: dim = 0)",
        "a warning, every time", "a warning, every time"]


def test_installed_once_and_a_new_run_reports_each_error_again():
    logger, kept = a_logger("runs")
    first = collapse_repeated_errors(logger)
    logger.error("boom")
    assert collapse_repeated_errors(logger) is first
    assert [f for f in logger.filters if isinstance(f, RepeatedErrors)] == [first]
    logger.error("boom")
    assert [r.getMessage() for r in kept.records] == ["boom", "boom"]
    assert [n for n in range(1, 2000) if is_power_of_ten(n)] == [1, 10, 100, 1000]


def test_a_strategys_run_collapses_the_tracebacks_flower_logs_for_failing_devices(caplog):
    """Four devices of eight fail every message with one error (labels 0/1 on a partition);
    the wrapper logs what Flower's simulation worker logs for each failed message (the
    exception, then its traceback) before the error reply."""
    logging.getLogger("flwr").setLevel(logging.INFO)
    problem = make_problem(num_tasks=8)
    app = make_mocha_client_app(problem.load)
    failed = []

    def client(message: Message, context: Context) -> Message:
        try:
            if context.node_config["partition-id"] >= 4:
                raise ValueError(f"task {context.node_config['partition-id']}: labels "
                                 "must be in {-1, 1}, found [0]")
            return app(message, context)
        except Exception as ex:  # as flwr/server/superlink/fleet/vce/vce_api.py's worker
            failed.append(ex)
            log(logging.ERROR, ex)
            log(logging.ERROR, traceback.format_exc())
            raise

    strategy = MOCHA(8, lam=0.1, discovery_timeout=3.0)
    strategy.min_tasks = 4
    with caplog.at_level(logging.ERROR, logger="flwr"):
        strategy.start(grid=InProcessGrid(client, 8), num_rounds=3, timeout=30.0)
    assert len(failed) >= 4
    tracebacks = [r for r in caplog.records if "Traceback (most recent call last)" in r.message]
    assert len(tracebacks) == 1
    counts = [r for r in caplog.records if r.message.startswith("(the error above repeated")]
    assert 2 <= len(counts) <= 2 * sum(is_power_of_ten(n) for n in range(1, len(failed)))
