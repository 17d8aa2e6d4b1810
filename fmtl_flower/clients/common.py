"""Helpers shared by the ClientApp handlers."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from ..checkpoint import state_file_path
from ..core.hinge import classification_errors
from ..core.multiclass import Lifting, class_indices, lift, multiclass_errors, with_intercept
from ..data.validation import node_task_id, validate_task
from ..wire import from_array, to_array

DataLoader = Callable[[Context], tuple[np.ndarray, ...]]
TaskIdFn = Callable[[Context], int]


@dataclass(frozen=True)
class LocalTask:
    """The data one device holds for its task as MOCHA sees it (validated, float64, labels
    in {-1, +1}; lifted and with the intercept column when the run asks,
    :func:`prepare_task`).

    ``blocks`` is K of a multi-class run (1: binary): ``X_test`` then holds the test
    features (intercept column included, not lifted) and ``test_classes`` their class
    indices; the test error is the argmax's (:func:`eval_metrics`)."""

    task_id: int
    X: np.ndarray
    y: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    sqnorm: np.ndarray
    fingerprint: str = ""  # of (X, y): the dual state is bound to it
    blocks: int = 1
    test_classes: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def dim(self) -> int:
        return self.X.shape[1]


@dataclass(frozen=True)
class DeviceData:
    """What a linear-task device's loader returned, checked: features float64 (finite,
    train and test of the same width) and the labels as given (any values: the run decides
    what they mean, :func:`prepare_task`)."""

    task_id: int
    X: np.ndarray
    labels: np.ndarray
    X_test: np.ndarray
    labels_test: np.ndarray

    @classmethod
    def of(cls, task_id: int, loaded: tuple[Any, ...]) -> DeviceData:
        """Check a loader's ``(X, y)`` or ``(X, y, X_test, y_test)``; ValueError naming the
        task otherwise."""
        if len(loaded) == 2:
            X, y = loaded
            X_test, y_test = np.zeros((0, np.shape(X)[1])), np.zeros(0)
        elif len(loaded) == 4:
            X, y, X_test, y_test = loaded
        else:
            raise ValueError("load_data must return (X, y) or (X, y, X_test, y_test)")
        X, y = _features(X, y, f"task {task_id} (train)")
        if len(y_test):
            X_test, y_test = _features(X_test, y_test, f"task {task_id} (test)")
            if X_test.shape[1] != X.shape[1]:
                raise ValueError(f"task {task_id}: test data has {X_test.shape[1]} features, "
                                 f"train data {X.shape[1]}")
        else:
            X_test, y_test = np.zeros((0, X.shape[1])), np.zeros(0)
        return cls(task_id, X, y, X_test, y_test)


