"""ClientApp handlers of FedEM and its baselines (FedAvg, FedProx, FedAvg+, IFCA, CFL, pFedMe,
local).

The wire contract is documented in :mod:`fmtl_flower.strategies.fedem`. A device keeps in
``context.state`` (ArrayRecord ``fedem.arrays``; ConfigRecord ``fedem.meta``) its mixture
weights ``pi`` (M,), its per-component momentum buffers (M, P) and, for ``local``, its own
models (M, P); none of them ever leaves the device. ``fedem.meta`` holds a signature of the
setting (method, model, M, P): state written under another setting is discarded, never mixed.

Resume. The device keeps two slots, the state after its newest training round and the one
before it (``fedem.previous.*``), each with its round. A ``train`` message of round R uses the
newest slot written before round R, an ``evaluate`` of round R the newest up to R. So when a
server killed during round R resumes from its checkpoint of round R - 1 and sends round R
again, the device starts from the same state as the first time and the resumed run matches an
uninterrupted one bit for bit (checkpoint every round; with sparser checkpoints a device whose
slots are all too new starts afresh, never mixed). With ``client-state-dir`` (node config,
run config, or the ``state_dir`` argument) the slots are also kept in
``<dir>/fedem-task-<id>.npz`` (atomic, no pickle) and read when ``context.state`` is empty,
i.e. in a new Flower run.

Labels: {0, 1} or 0..C-1 as given; {-1, +1} (the MOCHA datasets) are mapped to {0, 1}.

Build a FedEM ClientApp over your own data with :func:`make_fedem_client_app`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from ..checkpoint import CheckpointError, read_state_file, write_state_file
from ..core.fedem import (
    PI_FLOOR,
    LocalUpdate,
    check_simplex,
    component_losses,
    fit_mixture_weights,
    local_update,
    mixture_proba,
)
from ..core.labels import labels_as_classes
from ..core.local_sgd import SGDConfig
from ..core.models import Model, make_model
from ..core.pfedme import PFedMeConfig, local_pass
from ..core.privacy import clip_towards
from ..core.rng import TAG_FEDEM_FINETUNE, TAG_FEDEM_TRAIN
from ..wire import from_array, to_array
from .common import (
    DataLoader,
    TaskIdFn,
    client_app_for,
    config_value,
    default_task_id,
    state_file_for,
)

STATE_ARRAYS = "fedem.arrays"
STATE_META = "fedem.meta"
PREVIOUS = "fedem.previous"  # prefix of the older slot's records
TAG_TRAIN, TAG_FINETUNE = TAG_FEDEM_TRAIN, TAG_FEDEM_FINETUNE
METHODS = ("fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "ifca", "cfl", "pfedme",
           "local")
#: Methods whose device picks, among the components it receives, the one of lowest loss.
PICK_BEST = ("clustered", "ifca")



@dataclass(frozen=True)
class ClientData:
    """One device's data for the FedEM family (float64 features, int64 classes)."""

    task_id: int
    X: np.ndarray
    y: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def num_classes(self) -> int:
        """Classes seen on this device (at least 2)."""
        top = max(int(self.y.max(initial=0)), int(self.y_test.max(initial=0)))
        return max(2, top + 1)


