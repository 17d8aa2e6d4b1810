"""Fuzzing the reply path of every strategy family (issue 15, "Must show").

Hostile replies (wrong record types, every dtype, corrupt bytes, wrong shapes, non-finite and
huge values, wrong ids and rounds, duplicates, wrong message type, forged sources) replace the
real replies of one or several devices, in-process. Every run must finish with a finite
state equal to the run in which those replies were lost (none of the hostile replies carries a
valid update: each must be rejected or ignored).

``HOSTILE`` holds the distinct cases (>= 40); each is tried on every family by
``test_every_hostile_case`` (one device, one exchange), and hypothesis draws combinations
(several devices and exchanges at once) in ``test_random_hostile_replies``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import default_task_id, make_mocha_client_app
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.engine import FIRST_NODE_ID
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.ofmtl import OFMTL
from fmtl_flower.wire import from_array, to_array

from .helpers import make_problem
from .hostile import HostileGrid

Case = Callable[[Message, Message], list[Message]]


# ------------------------------------------------------------------------------ the cases
def _rebuild(message: Message, reply: Message, **records: Any) -> Message:
    """``reply``'s records with some replaced (None: removed), answering ``message``."""
    content = {k: v for k, v in reply.content.items()}
    for key, value in records.items():
        if value is None:
            content.pop(key, None)
        else:
            content[key] = value
    return Message(RecordDict(content), reply_to=message)


def _array_key(reply: Message) -> str | None:
    if "arrays" in reply.content and len(reply.content["arrays"]):
        return sorted(reply.content["arrays"])[0]
    return None


def _with_array(message: Message, reply: Message, make: Callable[[np.ndarray], Any]) -> Message:
    """Every array of the reply replaced by ``make(values)`` (an ndarray or an Array)."""
    if _array_key(reply) is None:  # an arrays-free reply (none is tampered here): break it
        return _rebuild(message, reply, metrics=None)
    arrays = {}
    for key, array in reply.content["arrays"].items():
        new = make(np.array(from_array(array)))
        arrays[key] = new if isinstance(new, Array) else to_array(new)
    return _rebuild(message, reply, arrays=ArrayRecord(arrays))


def _raw(values: np.ndarray, *, dtype: str | None = None, shape: tuple | None = None,
         stype: str = "numpy.ndarray", data: bytes | None = None) -> Array:
    good = to_array(values)
    return Array(dtype=dtype or good.dtype, shape=tuple(good.shape if shape is None else shape),
                 stype=stype, data=good.data if data is None else data)


def _with_metric(message: Message, reply: Message, key: str | None, value: Any) -> Message:
    """Metric ``key`` (None: the first int metric, task-id) set to ``value`` (None: removed)."""
    metrics = dict(reply.content["metrics"])
    key = key or "task-id"
    if value is None:
        metrics.pop(key, None)
    else:
        metrics[key] = value
    return _rebuild(message, reply, metrics=MetricRecord(metrics))


def _add(value: float) -> Callable[[np.ndarray], np.ndarray]:
    def make(v: np.ndarray) -> np.ndarray:
        out = v.astype(np.float64).copy()
        out.reshape(-1)[0] += value
        return out
    return make


def _set_first(value: float) -> Callable[[np.ndarray], np.ndarray]:
    def make(v: np.ndarray) -> np.ndarray:
        out = v.astype(np.float64).copy()
        out.reshape(-1)[0] = value
        return out
    return make


def _forged_source(message: Message, reply: Message) -> list[Message]:
    forged = Message(reply.content, reply_to=message)
    forged.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id + 1
    return [forged]


def _answers_nothing(message: Message, reply: Message) -> list[Message]:
    forged = Message(reply.content, reply_to=message)
    forged.metadata.__dict__["_reply_to_message_id"] = "not-a-message-of-this-round"
    return [forged]


def _wrong_type(message: Message, reply: Message) -> list[Message]:
    forged = Message(reply.content, reply_to=message)
    kind = message.metadata.message_type
    forged.metadata.__dict__["_message_type"] = (
        MessageType.EVALUATE if kind != MessageType.EVALUATE else MessageType.TRAIN)
    return [forged]


