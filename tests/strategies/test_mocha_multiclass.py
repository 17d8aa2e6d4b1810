"""Multi-class MOCHA (one-vs-rest, one Omega) and the intercept, end to end in-process
(issue 27 item 3 B; :mod:`fmtl_flower.core.multiclass`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from scipy.optimize import minimize

from fmtl_flower.clients.mocha import default_task_id, make_mocha_client_app
from fmtl_flower.clients.packed_mocha import PackedMOCHA
from fmtl_flower.core.multiclass import lift, predict_classes, with_intercept
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies.discovery import BeyondLimits, ReplyError, TaskDirectory
from fmtl_flower.strategies.mocha import MOCHA

from .helpers import ServerKilled, killed_in

TASKS, DIM, N, N_TEST = 4, 3, 24, 12
NAMES = np.array(["a", "b", "c"])


def string_label_tasks(seed: int = 0, names: np.ndarray = NAMES) -> list[tuple[np.ndarray, ...]]:
    """Per task (X, y, X_test, y_test): clusters around one centre per class, labels
    ``names`` (strings), task-specific shifts."""
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.normal(size=(len(names), DIM))
    tasks = []
    for _ in range(TASKS):
        shift = 0.5 * rng.normal(size=DIM)
        c = rng.integers(0, len(names), N + N_TEST)
        X = centres[c] + shift + rng.normal(size=(N + N_TEST, DIM))
        tasks.append((X[:N], names[c[:N]], X[N:], names[c[N:]]))
    return tasks


def loader(tasks: list[tuple[np.ndarray, ...]], transform: Callable | None = None
           ) -> Callable[[Context], tuple[np.ndarray, ...]]:
    def load(context: Context) -> tuple[np.ndarray, ...]:
        data = tasks[default_task_id(context)]
        return data if transform is None else transform(*data)
    return load


def run(load: Callable, labels: str, rounds: int = 6, wrap: Callable | None = None,
        **kwargs: Any) -> MOCHA:
    app = make_mocha_client_app(load, labels=labels)
    client = app if wrap is None else wrap(app)
    options = {"lam": 0.1, "omega": "probabilistic", "omega_every": 2, **kwargs}
    strategy = MOCHA(TASKS, discovery_timeout=5.0, **options)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    run_inprocess(server_app, client, TASKS)
    return strategy


def hand_lifted(names: np.ndarray = NAMES, scaling: float = 0.0) -> Callable:
    """The binary problem built by hand: labels -1/+1 of the lifted samples (i, k)."""
    def transform(X, y, X_test, y_test):
        X = with_intercept(X, scaling)
        return lift(X, np.searchsorted(names, y), len(names))
    return transform


def test_three_string_classes_are_the_hand_lifted_binary_problem():
    tasks = string_label_tasks()
    multi = run(loader(tasks), "auto")
    binary = run(loader(tasks, hand_lifted()), "pm1")
    assert multi.lifting.classes == ("a", "b", "c")
    assert multi.state.dim == binary.state.dim == DIM * 3
    np.testing.assert_array_equal(multi.state.W, binary.state.W)  # bit for bit
    mine, theirs = multi.results()["rounds"], binary.results()["rounds"]
    assert [r["gap"] for r in mine] == [r["gap"] for r in theirs]
    assert all(r["gap_certified"] and r["gap"] >= 0 for r in mine)


@pytest.mark.parametrize("loss", ["smoothed-hinge", "logistic", "squared"])
def test_multiclass_with_another_loss_is_the_hand_lifted_problem_of_that_loss(loss):
    """The lifting is loss-agnostic: K = 3 with an intercept under ``loss`` trains the
    hand-lifted binary problem under the same loss, bit for bit, and certifies every round."""
    tasks = string_label_tasks(seed=3)
    multi = run(loader(tasks), "auto", fit_intercept=True, loss=loss)
    binary = run(loader(tasks, hand_lifted(scaling=1.0)), "pm1", loss=loss)
    np.testing.assert_array_equal(multi.state.W, binary.state.W)
    rounds = multi.results()["rounds"]
    assert [r["gap"] for r in rounds] == [r["gap"] for r in binary.results()["rounds"]]
    assert all(r["gap_certified"] and r["gap"] >= 0 for r in rounds)


def test_intercept_is_the_hand_built_constant_feature():
    tasks = string_label_tasks(seed=1)
    multi = run(loader(tasks), "auto", fit_intercept=True, intercept_scaling=2.0)
    binary = run(loader(tasks, hand_lifted(scaling=2.0)), "pm1")
    assert multi.state.dim == (DIM + 1) * 3
    np.testing.assert_array_equal(multi.state.W, binary.state.W)


def test_test_error_is_the_argmax_error_of_w():
    tasks = string_label_tasks(seed=2)
    strategy = run(loader(tasks), "auto", fit_intercept=True)
    W = strategy.state.W
    errors = [np.count_nonzero(NAMES[predict_classes(with_intercept(Xt, 1.0), W[:, t], 3)]
                               != yt) for t, (_, _, Xt, yt) in enumerate(tasks)]
    final = strategy.results()["final"]
    assert final["test_error"] == pytest.approx(np.mean(np.array(errors) / N_TEST))
    assert final["test_error"] < 0.5  # three classes: chance is 2/3


def dual_optimum(Xs: list[np.ndarray], ys: list[np.ndarray], K: np.ndarray) -> np.ndarray:
    """W* of MOCHA's primal with K fixed, by scipy's L-BFGS-B on the dual (smooth, box
    constrained; the hinge primal is not smooth): max sum_t mean(beta_t) - 1/2 tr(B K^-1 B^T),
    alpha = y * beta, beta in [0, 1], b_t = X_t^T alpha_t / n_t; W* = B K^-1."""
    sizes = [len(y) for y in ys]
    Kinv = np.linalg.inv(K)

    def parts(beta: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        chunks = np.split(beta, np.cumsum(sizes)[:-1])
        B = np.stack([X.T @ (y * c) / len(y) for X, y, c in zip(Xs, ys, chunks, strict=True)],
                     axis=1)
        return B, chunks

    def negative_dual(beta: np.ndarray) -> tuple[float, np.ndarray]:
        B, chunks = parts(beta)
        W = B @ Kinv
        value = sum(c.mean() for c in chunks) - 0.5 * float(np.sum(W * B))
        grad = [1.0 / len(y) - y * (X @ W[:, t]) / len(y)
                for t, (X, y) in enumerate(zip(Xs, ys, strict=True))]
        return -value, -np.concatenate(grad)

    start = np.zeros(sum(sizes))
    result = minimize(negative_dual, start, jac=True, method="L-BFGS-B",
                      bounds=[(0.0, 1.0)] * len(start),
                      options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-12})
    return parts(result.x)[0] @ Kinv


def test_multiclass_optimum_matches_an_independent_solver():
    tasks = string_label_tasks(seed=3)
    strategy = run(loader(tasks), "auto", rounds=300, omega="identity", omega_every=0,
                   fit_intercept=True)
    final = strategy.results()["final"]
    assert final["gap_certified"] and 0 <= final["gap"] < 1e-7
    lifted = [hand_lifted(scaling=1.0)(*task) for task in tasks]
    K = strategy.state.formulation.regulariser_matrix()
    W_star = dual_optimum([X for X, _ in lifted], [y for _, y in lifted], K)
    np.testing.assert_allclose(strategy.state.W, W_star, atol=1e-4)


def test_two_labels_of_any_kind_are_the_binary_problem():
    """{"no", "yes"} is the binary run of -1/+1 (c_0 -> -1), bit for bit; 0/1 keeps needing
    nothing sent (today's mapping)."""
    tasks = string_label_tasks(seed=4, names=np.array(["no", "yes"]))
    words = run(loader(tasks), "auto")

    def pm1(X, y, X_test, y_test):
        return X, np.where(y == "yes", 1.0, -1.0), X_test, np.where(y_test == "yes", 1.0, -1.0)

    signs = run(loader(tasks, pm1), "pm1")
    assert words.lifting.classes == ("no", "yes") and words.state.dim == DIM
    np.testing.assert_array_equal(words.state.W, signs.state.W)
    assert words.results()["final"]["test_error"] == signs.results()["final"]["test_error"]

    def zero_one(X, y, X_test, y_test):
        return X, (y == "yes").astype(int), X_test, (y_test == "yes").astype(int)

    bits = run(loader(tasks, zero_one), "auto")
    assert bits.lifting.classes is None  # {0, 1}: today's binary run
    np.testing.assert_array_equal(bits.state.W, signs.state.W)


def test_intercept_fits_data_that_need_a_bias():
    """Labels sign(x_0 - 3) with x_0 in [0, 6]: no line through the origin separates them."""
    rng = np.random.default_rng(5)
    tasks = []
    for _ in range(TASKS):
        X = np.column_stack([rng.uniform(0, 6, N + N_TEST), rng.normal(size=N + N_TEST)])
        y = np.where(X[:, 0] > 3.0, 1.0, -1.0)
        tasks.append((X[:N], y[:N], X[N:], y[N:]))
    common = {"rounds": 40, "lam": 1e-3, "omega": "identity", "omega_every": 0}
    plain = run(loader(tasks), "pm1", **common)
    biased = run(loader(tasks), "pm1", fit_intercept=True, intercept_scaling=3.0, **common)
    assert biased.state.dim == 3
    assert plain.results()["final"]["test_error"] > 0.25
    assert biased.results()["final"]["test_error"] < 0.1
    assert biased.results()["final"]["gap"] >= 0


def hostile_labels(node_task: int, classes: list[Any]) -> Callable:
    """Wrap a ClientApp: task ``node_task``'s whoami reply claims ``classes``."""
    def wrap(app: Callable) -> Callable:
        def client(message: Message, context: Context) -> Message:
            reply = app(message, context)
            if "whoami" in message.metadata.message_type \
                    and default_task_id(context) == node_task:
                info = dict(reply.content["info"].items())
                info["classes"] = classes
                return Message(RecordDict({"info": ConfigRecord(info)}), reply_to=message)
            return reply
        return client
    return wrap


def test_a_node_claiming_a_million_classes_is_refused():
    tasks = string_label_tasks(seed=6)
    strategy = run(loader(tasks), "auto", rounds=2,
                   wrap=hostile_labels(0, [f"c{i}" for i in range(1_000_000)]),
                   min_tasks=TASKS - 1)
    assert strategy.lifting.classes == ("a", "b", "c")
    assert 0 not in strategy.task_to_node and strategy.state.dim == 3 * DIM


@pytest.mark.parametrize("robust", [True, False])
def test_class_votes_fence_and_label_skew(robust):
    """One node claiming 40 classes among nodes holding 3: refused in robust mode (above
    the federation's fence), taken at its word otherwise; a class only one node holds ("d")
    is a class either way."""
    names = np.array(["a", "b", "c", "d"])
    tasks = string_label_tasks(seed=7, names=names[:3])
    X, y, Xt, yt = tasks[1]
    tasks[1] = (X, np.where(y == "c", "d", y), Xt, np.where(yt == "c", "d", yt))
    claimed = ["a", "b", "c", *[f"z{i:02d}" for i in range(37)]]
    strategy = run(loader(tasks), "auto", rounds=1, wrap=hostile_labels(2, claimed),
                   robust=robust, min_tasks=TASKS - 1)
    if robust:
        assert strategy.lifting.classes == ("a", "b", "c", "d")
        assert 2 not in strategy.task_to_node
    else:
        assert len(strategy.lifting.classes) == 41 and 2 in strategy.task_to_node
    assert 1 in strategy.task_to_node


def test_max_classes_caps_what_a_node_may_claim():
    tasks = string_label_tasks(seed=8)
    strategy = run(loader(tasks), "auto", rounds=1, max_classes=3, robust=False,
                   wrap=hostile_labels(0, ["a", "b", "c", "x"]), min_tasks=TASKS - 1)
    assert strategy.lifting.classes == ("a", "b", "c") and 0 not in strategy.task_to_node


def test_packed_nodes_lift_their_slots_as_one_task_nodes_do():
    """Two nodes hosting two tasks each (the stacking protocol): the same W, bit for bit,
    as one node per task; each packed node is one vote for the class list."""
    tasks = string_label_tasks(seed=9)
    single = run(loader(tasks), "auto", fit_intercept=True)
    app = make_mocha_client_app(loader(tasks), labels="auto")
    handler = PackedMOCHA(app.mocha_client)
    packed = packed_client_app(app, lambda ctx: tasks_of_node(ctx.node_config, 2, TASKS),
                               {handler.protocol: handler}, {"query.whoami": handler.whoami})
    strategy = MOCHA(TASKS, discovery_timeout=5.0, lam=0.1, omega="probabilistic",
                     omega_every=2, fit_intercept=True)
    strategy.start(grid=PackedGrid(InProcessGrid(packed, 2), query_timeout=5.0), num_rounds=6,
                   timeout=60.0)
    assert strategy.lifting == single.lifting
    assert len(strategy.directory.labels_by_node()) == 2
    np.testing.assert_array_equal(strategy.state.W, single.state.W)


def test_a_resumed_multiclass_run_is_the_uninterrupted_one(tmp_path):
    """Killed in round 4 and resumed from its checkpoint of round 3 (the class list and the
    intercept kept), it ends bit for bit where the uninterrupted run ends."""
    tasks = string_label_tasks(seed=10)
    options = {"lam": 0.1, "omega": "probabilistic", "omega_every": 2, "fit_intercept": True}
    uninterrupted = run(loader(tasks), "auto", **options)

    def start(strategy: MOCHA) -> None:
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            strategy.start(grid=grid, num_rounds=6, timeout=60.0)

        run_inprocess(server_app, make_mocha_client_app(loader(tasks), labels="auto"), TASKS,
                      run_config={"client-state-dir": str(tmp_path / "devices")})

    first = killed_in(MOCHA, 4)(TASKS, discovery_timeout=5.0, **options)
    first.enable_checkpoints(tmp_path / "ckpt")
    with pytest.raises(ServerKilled):
        start(first)
    second = MOCHA(TASKS, discovery_timeout=5.0, **options)
    second.enable_checkpoints(tmp_path / "ckpt")
    start(second)
    assert second.resumed_from == 3 and second.lifting == uninterrupted.lifting
    np.testing.assert_array_equal(second.state.W, uninterrupted.state.W)


def whoami(classes: Any) -> Message:
    """A whoami reply's content (all :meth:`TaskDirectory.read_whoami` reads)."""
    info = {"task-id": 0, "n-train": 10, "dim": DIM, "classes": classes}
    return Message(RecordDict({"info": ConfigRecord(info)}), dst_node_id=1,
                   message_type="query.whoami")


def test_a_whoami_with_labels_outside_the_decided_classes_is_refused():
    directory = TaskDirectory(2, "MOCHA", dim=DIM)
    assert directory.read_whoami(whoami(["b", "a"]))["classes"] == ("a", "b")
    directory.fix_labels(("a", "b", "c"), {}, "map the labels")
    assert directory.read_whoami(whoami(["a", "c"]))["classes"] == ("a", "c")
    with pytest.raises(BeyondLimits, match=r"labels \['z'\] outside the run's classes; map"):
        directory.read_whoami(whoami(["a", "z"]))
    for bad in ([1.0, float("nan")], ["x" * 201], []):
        with pytest.raises(ReplyError):
            directory.read_whoami(whoami(bad))
