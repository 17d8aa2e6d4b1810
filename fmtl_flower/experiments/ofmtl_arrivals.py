"""OFMTL paper, Figures 2-4 protocol: error, training time and communication vs devices.

Per dataset and arrival order (seed ``o`` = 0 .. shuffles - 1): every task is split 75/25
(``load_dataset(name, seed=o)``, the split of ``fmtl run --seed o``) and the tasks arrive in
the order ``np.random.default_rng([o, 43]).permutation(T)`` (the permutation of
``fmtl run ofmtl --seed o --set ofmtl.arrivals=shuffle``). The first ``initial`` tasks
(eat-voc: 1, as in the paper; small and synthetic: 10, the paper's HAR/GLEAM setting) are
present at the start; then the others join one at a time. At every device count m
(initial .. T), over the m present tasks:

* ``mocha``: MOCHA (probabilistic formulation) retrained from scratch on all m tasks with
  :func:`fmtl_flower.centralized.fit_mocha` (the federated computation bit for bit);
* ``ofmtl``: the initial MOCHA model, then per newcomer :func:`fmtl_flower.core.ofmtl.add_task`
  (old columns frozen), and a full MOCHA retraining -- the ``mocha`` fit at that m, which is
  the same computation -- when the newcomers since the last (re)training reach
  ``retrain_ratio`` (1.5) times the tasks at that (re)training (the reference driver's
  "global update"; counted under ``"retrainings"``);
* ``local``: one SVM per task; ``global``: one SVM on the pooled data (both with MOCHA's
  lambda scaling, :mod:`fmtl_flower.core.svm`), retrained on all present tasks at every
  arrival, as the reference driver does (their strength lambda m changes with m).

Reported per (dataset, order, devices, method): ``test_error`` (mean of the per-task test
errors over ALL present tasks), ``cumulative_time_s`` (``time.perf_counter`` around the
training calls only, evaluation excluded; OFMTL's = its initial MOCHA training + its
newcomer solves + its full retrainings) and ``floats_communicated`` (cumulative). The
summary adds the ratio of cumulative SDCA coordinate steps (MOCHA's ``fit.steps``; a
newcomer's outer x inner x floor(0.5 n)), a machine-independent companion of the time ratio:
on these small tasks the wall-clock time is dominated by per-round overheads, not flops.
Floats:

* MOCHA, per round and task: w_t and the two float scalars m_tt, sigma' down (d + 2), delta-b
  up (d) -- the payload of the federated strategy's ``train`` messages; plus the final
  models delivered (d per task). Integer bookkeeping (ids, round numbers, budgets, seeds) and
  the monitoring metrics of the replies (loss-mean, dual-mean) are not counted;
* OFMTL newcomer: :class:`~fmtl_flower.core.ofmtl.NewTaskResult` (outer (d + 1) down, outer
  d up: O(1) per newcomer, independent of m); a retraining costs MOCHA's floats;
* local SVM: 0;
* global SVM: each task's raw training data uploaded once when it joins (n_t (d + 1): samples
  and labels) plus the retrained global model broadcast to every present device at every
  arrival (m d).

Lambda (``lambda_mode``). ``"initial"`` (default): for each dataset and order lambda is chosen
per method (mtl for MOCHA and OFMTL, local, global) by 5-fold cross-validation
(:func:`fmtl_flower.model_selection.cross_validate_lambda`, training data only) on the
initial tasks and then fixed for all device counts; the CV time is reported
(``cv_time_s``) but not charged to any method. ``"every"``: the reference driver's protocol:
every method chooses lambda by CV on all present tasks at every device count, its CV time
charged to it; OFMTL takes MOCHA's lambda (and CV time) at its (re)trainings and its newcomers
use the last chosen lambda. ``"every"`` costs about 36x the MOCHA training time per arrival
(35 CV fits + the refit): about 25 CPU minutes for small and 40 for synthetic (5 orders),
so the full run uses ``"initial"``.

MOCHA settings, the reference's: 1000 rounds with an Omega-step every 100 (outer 10 x inner
100), ``local_frac`` 0.5; OFMTL's newcomer: outer 10 x inner 100 rounds of 0.5 n steps.

Writes ``ofmtl-arrivals.json``: ``{"rows": [{"dataset", "order", "devices", "method",
"test_error", "cumulative_time_s", "floats_communicated"}], "retrainings": {dataset: {order:
[devices at which OFMTL retrained]}}, "summary": {dataset: {...}}, "per_order": [...],
"skipped": {...}, "config": {...}}``, the CSV of the rows, and a figure with, per dataset,
mean error, mean cumulative time (log) and mean cumulative floats (log) vs devices.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..centralized import evaluate_models, fit_mocha
from ..config import as_float, as_int, positive_int
from ..core.ofmtl import add_task
from ..core.omega import DEFAULT_OMEGA_EPS
from ..core.rng import arrival_permutation
from ..core.svm import fit_global_svm, fit_linear_svm, fit_local_svms
from ..data import available_datasets, load_dataset
from ..model_selection import cross_validate_lambda
from .output import runs_per_dataset, write_outputs

NAME = "ofmtl-arrivals"
METHODS = ("ofmtl", "mocha", "local", "global")
DEFAULT_DATASETS = ("eat-voc", "small", "synthetic")
#: Tasks present at the start (the paper: 1 for its 4-task EHM, 10 for HAR and GLEAM).
INITIAL_TASKS = {"eat-voc": 1, "small": 10, "synthetic": 10}
DEFAULT_INITIAL = 10
#: The issue's targets, reported in the summary (never used to choose anything).
ERROR_TARGET_PP = 0.5
TIME_TARGET = 5.0
LAMBDA_MODES = ("initial", "every")
logger = logging.getLogger("fmtl_flower")


@dataclass(frozen=True)
class Settings:
    """The protocol's knobs (defaults: the reference's)."""

    rounds: int = 1000
    omega_every: int = 100
    local_frac: float = 0.5
    outer: int = 10
    inner: int = 100
    newcomer_frac: float = 0.5
    retrain_ratio: float = 1.5
    omega_eps: float = DEFAULT_OMEGA_EPS
    lambda_mode: str = "initial"
    folds: int = 5

    def __post_init__(self) -> None:
        lows = {"rounds": 1, "omega_every": 1, "outer": 1, "inner": 0, "folds": 2}
        for name, low in lows.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        # retrain_ratio = inf: never retrain (pure OFMTL after the initial training)
        for name in ("local_frac", "newcomer_frac", "retrain_ratio", "omega_eps"):
            value = getattr(self, name)
            positive, may_be_inf = name != "omega_eps", name == "retrain_ratio"
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or math.isnan(value) or (math.isinf(value) and not may_be_inf)
                    or value < 0 or (positive and value == 0)):
                kind = "a number" if may_be_inf else "a finite number"
                raise ValueError(f"{name} must be {kind} "
                                 f"{'> 0' if positive else '>= 0'}, got {value!r}")
        if self.lambda_mode not in LAMBDA_MODES:
            raise ValueError(f"lambda_mode must be one of {LAMBDA_MODES}, got "
                             f"{self.lambda_mode!r}")

    def mocha_kwargs(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "omega": "probabilistic",
                "omega_every": self.omega_every, "omega_eps": self.omega_eps,
                "local_frac": self.local_frac}


QUICK = Settings(rounds=100, omega_every=20, outer=5, inner=20)

#: What ``fmtl reproduce ofmtl-arrivals --set KEY=VALUE`` may set (``run``'s keyword
#: arguments; :class:`Settings` checks the ranges), e.g. ``--set retrain-ratio=0.5``.
_PARSERS = {int: as_int, float: lambda key, text: as_float(key, text, finite=False),
            str: lambda key, text: text}
OPTIONS = {**{f.name: _PARSERS[type(f.default)] for f in fields(Settings)},
           "initial_tasks": positive_int}


def arrival_order(num_tasks: int, order: int) -> np.ndarray:
    """The order in which the dataset's tasks arrive for arrival order (seed) ``order``."""
    return arrival_permutation(order, num_tasks)