def _garbage_then_real(message: Message, reply: Message) -> list[Message]:
    garbage = _rebuild(message, reply, arrays=MetricRecord({"x": 1.0}))
    return [garbage, reply]  # the first decides: the real one is a second reply


def _error_then_real(message: Message, reply: Message) -> list[Message]:
    return [Message(Error(code=0, reason="hostile"), reply_to=message), reply]


def one(make: Callable[[Message, Message], Message]) -> Case:
    return lambda message, reply: [make(message, reply)]


HOSTILE: dict[str, Case] = {
    # records of the wrong kind, or missing
    "error-reply": one(lambda m, r: Message(Error(code=0, reason="hostile"), reply_to=m)),
    "empty-content": one(lambda m, r: Message(RecordDict({}), reply_to=m)),
    "arrays-as-metricrecord": one(lambda m, r: _rebuild(m, r, arrays=MetricRecord({"a": 1.0}))),
    "arrays-as-configrecord": one(lambda m, r: _rebuild(m, r, arrays=ConfigRecord({"a": "x"}))),
    "metrics-as-arrayrecord": one(lambda m, r: _rebuild(
        m, r, metrics=ArrayRecord({"task-id": to_array(np.zeros(1))}))),
    "metrics-as-configrecord": one(lambda m, r: _rebuild(
        m, r, metrics=ConfigRecord(dict(r.content["metrics"])))),
    "no-arrays": one(lambda m, r: _rebuild(m, r, arrays=None) if _array_key(r) else
                     _rebuild(m, r, metrics=None)),
    "no-metrics": one(lambda m, r: _rebuild(m, r, metrics=None)),
    "arrays-renamed": one(lambda m, r: _rebuild(m, r, arrays=ArrayRecord(
        {f"{k}-x": v for k, v in r.content["arrays"].items()})) if _array_key(r) else
        _rebuild(m, r, metrics=None)),
    "empty-arrays": one(lambda m, r: _rebuild(m, r, arrays=ArrayRecord({})) if _array_key(r)
                        else _rebuild(m, r, metrics=None)),
    # serialisation
    "stype-torch-raw": one(lambda m, r: _with_array(m, r, lambda v: _raw(v, stype="torch.raw"))),
    "object-dtype": one(lambda m, r: _with_array(m, r, lambda v: _raw(v, dtype="object"))),
    "truncated-bytes": one(lambda m, r: _with_array(
        m, r, lambda v: _raw(v, data=to_array(v).data[:-3]))),
    "extra-bytes": one(lambda m, r: _with_array(
        m, r, lambda v: _raw(v, data=to_array(v).data + b"\1\2\3"))),
    "garbage-bytes": one(lambda m, r: _with_array(m, r, lambda v: _raw(v, data=b"\x93NUMPY"))),
    "header-shape-lies": one(lambda m, r: _with_array(
        m, r, lambda v: _raw(v, shape=(2**40,)))),
    "unknown-dtype-name": one(lambda m, r: _with_array(m, r, lambda v: _raw(v, dtype="qq9"))),
    # dtypes
    "float32": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.float32))),
    "float16": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.float16))),
    "int8": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.int8))),
    "uint8": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.uint8))),
    "int64": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.int64) + 1)),
    "bool": one(lambda m, r: _with_array(m, r, lambda v: v != 0)),
    "complex128": one(lambda m, r: _with_array(m, r, lambda v: v.astype(np.complex128))),
    "unicode": one(lambda m, r: _with_array(m, r, lambda v: np.array(["a"] * v.size))),
    "datetime64": one(lambda m, r: _with_array(
        m, r, lambda v: np.zeros(v.shape, dtype="datetime64[s]"))),
    "float128-bytes": one(lambda m, r: _with_array(
        m, r, lambda v: _raw(v, dtype="float128" if hasattr(np, "float128") else "V16"))),
    # shapes
    "one-more-entry": one(lambda m, r: _with_array(m, r, lambda v: np.append(v, 0.0))),
    "one-entry-less": one(lambda m, r: _with_array(m, r, lambda v: v.reshape(-1)[:-1])),
    "column-vector": one(lambda m, r: _with_array(m, r, lambda v: v.reshape(-1, 1))),
    "scalar": one(lambda m, r: _with_array(m, r, lambda v: np.float64(1.0))),
    "empty-array": one(lambda m, r: _with_array(m, r, lambda v: np.zeros(0))),
    "transposed": one(lambda m, r: _with_array(m, r, lambda v: v.reshape(1, -1).T.copy()
                                               if v.ndim == 1 else v.T.copy())),
    # values
    "nan": one(lambda m, r: _with_array(m, r, _set_first(np.nan))),
    "plus-inf": one(lambda m, r: _with_array(m, r, _set_first(np.inf))),
    "minus-inf": one(lambda m, r: _with_array(m, r, _set_first(-np.inf))),
    "huge-1e150": one(lambda m, r: _with_array(m, r, _add(1e150))),
    "huge-1e200": one(lambda m, r: _with_array(m, r, _add(1e200))),
    "max-float": one(lambda m, r: _with_array(m, r, _add(1.7e308))),
    "big-1e5": one(lambda m, r: _with_array(m, r, _add(1e5))),
    # metrics
    "wrong-task-id": one(lambda m, r: _with_metric(m, r, "task-id",
                                                   int(r.content["metrics"]["task-id"]) + 1)),
    "negative-task-id": one(lambda m, r: _with_metric(m, r, "task-id", -1)),
    "task-id-float": one(lambda m, r: _with_metric(
        m, r, "task-id", float(r.content["metrics"]["task-id"]))),
    "task-id-list": one(lambda m, r: _with_metric(m, r, "task-id", [1])),
    "task-id-missing": one(lambda m, r: _with_metric(m, r, "task-id", None)),
    "wrong-n-train": one(lambda m, r: _with_metric(
        m, r, "n-train", int(r.content["metrics"]["n-train"]) + 1)),
    "huge-n-train": one(lambda m, r: _with_metric(m, r, "n-train", 2**62)),
    "older-round": one(lambda m, r: _with_metric(m, r, _round_key(r), _round(r) - 1)),
    "newer-round": one(lambda m, r: _with_metric(m, r, _round_key(r), _round(r) + 1)),
    "nan-metric": one(lambda m, r: _with_metric(m, r, _float_key(r), float("nan"))),
    "inf-metric": one(lambda m, r: _with_metric(m, r, _float_key(r), float("inf"))),
    "negative-metric": one(lambda m, r: _with_metric(m, r, _float_key(r), -1.0)),
    "huge-metric": one(lambda m, r: _with_metric(m, r, _float_key(r), 1e308)),
    # envelope: sources, ids, types, duplicates
    "forged-source": _forged_source,
    "answers-no-message": _answers_nothing,
    "wrong-message-type": _wrong_type,
    "garbage-then-real": _garbage_then_real,
    "error-then-real": _error_then_real,
}


