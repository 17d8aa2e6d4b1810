"""FedEM poster, Table 1 synthetic row, plus the axes of its Figure 1 and unseen clients.

Every run is a real Flower federation (the FedEM strategy and ClientApp on the in-process
engine) on ``fedem-synthetic`` with the released generator (the data the poster's numbers
come from: 300 clients, M = 3, d = 150, seed 12345), with the run-config defaults of
:class:`fmtl_flower.config.RunConfig` (the tuned values, see ``simulations/fedem_tune.py``),
i.e. what ``fmtl run METHOD --dataset fedem-synthetic --seed S`` does. The seed changes the
initial components, client sampling and mini-batch orders; the data stay the paper's.

* ``rows``: Local, FedAvg, FedProx, FedAvg+ (fedavg-ft), clustered FL (IFCA) and FedEM, one
  row per seed: weighted mean / bottom-decile test accuracy over the clients (the authors'
  metrics), beside the poster's numbers (``summary``);
* ``m_sweep``: FedEM's accuracy against the number of components M (M = 1 is FedAvg);
* ``sampling_sweep``: against the client sampling rate, with the authors' aggregation (over
  all clients) and the unbiased one (over the sampled clients);
* ``unseen``: 20 % of the clients held out (``fedem.train-tasks-frac=0.8``, the poster's
  protocol); they never train and, for FedEM, fit only pi by EM on their own training split.

Writes ``fedem-table1.json`` (``{"rows": [{"method", "seed", "accuracy_mean",
"accuracy_bottom_decile", ...}], "summary", "m_sweep", "sampling_sweep", "unseen",
"config"}``), the CSV of the rows, and a 2 x 2 figure.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RunConfig, positive_int
from .output import write_outputs

#: ``fmtl reproduce ... --set KEY=VALUE``: jobs (worker processes).
OPTIONS = {"jobs": positive_int}
NAME = "fedem-table1"
METHODS = ("local", "fedavg", "fedprox", "fedavg-ft", "clustered", "fedem")
#: The poster's Table 1, synthetic row (average / bottom-decile test accuracy, %).
POSTER = {"local": (65.7, 58.4), "fedavg": (68.2, 58.9), "fedprox": (68.2, 59.0),
          "fedavg-ft": (68.9, 60.2), "clustered": (69.1, 59.0), "fedem": (74.7, 66.7)}
#: Settings per method, chosen by ``simulations/fedem_tune.py`` (weighted validation accuracy
#: on an 80/20 split of every client's training set, 100 rounds, seed 0): lr in
#: {0.03, 0.1, 0.3} x batch in {32, 128} at M = 3, then M in {3, 4, 5} for fedem and
#: clustered at their best lr and batch. FedEM's are the run-config defaults.
TUNED = {"local": {"lr": 0.03, "batch-size": 128}, "fedavg": {"lr": 0.3, "batch-size": 32},
         "fedprox": {"lr": 0.3, "batch-size": 32}, "fedavg-ft": {"lr": 0.1, "batch-size": 32},
         "clustered": {"lr": 0.3, "batch-size": 128, "M": 5}, "fedem": {}}
KEYS = ("accuracy_mean", "accuracy_bottom_decile", "accuracy_mean_unweighted",
        "unseen_accuracy_mean", "unseen_accuracy_bottom_decile", "train_loss")
logger = logging.getLogger("fmtl_flower")
#: FedEM's run-config keys by their names without the family (``lr`` -> ``fedem.lr``): the
#: names ``TUNED``, the plan and the written results use.
FEDEM_KEYS = {key.partition(".")[2]: key for key in RunConfig.keys() if key.startswith("fedem.")}


def run_config_of(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with FedEM's names (``lr``, ``M``, ``fraction``, ...) as their run-config
    keys (``fedem.lr``, ...); the common and dotted keys as they are."""
    return {FEDEM_KEYS.get(key, key): value for key, value in settings.items()}


def run_one(settings: dict[str, Any]) -> dict[str, Any]:
    """One federation (in-process) with the run-config ``settings`` (FedEM's keys with or
    without ``fedem.``, see :func:`run_config_of`); its final metrics."""
    import flwr.common.logger  # noqa: F401  - configure Flower's logger, then quieten it

    from ..apps.common import dataset_for
    from ..apps.run import run_federation

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cfg = RunConfig.from_mapping(run_config_of({"dataset": "fedem-synthetic", **settings}))
    started = time.perf_counter()
    results = run_federation(cfg, dataset_for(cfg), "inprocess")
    final = results["final"]
    extra = {"num_clusters": final["num_clusters"]} if "num_clusters" in final else {}  # CFL
    return {**{k: final.get(k) for k in KEYS}, **extra, "rounds": final.get("round"),
            "wall_time_s": time.perf_counter() - started}


