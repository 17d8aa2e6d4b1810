"""FSVRG paper (Konečný et al. 2016), Figure 2: objective and test error vs rounds of
communication for GD, CoCoA+, FSVRG, FSVRG on reshuffled (IID) data, and the optimum.

Data: ``sparse-federated`` (K nodes, default 1000; :mod:`fmtl_flower.data.sparse_federated`),
lambda = 1/n as in the paper. The optimum P* is computed independently by scikit-learn's
``LogisticRegression(fit_intercept=False, C=1/(lambda n))`` on the pooled training data. The
methods run the core functions of :mod:`fmtl_flower.core.fsvrg` in the federated order (each
node's computation, then the server's), without Flower's per-message cost:

* ``gd``: one round trip per round (gradient sums), step 1/L with
  L = sigma_max(X)^2 / (4n) + lambda;
* ``cocoa-plus``: one round trip per round, one local SDCA pass per node (sigma' = K, adding);
* ``fsvrg``: two round trips per round (full gradient, then local passes with S_k and the
  aggregation with A), stepsize h = 16; plus one setup round trip for the sparsity statistics;
* ``fsvrg-iid``: the same on the rows reshuffled IID across the same node sizes (FSVRGR).

``exchanges`` counts server-client round trips so far. Also written: the naive predictors of
section 4.1 (all -1, the global optimum, per-node majority) and, per method, the round trips
needed to reach relative sub-optimality 1e-3.

Writes ``fsvrg-fig2.json`` (``{"optimum": P*, "rows": [{"method", "round", "exchanges",
"objective", "test_error_pooled"}], "naive": {...}, "to_1e-3": {...}, "config": {...}}``;
``test_error_pooled`` is the error over all test rows pooled, the paper's), the CSV of the rows
and a two-panel figure.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy.sparse.linalg import svds

from ..config import positive_int
from ..core.fsvrg import (
    cocoa_plus_aggregate,
    cocoa_plus_local_sdca,
    combine_feature_counts,
    fsvrg_aggregate,
    fsvrg_local_pass,
    gd_step,
    global_gradient,
    local_loss_grad_sums,
    logistic_objective,
    node_feature_counts,
    node_scaling,
    relative_suboptimality,
)
from ..core.rng import TAG_GD_POWER, coordinate_order
from .output import write_outputs

#: ``fmtl reproduce ... --set KEY=VALUE``: num_tasks (default 1000) and rounds (default 200).
OPTIONS = {"num_tasks": positive_int, "rounds": positive_int}
NAME = "fsvrg-fig2"
METHODS = ("gd", "cocoa-plus", "fsvrg", "fsvrg-iid")
logger = logging.getLogger("fmtl_flower")


class Pooled:
    """Pooled train and test matrices of a sparse dataset (for the objective and error only;
    the methods themselves use each node's own rows)."""

    def __init__(self, data: Any) -> None:
        self.X, self.y = data.pooled_train()
        self.Xt, self.yt = data.pooled_test()
        self.n = self.X.shape[0]

    def objective(self, w: np.ndarray, lam: float) -> float:
        return logistic_objective(self.X, self.y, w, lam)

    def test_error(self, w: np.ndarray) -> float:
        pred = np.where(self.Xt @ w > 0.0, 1.0, -1.0)
        return float(np.mean(pred != self.yt))


def optimum(pooled: Pooled, lam: float) -> tuple[float, np.ndarray]:
    """P* and w* by scikit-learn on the pooled training data (independent of our code)."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(fit_intercept=False, C=1.0 / (lam * pooled.n), tol=1e-10,
                             max_iter=10_000)
    clf.fit(pooled.X, pooled.y)
    w = clf.coef_.ravel().astype(np.float64)
    return pooled.objective(w, lam), w


def _full_gradient(tasks: list, w: np.ndarray, n: int, lam: float) -> np.ndarray:
    total = np.zeros_like(w)
    for t in tasks:
        total += local_loss_grad_sums(t.X_train, t.y_train, w)[1]
    return global_gradient(w, total, n, lam)


def sigma_max(X: Any, seed: int) -> float:
    """Largest singular value of ``X`` by ARPACK from a start vector drawn from
    ``[seed, TAG_GD_POWER]``: without ``v0`` scipy draws a fresh random start each call and the
    result differs between runs in the last bit."""
    v0 = np.random.default_rng([int(seed), TAG_GD_POWER]).standard_normal(min(X.shape))
    return float(svds(X, k=1, v0=v0, return_singular_vectors=False)[0])


def run_gd(data: Any, pooled: Pooled, lam: float, rounds: int, seed: int = 0, **_: Any):
    """Distributed GD: yields (round, exchanges, w)."""
    sigma = sigma_max(pooled.X, seed)
    step = 1.0 / (sigma**2 / (4 * pooled.n) + lam)
    w = np.zeros(pooled.X.shape[1])
    yield 0, 0, w
    for r in range(1, rounds + 1):
        w = gd_step(w, _full_gradient(list(data.tasks), w, pooled.n, lam), step)
        yield r, r, w


def run_cocoa_plus(data: Any, pooled: Pooled, lam: float, rounds: int, seed: int = 0, **_: Any):
    """CoCoA+ (adding, sigma' = K): one local SDCA pass per node and round."""
    tasks = list(data.tasks)
    K = len(tasks)
    alphas = [np.zeros(t.n_train) for t in tasks]
    w = np.zeros(pooled.X.shape[1])
    yield 0, 0, w
    for r in range(1, rounds + 1):
        d_w_sum = np.zeros_like(w)
        for k, t in enumerate(tasks):
            d_alpha, d_w = cocoa_plus_local_sdca(
                t.X_train, t.y_train, alphas[k], w, lam=lam, n=pooled.n, sigma_prime=K,
                order=coordinate_order(seed, k, r, t.n_train))
            alphas[k] = alphas[k] + d_alpha
            d_w_sum += d_w
        w = cocoa_plus_aggregate(w, d_w_sum)
        yield r, r, w


def run_fsvrg(data: Any, pooled: Pooled, lam: float, rounds: int, seed: int = 0,
              h: float = 16.0, **_: Any):
    """FSVRG (Algorithm 4): a setup round trip (counts), then two per round."""
    tasks = list(data.tasks)
    counts = [node_feature_counts(t.X_train) for t in tasks]
    stats = combine_feature_counts(counts)
    scalings = [node_scaling(stats.phi, n_k, c) for n_k, c in counts]
    sizes = [t.n_train for t in tasks]
    w = np.zeros(pooled.X.shape[1])
    yield 0, 1, w
    for r in range(1, rounds + 1):
        grad = _full_gradient(tasks, w, stats.n, lam)
        models = [fsvrg_local_pass(t.X_train, t.y_train, w, grad, lam=lam, h=h, s=scalings[k],
                                   order=coordinate_order(seed, k, r, t.n_train))
                  for k, t in enumerate(tasks)]
        w = fsvrg_aggregate(w, models, sizes, stats.a, n=stats.n)
        yield r, 1 + 2 * r, w


RUNNERS = {"gd": run_gd, "cocoa-plus": run_cocoa_plus, "fsvrg": run_fsvrg,
           "fsvrg-iid": run_fsvrg}


def _to_target(rows: list[dict[str, Any]], optimum_value: float, target: float) -> dict:
    for r in rows:
        if relative_suboptimality(r["objective"], optimum_value) <= target:
            return {"round": r["round"], "exchanges": r["exchanges"]}
    return {"round": None, "exchanges": None}


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """Relative sub-optimality and test error vs round trips."""
    p_star = payload["optimum"]
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for method in METHODS:
        rows = [r for r in payload["rows"] if r["method"] == method]
        if not rows:
            continue
        x = [r["exchanges"] for r in rows]
        ax1.semilogy(x, [max((r["objective"] - p_star) / abs(p_star), 1e-12) for r in rows],
                     label=method)
        ax2.plot(x, [r["test_error_pooled"] for r in rows], label=method)
    ax2.axhline(payload["naive"]["optimum"], color="k", ls="--", lw=1, label="optimum")
    ax2.axhline(payload["naive"]["node_majority"], color="grey", ls=":", lw=1,
                label="per-node majority")
    ax1.set_xlabel("round trips")
    ax1.set_ylabel("(f(w) - P*) / P*")
    ax2.set_xlabel("round trips")
    ax2.set_ylabel("test error")
    ax1.set_title(f"objective, K = {payload['config']['num_tasks']}")
    ax2.set_title("test error")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)


def run(out_dir: Path, quick: bool = False, shuffles: int | None = None,
        datasets: list[str] | None = None, num_tasks: int | None = None,
        rounds: int | None = None, methods: tuple[str, ...] = METHODS,
        name: str = NAME) -> dict[str, Any]:
    """Run the methods and write the outputs (see the module docstring).

    ``num_tasks``, ``rounds`` (FSVRG's; GD and CoCoA+ get the same number of round trips),
    ``methods`` (a subset of :data:`METHODS`) and ``name`` (of the output files) serve the
    scale run (``simulations/fsvrg_scale.py``).
    """
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {methods}")
    from ..data import load_dataset
    from ..data.sparse_federated import constant_error, majority_vote_error

    if datasets and list(datasets) != ["sparse-federated"]:
        raise ValueError("fsvrg-fig2 runs on sparse-federated only")
    K = num_tasks or (30 if quick else 1000)
    R = rounds or (6 if quick else 200)
    seed = 0
    started = time.perf_counter()
    data = load_dataset("sparse-federated", num_tasks=K, seed=seed)
    pooled = Pooled(data)
    lam = 1.0 / pooled.n
    p_star, w_star = optimum(pooled, lam)
    data_iid = pooled_iid = p_star_iid = None
    if "fsvrg-iid" in methods:
        data_iid = load_dataset("sparse-federated", num_tasks=K, seed=seed, iid=True)
        pooled_iid = Pooled(data_iid)
        p_star_iid, _ = optimum(pooled_iid, lam)
    naive = {"all_minus_one": constant_error(data), "optimum": pooled.test_error(w_star),
             "node_majority": majority_vote_error(data)}
    rows: list[dict[str, Any]] = []
    targets: dict[str, dict] = {}
    for method in methods:
        d, pool, p = (data_iid, pooled_iid, p_star_iid) if method == "fsvrg-iid" else \
            (data, pooled, p_star)
        t0 = time.perf_counter()
        # GD and CoCoA+ use one round trip per round: give them FSVRG's number of round trips
        method_rounds = R if method.startswith("fsvrg") else 2 * R + 1
        mrows = []
        for r, exchanges, w in RUNNERS[method](d, pool, lam, method_rounds, seed=seed):
            mrows.append({"method": method, "round": r, "exchanges": exchanges,
                          "objective": pool.objective(w, lam),
                          "test_error_pooled": pool.test_error(w)})
        rows += mrows
        targets[method] = {**_to_target(mrows, p, 1e-3),
                           "final_relative_suboptimality": relative_suboptimality(
                               mrows[-1]["objective"], p),
                           "seconds": time.perf_counter() - t0}
        logger.info("%s: final relative sub-optimality %.3e, 1e-3 after %s round trips [%.0f s]",
                    method, targets[method]["final_relative_suboptimality"],
                    targets[method]["exchanges"], targets[method]["seconds"])
    payload = {"optimum": p_star, "optimum_iid": p_star_iid, "rows": rows, "naive": naive,
               "to_1e-3": targets,
               "config": {"num_tasks": K, "rounds": R, "lambda": lam, "n": pooled.n,
                          "dim": int(pooled.X.shape[1]), "seed": seed, "h": 16.0,
                          "quick": quick, "wall_time_s": time.perf_counter() - started}}
    write_outputs(Path(out_dir), name, payload, plot)
    return payload


def format_table(payload: dict[str, Any]) -> str:
    """Round trips to 1e-3 relative sub-optimality and the final values."""
    lines = [f"P* = {payload['optimum']:.6f} (K = {payload['config']['num_tasks']}, "
             f"lambda = 1/n = {payload['config']['lambda']:.3g})",
             f"{'method':11s} {'to 1e-3 (round trips)':>22s} {'final rel. sub-opt':>19s}"]
    for method, t in payload["to_1e-3"].items():
        reached = "-" if t["exchanges"] is None else str(t["exchanges"])
        lines.append(f"{method:11s} {reached:>22s} {t['final_relative_suboptimality']:19.3e}")
    n = payload["naive"]
    lines.append(f"naive test errors: all -1 {n['all_minus_one']:.4f}, optimum "
                 f"{n['optimum']:.4f}, per-node majority {n['node_majority']:.4f}")
    return "\n".join(lines)


__all__ = ["METHODS", "NAME", "format_table", "run"]