def mocha_floats(m: int, d: int, rounds: int) -> int:
    """Floats one MOCHA training over m tasks moves (see the module docstring)."""
    return rounds * m * ((d + 2) + d) + m * d


def newcomer_floats(d: int, outer: int) -> int:
    """Floats of one OFMTL newcomer: outer (d + 1) down + outer d up."""
    return outer * (2 * d + 1)


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started


def _warm_up() -> None:
    """Load the compiled kernels before anything is timed."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8, 3))
    y = np.where(X[:, 0] > 0, 1.0, -1.0)
    fit = fit_mocha([(X, y), (X, -y)], lam=0.1, rounds=2, omega="probabilistic", omega_every=1)
    add_task(fit.W, fit.state.formulation.sigma, X, y, lam=0.1, outer=2, inner=2)
    fit_linear_svm(X, y, 0.1)


def run_order(dataset: str, order: int, settings: Settings,
              initial: int | None = None) -> dict[str, Any]:
    """One dataset and arrival order: every method at every device count.

    Returns ``{"rows": [...], "retrainings": [devices], "lambdas": {...}, ...}``.
    """
    data = load_dataset(dataset, seed=order, test_frac=0.25)
    perm = arrival_order(data.num_tasks, order)
    train = [(data.tasks[t].X_train, data.tasks[t].y_train) for t in perm]
    test = [(data.tasks[t].X_test, data.tasks[t].y_test) for t in perm]
    T = len(train)
    m0 = INITIAL_TASKS.get(dataset, DEFAULT_INITIAL) if initial is None else int(initial)
    if not 1 <= m0 < T:
        raise ValueError(f"{dataset}: initial tasks must be in [1, {T - 1}], got {m0}")
    run = _OrderRun(settings, order, data.dim, m0)
    run.choose_initial_lambdas(train[:m0])
    for m in range(m0, T + 1):
        errors = run.devices(train[:m], test[:m])
        run.rows += [{"dataset": dataset, "order": int(order), "devices": int(m),
                      "method": method, "test_error": float(errors[method]),
                      "cumulative_time_s": float(run.time_s[method]),
                      "floats_communicated": int(run.floats[method])} for method in METHODS]
    return {"rows": run.rows, "retrainings": run.retrainings, "dim": int(data.dim),
            "num_tasks": int(T), "initial": int(m0), "arrival_order": [int(t) for t in perm],
            "lambdas": {k: v if run.every else v[0] for k, v in run.chosen.items()},
            "cv_time_s": run.cv_time, "newcomer_final_gaps": run.gaps,
            "cumulative_sdca_steps": run.steps}


class _OrderRun:
    """:func:`run_order`'s state over device counts: lambdas, OFMTL's (W, Sigma), and the
    per-method time, floats, SDCA steps and rows accumulated so far."""

    def __init__(self, settings: Settings, order: int, dim: int, initial: int) -> None:
        self.settings, self.order, self.d = settings, order, dim
        self.mocha_kw = settings.mocha_kwargs()
        self.every = settings.lambda_mode == "every"
        self.lambdas: dict[str, float] = {}
        self.chosen: dict[str, list[float]] = {"mtl": [], "local": [], "global": []}
        self.cv_time = 0.0
        self.time_s = dict.fromkeys(METHODS, 0.0)
        self.floats = dict.fromkeys(METHODS, 0)
        self.steps: dict[str, list[int]] = {"ofmtl": [], "mocha": []}  # cumulative per count
        self.rows: list[dict[str, Any]] = []
        self.retrainings: list[int] = []
        self.gaps: list[float] = []
        self.W = self.Sigma = None
        self.lam_ofmtl = math.nan
        self.initial = initial
        self.tasks_at_training, self.since = initial, 0

    def _choose(self, method: str, tasks: list) -> tuple[float, float]:
        extra = self.mocha_kw if method == "mtl" else {}
        (lam, _), seconds = _timed(cross_validate_lambda, method, tasks,
                                   folds=self.settings.folds, seed=self.order, **extra)
        return lam, seconds

    def choose_initial_lambdas(self, initial_tasks: list) -> None:
        """lambda-mode ``initial``: each method's lambda by CV on the initial tasks, once."""
        if not self.every:
            for method in ("mtl", "local", "global"):
                self.lambdas[method], seconds = self._choose(method, initial_tasks)
                self.cv_time += seconds

    def _add_steps(self, method: str, count: int) -> None:
        self.steps[method].append((self.steps[method][-1] if self.steps[method] else 0) + count)

    def devices(self, present: list, present_test: list) -> dict[str, float]:
        """Every method on the m = len(present) tasks present now; their test errors."""
        m = len(present)
        lam_cv = {}  # CV seconds per method ("every" mode), charged to the method
        for method in ("mtl", "local", "global"):
            seconds = 0.0
            if self.every:
                self.lambdas[method], seconds = self._choose(method, present)
            lam_cv[method] = seconds
            self.chosen[method].append(self.lambdas[method])
        errors: dict[str, float] = {}
        fit, seconds = _timed(fit_mocha, present, lam=self.lambdas["mtl"], seed=self.order,
                              **self.mocha_kw)
        mocha_seconds = lam_cv["mtl"] + seconds
        self.time_s["mocha"] += mocha_seconds
        self.floats["mocha"] += mocha_floats(m, self.d, self.settings.rounds)
        errors["mocha"] = evaluate_models(fit.W, present_test)["test_error"]
        mocha_steps = int(sum(int(s.sum()) for s in fit.steps))
        self._add_steps("mocha", mocha_steps)
        self._add_steps("ofmtl", self._ofmtl(present, fit, mocha_seconds, mocha_steps))
        errors["ofmtl"] = evaluate_models(self.W, present_test)["test_error"]
        errors.update(self._svms(present, present_test, lam_cv))
        return errors

    def _ofmtl(self, present: list, fit: Any, mocha_seconds: float, mocha_steps: int) -> int:
        """OFMTL at m tasks: initial training, full retraining (= the MOCHA fit), or the
        newcomer's protocol; its SDCA steps."""
        m, settings = len(present), self.settings
        if m == self.initial or self.since + 1 >= settings.retrain_ratio * self.tasks_at_training:
            if m > self.initial:
                self.retrainings.append(m)
            self.W = np.array(fit.W, copy=True)
            self.Sigma = np.array(fit.state.formulation.sigma, copy=True)
            self.lam_ofmtl = self.lambdas["mtl"]
            self.tasks_at_training, self.since = m, 0
            self.time_s["ofmtl"] += mocha_seconds
            self.floats["ofmtl"] += mocha_floats(m, self.d, settings.rounds)
            return mocha_steps
        X_new, y_new = present[-1]
        res, seconds = _timed(add_task, self.W, self.Sigma, X_new, y_new, lam=self.lam_ofmtl,
                              outer=settings.outer, inner=settings.inner,
                              local_frac=settings.newcomer_frac, omega_eps=settings.omega_eps,
                              seed=self.order, task_id=m - 1)
        self.W, self.Sigma = res.W, res.Sigma
        self.since += 1
        self.time_s["ofmtl"] += seconds
        self.floats["ofmtl"] += res.floats_communicated
        self.gaps.append(float(res.gaps[-1]))
        return settings.outer * settings.inner * int(
            np.floor(settings.newcomer_frac * X_new.shape[0]))

    def _svms(self, present: list, present_test: list,
              lam_cv: dict[str, float]) -> dict[str, float]:
        """The SVM baselines, retrained on all present tasks; their test errors."""
        m, d = len(present), self.d
        W_loc, seconds = _timed(fit_local_svms, present, self.lambdas["local"], seed=self.order)
        self.time_s["local"] += lam_cv["local"] + seconds
        W_glob, seconds = _timed(fit_global_svm, present, self.lambdas["global"],
                                 seed=self.order)
        self.time_s["global"] += lam_cv["global"] + seconds
        uploads = sum(X.shape[0] * (d + 1) for X, _ in
                      (present if m == self.initial else present[-1:]))
        self.floats["global"] += uploads + m * d
        return {"local": evaluate_models(W_loc, present_test)["test_error"],
                "global": evaluate_models(W_glob, present_test)["test_error"]}