def _round_key(reply: Message) -> str:
    return "step" if "step" in reply.content["metrics"] else "round"


def _round(reply: Message) -> int:
    return int(reply.content["metrics"][_round_key(reply)])


def _float_key(reply: Message) -> str:
    """A float metric every family's train reply has and bounds."""
    metrics = reply.content["metrics"]
    for key in ("loss-mean", "train-loss", "loss-sum", "gap"):
        if key in metrics:
            return key
    return "task-id"  # (Mb-SGD and FSVRG local models: the task id breaks instead)


assert len(HOSTILE) >= 40, len(HOSTILE)


# ------------------------------------------------------------------------------ the families
@dataclass
class Family:
    """One strategy family: how to run it and read its final state."""

    name: str
    num_nodes: int
    run: Callable[[HostileGrid], Any]            # starts the strategy on the grid
    client: Callable[[], Any]                    # a fresh ClientApp
    state: Callable[[Any], dict[str, np.ndarray]]
    targets: tuple[str, ...]                     # message types whose replies are tampered
    exchanges: int                               # occurrences per node to draw from
    victim: int = 1                              # the task of test_every_hostile_case


MOCHA_PROBLEM = make_problem(num_tasks=4, dim=4, samples_per_task=24, seed=5)
FSVRG_DATA = make_sparse_federated(num_tasks=4, dim=500, seed=1)


