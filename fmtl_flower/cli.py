"""The ``fmtl`` command line: run a strategy on a dataset and report per-round metrics.

Examples
--------
fmtl run mocha                                  # MOCHA on the embedded synthetic dataset
fmtl run mocha --dataset small --rounds 500 --set omega=identity --set lambda=1e-4
fmtl run local --dataset eat-voc --set lambda=cv
fmtl run fedem --dataset fedem-synthetic        # FedEM on the FedEM paper's synthetic data
fmtl run fedavg --dataset fedem-synthetic --set train-tasks-frac=0.8
fmtl reproduce mocha-table1 --out results/
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from typing import Any

from .config import (
    FEDERATED,
    FSVRG_FAMILY,
    STRATEGIES,
    ConfigError,
    RunConfig,
    parse_set_options,
)

FINAL_KEYS = ("primal", "dual", "gap", "test_error", "test_error_pooled", "accuracy_mean",
              "accuracy_mean_unweighted", "accuracy_bottom_decile", "unseen_accuracy_mean",
              "unseen_accuracy_bottom_decile", "train_loss", "num_replies", "num_dropped")
#: Keys of the final table that only mean something for one family; left out when None.
_OPTIONAL_KEYS = ("primal", "dual", "gap", "accuracy_mean_unweighted", "unseen_accuracy_mean",
                  "unseen_accuracy_bottom_decile", "train_loss")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fmtl``."""
    parser = argparse.ArgumentParser(prog="fmtl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one strategy and print per-round metrics")
    run.add_argument("strategy", choices=STRATEGIES)
    run.add_argument("--dataset", default=None,
                     help="synthetic (default), small, eat-voc, or a path to a .mat file")
    run.add_argument("--rounds", type=int, default=None, help="communication rounds")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--engine", choices=("inprocess", "ray"), default="inprocess")
    run.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                     help="with --engine ray: join the running Ray cluster whose head is at "
                          "HOST:PORT (`ray start --head --port PORT`) instead of starting Ray")
    run.add_argument("--out", default=None, help="write the results JSON here")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a run-config key, dotted for a family's (mocha.theta=0.3); "
                          "repeatable")
    run.add_argument("--run-config", action="append", default=[], metavar="CONFIG",
                     help="run-config overrides as `flwr run --run-config` takes them: "
                          "\"mocha.theta=0.3 dataset='small'\" (TOML values) or a .toml file "
                          "(nested tables become dotted keys); --set wins over it")
    run.add_argument("--print-every", type=int, default=0,
                     help="print every N-th round (default: about 50 lines per run)")
    run.add_argument("--quiet", action="store_true", help="print only the final table")
    run.add_argument("--verbose", action="store_true", help="show Flower's INFO logs")
    rep = sub.add_parser("reproduce", help="reproduce a table or figure of the papers")
    rep.add_argument("name", help="e.g. mocha-table1")
    rep.add_argument("--out", default="results", help="output directory (default: results)")
    rep.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    rep.add_argument("--datasets", nargs="+", default=None, help="override the datasets")
    rep.add_argument("--shuffles", type=int, default=None, help="override the shuffles/seeds")
    rep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a reproduction's own option, e.g. ofmtl-arrivals "
                          "--set retrain-ratio=0.5 (repeatable; an unknown key lists them)")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Merge the named options and ``--set`` pairs into a validated :class:`RunConfig`."""
    values: dict[str, Any] = {"strategy": args.strategy}
    if args.dataset is not None:
        values["dataset"] = args.dataset
    if args.rounds is not None:
        values["num-server-rounds"] = args.rounds
    if args.seed is not None:
        values["seed"] = args.seed
    values.update(run_config_overrides(args.run_config))
    values.update(parse_set_options(args.set))
    return RunConfig.from_mapping(values)


def run_config_overrides(configs: list[str]) -> dict[str, Any]:
    """``--run-config`` values parsed as Flower parses ``flwr run --run-config`` (TOML values,
    or one .toml file; nested tables flattened into dotted keys)."""
    if not configs:
        return {}
    import click
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args(configs)
    except click.ClickException as err:
        raise ConfigError(f"--run-config: {err.message}") from None


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


def progress_line(record: dict[str, Any], num_tasks: int) -> str:
    """One line of per-round progress (MOCHA's family: objective and gap; FedEM's: loss and
    accuracies)."""
    if "exchanges" in record:  # FSVRG's family: one global model
        return (f"round {record['round']:5d} | round trips {record['exchanges']:5d} | "
                f"objective {_fmt(record.get('objective'), '.8f')} | test err "
                f"{_fmt(record.get('test_error'), '.4f')} | replies "
                f"{_fmt(record.get('num_replies'), 'd')}/{num_tasks} | "
                f"{_fmt(record.get('wall_time_s') and record['wall_time_s'] * 1e3, '.1f')} ms")
    if "event" in record:  # OFMTL: one record per training or newcomer
        return (f"event {record['round']:3d} {record['event']:9s} | devices "
                f"{record['devices']:4d} | test err {_fmt(record.get('test_error'), '.4f')} | "
                f"floats {record['floats_communicated']:10d} (total "
                f"{record['cumulative_floats']}) | {record['event_time_s'] * 1e3:.0f} ms")
    if "train_loss" in record:
        unseen = record.get("unseen_accuracy_mean")
        return (f"round {record['round']:5d} | train loss {_fmt(record.get('train_loss'), '.5f')}"
                f" | acc {_fmt(record.get('accuracy_mean'), '.4f')} | bottom-10% "
                f"{_fmt(record.get('accuracy_bottom_decile'), '.4f')}"
                + (f" | unseen acc {unseen:.4f}" if unseen is not None else "")
                + f" | replies {_fmt(record.get('num_replies'), 'd')}/"
                f"{_fmt(record.get('num_sampled'), 'd')} | "
                f"{_fmt(record.get('wall_time_s') and record['wall_time_s'] * 1e3, '.1f')} ms")
    primal, gap = record.get("primal"), record.get("gap")
    rel = gap / primal if gap is not None and primal else None
    replies = record.get("num_replies")
    return (f"round {record['round']:5d} | primal {_fmt(primal, '.6e')} | "
            f"dual {_fmt(record.get('dual'), '.6e')} | gap {_fmt(gap, '.3e')} "
            f"(rel {_fmt(rel, '.2e')}) | test err {_fmt(record.get('test_error'), '.4f')} | "
            f"replies {_fmt(replies, 'd')}/{num_tasks} | "
            f"{_fmt(record.get('wall_time_s') and record['wall_time_s'] * 1e3, '.1f')} ms")


#: The FedEM family's methods that train ``fedem.M`` models (FedEM's components, IFCA's
#: clusters); the final table shows M for them only.
MIXTURE_METHODS = ("fedem", "clustered", "ifca")


def final_table(results: dict[str, Any]) -> str:
    """The final table printed at the end of a run."""
    final = results["final"]
    cfg = results["config"]
    rows = [("strategy", cfg["strategy"]), ("dataset", cfg["dataset"])]
    if "train_loss" in final or cfg.get("model", "auto") not in ("auto", "svm"):
        rows.append(("model", cfg.get("model")))
        if cfg["strategy"] in MIXTURE_METHODS:  # the others train one model (CFL: then splits)
            rows.append(("M", cfg.get("fedem.M", cfg.get("M"))))
    elif "exchanges" in final:
        rows.append(("lambda", "1/n (the paper's)"))
    else:
        rows.append(("lambda", cfg.get("mocha.lambda", cfg.get("lambda"))))
    rows.append(("rounds", final.get("round", "-")))
    for key in FINAL_KEYS:
        value = final.get(key)
        mocha_family = not ({"train_loss", "event", "exchanges"} & set(final))
        if value is None and (key in _OPTIONAL_KEYS or "event" in final) and not mocha_family:
            continue
        rows.append((key, "-" if value is None else
                     (f"{value:.6g}" if isinstance(value, float) else str(value))))
    for key in ("devices", "retrainings", "cumulative_floats", "objective", "exchanges",
                "epsilon", "dp_noise_multiplier"):  # epsilon: client-level DP (dp.*)
        if key in final:
            rows.append((key, str(final[key])))
    if final.get("primal") and final.get("gap") is not None:
        rows.append(("relative_gap", f"{final['gap'] / final['primal']:.3e}"))
    for key in ("tasks_never_replied", "tasks_missing"):
        if final.get(key):
            rows.append((key, str(final[key])))
    if "wall_time_s" in results:
        rows.append(("total_wall_time_s", f"{results['wall_time_s']:.2f}"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 24)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def _resolve_lambda(cfg: RunConfig, data) -> tuple[RunConfig, dict[float, float] | None]:
    if cfg.lam != "cv" or cfg.is_fedem_family or cfg.model_family != "svm":
        return cfg, None
    if cfg.strategy == "mb-sgd":
        raise ConfigError("lambda=cv is not available for mb-sgd; give a number")
    from .model_selection import cross_validate_lambda
    from .settings import MOCHASettings

    method = {"local": "local", "global": "global"}.get(cfg.strategy, "mtl")
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    mocha: dict[str, Any] = {}
    if method == "mtl":  # the CV fits: the run's formulation and local solver, no systems
        settings = MOCHASettings.from_run_config(
            {k: v for k, v in cfg.to_dict().items() if k != "mocha.lambda"},
            method=cfg.strategy)
        mocha = {"rounds": cfg.num_server_rounds, "omega": settings.omega,
                 "omega_every": settings.omega_every, "omega_eps": settings.omega_eps,
                 "lam2": settings.lam2, "s2": settings.s2, "eta": settings.eta,
                 "clusters": settings.clusters, "gamma": settings.gamma,
                 "method": settings.method, "theta": settings.theta, "beta": settings.beta,
                 "local_frac": settings.local_frac, "sigma_mode": settings.sigma_mode,
                 "loss": settings.loss}
    else:
        mocha = {"loss": cfg.loss}
    best, scores = cross_validate_lambda(method, tasks, seed=cfg.seed, **mocha)
    return dataclasses.replace(cfg, lam=best), scores


def run_baseline(cfg: RunConfig, data) -> dict[str, Any]:
    """``local`` or ``global``: SVMs fitted centrally, evaluated with the same metrics; or
    ``global`` with another model family: one model trained centrally on the pooled data."""
    from .centralized import evaluate_models
    from .core.svm import fit_global_svm, fit_local_svms

    if cfg.model_family != "svm":
        from .centralized import fit_pooled_model

        final = {"round": cfg.num_server_rounds,
                 **fit_pooled_model(cfg, data, unseen=_unseen(cfg, data.num_tasks))}
        return {"config": cfg.to_dict(), "rounds": [], "final": final}

    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    fit = fit_local_svms if cfg.strategy == "local" else fit_global_svm
    W = fit(tasks, float(cfg.lam), seed=cfg.seed, loss=cfg.loss)
    final: dict[str, Any] = {"round": None, "primal": None, "dual": None, "gap": None}
    final.update(evaluate_models(W, [(t.X_test, t.y_test) for t in data.tasks]))
    return {"config": cfg.to_dict(), "rounds": [], "final": final}


def _unseen(cfg: RunConfig, num_tasks: int) -> list[int]:
    from .config import unseen_tasks

    return unseen_tasks(cfg, num_tasks)


def run_federation(cfg: RunConfig, data, engine: str, print_every: int,
                   quiet: bool, ray_address: str | None = None) -> dict[str, Any]:
    """:func:`fmtl_flower.apps.run.run_federation` with a progress line every ``print_every``
    rounds (0: about 50 lines in all) unless ``quiet``; return the results dict."""
    from .apps.run import run_federation as run

    m = data.num_tasks
    every = print_every or max(1, math.ceil(cfg.num_server_rounds / 50))
    cfg = _unpacked_for_async(cfg)
    if cfg.tasks_per_node == 0:  # automatic task packing (documented rule, in the header)
        from .packing import auto_packing

        cfg, rule = auto_packing(cfg, m, engine)
        if not quiet:
            print(f"task packing: {rule}", flush=True)

    def on_round(record: dict[str, Any]) -> None:
        k = record["round"]
        if not quiet and ("event" in record or k % every == 0 or k == cfg.num_server_rounds):
            print(progress_line(record, m), flush=True)

    return run(cfg, data, engine, on_round=on_round, ray_address=ray_address)


def _unpacked_for_async(cfg: RunConfig) -> RunConfig:
    """Barrier-free MOCHA sends one message per request, so packing saves it no messages:
    automatic packing means one task per node; an explicit ``tasks-per-node`` above 1 packs
    (each task on a node is its own request, :mod:`fmtl_flower.strategies.async_mocha`)."""
    from .config import ASYNC_MOCHA

    if cfg.strategy not in ASYNC_MOCHA or cfg.tasks_per_node > 1:
        return cfg
    return dataclasses.replace(cfg, tasks_per_node=1)


def _check_sparse_for_fsvrg(cfg: RunConfig, data: Any) -> None:
    """FSVRG's family trains on sparse (CSR) design matrices: a dense dataset is a clear
    error here, not a federation whose every node fails discovery."""
    if cfg.strategy not in FSVRG_FAMILY or not data.num_tasks:
        return
    import scipy.sparse as sp

    if not sp.issparse(data.tasks[0].X_train):
        raise ConfigError(f"strategy={cfg.strategy} trains on sparse data (FSVRG's family): "
                          f"dataset {cfg.dataset!r} is dense; use --dataset sparse-federated")


def cmd_run(args: argparse.Namespace) -> int:
    """``fmtl run``."""
    from .apps.common import dataset_for, write_results

    started = time.perf_counter()
    cfg = config_from_args(args)
    from .apps.common import is_federated

    if args.engine == "ray" and not is_federated(cfg):
        raise ConfigError(f"--engine applies to federated strategies {FEDERATED}")
    if args.ray_address is not None:
        if args.engine != "ray":
            raise ConfigError("--ray-address needs --engine ray (it names the Ray cluster "
                              "that the Ray simulation joins)")
        from .engine import validate_ray_address

        validate_ray_address(args.ray_address)
    data = dataset_for(cfg)
    _check_sparse_for_fsvrg(cfg, data)
    if not args.quiet:
        print(f"dataset {cfg.dataset}: {data.num_tasks} tasks, {data.dim} features, "
              f"{int(data.n_train.sum())} training samples", flush=True)
    from .core import jit

    with jit.simulation() as (kernels, why):  # a simulation: numba for every call (core.jit)
        if not args.quiet:
            print(f"kernels: {kernels} ({why})", flush=True)
        cfg, scores = _resolve_lambda(cfg, data)
        if scores is not None and not args.quiet:
            print("lambda by 5-fold CV: " + ", ".join(f"{k:g}: {v:.4f}"
                                                      for k, v in scores.items())
                  + f" -> {cfg.lam:g}", flush=True)
        if is_federated(cfg):
            results = run_federation(cfg, data, args.engine, args.print_every, args.quiet,
                                     ray_address=args.ray_address)
        else:
            results = run_baseline(cfg, data)
    results["kernels"] = kernels
    if scores is not None:
        results["lambda_cv_scores"] = {f"{k:g}": v for k, v in scores.items()}
    results["engine"] = args.engine
    results["wall_time_s"] = time.perf_counter() - started
    print(final_table(results), flush=True)
    if args.out:
        write_results(args.out, results)
        print(f"results written to {args.out}")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """``fmtl reproduce``."""
    from .experiments import module_of, parse_options, reproduce

    module = module_of(args.name)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    pkg_logger = logging.getLogger("fmtl_flower")
    pkg_logger.addHandler(handler)
    pkg_logger.setLevel(logging.INFO)
    if args.shuffles is not None and args.shuffles < 1:
        raise ConfigError(f"--shuffles must be >= 1, got {args.shuffles}")
    options = {k: v for k, v in (("datasets", args.datasets), ("shuffles", args.shuffles))
               if v is not None}
    options.update(parse_options(args.name, args.set))
    started = time.perf_counter()
    payload = reproduce(args.name, args.out, quick=args.quick, **options)
    if hasattr(module, "format_table"):
        print(module.format_table(payload))
    print(f"{args.name}: written to {args.out}/ in {time.perf_counter() - started:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fmtl`` console script."""
    args = build_parser().parse_args(argv)
    import flwr.common.logger  # noqa: F401  - configures the "flwr" logger; then set its level

    logging.getLogger("flwr").setLevel(
        logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    try:
        if args.command == "reproduce":
            return cmd_reproduce(args)
        return cmd_run(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"fmtl: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the run could not go on (DiscoveryError, NoValidReplies)
        from .strategies.base import NoValidReplies
        from .strategies.discovery import DiscoveryError

        if not isinstance(err, DiscoveryError | NoValidReplies):
            raise
        print(f"fmtl: run failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
