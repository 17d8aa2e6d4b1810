"""``start(initial_arrays=...)`` seeds the methods that have one global start: MOCHA and its
primal-dual baselines through the dual seeding round (:mod:`fmtl_flower.clients.dual_seed`:
W stays W(alpha), gaps stay valid, a W0 at the optimum restarts near it), Mb-SGD and FSVRG
directly; bad keys, shapes or values, and the methods without one start, are clear errors.
Tasks on packed nodes that speak a stacking protocol are seeded too, bit for bit as unpacked."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fmtl_flower import (
    FSVRG,
    MOCHA,
    OFMTL,
    FedEM,
    MbSGD,
    make_fedem_client_app,
    make_fsvrg_client_app,
    make_mbsgd_client_app,
    make_mocha_client_app,
)
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.packed_mbsgd import PackedMbSGD
from fmtl_flower.clients.packed_mocha import PackedMOCHA
from fmtl_flower.data import make_sparse_federated
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies.base import as_array_record
from fmtl_flower.wire import to_array

from .helpers import make_problem

TASKS, DIM = 5, 4


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=TASKS, dim=DIM, samples_per_task=40, seed=5)


def record(**arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({k: to_array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def packed_grid(app, handler, per_node: int, seen: list | None = None) -> PackedGrid:
    """A PackedGrid over ``ceil(TASKS / per_node)`` nodes hosting ``per_node`` tasks each,
    whose stacked messages ``handler`` serves; ``seen`` collects each message's
    (type, stacked, seeding) as the nodes receive it."""
    packed = packed_client_app(app, lambda ctx: tasks_of_node(ctx.node_config, per_node, TASKS),
                               {handler.protocol: handler}, {"query.whoami": handler.whoami})

    def node(message, context):
        if seen is not None:
            arrays = message.content["arrays"] if "arrays" in message.content else {}
            seen.append((message.metadata.message_type, "stack" in message.content,
                         "seed-w" in arrays))
        return packed(message, context)

    return PackedGrid(InProcessGrid(node, math.ceil(TASKS / per_node)), query_timeout=5.0)


def run_mocha(problem, rounds: int, initial: ArrayRecord | None = None, *,
              per_node: int = 1, seen: list | None = None, **kwargs):
    options = {"lam": 0.05, "omega": "mean", "lam2": 0.5, "omega_every": 0,
               "discovery_timeout": 5.0, **kwargs}
    strategy = MOCHA(TASKS, **options)
    app = make_mocha_client_app(problem.load)
    grid = (InProcessGrid(app, TASKS) if per_node == 1
            else packed_grid(app, PackedMOCHA(app.mocha_client), per_node, seen))
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=30.0)
    return strategy, result


def untimed(records: list[dict]) -> list[dict]:
    """The round records without measured durations (keys ending in ``_s``)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


@pytest.mark.parametrize("method", ["mocha", "cocoa", "mb-sdca"])
def test_initial_arrays_change_round_one_and_keep_the_gap(problem, method):
    rng = np.random.default_rng(0)
    W0 = rng.normal(size=(DIM, TASKS))
    plain, plain_result = run_mocha(problem, 4, method=method)
    seeded, seeded_result = run_mocha(problem, 4, record(W=W0), method=method)
    rounds = seeded.results()["rounds"]
    assert rounds[1].get("seeded") is True and "seeded" not in plain.results()["rounds"][1]
    assert not np.allclose(rounds[1]["primal"], plain.results()["rounds"][1]["primal"])
    assert not np.array_equal(seeded_result.arrays["W"].numpy(),
                              plain_result.arrays["W"].numpy())
    assert all(r["gap"] >= -1e-9 for r in rounds), [r["gap"] for r in rounds]
    assert seeded.results()["final"]["complete"]


def test_a_broadcast_w0_moves_every_task_toward_it(problem):
    w0 = np.array([0.5, -0.25, 0.1, 0.0])
    strategy, _ = run_mocha(problem, 1, record(W=w0), omega="identity")
    W = strategy.state.W
    zero = np.linalg.norm(w0[:, None] - np.zeros_like(W))
    assert np.linalg.norm(W - w0[:, None]) < zero  # closer to W0 than the zero start