def _features(X: Any, y: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(X as :func:`~fmtl_flower.data.validation.validate_task` checks it, the labels as a
    1-D array of len(X); numeric labels finite)."""
    labels = np.asarray(y)
    if labels.ndim == 2 and 1 in labels.shape:
        labels = labels.reshape(-1)
    if labels.ndim != 1:
        raise ValueError(f"{name}: y must be a vector (n,), (n, 1) or (1, n), got shape "
                         f"{labels.shape}")
    X, _ = validate_task(X, np.ones(labels.shape[0]), name=name)
    if labels.dtype.kind in "fc" and not np.isfinite(labels).all():
        raise ValueError(f"{name}: y contains {int(np.count_nonzero(~np.isfinite(labels)))} "
                         "non-finite value(s) (NaN or Inf)")
    return X, labels


def prepare_task(data: DeviceData, lifting: Lifting, labels: str) -> LocalTask:
    """The device's task as the run's ``lifting`` (:mod:`fmtl_flower.core.multiclass`)
    makes it: without a class list, today's binary labels (``labels``: ``"pm1"`` or
    ``"auto"``, :func:`hinge_labels`); with two classes c_0 -> -1, c_1 -> +1; with more,
    the one-vs-rest lifting; the intercept column appended first when the run fits one."""
    tid, scaling = data.task_id, lifting.intercept_scaling
    X, X_test = with_intercept(data.X, scaling), with_intercept(data.X_test, scaling)
    test_classes = None
    if lifting.classes is None:
        y = _binary(data.labels, labels, f"task {tid} (train)")
        y_test = _binary(data.labels_test, labels, f"task {tid} (test)")
    else:
        index = class_indices(data.labels, lifting.classes, f"task {tid} (train)")
        test_index = class_indices(data.labels_test, lifting.classes, f"task {tid} (test)")
        if lifting.blocks == 1:
            y, y_test = _pm1(index == 1), _pm1(test_index == 1)
        else:
            X, y = lift(X, index, lifting.blocks)
            y_test, test_classes = np.zeros(0), test_index
    sqnorm = np.einsum("ij,ij->i", X, X)
    return LocalTask(tid, X, y, X_test, y_test, sqnorm, data_fingerprint(X, y),
                     blocks=lifting.blocks, test_classes=test_classes)


def data_fingerprint(*arrays: np.ndarray) -> str:
    """A cheap fingerprint of a device's training data (hex of a 64-bit BLAKE2b over the
    arrays' shapes, dtypes and bytes): stored with the dual state, so that state kept for
    other data is never resumed (one pass over the data, about 1 GB/s)."""
    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape};".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _pm1(positive: np.ndarray) -> np.ndarray:
    return np.where(positive, 1.0, -1.0)


def _binary(y: np.ndarray, labels: str, name: str) -> np.ndarray:
    """Today's binary labels: ``y`` through :func:`hinge_labels`, checked to be -1/+1."""
    if y.size == 0:
        return np.zeros(0)
    y = hinge_labels(y, labels)
    if np.asarray(y).dtype.kind not in "biuf":
        raise ValueError(f"{name}: labels must be in {{-1, 1}} (labels={labels!r}); found "
                         f"{label_preview(y)}: build the ClientApp with labels=\"auto\" for "
                         "other labels (any K classes)")
    return validate_task(np.zeros((len(y), 1)), y, labels="pm1", name=name)[1]


def label_preview(y: np.ndarray) -> str:
    """Up to 5 of ``y``'s distinct values, for an error message."""
    values = np.unique(y)
    return f"{values[:5].tolist()}" + (f" ({values.size} distinct)" if values.size > 5 else "")


def read_instruction(msg: Message, task: LocalTask, name: str
                     ) -> tuple[dict[str, Any], np.ndarray, dict[str, Array]]:
    """A MOCHA or Mb-SGD instruction to ``task``'s node: its ``config`` values (a plain dict,
    read once; each key is checked where it is used, :func:`config_value`), its model ``w``
    (finite float64 of the task's dimension) and its ``arrays`` (a plain dict); ValueError
    naming what is wrong."""
    content = dict(msg.content.items())  # one read of each record; plain dicts below
    if "config" not in content or "arrays" not in content:
        raise ValueError(f"{name} message needs 'config' and 'arrays' records")
    config = dict(content["config"].items())
    tid = config_value(config, "task-id", int)
    if tid != task.task_id:
        raise ValueError(f"message for task {tid} reached the node of task {task.task_id}")
    arrays = dict(content["arrays"].items())
    if "w" not in arrays:
        raise ValueError(f"{name} message lacks array 'w'")
    w = from_array(arrays["w"])
    if w.dtype != np.float64 or w.shape != (task.dim,) or not np.isfinite(w).all():
        raise ValueError(f"'w' must be finite float64 of shape ({task.dim},), "
                         f"got {w.dtype} {w.shape}")
    return config, w, arrays



def lifting_of(msg: Message) -> Lifting:
    """The lifting a MOCHA message's config asks for (``classes``, ``intercept-scaling``:
    :meth:`~fmtl_flower.core.multiclass.Lifting.config`; none without a config record:
    :func:`read_instruction` says what is missing); ValueError if malformed."""
    if "config" not in msg.content:
        return Lifting()
    config = msg.content["config"]
    return Lifting.from_config({k: config[k] for k in ("classes", "intercept-scaling")
                                if k in config})