class FedEMClient:
    """Device-side handlers of the FedEM family over a user-supplied data loader.

    Parameters
    ----------
    load_data : callable
        ``load_data(context)`` returns ``(X, y, X_test, y_test)`` (or ``(X, y)``): samples as
        rows. Called once per node and run, then cached.
    task_id : callable, optional
        ``task_id(context) -> int``; default: ``task-id`` or ``partition-id`` of the node
        config.
    state_dir : str, optional
        ``client-state-dir`` to use when neither the node config nor the run config sets it.
    """

    def __init__(self, load_data: DataLoader, task_id: TaskIdFn | None = None,
                 state_dir: str | None = None) -> None:
        self._load_data = load_data
        self._task_id = task_id or default_task_id
        self._state_dir = state_dir or None
        self._cache: dict[tuple[int, int], ClientData] = {}
        self._models: dict[tuple[str, int, int, int], Model] = {}

    # -- data and model ----------------------------------------------------------------------
    def client_data(self, context: Context) -> ClientData:
        """The node's validated data (:meth:`read_client_data`, loaded once per node and
        run)."""
        key = (int(context.run_id), int(context.node_id))
        data = self._cache.get(key)
        if data is None:
            data = self.read_client_data(context)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = data
        return data

    def read_client_data(self, context: Context) -> ClientData:
        """The node's data, loaded and validated (not cached): :meth:`features`, then the
        labels as int64 classes."""
        tid = int(self._task_id(context))
        name = f"task {tid}"
        X, y, X_test, y_test = self.features(self._load_data(context), name)
        y = labels_as_classes(y, name)
        y_test = labels_as_classes(y_test, name + " (test)")
        if y.shape[0] != X.shape[0] or y_test.shape[0] != X_test.shape[0]:
            raise ValueError(f"{name}: X and y lengths differ")
        return ClientData(tid, X, y, X_test, y_test)

    @staticmethod
    def features(loaded, name: str) -> tuple[np.ndarray, Any, np.ndarray, Any]:
        """``load_data``'s output as checked float64 (n, d) features and raw labels:
        ``(X, y, X_test, y_test)`` or ``(X, y)`` (no test set)."""
        if len(loaded) == 2:
            X, y = loaded
            X_test, y_test = np.zeros((0, np.shape(X)[1])), np.zeros(0)
        else:
            X, y, X_test, y_test = loaded
        X = np.ascontiguousarray(X, dtype=np.float64)
        X_test = np.ascontiguousarray(X_test, dtype=np.float64)
        if X.ndim != 2 or X.shape[0] < 1 or X_test.ndim != 2 or X_test.shape[1] != X.shape[1]:
            raise ValueError(f"{name}: X must be (n >= 1, d) and X_test (n_test, d); got "
                             f"{X.shape} and {X_test.shape}")
        if not (np.all(np.isfinite(X)) and np.all(np.isfinite(X_test))):
            raise ValueError(f"{name}: features must be finite")
        return X, y, X_test, y_test

    def model(self, config: Mapping[str, Any], dim: int) -> Model:
        """The model family the message names (cached)."""
        name = config_value(config, "model", str)
        classes = config_value(config, "num-classes", int)
        hidden = config_value(config, "hidden", int)
        key = (name, dim, classes, hidden)
        if key not in self._models:
            self._models[key] = make_model(name, dim, num_classes=classes, hidden=hidden)
        return self._models[key]

    # -- handlers ----------------------------------------------------------------------------
    def whoami(self, msg: Message, context: Context) -> Message:
        """Reply ``info``: ``task-id``, ``n-train``, ``n-test``, ``dim``, ``num-classes``."""
        data = self.client_data(context)
        info = ConfigRecord({"task-id": data.task_id, "n-train": data.n,
                             "n-test": int(data.X_test.shape[0]), "dim": int(data.X.shape[1]),
                             "num-classes": data.num_classes})
        return Message(RecordDict({"info": info}), reply_to=msg)

    def train(self, msg: Message, context: Context) -> Message:
        """E-step, pi update and local SGD on the components (one component for IFCA; the
        device's own model for ``local``; CFL trains its cluster's model as FedAvg does;
        pFedMe's local pass, :func:`fmtl_flower.core.pfedme.local_pass`, keeping theta_i);
        reply the updated components."""
        data = self.client_data(context)
        config, components, method, model = self._read_instruction(msg, data)
        rnd = config_value(config, "server-round", int)
        stored = self._state(context, method, components, before=rnd)
        metrics, arrays, state = self.train_task(data, config, components, method, model,
                                                 stored)
        self._write_state(context, method, state, rnd)
        reply = {k: to_array(v) for k, v in arrays.items()}
        return Message(RecordDict({"arrays": ArrayRecord(reply),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Test accuracy of the device's personalised predictor (:meth:`evaluate_task`)."""
        data = self.client_data(context)
        config, components, method, model = self._read_instruction(msg, data)
        rnd = config_value(config, "server-round", int)
        stored = self._state(context, method, components, before=rnd + 1)
        metrics = self.evaluate_task(data, config, components, method, model, stored)
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    # -- one task's work (the unpacked handlers and the stacked ones of packed_fedem) --------
    def train_task(self, data: ClientData, config: Mapping[str, Any], components: np.ndarray,
                   method: str, model: Model, stored: StoredState
                   ) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """One task's ``train`` work from its checked instruction and stored state:
        ``(reply metrics, reply arrays, state arrays to store)``; touches no record."""
        rnd = config_value(config, "server-round", int)
        sgd = self._sgd_config(config)
        pi, momentum, own = stored
        if method == "local":
            components = own if own is not None else components
        rng = np.random.default_rng([config_value(config, "seed", int), data.task_id, rnd,
                                     TAG_TRAIN])
        if method == "pfedme":
            update = self._pfedme_update(model, components, config, data, rng)
        else:
            update = local_update(model, components, pi, momentum, data.X, data.y, sgd, rng,
                                  mode="cluster" if method in PICK_BEST else "mixture",
                                  pi_floor=config_value(config, "pi-floor", float))
        state = {"pi": update.pi, "momentum": update.momentum}
        if method == "local":
            state["own"] = update.components
        if method == "pfedme":  # theta_i kept; pFedMe's steps have no optimiser state
            state["own"], state["momentum"] = update.momentum, np.zeros_like(update.momentum)
        metrics = {"task-id": data.task_id, "round": rnd, "n-train": data.n,
                   "train-loss": update.train_loss, "e-step-s": update.estep_s,
                   "train-s": update.train_s}
        sent = update.components
        if "dp-clip" in config:  # client-level DP, client-clip: this device clips its update
            sent = clip_towards(components, sent, config_value(config, "dp-clip", float))
        return metrics, {"components": sent, "weights": update.weights,
                         "responsibility": update.pi}, state

    def evaluate_task(self, data: ClientData, config: Mapping[str, Any],
                      components: np.ndarray, method: str, model: Model,
                      stored: StoredState) -> dict[str, Any]:
        """One task's ``evaluate`` metrics from its checked instruction and stored state.

        fedem: the pi-weighted mixture (an ``unseen`` device first fits pi by EM on its own
        training split, to convergence); fedavg / fedprox: the global model; fedavg-ft: the
        global model fine-tuned locally; clustered / ifca: the component of lowest training
        loss; cfl: its cluster's model (a held-out device receives every cluster's model and
        takes the one of lowest training loss); pfedme: the personalised model theta_i of
        its last training round (a device without one runs pFedMe's local pass from the
        global model first); local: the device's own model.
        """
        rnd = config_value(config, "server-round", int)
        unseen = config_value(config, "unseen", bool)
        pi, _, own = stored
        iterations = 0
        losses = None
        if method == "local" and own is not None:
            components = own
        if method == "pfedme":  # the personalised model; a device that never trained
            if own is None:     # (held out) personalises from the global model first
                rng = np.random.default_rng([config_value(config, "seed", int), data.task_id,
                                             rnd, TAG_FINETUNE])
                own = self._pfedme_update(model, components, config, data, rng).momentum
            components = own
        if method == "fedavg-ft":
            rng = np.random.default_rng([config_value(config, "seed", int), data.task_id, rnd,
                                         TAG_FINETUNE])
            epochs = config_value(config, "finetune-epochs", int)
            if epochs > 0:
                tune = SGDConfig(lr=config_value(config, "lr", float),
                                 momentum=config_value(config, "momentum", float),
                                 weight_decay=config_value(config, "weight-decay", float),
                                 batch_size=config_value(config, "batch-size", int),
                                 epochs=epochs)
                tuned, _, _ = model.sgd_epochs(components[0], np.zeros_like(components[0]),
                                               data.X, data.y, np.ones(data.n), tune, rng)
                components = tuned[None, :]
        losses = component_losses(model, components, data.X, data.y)
        if method in PICK_BEST or (method == "cfl" and components.shape[0] > 1):
            pi = np.zeros(components.shape[0])
            pi[int(np.argmin(losses.mean(axis=1)))] = 1.0
        elif method == "fedem" and unseen:
            pi, iterations = fit_mixture_weights(losses, floor=config_value(config, "pi-floor",
                                                                            float))
        elif components.shape[0] == 1:
            pi = np.ones(1)
        train_loss = float(-np.log(np.maximum(
            (mixture_proba(model, components, pi, data.X))[np.arange(data.n), data.y],
            1e-300)).mean())
        correct = 0
        if data.X_test.shape[0]:
            proba = mixture_proba(model, components, pi, data.X_test)
            correct = int(np.count_nonzero(np.argmax(proba, axis=1) == data.y_test))
        return {"task-id": data.task_id, "round": rnd, "n-train": data.n,
                "train-loss": train_loss, "test-correct": correct,
                "test-n": int(data.X_test.shape[0]), "em-iterations": iterations}

    # -- helpers -----------------------------------------------------------------------------
    def _read_instruction(self, msg: Message, data: ClientData
                          ) -> tuple[ConfigRecord, np.ndarray, str, Model]:
        if "config" not in msg.content or "arrays" not in msg.content:
            raise ValueError("message lacks the 'config' or 'arrays' record")
        config = msg.content["config"]
        arrays = msg.content["arrays"]
        components, method, model = self.check_instruction(
            config, arrays["components"] if "components" in arrays else None, data)
        return config, components, method, model

    def check_instruction(self, config: Mapping[str, Any], components: Any, data: ClientData,
                          checked: set[tuple[int, int]] | None = None
                          ) -> tuple[np.ndarray, str, Model]:
        """``(components float64 (M, P), method, model)`` of an instruction for ``data``'s
        task (``components`` an Array or an ndarray; None: missing); ValueError if wrong.
        ``checked`` (the stacked handler's): (id(components), id(model)) pairs already
        checked, skipped and added to."""
        if config_value(config, "task-id", int) != data.task_id:
            raise ValueError(f"message for task {config['task-id']} reached task {data.task_id}")
        method = config_value(config, "method", str)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
        model = self.model(config, data.X.shape[1])
        if components is None:
            raise ValueError("array 'components' missing")
        if not isinstance(components, np.ndarray):
            components = from_array(components)
        if components.ndim != 2 or components.shape[0] < 1:
            raise ValueError(f"'components' must be (M, P), got shape {components.shape}")
        key = (id(components), id(model))
        if checked is None or key not in checked:
            for theta in components:
                model.check_params(theta)
            if checked is not None:
                checked.add(key)
        return np.asarray(components, dtype=np.float64), method, model

    @staticmethod
    def _pfedme_update(model: Model, components: np.ndarray, config: Mapping[str, Any],
                       data: ClientData, rng: np.random.Generator) -> LocalUpdate:
        """pFedMe's local pass from the global model, as a :class:`LocalUpdate` whose
        ``momentum`` slot carries the personalised model theta_i (1, P)."""
        if components.shape[0] != 1:
            raise ValueError(f"pfedme expects one global model, got {components.shape[0]}")
        settings = PFedMeConfig(lr=config_value(config, "lr", float),
                                personal_lr=config_value(config, "pfedme-lr", float),
                                lam=config_value(config, "pfedme-lambda", float),
                                inner_steps=config_value(config, "pfedme-steps", int),
                                batch_size=config_value(config, "batch-size", int),
                                epochs=config_value(config, "local-epochs", int),
                                weight_decay=config_value(config, "weight-decay", float))
        started = time.perf_counter()
        loss = float(model.per_sample_loss(components[0], data.X, data.y).mean())
        estep_s = time.perf_counter() - started
        update = local_pass(model, components[0], data.X, data.y, settings, rng)
        return LocalUpdate(update.w[None, :], update.theta[None, :], np.ones(1),
                           np.full(1, float(data.n)), loss, estep_s, update.train_s)

    @staticmethod
    def _sgd_config(config: Mapping[str, Any]) -> SGDConfig:
        return SGDConfig(lr=config_value(config, "lr", float),
                         momentum=config_value(config, "momentum", float),
                         weight_decay=config_value(config, "weight-decay", float),
                         batch_size=config_value(config, "batch-size", int),
                         epochs=config_value(config, "local-epochs", int),
                         prox_mu=config_value(config, "prox-mu", float))

    @staticmethod
    def _signature(method: str, components: np.ndarray) -> str:
        return state_signature(method, components)

    def _state(self, context: Context, method: str, components: np.ndarray, before: int
               ) -> StoredState:
        """(pi, momentum, own models or None) of the newest slot written before round
        ``before``; fresh when there is none, or it was written under another setting."""
        if STATE_META not in context.state:
            self._load_state_file(context)
        keys = ((STATE_ARRAYS, STATE_META), (f"{PREVIOUS}.arrays", f"{PREVIOUS}.meta"))
        present = [meta_key in context.state and arrays_key in context.state
                   for arrays_key, meta_key in keys]
        newest = newest_before([context.state[meta_key].get("round", None) if ok else None
                                for ok, (_, meta_key) in zip(present, keys, strict=True)],
                               before)
        if newest is None:
            return fresh_state(components)
        arrays_key, meta_key = keys[newest]
        arrays = context.state[arrays_key]
        return stored_state(context.state[meta_key].get("signature"),
                            lambda name: from_array(arrays[name]) if name in arrays else None,
                            method, components)

    def _write_state(self, context: Context, method: str, state: dict[str, np.ndarray],
                     rnd: int) -> None:
        """Store the state after round ``rnd`` as the newest slot; the newest slot of an
        earlier round becomes the older one (a repeated round replaces its own slot)."""
        if STATE_META in context.state and STATE_ARRAYS in context.state:
            if replaces_previous(context.state[STATE_META].get("round", None), rnd):
                context.state[f"{PREVIOUS}.arrays"] = context.state[STATE_ARRAYS]
                context.state[f"{PREVIOUS}.meta"] = context.state[STATE_META]
        context.state[STATE_ARRAYS] = ArrayRecord({k: to_array(v) for k, v in state.items()})
        context.state[STATE_META] = ConfigRecord(
            {"signature": self._signature(method, state["momentum"]), "round": rnd})
        path = self._state_path(context)
        if path is not None:
            self._save_state_file(context, path)

    # -- device state file ------------------------------------------------------------------
    def _state_path(self, context: Context) -> Path | None:
        return state_file_for(context, "fedem", int(self._task_id(context)), self._state_dir)

    @staticmethod
    def _save_state_file(context: Context, path: Path) -> None:
        generations = {}
        for name, (arrays_key, meta_key) in zip(GENERATIONS, (
                (STATE_ARRAYS, STATE_META), (f"{PREVIOUS}.arrays", f"{PREVIOUS}.meta")),
                strict=True):
            if meta_key in context.state and arrays_key in context.state:
                generations[name] = ({k: from_array(v) for k, v in
                                      context.state[arrays_key].items()},
                                     dict(context.state[meta_key]))
        write_state_file(path, *state_file_content(generations))

    def _load_state_file(self, context: Context) -> None:
        """Fill an empty ``context.state`` from the device's state file, if there is one."""
        found = read_generations_file(self._state_path(context))
        for name, (arrays_key, meta_key) in zip(GENERATIONS, (
                (STATE_ARRAYS, STATE_META), (f"{PREVIOUS}.arrays", f"{PREVIOUS}.meta")),
                strict=True):
            if name in found:
                values, info = found[name]
                context.state[arrays_key] = ArrayRecord({k: to_array(v)
                                                         for k, v in values.items()})
                context.state[meta_key] = ConfigRecord(info)


# -- the device state, free of records (shared with the stacked handler of packed_fedem) -----
#: A task's stored state as the handlers use it: pi (M,), momentum (M, P), own models
#: (M, P) or None.
StoredState = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]
#: The two stored generations of a task's state, newest first.
GENERATIONS = ("latest", "previous")
#: ``{generation: (arrays, {"signature": str, "round": int})}``
Generations = dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]]