def _fedem_data(num_tasks: int = 4, dim: int = 3, seed: int = 2) -> list[tuple]:
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=dim) * 3
    out = []
    for _ in range(num_tasks):
        X, Xt = rng.uniform(-1, 1, (40, dim)), rng.uniform(-1, 1, (20, dim))
        out.append((X, (X @ theta > 0).astype(float), Xt, (Xt @ theta > 0).astype(float)))
    return out


FEDEM_DATA = _fedem_data()


def _start(strategy: Any, rounds: int) -> Callable[[HostileGrid], Any]:
    def run(grid: HostileGrid) -> Any:
        strategy_ = strategy()
        strategy_.start(grid=grid, num_rounds=rounds, timeout=60.0)
        return strategy_
    return run


def _mocha_state(s: MOCHA) -> dict[str, np.ndarray]:
    return {"W": s.state.W, "B": s.state.B, "last_accepted": s.last_accepted}


FAMILIES = {
    "mocha": Family(
        "mocha", 4, _start(lambda: MOCHA(4, lam=0.05, omega="probabilistic", omega_every=2,
                                         seed=1, discovery_timeout=5.0), 4),
        lambda: make_mocha_client_app(MOCHA_PROBLEM.load), _mocha_state,
        (MessageType.TRAIN,), 4),
    "cocoa": Family(
        "cocoa", 4, _start(lambda: MOCHA(4, lam=0.05, method="cocoa", omega_every=2, seed=1,
                                         discovery_timeout=5.0), 3),
        lambda: make_mocha_client_app(MOCHA_PROBLEM.load), _mocha_state,
        (MessageType.TRAIN,), 3),
    "mb-sdca": Family(
        "mb-sdca", 4, _start(lambda: MOCHA(4, lam=0.05, method="mb-sdca", omega_every=2,
                                           seed=1, discovery_timeout=5.0), 3),
        lambda: make_mocha_client_app(MOCHA_PROBLEM.load), _mocha_state,
        (MessageType.TRAIN,), 3),
    "mb-sgd": Family(
        "mb-sgd", 4, _start(lambda: MbSGD(4, lam=0.05, omega="probabilistic", omega_every=2,
                                          seed=1, discovery_timeout=5.0), 4),
        lambda: make_mbsgd_client_app(MOCHA_PROBLEM.load), lambda s: {"W": s.W},
        (MessageType.TRAIN,), 4),
    "fedem": Family(
        "fedem", 4, _start(lambda: FedEM(4, num_components=2, lr=0.5, batch_size=16, seed=1,
                                         discovery_timeout=5.0), 3),
        lambda: make_fedem_client_app(lambda c: FEDEM_DATA[default_task_id(c)]),
        lambda s: {"components": s.components}, (MessageType.TRAIN,), 3),
    "fedavg": Family(
        "fedavg", 4, _start(lambda: FedEM(4, method="fedavg", lr=0.5, batch_size=16, seed=1,
                                          discovery_timeout=5.0), 3),
        lambda: make_fedem_client_app(lambda c: FEDEM_DATA[default_task_id(c)]),
        lambda s: {"components": s.components}, (MessageType.TRAIN,), 3),
    "fsvrg": Family(
        "fsvrg", 4, _start(lambda: FSVRG(4, method="fsvrg", seed=1, discovery_timeout=5.0), 3),
        lambda: make_fsvrg_client_app(lambda c: FSVRG_DATA.task(default_task_id(c)).arrays()),
        lambda s: {"w": s.w}, (MessageType.TRAIN, f"{MessageType.QUERY}.fsvrg_gradient"), 3),
    "cocoa-plus": Family(
        "cocoa-plus", 4, _start(lambda: FSVRG(4, method="cocoa-plus", seed=1,
                                              discovery_timeout=5.0), 3),
        lambda: make_fsvrg_client_app(lambda c: FSVRG_DATA.task(default_task_id(c)).arrays()),
        lambda s: {"w": s.w, **{f"ledger.{k}": v for k, v in s.ledger.to_arrays().items()}},
        (MessageType.TRAIN,), 3),
    "ofmtl": Family(
        "ofmtl", 4, lambda grid: _run_ofmtl(grid),
        lambda: make_ofmtl_client_app(MOCHA_PROBLEM.load),
        lambda s: {"W": s.W, "Sigma": np.asarray(s.Sigma)},
        (f"{MessageType.TRAIN}.ofmtl", MessageType.TRAIN), 3, victim=3),  # the newcomer
}
#: The strategy families of issue 15 (each key of FAMILIES belongs to one).
FAMILY_OF = {"mocha": "MOCHA/CoCoA/Mb-SDCA", "cocoa": "MOCHA/CoCoA/Mb-SDCA",
             "mb-sdca": "MOCHA/CoCoA/Mb-SDCA", "mb-sgd": "Mb-SGD", "fedem": "FedEM",
             "fedavg": "FedEM", "fsvrg": "FSVRG", "cocoa-plus": "FSVRG", "ofmtl": "OFMTL"}