def eval_metrics(task: LocalTask, w: np.ndarray, config: Mapping[str, Any]) -> dict[str, int]:
    """``test-errors`` and ``test-n`` of ``w`` on the task's test data when the instruction
    says ``eval``; nothing otherwise."""
    if "eval" in config and config_value(config, "eval", bool):
        return {"test-errors": test_errors(task, w), "test-n": int(task.X_test.shape[0])}
    return {}


def test_errors(task: LocalTask, w: np.ndarray) -> int:
    """Test samples ``w`` gets wrong: the sign's for a binary task, the argmax's over the
    K blocks of a multi-class one."""
    if task.blocks > 1:
        assert task.test_classes is not None
        return multiclass_errors(task.X_test, task.test_classes, w, task.blocks)
    return classification_errors(task.X_test, task.y_test, w)


def config_value(config: Mapping[str, Any], key: str, kind: type) -> Any:
    """``config[key]`` checked to be of ``kind`` (int, float, str or bool; no bool for numbers)."""
    value = config.get(key)
    if type(value) is kind and (kind is not float or math.isfinite(value)):
        return value  # the common case in one test; anything else is looked at below
    if key not in config:
        raise ValueError(f"message config lacks {key!r}")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"message config {key!r} must be an int, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"message config {key!r} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"message config {key!r} is not finite: {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"message config {key!r} must be a string, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"message config {key!r} must be a bool, got {value!r}")
    return value


def default_task_id(context: Context) -> int:
    """``task-id`` from the node config (deployments), else ``partition-id`` (simulation)."""
    return node_task_id(
        context.node_config,
        "this node has no task id: start the SuperNode with --node-config \"task-id=N\" "
        "(or partition-id=N)",
    )


class TaskClientApp(ClientApp):
    """Flower's ``ClientApp`` that hands a ``train``, ``evaluate`` or ``query.whoami``
    message straight to the function registered for it (with its mods, as Flower registers
    it) while the app has no lifespan function; anything else, or an app given a lifespan
    function, goes through Flower's ``ClientApp.__call__`` (its message-type checks and
    routing, which cost a few microseconds per message)."""

    #: Message type -> the name Flower registers its function under.
    ROUTES = {"train": "train.default", "evaluate": "evaluate.default",
              "query.whoami": "query.whoami"}

    def __init__(self) -> None:
        super().__init__()
        self._plain = getattr(self, "_lifespan", None)  # Flower's default: no lifespan

    def __call__(self, message: Message, context: Context) -> Message:
        """Run the handler of ``message``'s type (Flower's ``ClientApp.__call__``)."""
        name = self.ROUTES.get(message.metadata.message_type)
        handler = getattr(self, "_registered_funcs", {}).get(name) if name else None
        if handler is not None and self._plain is not None \
                and getattr(self, "_lifespan", None) is self._plain:
            return handler(message, context)
        return super().__call__(message, context)


def client_app_for(client: Any) -> ClientApp:
    """A ClientApp (:class:`TaskClientApp`) routing ``query.whoami``, ``train`` and
    ``evaluate`` to ``client``'s handlers of the same names."""
    app = TaskClientApp()
    app.query("whoami")(client.whoami)
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    return app


def state_dir_of(context: Context, default_dir: str | None = None) -> Path | None:
    """The device's ``client-state-dir``: of the node config, else of the run config, else
    ``default_dir``; None when none is set."""
    for config in (context.node_config, context.run_config):
        if "client-state-dir" in config and str(config["client-state-dir"]):
            return Path(str(config["client-state-dir"]))
    return Path(default_dir) if default_dir else None