def state_signature(method: str, components: np.ndarray) -> str:
    """The setting a stored state belongs to (method, M, P)."""
    return f"{method}|{components.shape[0]}|{components.shape[1]}"


def fresh_state(components: np.ndarray) -> StoredState:
    """The state of a device with nothing stored: pi uniform, no momentum, no own models."""
    M, P = components.shape
    return np.full(M, 1.0 / M), np.zeros((M, P)), None


def newest_before(rounds: Sequence[Any], before: int) -> int | None:
    """Index of the newest generation (``rounds`` newest first; None: absent) written
    before round ``before``; None if there is none."""
    for i, rnd in enumerate(rounds):
        if isinstance(rnd, int) and not isinstance(rnd, bool) and rnd < before:
            return i
    return None


def replaces_previous(latest_round: Any, rnd: int) -> bool:
    """Whether storing round ``rnd``'s state moves the newest generation (of round
    ``latest_round``) to the older one (a repeated round replaces its own)."""
    return isinstance(latest_round, int) and latest_round < rnd


def stored_state(signature: Any, array: Callable[[str], np.ndarray | None], method: str,
                 components: np.ndarray) -> StoredState:
    """The stored generation (its ``signature`` and ``array(name)``, None when absent) as
    (pi, momentum, own); fresh when written under another setting or unusable."""
    M, P = components.shape
    if signature != state_signature(method, components):
        return fresh_state(components)
    try:
        found = {name: array(name) for name in ("pi", "momentum", "own")}
        if found["pi"] is None or found["momentum"] is None:
            raise KeyError("pi or momentum")
        pi = np.array(found["pi"], dtype=np.float64)
        momentum = np.array(found["momentum"], dtype=np.float64)
        own = np.array(found["own"], dtype=np.float64) if found["own"] is not None else None
    except (KeyError, TypeError, ValueError):
        return fresh_state(components)
    try:
        check_simplex(pi, M)
        if momentum.shape != (M, P) or (own is not None and own.shape != (M, P)):
            raise ValueError(f"stored optimiser state has shape {momentum.shape}, "
                             f"expected {(M, P)}")
        if not (np.all(np.isfinite(momentum)) and (own is None or np.all(np.isfinite(own)))):
            raise ValueError("stored optimiser state or model is not finite")
    except ValueError as err:
        log(WARNING, "FedEM client: stored state rejected (%s); starting afresh", err)
        return fresh_state(components)
    return pi, momentum, own


