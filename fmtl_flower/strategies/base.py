"""What every per-task strategy shares: its run loop, node directory, checkpoints, results.

Checkpoint and resume
---------------------
:meth:`TaskStrategy.enable_checkpoints` makes the strategy write its state after every
``every``-th round (and after the last) to a directory, atomically and without pickle
(:mod:`fmtl_flower.checkpoint`). With ``resume`` on, :meth:`TaskStrategy.start` first looks
for the newest checkpoint there and continues after its round: a resumed server is a new
Flower run, so node ids are discovered afresh and devices reconcile their own state with the
server's by each strategy's commit protocol. A checkpoint written with other settings (its
``fingerprint``: strategy, number of tasks, lambda, ...) is refused with an error naming the
difference. Randomness is derived from (seed, task, round) everywhere, so there is no RNG
state to store: a resumed run draws the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..checkpoint import check_fingerprint, read_checkpoint, write_checkpoint
from .discovery import TaskDirectory


class TaskStrategy(Strategy):
    """Base of the strategies that keep one model per task (MOCHA and its baselines).

    Subclasses set ``directory`` (a :class:`TaskDirectory`), ``records`` (one dict per state
    k = 0 .. R; a record still waiting for its devices' numbers holds the key ``_reg``) and
    ``ever_replied`` (bool per task) in their constructor.
    """

    directory: TaskDirectory
    records: list[dict[str, Any]]
    ever_replied: np.ndarray
    num_rounds: int | None = None
    round_timeout: float = 120.0
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 1
    resume: bool = True
    resumed_from: int = 0  # round of the checkpoint this run continued from (0: none)
    last_checkpoint_round: int = 0  # round of the newest checkpoint written or resumed from

    @property
    def first_round(self) -> int:
        """The first round this run trains (1, or the one after the resumed checkpoint)."""
        return self.resumed_from + 1

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run rounds up to ``num_rounds`` plus a final metrics round, as ``Strategy.start``
        does, after resuming from the newest checkpoint when enabled (the rounds it covers are
        not run again). A checkpoint is written after a round's train and evaluate phases."""
        self.num_rounds = int(num_rounds)
        self.round_timeout = float(timeout)
        if self.checkpoint_dir is not None and self.resume:
            self._resume()
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        result = Result()
        arrays = ArrayRecord() if initial_arrays is None else initial_arrays
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        started = time.time()
        for server_round in range(self.first_round, self.num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, self.num_rounds)
            replies = grid.send_and_receive(
                as_taken_by(grid, self.configure_train(server_round, arrays, train_config, grid)),
                timeout=timeout)
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            drain(replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
                result.train_metrics_clientapp[server_round] = metrics
            self._evaluate_phase(grid, server_round, arrays, evaluate_config, timeout, result,
                                 evaluate_fn)
            self.maybe_checkpoint(server_round)  # after the round's evaluation, if any
        if self.first_round > self.num_rounds:
            log(INFO, "the checkpoint is of the last round (%d): nothing left to run",
                self.resumed_from)
        log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    def _evaluate_phase(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                        config: ConfigRecord, timeout: float, result: Result,
                        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
                        ) -> None:
        replies = grid.send_and_receive(
            as_taken_by(grid, self.configure_evaluate(server_round, arrays, config, grid)),
            timeout=timeout)
        metrics = self.aggregate_evaluate(server_round, replies)
        drain(replies)
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics
        if evaluate_fn is not None:
            served = evaluate_fn(server_round, arrays)
            if served is not None:
                result.evaluate_metrics_serverapp[server_round] = served

    # ------------------------------------------------------------------ checkpoints
    def enable_checkpoints(self, directory: str | Path, every: int = 1,
                           resume: bool = True) -> None:
        """Write a checkpoint after every ``every``-th round and the last; with ``resume``,
        continue from the newest one found in ``directory`` when the run starts."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be an int >= 1, got {every!r}")
        self.checkpoint_dir = Path(directory)
        self.checkpoint_every = every
        self.resume = bool(resume)

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The state after the current round: ``(arrays, JSON metadata)``. Strategies that
        support checkpoints override this and :meth:`restore_state`."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load a state written by :meth:`checkpoint_state`."""
        raise NotImplementedError(f"{type(self).__name__} does not support checkpoints")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must have been written with to be resumed by this strategy."""
        return {"strategy": type(self).__name__, "num_tasks": int(len(self.ever_replied))}

    def maybe_checkpoint(self, server_round: int) -> Path | None:
        """Write a checkpoint if one is due after ``server_round``."""
        if self.checkpoint_dir is None:
            return None
        if server_round % self.checkpoint_every and server_round != self.num_rounds:
            return None
        arrays, meta = self.checkpoint_state()
        path = write_checkpoint(self.checkpoint_dir, server_round, arrays,
                                {**meta, "fingerprint": self.fingerprint(),
                                 "ever_replied": self.ever_replied.tolist()})
        self.last_checkpoint_round = server_round
        log(INFO, "%s: checkpoint after round %d written to %s", type(self).__name__,
            server_round, path)
        return path

    def _resume(self) -> None:
        assert self.checkpoint_dir is not None
        checkpoint = read_checkpoint(self.checkpoint_dir)
        if checkpoint is None:
            log(INFO, "%s: no checkpoint in %s; starting from round 1", type(self).__name__,
                self.checkpoint_dir)
            return
        check_fingerprint(checkpoint, self.fingerprint())
        self.restore_state(checkpoint.arrays, checkpoint.meta)
        self.ever_replied = np.array(checkpoint.meta["ever_replied"], dtype=bool)
        self.resumed_from = self.last_checkpoint_round = checkpoint.server_round
        log(INFO, "%s: resumed from %s (state after round %d)", type(self).__name__,
            checkpoint.path, checkpoint.server_round)

    @property
    def node_to_task(self) -> dict[int, int]:
        return self.directory.node_to_task

    @property
    def task_to_node(self) -> dict[int, int]:
        return self.directory.task_to_node

    @property
    def n_train(self) -> np.ndarray:
        return self.directory.n_train

    @staticmethod
    def public_record(record: dict[str, Any]) -> dict[str, Any]:
        """A record without internal fields."""
        return {k: v for k, v in record.items() if not k.startswith("_")}

    def results(self) -> dict[str, Any]:
        """``{"rounds": [...], "final": {...}}`` of the results contract (completed records)."""
        rounds = [self.public_record(r) for r in self.records if "_reg" not in r]
        final = dict(rounds[-1]) if rounds else {}
        final["tasks_never_replied"] = sorted(int(t) for t in np.flatnonzero(~self.ever_replied))
        final["complete"] = bool(rounds) and not final.get("tasks_missing")
        return {"rounds": rounds, "final": final}


def drain(replies: Iterable[Message]) -> None:
    """Let a streaming grid (the in-process engine's) deliver the messages whose replies the
    strategy did not read, as Flower delivers every message; other grids: nothing to do."""
    finish = getattr(replies, "drain", None)
    if callable(finish):
        finish()


def as_taken_by(grid: Grid, messages: Iterable[Message]) -> Iterable[Message]:
    """A round's messages as ``grid`` can take them: as they are (possibly a generator, made
    one at a time) for a grid that declares ``streams_messages`` (the in-process engine's
    grid, the packing adapter: one pass, delivering as it goes); a list for the others
    (Flower's ``HttpGrid.push_messages`` iterates them twice: checks, then sends)."""
    if getattr(grid, "streams_messages", False):
        return messages
    return list(messages)