def state_file_for(context: Context, kind: str, task_id: int,
                   default_dir: str | None = None) -> Path | None:
    """Where a device keeps ``kind``'s state for ``task_id``: under ``client-state-dir`` of the
    node config, else of the run config, else ``default_dir``; None when none is set."""
    directory = state_dir_of(context, default_dir)
    return None if directory is None else state_file_path(directory, kind, task_id)


def use_kernel_cache(context: Context, default_dir: str | None = None) -> None:
    """Keep numba's compiled kernels in ``<client-state-dir>/numba-cache`` when the device has
    a state directory (a fresh ClientApp process per message then loads them instead of
    compiling); without one numba's default cache is used (:mod:`fmtl_flower.core.jit`)."""
    from ..core import jit  # the kernels' module (numba); FedEM's clients never load it

    directory = state_dir_of(context, default_dir)
    if directory is not None:
        jit.use_cache_dir(directory / "numba-cache")


def stacked_reply_arrays(metrics: Sequence[Mapping[str, Any]], ints: Sequence[str],
                         floats: Sequence[str], matrix: str | None = None,
                         rows: Sequence[np.ndarray] = (), dim: int = 0,
                         matrix_dtype: type = np.float64) -> ArrayRecord:
    """A stacked reply's ``arrays`` record (:mod:`fmtl_flower.packing`): each of ``ints``
    an int64 vector and each of ``floats`` a float64 vector over the replying slots'
    ``metrics``, and ``matrix`` (when given) the slots' ``rows`` stacked as a
    ``matrix_dtype`` (k, d) array ((0, ``dim``) when no slot replied)."""
    out = {key: to_array(np.array([m[key] for m in metrics], dtype=np.int64)) for key in ints}
    for key in floats:
        out[key] = to_array(np.array([m[key] for m in metrics], dtype=np.float64))
    if matrix is not None:
        stacked = np.stack(rows).astype(matrix_dtype, copy=False) if len(rows) \
            else np.zeros((0, dim), dtype=matrix_dtype)
        out[matrix] = to_array(stacked)
    return ArrayRecord(out)


def protocol_rounds(config: Mapping[str, Any]) -> tuple[int, int, str | None]:
    """``(last-accepted-round, checkpoint-round or -1, run-token or None)`` of a
    dual-protocol message, checked against ``server-round`` (:func:`run_token`)."""
    last_accepted = config_value(config, "last-accepted-round", int)
    server_round = config_value(config, "server-round", int)
    if not 0 <= last_accepted <= server_round:
        raise ValueError(f"last-accepted-round {last_accepted} outside 0..server-round "
                         f"({server_round})")
    checkpoint_round = -1
    if "checkpoint-round" in config:
        checkpoint_round = config_value(config, "checkpoint-round", int)
    return last_accepted, checkpoint_round, run_token(config)


def run_token(config: Mapping[str, Any]) -> str | None:
    """The message's ``run-token`` (the run's identity,
    :mod:`fmtl_flower.strategies.base`), None when it carries none or "" (a strategy driven
    by hand); ValueError unless it is a string."""
    return (config_value(config, "run-token", str) or None) if "run-token" in config else None


#: ``labels`` of a hinge-model ClientApp: ``"pm1"`` requires -1/+1; ``"auto"`` also takes 0/1
#: (0 -> -1, 1 -> +1, the same on every device).
HINGE_LABELS = ("pm1", "auto")


def hinge_labels(y: Any, labels: str) -> Any:
    """``y`` as a hinge model takes it: unchanged for ``labels="pm1"`` (checked later) or
    when its values are -1/+1; 0/1 (or booleans) mapped to -1/+1 for ``labels="auto"``.
    Any other label set is left as it is, for the check to name the values."""
    if labels not in HINGE_LABELS:
        raise ValueError(f"labels must be one of {HINGE_LABELS}, got {labels!r}")
    y = np.asarray(y)
    if labels == "pm1" or y.size == 0:
        return y
    values = np.unique(y)
    if np.isin(values, (0, 1)).all():
        return np.where(y.astype(np.float64) > 0, 1.0, -1.0).reshape(y.shape)
    return y