def _run_ofmtl(grid: HostileGrid) -> OFMTL:
    strategy = OFMTL(4, initial_tasks=3, lam=0.05, mocha_rounds=3, outer=3, inner=4,
                     discovery_timeout=5.0, arrival_timeout=1.0, max_attempts=3)
    strategy.start(grid=grid, timeout=60.0)
    return strategy


# ------------------------------------------------------------------------------ running
Injection = tuple[int, str, int]  # (task, message type, occurrence: 1 = the first message)


def run_family(family: Family, hostile: dict[Injection, Case],
               hits: set[Injection] | None = None) -> Any:
    """Run ``family`` with the replies of the given (task, type, occurrence) messages passed
    through their cases (a case of None: the reply is lost); ``hits`` collects the
    injections that found their message."""
    seen: dict[tuple[int, str], int] = {}
    hits = set() if hits is None else hits

    def tamper(message: Message, reply: Message | None) -> list[Message]:
        node, kind = message.metadata.dst_node_id, message.metadata.message_type
        seen[(node, kind)] = seen.get((node, kind), 0) + 1
        key = (node - FIRST_NODE_ID, kind, seen[(node, kind)])
        if reply is None or key not in hostile:
            return [] if reply is None else [reply]
        hits.add(key)
        case = hostile[key]
        return [] if case is None else case(message, reply)

    grid = HostileGrid(family.client(), family.num_nodes)
    grid.tamper = tamper
    return family.run(grid)


_REFERENCES: dict[tuple[str, frozenset], dict[str, np.ndarray]] = {}


def lost_reference(family: Family, where: frozenset) -> dict[str, np.ndarray]:
    key = (family.name, where)
    if key not in _REFERENCES:
        _REFERENCES[key] = {k: np.array(v) for k, v in
                            family.state(run_family(family, dict.fromkeys(where))).items()}
    return _REFERENCES[key]


def check_hostile_run(family: Family, hostile: dict[Injection, Case]) -> set[Injection]:
    """Assert the run with ``hostile`` replies equals the run where they were lost; return
    the injections that hit a message."""
    hits: set[Injection] = set()
    state = family.state(run_family(family, hostile, hits))
    reference = lost_reference(family, frozenset(hostile))
    for key, value in state.items():
        value = np.asarray(value)
        assert np.all(np.isfinite(value)) if value.dtype.kind == "f" else True, key
        assert np.array_equal(value, reference[key]), (
            f"{family.name}: {key} differs from the run where those replies were lost")
    return hits


@pytest.fixture(autouse=True, scope="module")
def quiet() -> Any:
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("name", ["mocha", "mb-sgd", "fedem", "fsvrg", "ofmtl"])
def test_every_hostile_case(name, case):
    """Each case on one device's reply in the middle of the run (the family's victim task,
    its second message of the family's first target type)."""
    family = FAMILIES[name]
    where = (family.victim, family.targets[0], 2)
    assert check_hostile_run(family, {where: HOSTILE[case]}) == {where}


@st.composite
def injections(draw: Any, family: Family) -> dict[Injection, Case]:
    count = draw(st.integers(1, 3))
    out = {}
    for _ in range(count):
        key = (draw(st.integers(0, family.num_nodes - 1)), draw(st.sampled_from(family.targets)),
               draw(st.integers(1, family.exchanges)))
        out[key] = HOSTILE[draw(st.sampled_from(sorted(HOSTILE)))]
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_hostile_replies(name, data):
    family = FAMILIES[name]
    check_hostile_run(family, data.draw(injections(family)))


