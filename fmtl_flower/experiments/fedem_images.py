"""FedEM on images with a small CNN through the torch backend, offline: FedEM vs FedAvg vs Local.

The data are :func:`fmtl_flower.data.fedem_images.relabelled_mixture`: generated class-
prototype images split among the clients by the authors' Dirichlet(0.4) label split
(CIFAR-10 / EMNIST protocol) or by Pachinko allocation (CIFAR-100 protocol), then relabelled
by M = 3 components (label permutations; client mixture weights pi ~ Dirichlet(0.4)). Every
run is a real Flower federation (the FedEM strategy with ``model="torch"`` and the ClientApp
of :func:`fmtl_flower.clients.fedem_torch.make_fedem_torch_client_app`) on the in-process
engine. 20 % of the clients are held out: they never train and, for FedEM, fit only pi by EM
(``unseen_accuracy_mean``). With ``--set dataset=cifar10`` or ``dataset=emnist`` the same
protocol runs on a local copy of the real dataset (Dirichlet split, no relabelling), which
is never downloaded.

Writes ``fedem-images.json`` (``{"rows": [{"method", "split", "seed", "accuracy_mean",
"accuracy_bottom_decile", "unseen_accuracy_mean", ...}], "summary", "config"}``), the CSV of
the rows and a bar chart.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..config import as_float, positive_int
from ..core.rng import TAG_IMAGES_SUBSAMPLE, TAG_IMAGES_UNSEEN
from .output import write_outputs

NAME = "fedem-images"
METHODS = ("local", "fedavg", "fedem")
SPLITS = ("dirichlet", "pachinko")
DATASETS = ("generated", "cifar10", "emnist")
logger = logging.getLogger("fmtl_flower")


def _dataset(key: str, text: str) -> str:
    if text not in DATASETS:
        raise ValueError(f"{key} must be one of {DATASETS}, got {text!r}")
    return text


def _split(key: str, text: str) -> str:
    if text not in (*SPLITS, "both"):
        raise ValueError(f"{key} must be one of {(*SPLITS, 'both')}, got {text!r}")
    return text


#: ``fmtl reproduce fedem-images --set KEY=VALUE``.
OPTIONS = {"rounds": positive_int, "clients": positive_int, "samples": positive_int,
           "lr": lambda k, t: as_float(k, t, 0.0, lo_open=True), "split": _split,
           "dataset": _dataset}


def small_cnn(channels: int, size: int, num_classes: int, seed: int):
    """Two 3x3 conv layers (8 and 16 channels, ReLU, 2x2 max-pool) and a linear layer."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    side = size // 4
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * side * side, num_classes))


def load_tasks(dataset: str, split: str, clients: int, samples: int, seed: int):
    """The federated image data (see the module docstring)."""
    from ..data import fedem_images as fi

    if dataset == "generated":
        return fi.relabelled_mixture(num_clients=clients, samples=samples, split=split,
                                     seed=seed)
    X, y, X_test, y_test = fi.load_cifar10() if dataset == "cifar10" else fi.load_emnist()
    X, y = np.concatenate([X, X_test]), np.concatenate([y, y_test])
    rng = np.random.default_rng([seed, TAG_IMAGES_SUBSAMPLE])
    keep = rng.permutation(y.size)[:clients * samples]
    X, y = X[keep], y[keep]
    parts = fi.dirichlet_label_split(y, clients, 0.4, rng)
    return fi.train_test_tasks(X, y, parts, 0.2, rng, int(y.max()) + 1)


