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