def summarise(rows: list[dict[str, Any]], per_order: list[dict[str, Any]],
              settings: Settings) -> dict[str, Any]:
    """Per dataset: the OFMTL-MOCHA error gap, the time ratio, the floats per newcomer."""
    summary: dict[str, Any] = {}
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        sel = [r for r in rows if r["dataset"] == dataset]
        devices = sorted({r["devices"] for r in sel})
        orders = sorted({r["order"] for r in sel})

        def mean(method: str, key: str, m: int, sel=sel) -> float:
            return float(np.mean([r[key] for r in sel
                                  if r["method"] == method and r["devices"] == m]))

        diff_pp = [100.0 * (mean("ofmtl", "test_error", m) - mean("mocha", "test_error", m))
                   for m in devices]
        stderr_pp = []
        for m in devices:
            per = {(r["order"], r["method"]): r["test_error"] for r in sel if r["devices"] == m}
            d_o = np.array([per[(o, "ofmtl")] - per[(o, "mocha")] for o in orders]) * 100.0
            stderr_pp.append(float(d_o.std(ddof=1) / np.sqrt(len(d_o))) if len(d_o) > 1
                             else None)
        worst = int(np.argmax(np.abs(diff_pp)))
        last = devices[-1]
        ratios = []
        for o in orders:
            t = {r["method"]: r["cumulative_time_s"] for r in sel
                 if r["order"] == o and r["devices"] == last}
            ratios.append(t["mocha"] / t["ofmtl"])
        info = next(p for p in per_order if p["dataset"] == dataset)
        counts = [len(p["retrainings"]) for p in per_order if p["dataset"] == dataset]
        time_ratio = mean("mocha", "cumulative_time_s", last) / mean(
            "ofmtl", "cumulative_time_s", last)
        mine = [p for p in per_order if p["dataset"] == dataset]
        step_ratio = float(np.mean([p["cumulative_sdca_steps"]["mocha"][-1] for p in mine])
                           / np.mean([p["cumulative_sdca_steps"]["ofmtl"][-1] for p in mine]))
        summary[dataset] = {
            "orders": len(orders),
            "devices": devices,
            "initial_tasks": info["initial"],
            "ofmtl_minus_mocha_error_pp": diff_pp,
            "ofmtl_minus_mocha_error_pp_stderr": stderr_pp,
            "max_abs_error_diff_pp": float(abs(diff_pp[worst])),
            "max_abs_error_diff_at_devices": devices[worst],
            f"within_{ERROR_TARGET_PP}pp_at_every_device_count":
                bool(max(abs(x) for x in diff_pp) <= ERROR_TARGET_PP),
            "time_ratio_mocha_over_ofmtl_last": float(time_ratio),
            "time_ratio_per_order": ratios,
            f"time_ratio_at_least_{TIME_TARGET:g}x": bool(time_ratio >= TIME_TARGET),
            "sdca_step_ratio_mocha_over_ofmtl_last": step_ratio,
            "ofmtl_floats_per_newcomer": newcomer_floats(info["dim"], settings.outer),
            "mocha_floats_per_training_at_last": mocha_floats(last, info["dim"],
                                                              settings.rounds),
            "retrainings_per_order": counts,
            "mean_error_at_last": {m: mean(m, "test_error", last) for m in METHODS},
            "mean_error_over_devices": {m: float(np.mean([mean(m, "test_error", k)
                                                          for k in devices]))
                                        for m in METHODS},
            "mean_cumulative_time_s_at_last": {m: mean(m, "cumulative_time_s", last)
                                               for m in METHODS},
            "mean_floats_at_last": {m: mean(m, "floats_communicated", last) for m in METHODS},
            "max_newcomer_final_gap": float(max(
                (g for p in per_order if p["dataset"] == dataset
                 for g in p["newcomer_final_gaps"]), default=0.0)),
        }
    return summary