def test_w0_at_the_optimum_restarts_near_the_optimum(problem):
    solved, solved_result = run_mocha(problem, 60)
    W_star = solved_result.arrays["W"].numpy()
    assert solved.results()["final"]["gap"] < 1e-2
    _, cold = run_mocha(problem, 1)
    warm_strategy, warm = run_mocha(problem, 1, record(W=W_star))
    cold_gap = cold.evaluate_metrics_clientapp[1]["gap"]
    warm_gap = warm.evaluate_metrics_clientapp[1]["gap"]
    assert 0.0 <= warm_gap < 0.05 * cold_gap, (warm_gap, cold_gap)
    W = warm.arrays["W"].numpy()
    assert np.linalg.norm(W - W_star) < 0.05 * np.linalg.norm(W_star)


@pytest.mark.parametrize("method", ["mocha", "cocoa", "mb-sdca"])
def test_packed_seeded_runs_equal_unpacked_seeded_runs_bit_for_bit(problem, method):
    W0 = np.random.default_rng(3).normal(size=(DIM, TASKS))
    options = {"method": method, "omega_every": 2}  # an Omega-step after the seeding round
    one, one_result = run_mocha(problem, 3, record(W=W0), **options)
    seen: list = []
    packed, packed_result = run_mocha(problem, 3, record(W=W0), per_node=2, seen=seen,
                                      **options)
    # the seeding round went stacked to every node (2 + 2 + 1 tasks), with the seed rows
    trains = [s for s in seen if s[0] == "train"]
    assert trains[:3] == [("train", True, True)] * 3
    assert len(trains) == 9 and all(s == ("train", True, False) for s in trains[3:])
    rounds = packed.results()["rounds"]
    assert rounds[1]["seeded"] is True and rounds[1]["num_replies"] == TASKS
    assert untimed(rounds) == untimed(one.results()["rounds"])
    assert np.array_equal(packed.state.W, one.state.W)
    assert np.array_equal(packed_result.arrays["W"].numpy(), one_result.arrays["W"].numpy())
    _, plain = run_mocha(problem, 3, per_node=2, **options)  # the seeding did something
    assert not np.array_equal(plain.arrays["W"].numpy(), packed_result.arrays["W"].numpy())


