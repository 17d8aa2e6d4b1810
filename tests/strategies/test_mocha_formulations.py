"""Every formulation, sigma' mode, gamma and local solver (MOCHA, CoCoA, Mb-SDCA) runs
federated, bit-identical to the bare loop."""

import logging

import numpy as np
import pytest

from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
from fmtl_flower.centralized import fit_mocha
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import run_inprocess

CASES = [
    {"omega": "identity"},
    {"omega": "mean", "lambda2": 0.05},
    {"omega": "probabilistic", "sigma-mode": "spectral"},
    {"omega": "probabilistic", "s2": 10.0, "gamma": 0.5, "sigma-mode": "per-task"},
    {"omega": "clustered", "eta": 0.5, "clusters": 2},
    {"omega": "graphical", "s2": 10.0, "lambda2": 0.01},
    {"strategy": "cocoa", "omega": "probabilistic", "theta": 0.3, "local-frac": 3.0},
    {"strategy": "mb-sdca", "omega": "identity", "beta": 4.0, "drop-prob": 0.3},
]


@pytest.mark.parametrize("keys", CASES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_federation_matches_fit_mocha(keys):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = RunConfig.from_mapping({"num-tasks": 5, "dim": 6, "samples-per-task": 25,
                                  "num-server-rounds": 6, "omega-every": 2, "lambda": 0.05,
                                  "eval-every": 3, **keys})
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg), 5)
    data = dataset_for(cfg)
    fit = fit_mocha([(t.X_train, t.y_train) for t in data.tasks], lam=0.05, rounds=6,
                    omega=cfg.omega, omega_every=2, lam2=cfg.lambda2 or None,
                    s2=cfg.s2 or None, eta=cfg.eta or None, clusters=cfg.clusters or None,
                    gamma=cfg.gamma, sigma_mode=cfg.sigma_mode, method=cfg.strategy,
                    theta=cfg.theta, beta=cfg.beta, local_frac=cfg.local_frac,
                    drop_prob=cfg.drop_prob, record_every=1)
    primals = [r["primal"] for r in box["rounds"]]
    assert primals == [h["primal"] for h in fit.history]
    assert all(r["gap"] >= -1e-12 for r in box["rounds"])
    assert box["final"]["gap"] < box["rounds"][0]["gap"]
    assert np.isfinite(box["final"]["test_error"])


def test_bad_formulation_parameters_are_clear_errors():
    from fmtl_flower.strategies.mocha import Mocha

    with pytest.raises(ValueError, match="lam2"):
        Mocha(4, omega="mean")
    with pytest.raises(ValueError, match="s2"):
        Mocha(4, omega="graphical", lam2=0.1)
    with pytest.raises(ValueError, match="eta|k"):
        Mocha(4, omega="clustered")
    with pytest.raises(ValueError, match="gamma"):
        Mocha(4, gamma=1.5)


def test_per_task_drop_probabilities_match_the_bare_loop():
    from flwr.serverapp import ServerApp

    from fmtl_flower.clients.mocha import make_mocha_client_app
    from fmtl_flower.data import make_synthetic_tasks
    from fmtl_flower.strategies.mocha import Mocha

    logging.getLogger("flwr").setLevel(logging.WARNING)
    Xs, ys = make_synthetic_tasks(num_tasks=5, dim=4, samples_per_task=20, seed=1)
    p = [1.0, 0.3, 0.0, 0.6, 0.0]  # task 0 never does any work
    strategy = Mocha(5, lam=0.05, omega="identity", omega_every=0, drop_prob=p)
    app = ServerApp()

    @app.main()
    def main(grid, context):
        strategy.start(grid=grid, num_rounds=8, timeout=60.0)

    run_inprocess(app, make_mocha_client_app(
        lambda c: (Xs[c.node_config["partition-id"]], ys[c.node_config["partition-id"]])), 5)
    fit = fit_mocha(list(zip(Xs, ys, strict=True)), lam=0.05, rounds=8, omega="identity",
                    omega_every=0, drop_prob=p, record_every=1)
    assert strategy.results()["final"]["primal"] == fit.history[-1]["primal"]
    assert not strategy.state.B[:, 0].any()  # the device that never works contributes nothing
    assert all(r["num_dropped"] >= 1 for r in strategy.results()["rounds"][1:])
    with pytest.raises(ValueError, match="drop"):
        Mocha(5, drop_prob=[0.1, 0.2])
