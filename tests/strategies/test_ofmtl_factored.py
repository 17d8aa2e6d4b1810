"""OFMTL's factored server path: the same run as the dense path (records, W, Sigma), factored
checkpoints that restore and refuse what does not fit, and one newcomer admitted over
m = 20 000 tasks without an m x m array."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from threadpoolctl import threadpool_limits

from fmtl_flower.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.core.factored import FactoredMatrix, sigma_probabilistic_factored
from fmtl_flower.core.ofmtl import add_task, newcomer_fit
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.ofmtl import OFMTL

from .helpers import Killed, KilledOFMTL, make_problem

DIM = 5
SETTINGS = {"initial_tasks": 2, "lam": 0.05, "mocha_rounds": 30, "inner": 20, "seed": 4,
            "discovery_timeout": 5.0, "arrival_timeout": 2.0}



@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=7, dim=DIM, samples_per_task=40, seed=2)


def run(problem, strategy: OFMTL) -> list[tuple[np.ndarray, Any]]:
    """Run in-process; the (W, Sigma) after every event."""
    states: list[tuple[np.ndarray, Any]] = []
    strategy.on_record = lambda record: states.append((strategy.W.copy(), strategy.Sigma))
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, make_ofmtl_client_app(problem.load), problem.num_tasks)
    return states


@pytest.fixture(scope="module")
def runs(problem):
    """The same OFMTL run (initial 2 tasks, a retraining at 5, 7 tasks) on both paths."""
    out = {}
    for path in ("dense", "factored"):
        strategy = OFMTL(problem.num_tasks, server_path=path, **SETTINGS)
        out[path] = (strategy, run(problem, strategy))
    return out


def dense_sigma(S) -> np.ndarray:
    return S.dense() if isinstance(S, FactoredMatrix) else S


def test_factored_run_gives_the_dense_run(runs):
    (dense, dense_states), (fac, fac_states) = runs["dense"], runs["factored"]
    assert dense.path == "dense" and isinstance(dense.Sigma, np.ndarray)
    assert fac.path == "factored" and isinstance(fac.Sigma, FactoredMatrix)
    keys = ("event", "devices", "test_error", "floats_communicated", "cumulative_floats",
            "retrainings", "tasks_missing")
    assert [{k: r[k] for k in keys} for r in fac.records] == \
        [{k: r[k] for k in keys} for r in dense.records]
    assert [r["event"] for r in fac.records].count("retrain") == 1
    gaps = [(a["newcomer_gap"], b["newcomer_gap"]) for a, b in zip(fac.records, dense.records,
                                                                    strict=True)]
    for a, b in gaps:
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-8 * max(1.0, b))
    assert len(fac_states) == len(dense_states) == 7
    for (W_f, S_f), (W_d, S_d) in zip(fac_states, dense_states, strict=True):
        assert isinstance(S_f, FactoredMatrix)
        np.testing.assert_allclose(W_f, W_d, rtol=1e-8, atol=1e-8 * np.abs(W_d).max())
        np.testing.assert_allclose(S_f.dense(), S_d, rtol=1e-8, atol=1e-10)
        assert S_f.rank <= DIM + 1  # MOCHA's factor (<= d), or an extension of it (+1)


def test_factored_newcomers_equal_the_centralised_driver(problem, runs):
    """Each factored newcomer event is add_task on the previous factored state, bit for bit."""
    strategy, states = runs["factored"]
    checked = 0
    for i, record in enumerate(strategy.records):
        if record["event"] != "newcomer":
            continue
        (W_prev, S_prev), (W_new, S_new) = states[i - 1], states[i]
        m = W_prev.shape[1]
        ref = add_task(W_prev, S_prev, problem.Xs[m], problem.ys[m], lam=strategy.lam,
                       outer=strategy.outer, inner=strategy.inner,
                       local_frac=strategy.newcomer_frac, seed=strategy.seed, task_id=m)
        np.testing.assert_array_equal(W_new, ref.W)
        for attr in ("V", "s", "c"):
            np.testing.assert_array_equal(getattr(S_new, attr), getattr(ref.Sigma, attr))
        checked += 1
    assert checked == 5  # tasks 2, 3, 4 (then the retraining at 5), 5 and 6


def test_factored_resume_mid_newcomer_ends_like_an_uninterrupted_run(problem, runs, tmp_path):
    plain, _ = runs["factored"]
    first = KilledOFMTL(problem.num_tasks, task=4, step=5, server_path="factored", **SETTINGS)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(Killed):
        run(problem, first)
    checkpoint = read_checkpoint(tmp_path)
    assert checkpoint.server_round == len(first.records)
    assert {"Sigma.V", "Sigma.s", "Sigma.c"} <= set(checkpoint.arrays)
    assert "Sigma" not in checkpoint.arrays  # the factor only, never m x m
    resumed = OFMTL(problem.num_tasks, server_path="factored", **SETTINGS)
    resumed.enable_checkpoints(tmp_path)
    run(problem, resumed)
    assert resumed.resumed_from == len(first.records)
    np.testing.assert_array_equal(resumed.W, plain.W)
    for attr in ("V", "s", "c"):
        np.testing.assert_array_equal(getattr(resumed.Sigma, attr), getattr(plain.Sigma, attr))
    keys = ("event", "devices", "test_error", "cumulative_floats", "retrainings")
    assert [{k: r[k] for k in keys} for r in resumed.records] == \
        [{k: r[k] for k in keys} for r in plain.records]


# ----------------------------------------------------------------------------- checkpoints


def write(directory, strategy: OFMTL, arrays: dict[str, np.ndarray], server_round: int = 1):
    meta = {"fingerprint": strategy.fingerprint(), "records": [{"round": 0}],
            "ever_replied": [0, 1, 2], "retrainings": 0, "tasks_at_training": 3,
            "newcomer_floats": [], "floats_total": 0}
    write_checkpoint(directory, server_round, arrays, meta)


def factor_arrays(m: int, d: int = 4) -> dict[str, np.ndarray]:
    W = np.random.default_rng(0).normal(size=(d, m))
    S = sigma_probabilistic_factored(W)
    return {"W": W, "Sigma.V": S.V, "Sigma.s": S.s, "Sigma.c": np.array(S.c)}


def test_factored_checkpoint_round_trip(tmp_path):
    strategy = OFMTL(10, initial_tasks=3, server_path="factored")
    arrays = factor_arrays(6)
    write(tmp_path, strategy, arrays)
    strategy.enable_checkpoints(tmp_path)
    assert strategy._restore()
    np.testing.assert_array_equal(strategy.W, arrays["W"])
    np.testing.assert_array_equal(strategy.Sigma.V, arrays["Sigma.V"])
    np.testing.assert_array_equal(strategy.Sigma.s, arrays["Sigma.s"])
    assert strategy.Sigma.c == float(arrays["Sigma.c"]) and strategy.m == 6
    # rank 0 (Sigma = I / m): V of shape (m, 0) survives the file
    other = tmp_path / "rank0"
    write(other, strategy, {"W": np.zeros((4, 5)), "Sigma.V": np.zeros((5, 0)),
                            "Sigma.s": np.zeros(0), "Sigma.c": np.array(0.2)})
    strategy = OFMTL(10, initial_tasks=3, server_path="factored")
    strategy.enable_checkpoints(other)
    assert strategy._restore() and strategy.Sigma.rank == 0 and strategy.Sigma.c == 0.2


@pytest.mark.parametrize(("change", "match"), [
    ({"Sigma.V": lambda a: a["Sigma.V"][:-1]}, r"Sigma.V must be \(6, r\)"),
    ({"Sigma.s": lambda a: a["Sigma.s"][:-1]}, "V must be"),
    ({"Sigma.c": lambda a: np.array([a["Sigma.c"]])}, "must be a scalar"),
    ({"Sigma.V": lambda a: 2.0 * a["Sigma.V"]}, "not orthonormal"),
    ({"Sigma.s": lambda a: np.full_like(a["Sigma.s"], np.nan)}, "finite"),
    ({"W": lambda a: np.zeros((4, 11))}, "does not fit"),
    ({"W": lambda a: np.zeros(6)}, "no W"),
])
def test_factored_checkpoint_that_does_not_fit_is_refused(tmp_path, change, match):
    strategy = OFMTL(10, initial_tasks=3, server_path="factored")
    arrays = factor_arrays(6)
    arrays.update({k: f(arrays) for k, f in change.items()})
    write(tmp_path, strategy, arrays)
    strategy.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        strategy._restore()


def test_checkpoint_of_the_other_path_is_refused(tmp_path):
    dense_dir, factored_dir = tmp_path / "dense", tmp_path / "factored"
    dense = OFMTL(10, initial_tasks=3, server_path="dense")
    write(dense_dir, dense, {"W": np.zeros((4, 3)), "Sigma": np.eye(3) / 3})
    write(factored_dir, dense, factor_arrays(3))
    for path, directory, held in (("factored", dense_dir, "dense"),
                                  ("dense", factored_dir, "factored")):
        strategy = OFMTL(10, initial_tasks=3, server_path=path)
        strategy.enable_checkpoints(directory)
        with pytest.raises(CheckpointError, match=f"holds a {held} Sigma"):
            strategy._restore()


def test_server_path_choice():
    assert OFMTL(7, initial_tasks=2).path == "dense"  # small: dense whatever d
    assert OFMTL(20_001, initial_tasks=2).path == "factored"  # dense would not fit
    assert OFMTL(3000, initial_tasks=2, server_path="dense").path == "dense"
    assert OFMTL(7, initial_tasks=2, server_path="factored").path == "factored"
    middle = OFMTL(3000, initial_tasks=2)
    assert middle.path is None  # m > 1000: factored iff m > 2 d, known at the first whoami
    middle._choose_path(20)
    assert middle.path == "factored"
    middle = OFMTL(3000, initial_tasks=2)
    middle._choose_path(2000)
    assert middle.path == "dense"
    with pytest.raises(ValueError, match=r"server-path \(server_path\): must be one of"):
        OFMTL(7, initial_tasks=2, server_path="sparse")
    with pytest.raises(ValueError, match="path 'dense'"):
        OFMTL(20_001, initial_tasks=2, server_path="dense")


# ----------------------------------------------------------------------------- scale


class LocalOFMTL(OFMTL):
    """The server's newcomer protocol (``_admit``) with the device in-process, no Flower."""

    def __init__(self, *args: Any, X: np.ndarray, y: np.ndarray, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.X, self.y, self.alpha = X, y, None

    def _newcomer_step(self, grid, task, node, step, omega, c):  # the client's computation
        fit = newcomer_fit(self.X, self.y, omega=omega, c=c, lam=self.lam, rounds=self.inner,
                           local_frac=self.newcomer_frac, seed=self.seed, task_id=task,
                           alpha=self.alpha, first_round=step * self.inner + 1,
                           track_gap=False)
        self.alpha = fit.alpha
        return fit.w, 0.0

    def _record(self, grid, event, floats, seconds, gap=None):
        self.records.append({"event": event, "floats": floats, "event_time_s": seconds})


def test_one_newcomer_over_20000_tasks_forms_no_m_by_m_array():
    m, d, n = 20_000, 20, 200
    rng = np.random.default_rng(11)
    W_old = rng.normal(size=(d, m)) * rng.lognormal(0.0, 0.5, size=m)
    X = rng.normal(size=(n, d))
    y = np.where(X @ rng.normal(size=d) > 0, 1.0, -1.0)
    # 1 BLAS thread: OpenBLAS threads that spin on a busy shared core make the timing noise
    with threadpool_limits(limits=1, user_api="blas"):
        Sigma_old = sigma_probabilistic_factored(W_old)  # as MOCHA's factored state leaves it
        strategy = LocalOFMTL(m + 1, initial_tasks=m, lam=0.05, outer=3, inner=5, X=X, y=y)
        assert strategy.path == "factored"
        strategy.W, strategy.Sigma = W_old, Sigma_old
        tracemalloc.start()
        try:
            strategy._admit(None, m, 0)  # extension, 3 x (omega, c), 2 Omega-steps
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        timed = LocalOFMTL(m + 1, initial_tasks=m, lam=0.05, outer=3, inner=5, X=X, y=y)
        timed.W, timed.Sigma = W_old, Sigma_old
        wall, cpu = time.perf_counter(), time.process_time()
        timed._admit(None, m, 0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        # the centralised driver on the same factored state
        ref = add_task(W_old, Sigma_old, X, y, lam=0.05, outer=3, inner=5, local_frac=0.5,
                       seed=0, task_id=m)
    print(f"\nOFMTL factored newcomer, m = {m}, d = {d}, outer = 3 (1 BLAS thread): "
          f"{wall:.3f} s wall, {cpu:.3f} s CPU; peak traced memory {peak / 2**20:.1f} MiB "
          f"(one m x m array: {8 * m * m / 2**30:.1f} GiB)")
    assert peak < 8 * m * m / 100  # < 32 MB; measured ~9 MiB (W, V and their copies)
    assert strategy.W.shape == (d, m + 1) and strategy.Sigma.num_tasks == m + 1
    np.testing.assert_array_equal(strategy.W[:, :m], W_old)
    np.testing.assert_array_equal(timed.W, strategy.W)
    assert strategy.Sigma.trace() == pytest.approx(1.0, abs=1e-12)
    assert strategy.Sigma.rank <= d
    # the same numbers as add_task, bit for bit
    np.testing.assert_array_equal(strategy.W, ref.W)
    np.testing.assert_array_equal(strategy.Sigma.s, ref.Sigma.s)
    # Omega = Sigma^-1 at this size: Sigma times the newcomer's column of Omega is e_m
    Omega = ref.Omega
    column = Omega.V @ (Omega.s * Omega.V[m])
    column[m] += Omega.c
    e_m = strategy.Sigma.right_multiply(column[None, :])[0]
    expected = np.zeros(m + 1)
    expected[m] = 1.0
    np.testing.assert_allclose(e_m, expected, atol=1e-10)
