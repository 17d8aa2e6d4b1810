"""The strategy guides' figures that no reproduction draws, at sizes that run in under a minute.

``python -m fmtl_flower.experiments.guide_figures mocha --out docs/guides/figures`` prints the
numbers it plots and writes ``mocha-learns.png``:

* ``mocha``: what MOCHA learns. Twelve synthetic tasks in three clusters
  (:func:`~fmtl_flower.data.make_synthetic_tasks`: task t in cluster t mod 3, d = 10, about
  20 training rows per task, half of each task held out for test), fitted by MOCHA
  (probabilistic formulation, 200 rounds, an Omega-step every 20;
  :func:`~fmtl_flower.centralized.fit_mocha`, the federation's computation), by one SVM per
  task (local) and by one SVM on the pooled data (global), each with its lambda chosen by
  3-fold cross-validation on the training rows
  (:func:`~fmtl_flower.model_selection.cross_validate_lambda`). Left: the task correlations
  of MOCHA's learned Sigma, tasks ordered by cluster (the clusters were never given to it).
  Right: each task's test error under the three models.

The OFMTL guide's figure is the OFMTL reproduction at its quick size
(``fmtl reproduce ofmtl-arrivals --quick --datasets small``); the other guides show their
family's reproduction figure (``docs/results/``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import fit_mocha
from ..core.svm import fit_global_svm, fit_local_svms
from ..data import make_synthetic_tasks, train_test_split_task
from ..model_selection import cross_validate_lambda

NUM_TASKS, NUM_CLUSTERS, DIM = 12, 3, 10
MOCHA_OPTIONS = {"rounds": 200, "omega": "probabilistic", "omega_every": 20}
LAMBDA_GRID = (1e-3, 1e-2, 1e-1, 1.0)


def clustered_tasks(seed: int = 0) -> tuple[list, list]:
    """(train, test): per task (X, y), half of each task's rows held out for test."""
    Xs, ys = make_synthetic_tasks(num_tasks=NUM_TASKS, dim=DIM, samples_per_task=40,
                                  num_clusters=NUM_CLUSTERS, seed=seed)
    train, test = [], []
    for t, (X, y) in enumerate(zip(Xs, ys, strict=True)):
        split = train_test_split_task(X, y, 0.5, np.random.default_rng([seed, t]))
        train.append((split.X_train, split.y_train))
        test.append((split.X_test, split.y_test))
    return train, test


def task_errors(W: np.ndarray, test: list) -> np.ndarray:
    """Each task's test error of its column of ``W`` (a score of 0 counts as an error)."""
    return np.array([np.mean(np.sign(X @ W[:, t]) != y) for t, (X, y) in enumerate(test)])


def correlations(sigma: np.ndarray) -> np.ndarray:
    """Sigma as a correlation matrix: Sigma_ij / sqrt(Sigma_ii Sigma_jj)."""
    scale = np.sqrt(np.diag(sigma))
    return sigma / np.outer(scale, scale)


def mocha_learns(seed: int = 0) -> dict[str, Any]:
    """The numbers of the MOCHA guide's figure (module docstring)."""
    train, test = clustered_tasks(seed)
    lam = {method: cross_validate_lambda(method, train, grid=LAMBDA_GRID, folds=3, seed=seed,
                                         **MOCHA_OPTIONS)[0]
           for method in ("mtl", "local", "global")}
    fit = fit_mocha(train, lam=lam["mtl"], seed=seed, **MOCHA_OPTIONS)
    errors = {"global": task_errors(fit_global_svm(train, lam["global"], seed=seed), test),
              "local": task_errors(fit_local_svms(train, lam["local"], seed=seed), test),
              "mocha": task_errors(fit.W, test)}
    order = np.argsort(np.arange(NUM_TASKS) % NUM_CLUSTERS, kind="stable")
    corr = correlations(fit.state.formulation.omega)[np.ix_(order, order)]
    return {"lambda": lam, "errors": errors, "order": order, "correlations": corr,
            "gap": fit.history[-1]["gap"], "train_rows": [len(y) for _, y in train]}


def plot_mocha(fig: Any, result: dict[str, Any]) -> None:
    """Left: learned task correlations (clusters ordered); right: per-task test error."""
    ax = fig.add_subplot(1, 2, 1)
    image = ax.imshow(result["correlations"], cmap="RdBu_r", vmin=-1, vmax=1)
    labels = [f"{t}" for t in result["order"]]
    ax.set_xticks(range(NUM_TASKS), labels, fontsize=7)
    ax.set_yticks(range(NUM_TASKS), labels, fontsize=7)
    size = NUM_TASKS // NUM_CLUSTERS
    for k in range(1, NUM_CLUSTERS):
        ax.axhline(k * size - 0.5, color="k", lw=0.8)
        ax.axvline(k * size - 0.5, color="k", lw=0.8)
    ax.set_title("learned task correlations\n(tasks by true cluster, t mod 3)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax = fig.add_subplot(1, 2, 2)
    width = 0.27
    x = np.arange(NUM_TASKS)
    for i, method in enumerate(("global", "local", "mocha")):
        errors = result["errors"][method][result["order"]]
        lam = result["lambda"]["mtl" if method == "mocha" else method]
        ax.bar(x + (i - 1) * width, errors, width,
               label=f"{method}: mean {errors.mean():.3f} (lambda {lam:g})")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_xlabel("task (by cluster)")
    ax.set_ylabel("test error")
    ax.set_title("per-task test error", fontsize=9)
    ax.set_ylim(0.0, 1.0)
    ax.legend(fontsize=7, loc="upper left")


def write_png(path: Path, plot: Any, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(9, 3.8))
    plot(fig, result)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figure", choices=["mocha"])
    parser.add_argument("--out", type=Path, default=Path("docs/guides/figures"))
    args = parser.parse_args(argv)
    result = mocha_learns()
    means = ", ".join(f"{m} {e.mean():.3f}" for m, e in result["errors"].items())
    print(f"mean test error over {NUM_TASKS} tasks: {means}; lambda (3-fold CV): "
          f"{result['lambda']}; MOCHA's duality gap {result['gap']:.2e}")
    size = NUM_TASKS // NUM_CLUSTERS
    same = [result["correlations"][i, j] for i in range(NUM_TASKS) for j in range(NUM_TASKS)
            if i != j and i // size == j // size]
    other = [result["correlations"][i, j] for i in range(NUM_TASKS)
             for j in range(NUM_TASKS) if i // size != j // size]
    print(f"learned correlation: same cluster mean {np.mean(same):.2f}, other clusters "
          f"mean {np.mean(other):.2f}")
    path = args.out / "mocha-learns.png"
    write_png(path, plot_mocha, result)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
