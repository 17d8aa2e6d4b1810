"""Run configuration: the kebab-case keys of `flwr run --run-config` and `fmtl run --set`.

One dataclass, :class:`RunConfig`, holds every key; :meth:`RunConfig.from_mapping` validates a
mapping of raw values (strings from the command line, or the typed values Flower passes in
``context.run_config``) and raises :class:`ConfigError` naming the key on any bad value or
unknown key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("mocha", "cocoa", "mb-sdca", "mb-sgd", "local", "global", "fedem", "fedavg",
              "fedprox", "fedavg-ft", "clustered", "ofmtl", "fsvrg", "fsvrg-naive", "gd",
              "cocoa-plus", "dane", "cfl", "pfedme", "ifca")
#: Strategies of MOCHA's primal-dual / primal family (one linear SVM per task).
MOCHA_FAMILY = ("mocha", "cocoa", "mb-sdca", "mb-sgd")
#: Strategies of FedEM's family (``local`` joins it with a model other than ``svm``).
FEDEM_FAMILY = ("fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "cfl", "pfedme", "ifca")
#: Strategies of FSVRG's family (one global sparse logistic-regression model).
FSVRG_FAMILY = ("fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane")
FEDERATED = MOCHA_FAMILY + FEDEM_FAMILY + ("ofmtl",) + FSVRG_FAMILY
MODELS = ("auto", "svm", "logistic", "softmax", "mlp")


class ConfigError(ValueError):
    """A run-config key is unknown or its value is invalid."""


def as_int(key: str, value: Any, minimum: int | None = None) -> int:
    """``value`` (a string or a number) as an int, >= ``minimum``; a ConfigError naming ``key``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError
            out = int(value)
        else:
            out = int(str(value).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {out}")
    return out


def positive_int(key: str, value: Any) -> int:
    """``value`` as an int >= 1 (:func:`as_int`); the reproductions' ``OPTIONS`` parser."""
    return as_int(key, value, 1)


def as_float(key: str, value: Any, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False, hi_open: bool = False, finite: bool = True) -> float:
    """``value`` as a float in the given bounds; a ConfigError naming ``key``.

    ``nan`` is never a number; ``inf`` is refused unless ``finite=False``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        out = float(str(value).strip()) if not isinstance(value, int | float) else float(value)
        if math.isnan(out) and not finite:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if finite and not math.isfinite(out):
        raise ConfigError(f"{key}: must be finite, got {value!r}")
    if lo is not None and (out < lo or (lo_open and out == lo)):
        raise ConfigError(f"{key}: must be {'>' if lo_open else '>='} {lo}, got {out}")
    if hi is not None and (out > hi or (hi_open and out == hi)):
        raise ConfigError(f"{key}: must be {'<' if hi_open else '<='} {hi}, got {out}")
    return out


def _as_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    out = str(value).strip()
    if out not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(choices)}; got {value!r}")
    return out


def _as_lambda(key: str, value: Any) -> float | str:
    if isinstance(value, str) and value.strip().lower() == "cv":
        return "cv"
    return as_float(key, value, lo=0.0, lo_open=True)


@dataclass(frozen=True)
class RunConfig:
    """Every run-config key (kebab-case on the wire, snake_case here).

    Attributes
    ----------
    strategy : str
        One of :data:`STRATEGIES`. ``cocoa`` and ``mb-sdca`` share MOCHA's primal-dual
        machinery with another local solver; ``mb-sgd`` is the primal mini-batch subgradient
        baseline; ``local`` and ``global`` are the baselines without sharing / with one
        pooled model (SVMs by default, see ``model``); ``fedem``, ``fedavg``, ``fedprox``,
        ``fedavg-ft``, ``cfl`` (Sattler et al.'s clustered FL), ``clustered`` (IFCA; alias
        ``ifca``) and ``pfedme`` are FedEM and its baselines.
    dataset : str
        ``synthetic`` (generated), ``small``, ``eat-voc`` or a path to a ``.mat`` file.
    num_server_rounds : int
        Communication rounds (W-steps).
    seed : int
        The one seed of the run (split, generator, budgets, drops, local shuffles).
    lam : float or "cv"
        Regularisation strength lambda, or ``cv`` for 5-fold cross-validation on the
        training split over the grid of the MOCHA reference code.
    omega : {"identity", "mean", "probabilistic", "clustered", "graphical"}
        The formulation of the MOCHA paper's appendix B.
    omega_every : int
        Rounds between Omega-steps (0: never).
    omega_eps : float
        Relative eigenvalue perturbation of the probabilistic Omega-step, in (0, 1).
    lambda2 : float or None
        ``mean``'s weight of |W|_F^2 (> 0) and ``graphical``'s weight of lambda2 |Omega|_1
        (>= 0, every entry of Omega; equal to the MOCHA paper's lambda2 of eq. 15, while
        ``lambda`` is twice the paper's lambda there). None ("" on the wire, the default):
        unset; 0 is a value (``graphical``: Omega is the inverse of the perturbed Gram
        matrix), not "unset".
    s2, eta, clusters : float, float, int
        Formulation parameters (0: unset; s2 unset = infinity): ``probabilistic``'s and
        ``graphical``'s s2, ``clustered``'s eta and k.
    gamma : float
        Aggregation parameter in (0, 1] (appendix D.1).
    theta : float
        CoCoA's relative local accuracy in (0, 1) (``cocoa``).
    beta : float
        Mb-SDCA's aggregation parameter (> 0, ``mb-sdca``); Mb-SGD's step scale (step
        beta / h in round h; 0: 1 / lambda_min(K), the Pegasos choice).
    local_frac : float
        Local SDCA steps per round as a fraction of n_t (``sys_het == "none"``).
    sigma_mode : {"global", "per-task", "spectral"}
    sys_het : {"none", "low", "high"}
    sys_het_base : {"n_min", "n_t"}
    drop_prob : float
        Probability that a node does no work in a round (simulated drop-out).
    test_frac : float
        Per-task stratified test fraction (0: train on everything).
    eval_every : int
        Rounds between test-error evaluations (the final model is always evaluated).
    network : {"wifi", "lte", "3g"}
        Link of the estimated-time model (``estimated_time_s`` per round).
    time_model : {"physical", "reference"}
        Measured link figures, or the MOCHA reference code's communication cost units.
    clock_cycle : float
        Per-round deadline in seconds (0: none); budgets are cut to meet it.
    round_timeout : float
        Seconds to wait for replies in a round; a late reply counts as a drop.
    skew : float
        Subsample the tasks' training sets so their sizes span this ratio (appendix E.2,
        :func:`fmtl_flower.data.skew_tasks`; 0: no skew).
    num_tasks, dim, samples_per_task : int
        Generator overrides for ``synthetic`` (0: the generator's default). ``num_tasks`` is
        also the number of tasks the server waits for (0: the dataset's).
    results_file : str
        When set, the ServerApp writes the results JSON there (for ``flwr run``).
    model : {"auto", "svm", "logistic", "softmax", "mlp"}
        Model family: ``auto`` is ``logistic`` for the FedEM family and on
        ``fedem-synthetic``, else ``svm`` (``local`` / ``global`` on the MOCHA datasets);
        ``local`` / ``global`` with another family train that model.
    hidden : int
        Hidden units of ``mlp``.
    num_components : int
        FedEM's M (key ``M``): mixture components (``fedem``) or cluster models
        (``clustered``).
    lr, batch_size, local_epochs, momentum, weight_decay : float / int
        The FedEM family's local solver (mini-batch SGD with momentum and weight decay).
        ``local_epochs`` is also ``cocoa-plus``'s SDCA passes and ``dane``'s SVRG epochs.
    lr_schedule : {"constant", "multi-step"}
    fraction : float
        Client sampling rate in (0, 1].
    aggregation : {"all", "sampled"}
        The authors' aggregation over all clients, or the average over the sampled ones.
    prox_mu : float
        FedProx's mu.
    finetune_epochs : int
        FedAvg+'s local fine-tuning epochs before evaluation.
    cfl_eps1, cfl_eps2 : float
        CFL's split thresholds (mean and largest client update norm; the FedEM authors' 0.4
        and 1.6).
    pfedme_lambda, pfedme_lr, pfedme_steps, pfedme_beta : float / int / int / float
        pFedMe's lambda, inner learning rate, inner steps K and server beta (``lr`` is its
        eta).
    generator : {"released", "fixed"}
        ``fedem-synthetic``: keep the released generator's row-offset bug or fix it.
    train_tasks_frac : float
        Fraction of tasks that train; tasks t >= floor(frac * T) are unseen clients.
    n_test : int
        ``fedem-synthetic``'s test samples per task (0: the paper's 5000). The generator draws
        every task from one stream, so another value also changes the training sets of all
        tasks after the first (for quick tests only).
    initial_tasks : int
        OFMTL: tasks that train MOCHA first (0: 1).
    arrivals : str
        OFMTL: the order in which the dataset's tasks join: "" (task order), "shuffle" (a
        permutation drawn from the seed) or comma-separated task indices (a permutation).
    retrain_ratio : float
        OFMTL: retrain MOCHA when newcomers since the last training reach this multiple of
        that training's tasks.
    iid : bool
        ``sparse-federated``: reshuffle the rows IID across the same node sizes (FSVRGR).
    step_size : float
        FSVRG family: FSVRG's / naive FSVRG's stepsize h, GD's step, DANE's SVRG step (0: the
        method's default: h = 16 for fsvrg; 1/L for gd, L = sigma_max(X)^2 / (4 n) + lambda
        with sigma_max(X) of the pooled rows estimated by power iteration on the pooled Gram
        operator, round trips counted in ``exchanges``, the step used and L in the results'
        ``final``; each device's 1/(4 L_max) for dane; fsvrg-naive needs one). The family
        uses the paper's lambda = 1/n (the ``lambda`` key is MOCHA's).
    dane_mu : float
        DANE's proximal parameter mu >= 0 (the paper's default 0).
    checkpoint_dir : str
        Every federated strategy: write the server state there after every
        ``checkpoint_every``-th round (and the last; OFMTL: after every event), and resume
        from the newest checkpoint found there ("": off).
    checkpoint_every : int
        Rounds between checkpoints (>= 1).
    client_state_dir : str
        MOCHA, CoCoA+ and FedEM devices: keep their local state in files there as well, so it
        survives a server restart (a new Flower run); in a deployment, set it per device with
        ``--node-config "client-state-dir=..."`` ("": off).
    server_path : {"auto", "dense", "factored"}
        MOCHA: keep M = K^-1 as an m x m matrix or factored (O(m d) memory); ``auto``
        factors when m > 1000 and m > 2 d.
    min_replies : int
        MOCHA: a round counts only with at least this many valid replies.
    max_failures, probe_every : int
        MOCHA: exclude a task after ``max_failures`` consecutive failed rounds (0: never) and
        probe it every ``probe_every`` rounds until it answers.
    tasks_per_node : int
        Task packing (:mod:`fmtl_flower.packing`): 1 is one task per Flower node; K > 1
        makes one message per node carry all of its tasks. In simulation node p hosts tasks
        p K .. p K + K - 1 (so ceil(m / K) nodes); a deployed node hosts the tasks of its
        ``--node-config "task-ids='3,4,5'"``. 0 (default): automatic; ``fmtl run`` and the
        reproductions then pack by :func:`fmtl_flower.packing.auto_tasks_per_node` (MOCHA,
        CoCoA+, Mb-SDCA, Mb-SGD and FedEM's family on the in-process and Ray engines) and say
        so in the run header;
        a Flower app (``flwr run``) takes 0 as 1.
    max_row_norm : float
        The server's bound on every task's training-row norms, used to reject dual updates
        no feasible step can produce (MOCHA, CoCoA, Mb-SDCA, Mb-SGD; see the wire contract of
        :mod:`fmtl_flower.strategies.mocha`); 0: each device's ``max-row-norm`` reported at
        discovery.
    max_update_ratio : float
        FedEM and FSVRG families: a reply's model (component) may move at most this times
        max(|model|, 1) from the one sent (> 0).
    """

    strategy: str = "mocha"
    dataset: str = "synthetic"
    num_server_rounds: int = 100
    seed: int = 0
    lam: float | str = 0.1
    omega: str = "probabilistic"
    omega_every: int = 10
    omega_eps: float = 1e-3
    lambda2: float | None = None
    s2: float = 0.0
    eta: float = 0.0
    clusters: int = 0
    gamma: float = 1.0
    theta: float = 0.5
    beta: float = 1.0
    local_frac: float = 1.0
    sigma_mode: str = "global"
    sys_het: str = "none"
    sys_het_base: str = "n_min"
    drop_prob: float = 0.0
    test_frac: float = 0.25
    eval_every: int = 1
    network: str = "lte"
    time_model: str = "physical"
    clock_cycle: float = 0.0
    round_timeout: float = 120.0
    skew: float = 0.0
    num_tasks: int = 0
    dim: int = 0
    samples_per_task: int = 0
    results_file: str = ""
    model: str = "auto"
    hidden: int = 32
    num_components: int = 4
    lr: float = 0.3
    batch_size: int = 128
    local_epochs: int = 1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    lr_schedule: str = "constant"
    fraction: float = 1.0
    aggregation: str = "all"
    prox_mu: float = 0.1
    finetune_epochs: int = 1
    cfl_eps1: float = 0.4
    cfl_eps2: float = 1.6
    pfedme_lambda: float = 15.0
    pfedme_lr: float = 0.05
    pfedme_steps: int = 5
    pfedme_beta: float = 1.0
    generator: str = "released"
    train_tasks_frac: float = 1.0
    n_test: int = 0
    initial_tasks: int = 0
    arrivals: str = ""
    retrain_ratio: float = 1.5
    iid: bool = False
    step_size: float = 0.0
    dane_mu: float = 0.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 1
    client_state_dir: str = ""
    server_path: str = "auto"
    min_replies: int = 1
    max_failures: int = 3
    probe_every: int = 5
    tasks_per_node: int = 0
    max_row_norm: float = 0.0
    max_update_ratio: float = 1e4

    @property
    def model_family(self) -> str:
        """The model family ``model`` resolves to for this strategy."""
        if self.model != "auto":
            return self.model
        if self.strategy in ("local", "global") and self.dataset != "fedem-synthetic":
            return "svm"  # the MOCHA paper's baselines
        return "logistic"

    @property
    def is_fedem_family(self) -> bool:
        """Whether the run uses FedEM's strategy and clients."""
        return self.strategy in FEDEM_FAMILY or (
            self.strategy == "local" and self.model_family != "svm")

    @classmethod
    def keys(cls) -> list[str]:
        """The kebab-case keys, in declaration order."""
        return [_to_key(f.name) for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: RunConfig | None = None,
                     ignore_unknown: bool = False) -> RunConfig:
        """Validate ``values`` (kebab-case keys) on top of ``base`` (default: the defaults)."""
        out = dataclasses.asdict(base or cls())
        known = {_to_key(name): name for name in out}
        for key, raw in values.items():
            if key not in known:
                if ignore_unknown:
                    continue
                raise ConfigError(
                    f"unknown run-config key {key!r}; known keys: {', '.join(sorted(known))}"
                )
            out[known[key]] = _PARSE[key](key, raw)
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        """Kebab-case mapping of every key (for results JSON and ``--run-config``)."""
        return {_to_key(k): v for k, v in dataclasses.asdict(self).items()}


_KEY_NAMES = {"lam": "lambda", "num_components": "M"}


def _to_key(field_name: str) -> str:
    return _KEY_NAMES.get(field_name, field_name.replace("_", "-"))


_PARSE = {
    "strategy": lambda k, v: _as_choice(k, v, STRATEGIES),
    "dataset": lambda k, v: _nonempty(k, v),
    "num-server-rounds": lambda k, v: as_int(k, v, 1),
    "seed": lambda k, v: as_int(k, v, 0),
    "lambda": _as_lambda,
    "omega": lambda k, v: _as_choice(
        k, v, ("identity", "mean", "probabilistic", "clustered", "graphical")),
    "lambda2": lambda k, v: _optional_float(k, v, lo=0.0),
    "s2": lambda k, v: as_float(k, v, lo=0.0),
    "eta": lambda k, v: as_float(k, v, lo=0.0),
    "clusters": lambda k, v: as_int(k, v, 0),
    "gamma": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, lo_open=True),
    "theta": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, lo_open=True, hi_open=True),
    "beta": lambda k, v: as_float(k, v, lo=0.0),
    "omega-every": lambda k, v: as_int(k, v, 0),
    "omega-eps": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, lo_open=True, hi_open=True),
    "local-frac": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "sigma-mode": lambda k, v: _as_choice(k, v, ("global", "per-task", "spectral")),
    "sys-het": lambda k, v: _as_choice(k, v, ("none", "low", "high")),
    "sys-het-base": lambda k, v: _as_choice(k, v, ("n_min", "n_t")),
    "drop-prob": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, hi_open=True),
    "test-frac": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, hi_open=True),
    "eval-every": lambda k, v: as_int(k, v, 1),
    "network": lambda k, v: _as_choice(k, v, ("wifi", "lte", "3g")),
    "time-model": lambda k, v: _as_choice(k, v, ("physical", "reference")),
    "clock-cycle": lambda k, v: as_float(k, v, lo=0.0),
    "round-timeout": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "skew": lambda k, v: _skew(k, v),
    "num-tasks": lambda k, v: as_int(k, v, 0),
    "dim": lambda k, v: as_int(k, v, 0),
    "samples-per-task": lambda k, v: as_int(k, v, 0),
    "results-file": lambda k, v: str(v),
    "model": lambda k, v: _as_choice(k, v, MODELS),
    "hidden": lambda k, v: as_int(k, v, 1),
    "M": lambda k, v: as_int(k, v, 1),
    "lr": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "batch-size": lambda k, v: as_int(k, v, 1),
    "local-epochs": lambda k, v: as_int(k, v, 1),
    "momentum": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, hi_open=True),
    "weight-decay": lambda k, v: as_float(k, v, lo=0.0),
    "lr-schedule": lambda k, v: _as_choice(k, v, ("constant", "multi-step")),
    "fraction": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, lo_open=True),
    "aggregation": lambda k, v: _as_choice(k, v, ("all", "sampled")),
    "prox-mu": lambda k, v: as_float(k, v, lo=0.0),
    "finetune-epochs": lambda k, v: as_int(k, v, 0),
    "cfl-eps1": lambda k, v: as_float(k, v, lo=0.0),
    "cfl-eps2": lambda k, v: as_float(k, v, lo=0.0),
    "pfedme-lambda": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "pfedme-lr": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "pfedme-steps": lambda k, v: as_int(k, v, 1),
    "pfedme-beta": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "generator": lambda k, v: _as_choice(k, v, ("released", "fixed")),
    "train-tasks-frac": lambda k, v: as_float(k, v, lo=0.0, hi=1.0, lo_open=True),
    "n-test": lambda k, v: as_int(k, v, 0),
    "initial-tasks": lambda k, v: as_int(k, v, 0),
    "arrivals": lambda k, v: _arrivals(k, v),
    "retrain-ratio": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
    "iid": lambda k, v: _as_bool(k, v),
    "step-size": lambda k, v: as_float(k, v, lo=0.0),
    "dane-mu": lambda k, v: as_float(k, v, lo=0.0),
    "checkpoint-dir": lambda k, v: str(v).strip(),
    "checkpoint-every": lambda k, v: as_int(k, v, 1),
    "client-state-dir": lambda k, v: str(v).strip(),
    "server-path": lambda k, v: _as_choice(k, v, ("auto", "dense", "factored")),
    "min-replies": lambda k, v: as_int(k, v, 0),
    "max-failures": lambda k, v: as_int(k, v, 0),
    "probe-every": lambda k, v: as_int(k, v, 1),
    "tasks-per-node": lambda k, v: as_int(k, v, 0),
    "max-row-norm": lambda k, v: as_float(k, v, lo=0.0),
    "max-update-ratio": lambda k, v: as_float(k, v, lo=0.0, lo_open=True),
}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _arrivals(key: str, value: Any) -> str:
    out = str(value).strip()
    if out in ("", "shuffle"):
        return out
    try:
        order = [int(p) for p in out.split(",")]
    except ValueError:
        raise ConfigError(f"{key}: '', 'shuffle' or comma-separated task indices, got "
                          f"{value!r}") from None
    if sorted(order) != list(range(len(order))):
        raise ConfigError(f"{key}: must be a permutation of 0..{len(order) - 1}, got {out!r}")
    return ",".join(map(str, order))


def _optional_float(key: str, value: Any, lo: float) -> float | None:
    """None for an unset key (None, or "" as the wire's default), else a float >= ``lo``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return as_float(key, value, lo=lo)


def _skew(key: str, value: Any) -> float:
    out = as_float(key, value, lo=0.0)
    if 0.0 < out <= 1.0:
        raise ConfigError(f"{key}: a size ratio > 1 (or 0 for none), got {out}")
    return out


def _nonempty(key: str, value: Any) -> str:
    out = str(value).strip()
    if not out:
        raise ConfigError(f"{key}: must not be empty")
    return out


def split_set_option(pair: str) -> tuple[str, str]:
    """``"key=value"`` (one ``--set`` option) as ``(key, value)``, both stripped."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
    return key.strip(), value.strip()


def parse_set_options(pairs: list[str]) -> dict[str, str]:
    """Turn ``["key=value", ...]`` (``--set`` options) into a dict, with clear errors."""
    return dict(split_set_option(pair) for pair in pairs)