def test_a_malformed_seed_row_fails_only_its_slot(problem):
    """A stacked seeding row of the wrong width or with a non-finite value fails its slot
    alone, as the one-task client refuses such a ``seed-w``."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    InProcessGrid(make_mocha_client_app(problem.load), 1)  # Flower's TaskIdentity
    handler = PackedMOCHA(make_mocha_client_app(problem.load).mocha_client)
    k = 3
    seed_w = np.zeros((k, DIM))
    seed_w[1, 2] = np.inf
    arrays = {"w": np.zeros((k, DIM)), "task-id": np.array([0, 1, 2]),
              "last-accepted-round": np.zeros(k, dtype=np.int64), "m-tt": np.full(k, 2.0),
              "sigma-prime": np.ones(k), "budget": np.full(k, 40),
              "dropped": np.zeros(k, dtype=bool), "seed-w": seed_w, "seed-b": np.zeros((k, DIM))}
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1, "seed": 0,
                                                      "eval": False}),
                              "arrays": record(**arrays)}),
                  dst_node_id=1001, message_type="train")
    ctx = Context(run_id=7, node_id=1001, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={})
    content, done, errors = handler(msg, ctx, [(0, 0), (1, 1), (2, 2)])
    assert done == [0, 2] and list(errors) == [1]
    assert "'seed-w' must be finite float64 of shape (4,)" in errors[1]
    assert np.any(content["arrays"]["delta-b"].numpy() != 0)  # the others seeded
    del arrays["seed-b"]
    with pytest.raises(ValueError, match="lacks array 'seed-b'"):
        handler(Message(RecordDict({"config": msg.content["config"],
                                    "arrays": record(**arrays)}),
                        dst_node_id=1001, message_type="train"), ctx, [(0, 0), (1, 1), (2, 2)])


@pytest.mark.parametrize(("arrays", "match"), [
    ({"w": np.zeros((DIM, TASKS))}, r"exactly one array 'W' of shape \(d, 5\) or \(d,\)"),
    ({"W": np.zeros((DIM, TASKS)), "b": np.zeros(DIM)}, "exactly one array 'W'"),
    ({"W": np.zeros((DIM, TASKS + 1))}, r"must have shape \(d, 5\) or \(d,\), got \(4, 6\)"),
    ({"W": np.zeros((DIM, TASKS, 1))}, "must have shape"),
    ({"W": np.full((DIM, TASKS), np.nan)}, "non-finite"),
    ({"W": np.zeros((DIM + 1, TASKS))}, r"dim = 4 features \(expected 4 rows\)"),
])
def test_bad_initial_arrays_are_clear_errors(problem, arrays, match):
    with pytest.raises(ValueError, match=match):
        run_mocha(problem, 1, record(**arrays))


def test_mbsgd_starts_from_w0(problem):
    W0 = np.random.default_rng(1).normal(size=(DIM, TASKS))

    def run(initial):
        strategy = MbSGD(TASKS, lam=0.05, discovery_timeout=5.0)
        strategy.start(grid=InProcessGrid(make_mbsgd_client_app(problem.load), TASKS),
                       initial_arrays=initial, num_rounds=1, timeout=30.0)
        return strategy

    seeded, plain = run(record(W=W0)), run(None)
    # record 0 is the state before round 1: its loss is measured at W0
    assert seeded.results()["rounds"][0]["primal"] != plain.results()["rounds"][0]["primal"]
    assert not np.allclose(seeded.W, plain.W)
    with pytest.raises(ValueError, match=r"dim = 4 features"):
        run(record(W=np.zeros(DIM + 2)))


def test_packed_mbsgd_from_w0_equals_unpacked(problem):
    W0 = np.random.default_rng(4).normal(size=(DIM, TASKS))

    def run(initial, per_node):
        strategy = MbSGD(TASKS, lam=0.05, discovery_timeout=5.0)
        app = make_mbsgd_client_app(problem.load)
        seen: list = []
        grid = (InProcessGrid(app, TASKS) if per_node == 1
                else packed_grid(app, PackedMbSGD(app.mbsgd_client), per_node, seen))
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=3, timeout=30.0)
        assert per_node == 1 or all(stacked for kind, stacked, _ in seen if kind == "train")
        return strategy, result

    one, one_result = run(record(W=W0), 1)
    packed, packed_result = run(record(W=W0), 2)
    plain, _ = run(None, 2)
    assert untimed(packed.results()["rounds"]) == untimed(one.results()["rounds"])
    assert np.array_equal(packed.W, one.W)
    assert np.array_equal(packed_result.arrays["W"].numpy(), one_result.arrays["W"].numpy())
    # record 0 is the state before round 1: its loss is measured at W0, not at 0
    assert packed.results()["rounds"][0]["primal"] != plain.results()["rounds"][0]["primal"]


def test_fsvrg_starts_from_w0():
    data = make_sparse_federated(num_tasks=3, dim=300, seed=0)
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    w0 = np.random.default_rng(2).normal(scale=0.1, size=300)

    def run(initial, method="fsvrg"):
        strategy = FSVRG(3, method=method, discovery_timeout=5.0)
        strategy.start(grid=InProcessGrid(app, 3), initial_arrays=initial, num_rounds=1,
                       timeout=30.0)
        return strategy

    seeded, plain = run(record(w=w0)), run(None)
    assert seeded.results()["rounds"][0]["objective"] != plain.results()["rounds"][0]["objective"]
    assert not np.allclose(seeded.w, plain.w)
    with pytest.raises(ValueError, match=r"exactly one array 'w' of shape \(d,\)"):
        run(record(W=w0))
    with pytest.raises(ValueError, match=r"\['w'\] must have shape \(d,\), got \(300, 3\)"):
        run(record(w=np.zeros((300, 3))))
    with pytest.raises(ValueError, match=r"dim = 300 features"):
        run(record(w=np.zeros(301)))
    with pytest.raises(ValueError, match="cocoa-plus"):
        run(record(w=w0), method="cocoa-plus")


def test_methods_without_one_global_start_refuse_initial_arrays(problem):
    with pytest.raises(ValueError, match="initial_arrays"):
        OFMTL(TASKS, initial_tasks=2, discovery_timeout=1.0).start(
            grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
            initial_arrays=record(W=np.zeros((DIM, TASKS))))
    with pytest.raises(ValueError, match="model='torch'"):
        FedEM(TASKS, method="fedavg", discovery_timeout=1.0).start(
            grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
            initial_arrays=record(W=np.zeros(DIM)), num_rounds=1)


def test_ofmtl_refuses_an_evaluate_fn_it_could_not_call(problem):
    """OFMTL has no global model per round: an ``evaluate_fn`` is a clear error, not
    silently never called."""
    with pytest.raises(ValueError, match="evaluate_fn must be None"):
        OFMTL(TASKS, initial_tasks=2, discovery_timeout=1.0).start(
            grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
            evaluate_fn=lambda server_round, arrays: None)


# ---------------------------------------------------------------- what Flower users write


def as_written(form: str, key: str, W0: np.ndarray):
    """``W0`` as a Flower user writes ``initial_arrays``: Flower's ``ArrayRecord([W0])``
    (one unnamed array), ``ArrayRecord({key: Array(W0)})``, the numpy array itself or a
    dict of numpy arrays."""
    return {"list": lambda: ArrayRecord([W0]),
            "array-dict": lambda: ArrayRecord({key: Array(W0)}),
            "numpy": lambda: W0,
            "numpy-dict": lambda: {key: W0}}[form]()


FORMS = ["list", "array-dict", "numpy", "numpy-dict"]


@pytest.mark.parametrize("form", FORMS)
def test_mocha_takes_initial_arrays_as_flower_users_write_them(problem, form):
    W0 = np.random.default_rng(6).normal(size=(DIM, TASKS))
    expected, expected_result = run_mocha(problem, 2, record(W=W0))
    seeded, result = run_mocha(problem, 2, as_written(form, "W", W0))
    assert seeded.results()["rounds"][1]["seeded"] is True
    assert untimed(seeded.results()["rounds"]) == untimed(expected.results()["rounds"])
    assert np.array_equal(result.arrays["W"].numpy(), expected_result.arrays["W"].numpy())


@pytest.mark.parametrize("form", FORMS)
def test_mbsgd_takes_initial_arrays_as_flower_users_write_them(problem, form):
    W0 = np.random.default_rng(7).normal(size=(DIM, TASKS))

    def run(initial):
        strategy = MbSGD(TASKS, lam=0.05, discovery_timeout=5.0)
        strategy.start(grid=InProcessGrid(make_mbsgd_client_app(problem.load), TASKS),
                       initial_arrays=initial, num_rounds=1, timeout=30.0)
        return strategy

    expected, seeded = run(record(W=W0)), run(as_written(form, "W", W0))
    assert seeded.results()["rounds"][0]["primal"] == expected.results()["rounds"][0]["primal"]
    assert np.array_equal(seeded.W, expected.W)


@pytest.mark.parametrize("form", FORMS)
def test_fsvrg_takes_initial_arrays_as_flower_users_write_them(form):
    data = make_sparse_federated(num_tasks=3, dim=300, seed=0)
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    w0 = np.random.default_rng(2).normal(scale=0.1, size=300)

    def run(initial):
        strategy = FSVRG(3, discovery_timeout=5.0)
        strategy.start(grid=InProcessGrid(app, 3), initial_arrays=initial, num_rounds=1,
                       timeout=30.0)
        return strategy

    expected, seeded = run(record(w=w0)), run(as_written(form, "w", w0))
    assert seeded.results()["rounds"][0]["objective"] \
        == expected.results()["rounds"][0]["objective"]
    assert np.array_equal(seeded.w, expected.w)


def test_initial_arrays_that_name_no_model_are_clear_errors(problem):
    W0 = np.zeros((DIM, TASKS))
    with pytest.raises(ValueError, match=r"exactly one array 'W'.*got keys \['0', '1'\]"):
        run_mocha(problem, 1, ArrayRecord([W0, W0]))  # two unnamed arrays: which is W?
    with pytest.raises(TypeError, match="a numpy array or a dict of numpy arrays"):
        run_mocha(problem, 1, [W0])  # type: ignore[arg-type]


def test_a_torch_state_dict_stays_as_it_is():
    torch = pytest.importorskip("torch")
    state = {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}
    out = as_array_record(state)
    assert sorted(out) == ["fc.bias", "fc.weight"]
    assert np.array_equal(out["fc.weight"].numpy(), np.ones((2, 3), dtype=np.float32))
    assert sorted(as_array_record({"fc.bias": np.zeros(2)})) == ["fc.bias"]