def _plan(quick: bool, seeds: int) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    base: dict[str, Any] = {"eval-every": 1000}
    if quick:
        base.update({"num-tasks": 30, "n-test": 100, "num-server-rounds": 5})
    jobs: list[tuple[str, dict[str, Any]]] = []
    for seed in range(seeds):
        jobs += [("rows", {"strategy": m, "seed": seed}) for m in METHODS]
    default_m = RunConfig().num_components
    sweep = [k for k in range(1, 6) if k != default_m]
    for M in sweep[:2] if quick else sweep:
        jobs.append(("m_sweep", {"strategy": "fedem", "M": M}))
    for fraction in ((0.5,) if quick else (0.1, 0.2, 0.5)):
        for rule in ("all", "sampled"):
            jobs.append(("sampling_sweep", {"strategy": "fedem", "fraction": fraction,
                                            "aggregation": rule}))
    for method in (("fedem",) if quick else ("fedem", "fedavg", "fedavg-ft", "clustered")):
        jobs.append(("unseen", {"strategy": method, "train-tasks-frac": 0.8}))
    return base, jobs


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds per method, beside the poster's numbers."""
    out = []
    for method in METHODS:
        sel = [r for r in rows if r["method"] == method]
        if not sel:
            continue
        entry: dict[str, Any] = {"method": method, "seeds": len(sel)}
        for key in ("accuracy_mean", "accuracy_bottom_decile"):
            v = np.array([r[key] for r in sel], dtype=float)
            entry[f"{key}_mean"] = float(v.mean())
            entry[f"{key}_std"] = float(v.std(ddof=1)) if v.size > 1 else None
        entry["poster_accuracy_mean"], entry["poster_accuracy_bottom_decile"] = (
            x / 100 for x in POSTER[method])
        out.append(entry)
    return out


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """(a) Table 1 bars with the poster's values; (b) vs M; (c) vs sampling rate; (d) unseen."""
    fig.set_size_inches(11, 7.5)
    ax = fig.add_subplot(2, 2, 1)
    summary = payload["summary"]
    x = np.arange(len(summary))
    for k, key in enumerate(("accuracy_mean", "accuracy_bottom_decile")):
        ax.bar(x + (k - 0.5) * 0.38, [s[f"{key}_mean"] for s in summary], 0.38,
               yerr=[s[f"{key}_std"] or 0.0 for s in summary], capsize=3,
               label="average" if k == 0 else "bottom decile")
        ax.scatter(x + (k - 0.5) * 0.38, [s[f"poster_{key}"] for s in summary], marker="_",
                   s=200, color="k", zorder=3, label="poster" if k == 0 else None)
    ax.set_xticks(x, [s["method"] for s in summary], rotation=20)
    ax.set_ylim(0.5, 0.85)
    ax.set_ylabel("test accuracy")
    ax.set_title("Table 1, synthetic (mean ± sd over seeds)")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(2, 2, 2)
    sweep = sorted(payload["m_sweep"], key=lambda r: r["M"])
    ax.plot([r["M"] for r in sweep], [r["accuracy_mean"] for r in sweep], "o-", label="average")
    ax.plot([r["M"] for r in sweep], [r["accuracy_bottom_decile"] for r in sweep], "s--",
            label="bottom decile")
    ax.set_xlabel("components M")
    ax.set_ylabel("test accuracy")
    ax.set_title("FedEM vs M")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(2, 2, 3)
    for rule in ("all", "sampled"):
        pts = sorted((r for r in payload["sampling_sweep"] if r["aggregation"] == rule),
                     key=lambda r: r["fraction"])
        ax.plot([r["fraction"] for r in pts], [r["accuracy_mean"] for r in pts], "o-",
                label=f"aggregation={rule}")
    ax.set_xscale("log")
    ax.set_xlabel("client sampling rate")
    ax.set_ylabel("average test accuracy")
    ax.set_title("FedEM vs sampling rate")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(2, 2, 4)
    unseen = payload["unseen"]
    x = np.arange(len(unseen))
    ax.bar(x - 0.2, [r["accuracy_mean"] for r in unseen], 0.4, label="training clients")
    ax.bar(x + 0.2, [r["unseen_accuracy_mean"] for r in unseen], 0.4, label="unseen clients")
    ax.set_xticks(x, [r["method"] for r in unseen])
    ax.set_ylim(0.5, 0.85)
    ax.set_ylabel("average test accuracy")
    ax.set_title("Unseen clients (20 % held out)")
    ax.legend(fontsize=8)