def plot(fig: Any, payload: dict[str, Any]) -> None:
    """Per dataset: mean error, cumulative time (log) and cumulative floats (log) vs devices."""
    from matplotlib.ticker import MaxNLocator

    rows = payload["rows"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig.set_size_inches(14, 3.6 * len(datasets))
    styles = {"ofmtl": "o-", "mocha": "s--", "local": "^:", "global": "v-."}
    colors = {"ofmtl": "C0", "mocha": "C1", "local": "C2", "global": "C3"}
    panels = (("test_error", "mean test error", "linear"),
              ("cumulative_time_s", "cumulative training time (s)", "log"),
              ("floats_communicated", "cumulative floats communicated", "log"))
    for i, dataset in enumerate(datasets):
        sel = [r for r in rows if r["dataset"] == dataset]
        devices = sorted({r["devices"] for r in sel})
        orders = len({r["order"] for r in sel})
        for j, (key, label, scale) in enumerate(panels):
            ax = fig.add_subplot(len(datasets), 3, 3 * i + j + 1)
            for method in METHODS:
                values = [np.mean([r[key] for r in sel if r["method"] == method
                                   and r["devices"] == m]) for m in devices]
                if scale == "log" and min(values) <= 0:
                    continue  # local SVMs communicate nothing
                ax.plot(devices, values, styles[method], color=colors[method], label=method,
                        markersize=3)
            ax.set_yscale(scale)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("devices")
            ax.set_ylabel(label)
            title = f"{dataset} ({orders} orders)"
            if key == "floats_communicated":
                title += ", local: 0"
            ax.set_title(title, fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)


def run(out_dir: Path, quick: bool = False, datasets: list[str] | None = None,
        shuffles: int | None = None, lambda_mode: str | None = None,
        initial_tasks: int | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the protocol and write the outputs (see the module docstring).

    ``overrides`` set fields of :class:`Settings` (``rounds``, ``outer``, ``inner``, ...);
    ``initial_tasks`` overrides every dataset's initial task count.
    """
    base = QUICK if quick else Settings()
    known = set(asdict(base))
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}; settings: {sorted(known)}")
    settings = Settings(**{**asdict(base), **overrides,
                           **({"lambda_mode": lambda_mode} if lambda_mode else {})})
    datasets = list(datasets or (["small"] if quick else DEFAULT_DATASETS))
    shuffles = shuffles or (2 if quick else 5)
    bad = [d for d in datasets if d not in available_datasets() and not d.endswith(".mat")]
    if bad:
        raise ValueError(f"unknown datasets {bad}; available: {available_datasets()}")
    _warm_up()
    rows: list[dict[str, Any]] = []
    per_order: list[dict[str, Any]] = []
    retrainings: dict[str, dict[str, list[int]]] = {}
    skipped: dict[str, str] = {}
    for dataset, order, result, seconds in runs_per_dataset(
            datasets, shuffles, lambda ds, o: run_order(ds, o, settings, initial_tasks), skipped):
        rows.extend(result.pop("rows"))
        per_order.append({"dataset": dataset, "order": order, **result})
        retrainings.setdefault(dataset, {})[str(order)] = result["retrainings"]
        last = [r for r in rows if r["dataset"] == dataset and r["order"] == order
                and r["devices"] == result["num_tasks"]]
        logger.info("%s order %d: %s; retrained at %s [%.1f s]", dataset, order, ", ".join(
            f"{r['method']} {r['test_error']:.4f} ({r['cumulative_time_s']:.2f} s)"
            for r in last), result["retrainings"], seconds)
    payload = {"rows": rows, "retrainings": retrainings,
               "summary": summarise(rows, per_order, settings), "per_order": per_order,
               "skipped": skipped,
               "config": {"datasets": datasets, "shuffles": shuffles, "quick": quick,
                          "initial_tasks": {d: initial_tasks or INITIAL_TASKS.get(
                              d, DEFAULT_INITIAL) for d in datasets},
                          **asdict(settings), "test_frac": 0.25,
                          "floats_counted": {
                              "mocha": "per round and task: w_t + m_tt + sigma' down (d + 2), "
                                       "delta-b up (d); + final models (d per task)",
                              "ofmtl": "newcomer: outer (d + 1) down + outer d up; "
                                       "(re)trainings: MOCHA's",
                              "local": "0",
                              "global": "raw training data of each task once (n_t (d + 1)) "
                                        "+ the global model to every present device at "
                                        "every arrival (m d)"}}}
    write_outputs(Path(out_dir), NAME, payload, plot)
    return payload


def format_table(payload: dict[str, Any]) -> str:
    """Mean error / cumulative time per device count, then the summary, per dataset."""
    rows = payload["rows"]
    lines = []
    for dataset, s in payload["summary"].items():
        lines.append(f"{dataset} ({s['orders']} orders, {s['initial_tasks']} initial tasks)")
        lines.append(f"{'devices':>7s} " + " ".join(f"{m + ' err':>10s}" for m in METHODS)
                     + f" {'ofmtl s':>9s} {'mocha s':>9s}")
        for m in s["devices"]:
            sel = [r for r in rows if r["dataset"] == dataset and r["devices"] == m]

            def mean(method: str, key: str, sel=sel) -> float:
                return float(np.mean([r[key] for r in sel if r["method"] == method]))

            lines.append(f"{m:7d} " + " ".join(f"{mean(k, 'test_error'):10.4f}"
                                                for k in METHODS)
                         + f" {mean('ofmtl', 'cumulative_time_s'):9.2f}"
                         f" {mean('mocha', 'cumulative_time_s'):9.2f}")
        lines.append(
            f"  max |OFMTL - MOCHA| = {s['max_abs_error_diff_pp']:.2f} pp (at "
            f"{s['max_abs_error_diff_at_devices']} devices); time ratio MOCHA/OFMTL at "
            f"{s['devices'][-1]} devices = {s['time_ratio_mocha_over_ofmtl_last']:.1f}x (SDCA "
            f"steps {s['sdca_step_ratio_mocha_over_ofmtl_last']:.1f}x); "
            f"OFMTL floats per newcomer = {s['ofmtl_floats_per_newcomer']}; retrainings per "
            f"order = {s['retrainings_per_order']}")
    return "\n".join(lines)