def run_one(tasks, method: str, rounds: int, lr: float, seed: int,
            unseen: list[int]) -> dict[str, Any]:
    """One federation of ``method`` on ``tasks``; its final metrics."""
    import flwr.common.logger  # noqa: F401  - configure Flower's logger, then quieten it
    import torch
    from flwr.app import ArrayRecord
    from flwr.serverapp import ServerApp

    from ..clients.fedem_torch import make_fedem_torch_client_app
    from ..clients.mocha import default_task_id
    from ..engine import run_inprocess
    from ..strategies.fedem import FedEM

    logging.getLogger("flwr").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    channels, size = tasks.X[0].shape[1], tasks.X[0].shape[2]
    M = 3 if method == "fedem" else 1

    def model_fn():
        return small_cnn(channels, size, tasks.num_classes, seed)

    def load(context):
        t = default_task_id(context)
        return tasks.X[t], tasks.y[t], tasks.X_test[t], tasks.y_test[t]

    initial = [ArrayRecord(small_cnn(channels, size, tasks.num_classes,
                                     1000 * seed + m).state_dict()) for m in range(M)]
    strategy = FedEM(tasks.num_tasks, method=method, num_components=M, model="torch",
                     initial_components=initial, num_classes=tasks.num_classes, lr=lr,
                     batch_size=32, local_epochs=1, momentum=0.9, weight_decay=5e-4,
                     unseen_tasks=[] if method == "local" else unseen, eval_every=1000,
                     seed=seed, discovery_timeout=30.0)
    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=3600.0)

    started = time.perf_counter()
    run_inprocess(server, make_fedem_torch_client_app(model_fn, load), tasks.num_tasks)
    final = strategy.results()["final"]
    return {key: final.get(key) for key in (
        "accuracy_mean", "accuracy_bottom_decile", "unseen_accuracy_mean",
        "unseen_accuracy_bottom_decile", "train_loss")} | {
        "rounds": rounds, "wall_time_s": time.perf_counter() - started}


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """Average test accuracy per method and split (held-out clients hatched)."""
    ax = fig.add_subplot(1, 1, 1)
    rows = payload["summary"]
    labels = [f"{r['method']}\n{r['split']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["accuracy_mean"] for r in rows], 0.4, label="training clients")
    ax.bar(x + 0.2, [r["unseen_accuracy_mean"] or 0.0 for r in rows], 0.4, hatch="//",
           label="unseen clients")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("average test accuracy")
    ax.set_title(f"FedEM on images ({payload['config']['dataset']}), small CNN")
    ax.legend(fontsize=8)


def run(out_dir: Path, quick: bool = False, shuffles: int | None = None,
        datasets: list[str] | None = None, rounds: int | None = None,
        clients: int | None = None, samples: int | None = None, lr: float = 0.1,
        split: str = "both", dataset: str = "generated") -> dict[str, Any]:
    """Run FedEM, FedAvg and Local on every split and write the outputs.

    ``quick``: 10 clients of 120 samples, 10 rounds, the Dirichlet split only, one seed;
    full: 24 clients of 200 samples, 50 rounds, both splits, ``shuffles`` seeds (default 3;
    the seed draws the data, the initial components and the mini-batch orders). The same lr
    (0.1, batch 32, momentum 0.9, weight decay 5e-4, one local epoch) for every method.
    """
    if datasets:
        raise ValueError("fedem-images takes its data from --set dataset=...")
    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise ValueError(f"fedem-images needs torch ({err}): pip install "
                         '"fmtl-flower[torch]"') from err
    rounds = rounds or (10 if quick else 50)
    clients = clients or (10 if quick else 24)
    samples = samples or (120 if quick else 200)
    splits = ["dirichlet"] if quick and split == "both" else (
        list(SPLITS) if split == "both" else [split])
    if dataset != "generated":
        splits = ["dirichlet"]
    seeds = shuffles or (1 if quick else 3)
    started = time.perf_counter()
    rows = []
    for seed in range(seeds):
        for sp in splits:
            tasks = load_tasks(dataset, sp, clients, samples, seed)
            unseen = np.random.default_rng([seed, TAG_IMAGES_UNSEEN]).permutation(tasks.num_tasks)[
                :max(1, tasks.num_tasks // 5)].tolist()
            for method in METHODS:
                result = run_one(tasks, method, rounds, lr, seed, sorted(unseen))
                row = {"method": method, "split": sp, "seed": seed, **result}
                rows.append(row)
                unseen_acc = row["unseen_accuracy_mean"]
                logger.info("%s %s seed %d: accuracy %.4f / bottom decile %.4f%s [%.0f s]",
                            method, sp, seed, row["accuracy_mean"],
                            row["accuracy_bottom_decile"],
                            "" if unseen_acc is None else f" / unseen {unseen_acc:.4f}",
                            row["wall_time_s"])
    summary = []
    for sp in splits:
        for method in METHODS:
            sel = [r for r in rows if r["split"] == sp and r["method"] == method]
            entry = {"method": method, "split": sp, "seeds": len(sel)}
            for key in ("accuracy_mean", "accuracy_bottom_decile", "unseen_accuracy_mean"):
                values = [r[key] for r in sel if r[key] is not None]
                entry[key] = float(np.mean(values)) if values else None
                entry[f"{key}_se"] = (float(np.std(values, ddof=1) / np.sqrt(len(values)))
                                      if len(values) > 1 else None)
            summary.append(entry)
    payload = {"rows": rows, "summary": summary, "config": {
        "quick": quick, "dataset": dataset, "splits": splits, "seeds": seeds,
        "rounds": rounds, "clients": clients, "samples_per_client": samples, "lr": lr,
        "batch_size": 32, "momentum": 0.9, "weight_decay": 5e-4, "M": 3,
        "alpha": 0.4, "mix_alpha": 0.4, "held_out_frac": 0.2,
        "wall_time_s": time.perf_counter() - started}}
    write_outputs(Path(out_dir), NAME, payload, plot)
    return payload


def format_table(payload: dict[str, Any]) -> str:
    """The summary as text (percent)."""
    def pct(v: Any) -> str:
        return "   -" if v is None else f"{100 * v:5.1f}"

    lines = [f"{'method':8s} {'split':10s} {'average':>8s} {'bottom 10%':>10s} {'unseen':>7s}"]
    for s in payload["summary"]:
        lines.append(f"{s['method']:8s} {s['split']:10s} {pct(s['accuracy_mean']):>8s} "
                     f"{pct(s['accuracy_bottom_decile']):>10s} "
                     f"{pct(s['unseen_accuracy_mean']):>7s}")
    return "\n".join(lines)