# ------------------------------------------------------------------------------ stacked replies
# Packed FSVRG nodes (clients/packed_fsvrg.py): one stacked reply per node and exchange. A
# hostile *row* must fail only its task (the run equals the one where that row's slot failed);
# a hostile *reply* (records, envelope) fails the node's tasks (the run equals the one where
# the whole reply was lost). Cases act on row ROW of the reply.
ROW = 1
PACKED_TASKS, PER_NODE = 6, 3


def _stacked_arrays(reply: Message) -> dict[str, np.ndarray]:
    return {k: np.array(from_array(v)) for k, v in reply.content["arrays"].items()}


def _matrix_key(arrays: dict[str, np.ndarray]) -> str:
    """The reply's (k, d) matrix (an evaluate reply has none: its ``loss-sum``)."""
    return next((k for k, v in arrays.items() if v.ndim == 2), "loss-sum")


def _with_arrays(message: Message, reply: Message, arrays: dict[str, Any]) -> Message:
    return _rebuild(message, reply, arrays=ArrayRecord(
        {k: v if isinstance(v, Array) else to_array(v) for k, v in arrays.items()}))


def _row(change: Callable[[dict[str, np.ndarray]], None]) -> Case:
    """A row case: ``change(arrays)`` edits the decoded arrays (row ROW) in place."""
    def case(message: Message, reply: Message) -> list[Message]:
        arrays = _stacked_arrays(reply)
        change(arrays)
        return [_with_arrays(message, reply, arrays)]
    return case


def _set(key: str | None, value: Any) -> Callable[[dict[str, np.ndarray]], None]:
    def change(arrays: dict[str, np.ndarray]) -> None:
        name = key or _matrix_key(arrays)
        if arrays[name].ndim == 2:
            arrays[name][ROW, 0] = value
        else:
            arrays[name][ROW] = value
    return change


def _shift(key: str, by: int) -> Callable[[dict[str, np.ndarray]], None]:
    def change(arrays: dict[str, np.ndarray]) -> None:
        arrays[key][ROW] += by
    return change


def _float_vector(arrays: dict[str, np.ndarray]) -> str:
    return "loss-sum" if "loss-sum" in arrays else "task-id"