def state_file_content(generations: Generations
                       ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, meta)`` of a device state file (``<generation>.<name>`` arrays)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for name, (values, info) in generations.items():
        for key, value in values.items():
            arrays[f"{name}.{key}"] = value
        meta[name] = dict(info)
    return arrays, meta


def read_generations_file(path: Path | None) -> Generations:
    """The generations stored in a device state file (none if absent or unusable)."""
    if path is None or not path.exists():
        return {}
    try:
        arrays, meta = read_state_file(path)
    except CheckpointError as err:
        log(WARNING, "FedEM client: state file unusable (%s); starting afresh", err)
        return {}
    out: Generations = {}
    for name in GENERATIONS:
        names = [k for k in arrays if k.startswith(f"{name}.")]
        info = meta.get(name)
        if not names or not isinstance(info, dict) or not isinstance(
                info.get("round"), int) or not isinstance(info.get("signature"), str):
            continue
        out[name] = ({k[len(name) + 1:]: np.asarray(arrays[k], dtype=np.float64)
                      for k in names},
                     {"signature": info["signature"], "round": info["round"]})
    return out


def make_fedem_client_app(load_data: DataLoader, task_id: TaskIdFn | None = None,
                          state_dir: str | None = None) -> ClientApp:
    """A ClientApp serving the FedEM family over ``load_data(context)`` (device state files
    under ``state_dir`` unless the node or run config sets ``client-state-dir``).

    Examples
    --------
    >>> def load(context):  # doctest: +SKIP
    ...     return my_X, my_y, my_X_test, my_y_test
    >>> app = make_fedem_client_app(load)  # doctest: +SKIP
    """
    client = FedEMClient(load_data, task_id, state_dir)
    app = client_app_for(client)
    app.fedem_client = client  # type: ignore[attr-defined]  # packing's stacked handler
    return app


__all__ = ["METHODS", "PI_FLOOR", "ClientData", "FedEMClient", "labels_as_classes",
           "make_fedem_client_app"]
