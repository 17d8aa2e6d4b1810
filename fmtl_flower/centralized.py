"""Baselines and MOCHA run centrally, without Flower: the same math and the same random streams.

:func:`fit_pooled_model` is the FedEM family's ``global`` baseline (one model on the pooled
training data).

:func:`fit_mocha` performs exactly the computation of the federated :class:`MOCHA` strategy
with its ClientApp (same budgets, drops, coordinate orders, aggregation order and Omega-steps),
so for the same seed it produces bit-identical models and objectives. It serves
cross-validation sweeps, benchmarks (the bare loop the engine overhead is measured against)
and parity tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .core.baselines import cocoa_local_update, mbsdca_local_update, mbsdca_scale
from .core.formulations import Formulation, make_formulation
from .core.hinge import classification_errors
from .core.losses import Loss, get_loss
from .core.mocha import MOCHAServerState, omega_step_due
from .core.rng import TAG_POOLED_INIT, coordinate_order
from .core.sdca import sdca_local_update
from .metrics import error_summary
from .settings import MOCHASettings, drop_prob_of
from .systems.heterogeneity import drop_mask, local_budgets
from .systems.timing import deadline_budgets

TaskArrays = tuple[np.ndarray, np.ndarray]


@dataclass
class MOCHAFit:
    """Result of :func:`fit_mocha`: the final server state, dual variables and history."""

    state: MOCHAServerState
    alphas: list[np.ndarray]
    history: list[dict] = field(default_factory=list)
    steps: list[np.ndarray] = field(default_factory=list)  # per round: steps of every task

    @property
    def W(self) -> np.ndarray:
        return self.state.W


def _objective(state: MOCHAServerState, tasks: Sequence[TaskArrays],
               alphas: list[np.ndarray], loss_fn: Loss) -> tuple[float, float]:
    loss = np.array([loss_fn.mean_value(X, y, state.W[:, t]) for t, (X, y) in enumerate(tasks)])
    dual = np.array([loss_fn.dual_mean(a, y) for a, (_, y) in zip(alphas, tasks, strict=True)])
    reg = state.regulariser()
    return float(loss.sum()) + reg, float(dual.sum()) - reg


def fit_mocha(
    tasks: Sequence[TaskArrays],
    settings: MOCHASettings | None = None,
    *,
    rounds: int,
    record_every: int = 0,
    test: Sequence[TaskArrays] | None = None,
    formulation: Formulation | None = None,
    **kwargs: Any,
) -> MOCHAFit:
    """Run ``rounds`` MOCHA rounds over in-memory tasks.

    Parameters
    ----------
    tasks : sequence of (X, y)
        Training data per task (validated float64 arrays, labels in {-1, +1}).
    settings : MOCHASettings, optional
        As for :class:`fmtl_flower.strategies.mocha.MOCHA` (lambda, formulation, method,
        local work, systems, seed); keyword arguments are its fields (``lam=1e-3``) and
        override it. The discovery, fault and node settings do not apply here.
    rounds : int
        Rounds to run.
    record_every : int
        Record primal, dual, gap (and test errors when ``test`` is given) of the state after
        every ``record_every`` rounds, and of the final state (0: final state only).
    test : sequence of (X, y), optional
        Test data per task for the recorded test errors.
    formulation : Formulation, optional
        A ready formulation (e.g. with a learned Omega) instead of building one from
        ``omega``, ``lam`` and the formulation options; it is used, and stepped, in place.
    """
    s = MOCHASettings.resolve(settings, kwargs)
    loss = get_loss(s.loss)
    m = len(tasks)
    dim = tasks[0][0].shape[1]
    n = np.array([X.shape[0] for X, _ in tasks], dtype=np.int64)
    sqnorms = [np.einsum("ij,ij->i", X, X) for X, _ in tasks]
    if formulation is None:
        formulation = make_formulation(s.omega, m, lam=s.lam, **s.formulation_options)
    state = MOCHAServerState.zeros(dim, formulation)
    fit = MOCHAFit(state, [np.zeros(k) for k in n])
    systems = _Systems(n=n, dim=dim, s=s)
    method, seed = s.method, s.seed
    for r in range(1, rounds + 1):
        if record_every and (r - 1) % record_every == 0:
            _record(fit, r - 1, tasks, test, loss)
        budgets, dropped, scale = systems.draw(r)
        m_diag = state.m_diag()
        sigma_p = state.sigma_prime(s.sigma_mode)
        delta_B = np.zeros((dim, m))
        steps = np.zeros(m, dtype=np.int64)
        for t, (X, y) in enumerate(tasks):
            if dropped[t] or budgets[t] == 0:
                continue
            order = coordinate_order(seed, t, r, int(n[t]))
            d_alpha, d_b, steps[t] = _local_update(
                method, X, y, fit.alphas[t], state.W[:, t].copy(), budget=int(budgets[t]),
                m_tt=float(m_diag[t]), sigma_prime=float(sigma_p[t]), theta=s.theta,
                order=order, sqnorm=sqnorms[t], scale=scale, loss=loss)
            if s.gamma != 1.0:
                d_alpha, d_b = s.gamma * d_alpha, s.gamma * d_b
            delta_B[:, t] = d_b
            fit.alphas[t] = fit.alphas[t] + d_alpha
        fit.steps.append(steps)
        state.add_updates(np.arange(m), delta_B)
        if omega_step_due(r, s.omega_every, rounds):
            state.omega_step()
    _record(fit, rounds, tasks, test, loss)
    return fit


@dataclass(frozen=True)
class _Systems:
    """The per-round budgets and drops of :func:`fit_mocha`, drawn as the strategy draws them."""

    n: np.ndarray
    dim: int
    s: MOCHASettings

    def draw(self, r: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Round ``r``'s (budgets, dropped mask, Mb-SDCA scale (1.0 for the others))."""
        s = self.s
        budgets = local_budgets(self.n, local_frac=s.local_frac, sys_het=s.sys_het,
                                base=s.sys_het_base, seed=s.seed, server_round=r)
        budgets = deadline_budgets(budgets, s.clock_cycle, self.dim, s.method, s.network,
                                   model=s.time_model, n=self.n if s.method == "cocoa" else None,
                                   loss=s.loss)
        dropped = drop_mask(self.n.size, drop_prob_of(s.drop_prob), seed=s.seed, server_round=r)
        scale = 1.0
        if s.method == "mb-sdca":
            budgets = np.minimum(budgets, self.n)
            scale = mbsdca_scale(s.beta, int(budgets[~dropped].sum()))
        return budgets, dropped, scale


