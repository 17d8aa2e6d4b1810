"""What every per-task strategy shares: its run length, node directory and results contract."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

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

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Run ``num_rounds`` rounds plus a final metrics round (see ``Strategy.start``)."""
        self.num_rounds = int(num_rounds)
        self.round_timeout = float(timeout)
        if initial_arrays is None:
            initial_arrays = ArrayRecord()
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                             evaluate_config, evaluate_fn)

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