def run(out_dir: Path, quick: bool = False, shuffles: int | None = None,
        datasets: list[str] | None = None, jobs: int | None = None) -> dict[str, Any]:
    """Run every federation of the plan and write the outputs (see the module docstring).

    ``shuffles`` is the number of seeds of the Table 1 rows (default 3; 1 with ``quick``);
    ``jobs`` the number of worker processes (default: ``$FMTL_JOBS`` or 1). ``datasets`` is
    not used (the protocol is the synthetic row).
    """
    if datasets and list(datasets) != ["fedem-synthetic"]:
        raise ValueError("fedem-table1 runs on fedem-synthetic only")
    seeds = shuffles or (1 if quick else 3)
    base, plan = _plan(quick, seeds)
    plan = [(part, {**TUNED[extra["strategy"]], **extra}) for part, extra in plan]
    settings = [{**base, **extra} for _, extra in plan]
    jobs = jobs or int(os.environ.get("FMTL_JOBS", "1"))
    started = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(run_one, settings))
    else:
        results = [run_one(s) for s in settings]
    payload: dict[str, Any] = {"rows": [], "m_sweep": [], "sampling_sweep": [], "unseen": []}
    defaults = RunConfig()
    for (part, extra), result in zip(plan, results, strict=True):
        row = {"method": extra["strategy"], "seed": extra.get("seed", 0), **result}
        if extra["strategy"] in ("fedem", "clustered"):
            row["M"] = extra.get("M", defaults.num_components)
        if part == "sampling_sweep":
            row.update(fraction=extra["fraction"], aggregation=extra["aggregation"])
        payload[part].append(row)
        logger.info("%s %s %s: accuracy %.4f / bottom decile %.4f%s [%.0f s]", part,
                    extra["strategy"], {k: v for k, v in extra.items() if k != "strategy"},
                    row["accuracy_mean"], row["accuracy_bottom_decile"],
                    "" if row["unseen_accuracy_mean"] is None
                    else f" / unseen {row['unseen_accuracy_mean']:.4f}", row["wall_time_s"])
    fedem_default = [r for r in payload["rows"] if r["method"] == "fedem" and r["seed"] == 0]
    payload["m_sweep"].append({**fedem_default[0], "M": defaults.num_components})
    payload["sampling_sweep"] += [{**fedem_default[0], "fraction": 1.0, "aggregation": rule}
                                  for rule in ("all", "sampled")]
    payload["summary"] = summarise(payload["rows"])
    payload["config"] = {"quick": quick, "seeds": seeds, **base,
                         **{k: v for k, v in dataclasses.asdict(defaults).items()
                            if k in ("num_server_rounds", "num_components", "lr",
                                     "batch_size", "local_epochs", "momentum",
                                     "weight_decay", "lr_schedule", "prox_mu",
                                     "finetune_epochs", "generator")},
                         "tuned": TUNED, "wall_time_s": time.perf_counter() - started}
    write_outputs(Path(out_dir), NAME, payload, plot)
    return payload


def format_table(payload: dict[str, Any]) -> str:
    """Table 1 as text: ours (mean ± sd over seeds) beside the poster's."""
    lines = [f"{'method':10s} {'average':>16s} {'bottom decile':>16s} {'poster':>13s}"]
    def cell(s: dict[str, Any], key: str) -> str:
        sd = s[f"{key}_std"]
        return f"{100 * s[f'{key}_mean']:.1f}" + ("" if sd is None else f" ± {100 * sd:.1f}")

    for s in payload["summary"]:
        lines.append(f"{s['method']:10s} {cell(s, 'accuracy_mean'):>16s} "
                     f"{cell(s, 'accuracy_bottom_decile'):>16s} "
                     f"{100 * s['poster_accuracy_mean']:6.1f} / "
                     f"{100 * s['poster_accuracy_bottom_decile']:.1f}")
    for r in payload["unseen"]:
        lines.append(f"unseen ({r['method']}): training clients {100 * r['accuracy_mean']:.1f}, "
                     f"unseen clients {100 * r['unseen_accuracy_mean']:.1f} "
                     f"(bottom decile {100 * r['unseen_accuracy_bottom_decile']:.1f})")
    return "\n".join(lines)