def _set_float(value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def change(arrays: dict[str, np.ndarray]) -> None:
        key = _float_vector(arrays)
        if key == "task-id":  # (local models: no float vector) the row's task breaks
            arrays[key][ROW] = -1
        else:
            arrays[key][ROW] = value
    return change


def _whole(make: Callable[[Message, Message], Message]) -> Case:
    return lambda message, reply: [make(message, reply)]


def _with_matrix(make: Callable[[np.ndarray], Any]) -> Case:
    def case(message: Message, reply: Message) -> list[Message]:
        arrays: dict[str, Any] = _stacked_arrays(reply)
        key = _matrix_key(arrays)
        arrays[key] = make(arrays[key])
        return [_with_arrays(message, reply, arrays)]
    return case


def _with_stack(record: Callable[[Message], Any], name: str = "stack") -> Case:
    return _whole(lambda m, r: _rebuild(m, r, **{name: record(r)}))


def _slots(reply: Message) -> list[int]:
    return list(reply.content["stack"]["slots"])


STACKED_ROW: dict[str, Case] = {
    "row-nan": _row(_set(None, np.nan)),
    "row-plus-inf": _row(_set(None, np.inf)),
    "row-huge-1e150": _row(_set(None, 1e150)),
    "row-big-1e5": _row(_set(None, 1e5)),
    "row-max-float": _row(_set(None, 1.7e308)),
    "row-wrong-task-id": _row(_shift("task-id", 1)),
    "row-negative-task-id": _row(_set("task-id", -1)),
    "row-wrong-n-train": _row(_shift("n-train", 1)),
    "row-huge-n-train": _row(_set("n-train", 2**62)),
    "row-older-round": _row(_shift("round", -1)),
    "row-newer-round": _row(_shift("round", 1)),
    "row-nan-metric": _row(_set_float(np.nan)),
    "row-inf-metric": _row(_set_float(np.inf)),
    "row-negative-metric": _row(_set_float(-1.0)),
    "row-huge-metric": _row(_set_float(1e308)),
}
STACKED_REPLY: dict[str, Case] = {
    "error-reply": _whole(lambda m, r: Message(Error(code=0, reason="hostile"), reply_to=m)),
    "empty-content": _whole(lambda m, r: Message(RecordDict({}), reply_to=m)),
    "no-stack": _whole(lambda m, r: _rebuild(m, r, stack=None)),
    "no-arrays": _whole(lambda m, r: _rebuild(m, r, arrays=None)),
    "arrays-as-metricrecord": _whole(lambda m, r: _rebuild(m, r, arrays=MetricRecord({"a": 1.0}))),
    "stack-as-arrayrecord": _with_stack(lambda r: ArrayRecord({"slots": to_array(np.zeros(2))})),
    "stack-other-protocol": _with_stack(lambda r: ConfigRecord({"protocol": "mocha",
                                                                "slots": _slots(r)})),
    "stack-stranger-slot": _with_stack(lambda r: ConfigRecord({"protocol": "fsvrg",
                                                               "slots": [*_slots(r)[:-1], 77]})),
    "stack-slot-twice": _with_stack(lambda r: ConfigRecord({"protocol": "fsvrg",
                                                            "slots": [_slots(r)[0]] * 3})),
    "stack-slots-bools": _with_stack(lambda r: ConfigRecord({"protocol": "fsvrg",
                                                             "slots": [True, False, True]})),
    "stack-one-slot-less": _with_stack(lambda r: ConfigRecord({"protocol": "fsvrg",
                                                               "slots": _slots(r)[:-1]})),
    "errors-also-replied": _with_stack(lambda r: ConfigRecord(
        {"slots": [_slots(r)[0]], "reasons": ["x"]}), "stack-errors"),
    "errors-reasons-mismatch": _with_stack(lambda r: ConfigRecord(
        {"slots": [50], "reasons": ["x", "y"]}), "stack-errors"),
    "matrix-float32": _with_matrix(lambda v: v.astype(np.float32)),
    "matrix-int8": _with_matrix(lambda v: v.astype(np.int8)),
    "matrix-one-column-less": _with_matrix(lambda v: v[..., :-1].copy()),
    "matrix-one-row-less": _with_matrix(lambda v: v[:-1].copy()),
    "matrix-flat": _with_matrix(lambda v: v.reshape(-1) if v.ndim == 2 else v.reshape(-1, 1)),
    "matrix-garbage-bytes": _with_matrix(lambda v: _raw(v, data=b"\x93NUMPY")),
    "matrix-truncated": _with_matrix(lambda v: _raw(v, data=to_array(v).data[:-3])),
    "matrix-header-lies": _with_matrix(lambda v: _raw(v, shape=(2**40, 2))),
    "matrix-object-dtype": _with_matrix(lambda v: _raw(v, dtype="object")),
    "vector-float32": _row(lambda a: a.__setitem__("n-train", a["n-train"].astype(np.float32))),
    "vector-too-long": _row(lambda a: a.__setitem__("task-id", np.append(a["task-id"], 0))),
    "forged-source": _forged_source,
    "answers-no-message": _answers_nothing,
    "wrong-message-type": _wrong_type,
    "garbage-then-real": _garbage_then_real,
    "error-then-real": _error_then_real,
}
STACKED_HOSTILE = {**STACKED_ROW, **STACKED_REPLY}
assert len(STACKED_HOSTILE) >= 40, len(STACKED_HOSTILE)


def _drop_row(message: Message, reply: Message) -> list[Message]:
    """The reference of a row case: the reply whose row ROW's slot failed on the device."""
    arrays = _stacked_arrays(reply)
    keep = [i for i in range(len(arrays["task-id"])) if i != ROW]
    slots = _slots(reply)
    out = _with_arrays(message, reply, {k: v[keep] for k, v in arrays.items()})
    out.content["stack"] = ConfigRecord({"protocol": "fsvrg",
                                         "slots": [slots[i] for i in keep]})
    out.content["stack-errors"] = ConfigRecord({"slots": [slots[ROW]], "reasons": ["lost"]})
    return [out]


def _packed_fsvrg_client() -> Any:
    from fmtl_flower.clients.packed_fsvrg import PackedFSVRG
    from fmtl_flower.packing import packed_client_app, tasks_of_node

    app = make_fsvrg_client_app(lambda c: PACKED_DATA.task(default_task_id(c)).arrays())
    stacked = PackedFSVRG(app.fsvrg_client)
    return packed_client_app(
        app, lambda ctx: tasks_of_node(ctx.node_config, PER_NODE, PACKED_TASKS),
        {"fsvrg": stacked}, {"query.whoami": stacked.whoami})


def _packed_start(method: str, rounds: int) -> Callable[[HostileGrid], Any]:
    from fmtl_flower.packing import PackedGrid

    def run(grid: HostileGrid) -> Any:
        strategy = FSVRG(PACKED_TASKS, method=method, seed=1, discovery_timeout=5.0)
        strategy.start(grid=PackedGrid(grid), num_rounds=rounds, timeout=60.0)
        return strategy
    return run


PACKED_DATA = make_sparse_federated(num_tasks=PACKED_TASKS, dim=500, seed=1)
PACKED_FAMILIES = {
    "packed-fsvrg": Family(
        "packed-fsvrg", PACKED_TASKS // PER_NODE, _packed_start("fsvrg", 3),
        _packed_fsvrg_client, lambda s: {"w": s.w},
        (MessageType.TRAIN, f"{MessageType.QUERY}.fsvrg_gradient"), 3, victim=0),
    "packed-cocoa-plus": Family(
        "packed-cocoa-plus", PACKED_TASKS // PER_NODE, _packed_start("cocoa-plus", 3),
        _packed_fsvrg_client,
        lambda s: {"w": s.w, **{f"ledger.{k}": v for k, v in s.ledger.to_arrays().items()}},
        (MessageType.TRAIN, MessageType.EVALUATE), 3, victim=0),
}
FAMILY_OF.update({"packed-fsvrg": "FSVRG", "packed-cocoa-plus": "FSVRG"})


def check_stacked_run(family: Family, hostile: dict[Injection, str]) -> set[Injection]:
    """As :func:`check_hostile_run` for stacked cases (by name): the reference run loses the
    hit row (row cases) or the whole reply (the others)."""
    hits: set[Injection] = set()
    state = family.state(run_family(family, {k: STACKED_HOSTILE[c]
                                             for k, c in hostile.items()}, hits))
    where = frozenset((k, c in STACKED_ROW) for k, c in hostile.items())
    key = (family.name, where)
    if key not in _REFERENCES:
        lost = {k: _drop_row if row else None for k, row in where}
        _REFERENCES[key] = {k: np.array(v) for k, v in
                            family.state(run_family(family, lost)).items()}
    reference = _REFERENCES[key]
    for name, value in state.items():
        value = np.asarray(value)
        assert np.all(np.isfinite(value)) if value.dtype.kind == "f" else True, name
        assert np.array_equal(value, reference[name]), (
            f"{family.name}: {name} differs from the run where those replies were lost")
    return hits


@pytest.mark.parametrize("case", sorted(STACKED_HOSTILE))
@pytest.mark.parametrize("name", sorted(PACKED_FAMILIES))
def test_every_stacked_hostile_case(name, case):
    """Each case on one packed node's stacked reply in the middle of the run (node 0's
    second message of the family's first target type)."""
    family = PACKED_FAMILIES[name]
    where = (family.victim, family.targets[0], 2)
    assert check_stacked_run(family, {where: case}) == {where}


@st.composite
def stacked_injections(draw: Any, family: Family) -> dict[Injection, str]:
    out = {}
    for _ in range(draw(st.integers(1, 3))):
        key = (draw(st.integers(0, family.num_nodes - 1)), draw(st.sampled_from(family.targets)),
               draw(st.integers(1, family.exchanges)))
        out[key] = draw(st.sampled_from(sorted(STACKED_HOSTILE)))
    return out


@pytest.mark.parametrize("name", sorted(PACKED_FAMILIES))
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_stacked_hostile_replies(name, data):
    family = PACKED_FAMILIES[name]
    check_stacked_run(family, data.draw(stacked_injections(family)))
