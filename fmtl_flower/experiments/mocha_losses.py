"""MOCHA's losses: the federated run's certified gap against an independent optimum.

For each loss of :mod:`fmtl_flower.core.losses` other than the (non-smooth) hinge, MOCHA runs
as a federation (in-process engine: the ServerApp and the ClientApps of ``fmtl run``) with
Omega fixed, and its certified duality gap (every device's (loss-mean, dual-mean) pair passed
the certificate's check) is followed round by round. The optimum is then computed without
anything of MOCHA: scipy's L-BFGS on the same primal

    P(W) = sum_t (1/n_t) sum_i l(y_ti x_ti^T w_t) + (1/2) tr(W K W^T),

K the formulation's regulariser matrix, with the losses and their gradients written out again
here (:data:`LOSS_GRADIENTS`). A run passes when its relative gap (P - D) / P reaches
``target`` and its primal agrees with the L-BFGS optimum to ``target`` relative, with
D <= P_lbfgs (weak duality, a check of both solvers). ``simulations/mocha_losses.py`` prints
the table of docs/results.md ("MOCHA losses").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

TaskArrays = tuple[np.ndarray, np.ndarray]

__all__ = ["LOSS_GRADIENTS", "LossRun", "lbfgs_optimum", "primal_value", "run_loss"]


def _logistic(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.logaddexp(0.0, -z), -expit(-z)


def _squared(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return 0.5 * (1.0 - z) ** 2, z - 1.0


def _smoothed_hinge(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    value = np.where(z >= 1.0, 0.0, np.where(z <= 0.0, 0.5 - z, 0.5 * (1.0 - z) ** 2))
    slope = np.where(z >= 1.0, 0.0, np.where(z <= 0.0, -1.0, z - 1.0))
    return value, slope


#: l(z) and l'(z) of the smooth losses, apart from :mod:`fmtl_flower.core.losses`.
LOSS_GRADIENTS: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    "smoothed-hinge": _smoothed_hinge, "logistic": _logistic, "squared": _squared}


def primal_value(tasks: Sequence[TaskArrays], K: np.ndarray, W: np.ndarray,
                 loss: str) -> tuple[float, np.ndarray]:
    """P(W) and its gradient (d, m) for the smooth ``loss``."""
    f = LOSS_GRADIENTS[loss]
    total, grad = 0.0, W @ K
    for t, (X, y) in enumerate(tasks):
        value, slope = f(y * (X @ W[:, t]))
        total += float(value.mean())
        grad[:, t] += X.T @ (y * slope) / X.shape[0]
    return total + 0.5 * float(np.einsum("ij,ij->", W @ K, W)), grad


def lbfgs_optimum(tasks: Sequence[TaskArrays], K: np.ndarray, loss: str,
                  W0: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(P*, W*) by scipy's L-BFGS-B on :func:`primal_value` (no bounds), to its precision."""
    d, m = tasks[0][0].shape[1], len(tasks)
    start = np.zeros(d * m) if W0 is None else np.asarray(W0, dtype=float).ravel()

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = primal_value(tasks, K, x.reshape(d, m), loss)
        return value, grad.ravel()

    res = minimize(fun, start, jac=True, method="L-BFGS-B",
                   options={"maxiter": 100000, "maxfun": 200000, "maxcor": 30,
                            "ftol": 1e-15, "gtol": 1e-11})
    return float(res.fun), res.x.reshape(d, m)


@dataclass
class LossRun:
    """One federated run of a loss and its independent check."""

    dataset: str
    loss: str
    rounds: int
    rounds_to_target: int | None
    primal: float
    dual: float
    relative_gap: float
    certified: bool
    reference: float
    test_error: float

    @property
    def primal_error(self) -> float:
        """|P_MOCHA - P_lbfgs| / P_lbfgs."""
        return abs(self.primal - self.reference) / self.reference

    def passes(self, target: float) -> bool:
        """The run reached a certified relative gap <= target and agrees with the optimum."""
        return (self.certified and self.relative_gap <= target
                and self.primal_error <= target
                and self.dual <= self.reference * (1 + 1e-9))

    def row(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "loss": self.loss, "rounds": self.rounds,
                "rounds_to_target": self.rounds_to_target, "primal": self.primal,
                "dual": self.dual, "relative_gap": self.relative_gap,
                "certified": self.certified, "lbfgs_primal": self.reference,
                "primal_error": self.primal_error, "test_error": self.test_error}


def run_loss(dataset: str, loss: str, *, rounds: int, target: float = 1e-4,
             seed: int = 0, overrides: dict[str, Any] | None = None) -> LossRun:
    """Run MOCHA with ``loss`` on ``dataset`` for ``rounds`` rounds (Omega fixed: the run
    config's formulation with ``mocha.omega-every = 0``) and check it against L-BFGS.

    ``overrides``: run-config keys (``mocha.lambda``, ``mocha.omega``, sizes of
    ``synthetic``, ...)."""
    from ..apps.common import dataset_for
    from ..apps.run import run_federation
    from ..config import RunConfig, settings_from_config
    from ..core.formulations import make_formulation

    values = {"strategy": "mocha", "dataset": dataset, "num-server-rounds": rounds,
              "seed": seed, "mocha.loss": loss, "mocha.omega-every": 0, **(overrides or {})}
    cfg = RunConfig.from_mapping(values)
    data = dataset_for(cfg)
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    s = settings_from_config(cfg, data.num_tasks)
    K = make_formulation(s.omega, len(tasks), lam=s.lam,
                         **s.formulation_options).regulariser_matrix()
    reached: list[int] = []

    def on_round(record: dict[str, Any]) -> None:
        gap, primal = record.get("gap"), record.get("primal")
        if not reached and record.get("gap_certified") and gap is not None \
                and gap <= target * primal:
            reached.append(int(record["round"]))

    final = run_federation(cfg, data, on_round=on_round)["final"]
    reference, _ = lbfgs_optimum(tasks, K, loss)
    return LossRun(dataset, loss, rounds, reached[0] if reached else None,
                   float(final["primal"]), float(final["dual"]),
                   float(final["gap"]) / float(final["primal"]),
                   bool(final.get("gap_certified")), reference, float(final["test_error"]))
