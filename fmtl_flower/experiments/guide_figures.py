"""The strategy guides' figures that no reproduction draws, at sizes that run in under a minute.

``python -m fmtl_flower.experiments.guide_figures {mocha,fedem} --out docs/guides/figures``
prints the numbers it plots and writes ``mocha-learns.png`` / ``fedem-learns.png``:

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

* ``fedem``: what FedEM learns. Twelve clients whose labels come from a client-specific
  mixture of two linear rules (client t follows rule 0 with probability pi_t, drawn from
  Dirichlet(0.4, 0.4); 60-160 training and 300 test rows in d = 6), federated in-process for
  15 rounds by FedEM (M = 2 components), FedAvg and local training (the FedEM strategy's
  ``method``, lr 0.5, batch 32). Left: mean test accuracy per round. Right: each client's
  learned weight of the component closest to rule 0 (its mean E-step responsibility in the
  last round, as the client reports it) against its true pi_t.

The OFMTL guide's figure is the OFMTL reproduction at its quick size
(``fmtl reproduce ofmtl-arrivals --quick --datasets small``); the FSVRG guide's is its
family's reproduction figure (``docs/results/fsvrg-fig2.png``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import fit_mocha
from ..clients.fedem import make_fedem_client_app
from ..clients.mocha import default_task_id
from ..core.svm import fit_global_svm, fit_local_svms
from ..data import make_synthetic_tasks, train_test_split_task
from ..engine import InProcessGrid
from ..model_selection import cross_validate_lambda
from ..strategies.fedem import FedEM
from ..wire import from_array

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


def mixture_clients(num_clients: int = 12, dim: int = 6, seed: int = 0
                    ) -> tuple[list[tuple[np.ndarray, ...]], np.ndarray, np.ndarray]:
    """(per client (X, y, X_test, y_test), true pi (clients, 2), the rules (2, dim)): client
    t labels a row by rule 0 (``x . theta_0 > 0``) with probability pi_t0, else by rule 1."""
    rng = np.random.default_rng(seed)
    rules = rng.normal(size=(2, dim)) * 4
    pis = rng.dirichlet([0.4, 0.4], size=num_clients)
    data = []
    for t in range(num_clients):
        parts: list[np.ndarray] = []
        for n in (int(rng.integers(60, 160)), 300):
            X = rng.uniform(-1, 1, size=(n, dim))
            by_rule_0 = rng.random(n) < pis[t, 0]
            y = np.where(by_rule_0, X @ rules[0] > 0, X @ rules[1] > 0).astype(float)
            parts += [X, y]
        data.append(tuple(parts))
    return data, pis, rules


def fedem_learns(rounds: int = 15, seed: int = 0) -> dict[str, Any]:
    """The numbers of the FedEM guide's figure (module docstring)."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    data, pis, rules = mixture_clients(seed=seed)
    app = make_fedem_client_app(lambda context: data[default_task_id(context)])
    last_train: dict[int, dict[str, np.ndarray]] = {}

    def client(message: Any, context: Any) -> Any:
        reply = app(message, context)
        if message.metadata.message_type == "train" and reply.has_content():
            last_train[default_task_id(context)] = {
                key: from_array(value) for key, value in reply.content["arrays"].items()}
        return reply

    accuracy = {}
    for method, options in (("fedem", {"num_components": 2}), ("fedavg", {}), ("local", {})):
        strategy = FedEM(len(data), method=method, lr=0.5, batch_size=32, seed=seed,
                         discovery_timeout=5.0, **options)
        strategy.start(grid=InProcessGrid(client, len(data)), num_rounds=rounds, timeout=60.0)
        accuracy[method] = [(r["round"], r["accuracy_mean"])
                            for r in strategy.results()["rounds"]
                            if r.get("accuracy_mean") is not None]
        if method == "fedem":
            fedem_replies = dict(last_train)
    components = fedem_replies[0]["components"][:, :-1]  # (M, d): the bias dropped
    cosine = components @ rules[0] / np.linalg.norm(components, axis=1)
    rule_0 = int(np.argmax(cosine))
    learned = np.array([fedem_replies[t]["responsibility"][rule_0] for t in range(len(data))])
    return {"accuracy": accuracy, "true_pi": pis[:, 0], "learned_pi": learned,
            "cosine": float(cosine[rule_0] / np.linalg.norm(rules[0]))}


def plot_fedem(fig: Any, result: dict[str, Any]) -> None:
    """Left: mean test accuracy per round; right: learned vs true mixture weight."""
    ax = fig.add_subplot(1, 2, 1)
    for method, points in result["accuracy"].items():
        label = "FedEM (M = 2)" if method == "fedem" else method
        ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("mean test accuracy")
    ax.set_title("accuracy per round", fontsize=9)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    ax.plot([0, 1], [0, 1], "k:", lw=0.8, label="learned = true")
    ax.scatter(result["true_pi"], result["learned_pi"], s=18, label="a client")
    ax.set_xlabel("true weight of rule 0 (pi_t)")
    ax.set_ylabel("learned weight of its component")
    ax.set_title("each client's mixture weight", fontsize=9)
    ax.legend(fontsize=8)


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
    parser.add_argument("figure", choices=["mocha", "fedem"])
    parser.add_argument("--out", type=Path, default=Path("docs/guides/figures"))
    args = parser.parse_args(argv)
    if args.figure == "mocha":
        result = mocha_learns()
        print(mocha_summary(result))
        path = args.out / "mocha-learns.png"
        write_png(path, plot_mocha, result)
    else:
        result = fedem_learns()
        print(fedem_summary(result))
        path = args.out / "fedem-learns.png"
        write_png(path, plot_fedem, result)
    print(f"written {path}")
    return 0


def mocha_summary(result: dict[str, Any]) -> str:
    """What the MOCHA figure shows, in numbers."""
    means = ", ".join(f"{m} {e.mean():.3f}" for m, e in result["errors"].items())
    size = NUM_TASKS // NUM_CLUSTERS
    block = np.arange(NUM_TASKS) // size  # tasks ordered by cluster
    corr = result["correlations"]
    same = corr[(block[:, None] == block[None, :]) & ~np.eye(NUM_TASKS, dtype=bool)]
    other = corr[block[:, None] != block[None, :]]
    return (f"mean test error over {NUM_TASKS} tasks: {means}; lambda (3-fold CV): "
            f"{result['lambda']}; MOCHA's duality gap {result['gap']:.2e}\n"
            f"learned correlation: same cluster mean {same.mean():.2f}, other clusters mean "
            f"{other.mean():.2f}")


def fedem_summary(result: dict[str, Any]) -> str:
    """What the FedEM figure shows, in numbers."""
    final = ", ".join(f"{m} {points[-1][1]:.3f}" for m, points in result["accuracy"].items())
    gap = np.abs(result["learned_pi"] - result["true_pi"])
    return (f"mean test accuracy after {result['accuracy']['fedem'][-1][0]} rounds: {final}\n"
            f"learned mixture weight vs true: mean |difference| {gap.mean():.3f}, largest "
            f"{gap.max():.3f}; the matched component's cosine with rule 0 "
            f"{result['cosine']:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