def _local_update(method: str, X: np.ndarray, y: np.ndarray, alpha: np.ndarray,
                  w_t: np.ndarray, *, budget: int, m_tt: float, sigma_prime: float,
                  theta: float, order: np.ndarray, sqnorm: np.ndarray,
                  scale: float, loss: Loss) -> tuple[np.ndarray, np.ndarray, int]:
    """One task's local solver of ``method``: (Delta alpha_t, Delta b_t, steps taken)."""
    if method == "mocha":
        d_alpha, d_b = sdca_local_update(X, y, alpha, w_t, budget=budget, m_tt=m_tt,
                                         sigma_prime=sigma_prime, order=order, sqnorm=sqnorm,
                                         loss=loss)
        return d_alpha, d_b, budget
    if method == "cocoa":
        d_alpha, d_b, steps, _ = cocoa_local_update(
            X, y, alpha, w_t, m_tt=m_tt, sigma_prime=sigma_prime, theta=theta,
            max_steps=budget, order=order, sqnorm=sqnorm, loss=loss)
        return d_alpha, d_b, steps
    d_alpha, d_b = mbsdca_local_update(X, y, alpha, w_t, m_tt=m_tt, budget=budget, order=order,
                                       sqnorm=sqnorm, loss=loss)
    return scale * d_alpha, scale * d_b, budget


def _record(fit: MOCHAFit, k: int, tasks: Sequence[TaskArrays],
            test: Sequence[TaskArrays] | None, loss: Loss) -> None:
    primal, dual = _objective(fit.state, tasks, fit.alphas, loss)
    entry = {"round": k, "primal": primal, "dual": dual, "gap": primal - dual}
    if test is not None:
        entry.update(evaluate_models(fit.state.W, test))
    fit.history.append(entry)


def evaluate_models(W: np.ndarray, test: Sequence[TaskArrays]) -> dict:
    """Test-error summary (:func:`fmtl_flower.metrics.error_summary`) of models W (d, m)."""
    errors = np.array([classification_errors(X, y, W[:, t]) for t, (X, y) in enumerate(test)])
    counts = np.array([X.shape[0] for X, _ in test])
    return error_summary(errors, counts)


def fit_pooled_model(cfg, data, unseen: Sequence[int] = ()) -> dict:
    """The ``global`` baseline of the FedEM family: one model trained on the pooled data.

    The training tasks' training sets are pooled and the model family ``cfg.model_family``
    is trained centrally with the FedEM family's local solver settings for
    ``num_server_rounds * local_epochs`` epochs (seeded by ``cfg.seed``); every task is then
    evaluated with it, held-out tasks reported as ``unseen_accuracy_*``.
    """
    from .core.labels import labels_as_classes
    from .core.local_sgd import SGDConfig, sgd_epochs
    from .core.models import make_model

    held_out = set(int(t) for t in unseen)
    train = [t for t in range(data.num_tasks) if t not in held_out]
    X = np.vstack([data.tasks[t].X_train for t in train])
    y = labels_as_classes(np.concatenate([data.tasks[t].y_train for t in train]), "pooled")
    classes = max(2, int(y.max()) + 1)
    model = make_model(cfg.model_family, data.dim, num_classes=classes, hidden=cfg.hidden)
    rng = np.random.default_rng([cfg.seed, TAG_POOLED_INIT])
    params = model.init_params(rng)
    config = SGDConfig(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                       batch_size=cfg.batch_size,
                       epochs=cfg.num_server_rounds * cfg.local_epochs)
    params, _, _ = sgd_epochs(model, params, np.zeros_like(params), X, y, np.ones(y.size),
                              config, rng)
    out: dict = {}
    for prefix, tasks in (("", train), ("unseen_", sorted(held_out))):
        if not tasks:
            continue
        wrong, counts = [], []
        for t in tasks:
            task = data.tasks[t]
            y_test = labels_as_classes(task.y_test, f"task {t}")
            pred = np.argmax(model.predict_proba(params, task.X_test), axis=1)
            wrong.append(int(np.count_nonzero(pred != y_test)))
            counts.append(y_test.size)
        summary = error_summary(np.array(wrong), np.array(counts))
        if prefix:
            out["unseen_accuracy_mean"] = summary["accuracy_mean"]
            out["unseen_accuracy_bottom_decile"] = summary["accuracy_bottom_decile"]
        else:
            out.update(summary)
    return out
