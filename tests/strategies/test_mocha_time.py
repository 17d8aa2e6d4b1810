"""Estimated time per round (eq. 30) and straggler deadlines in the federation."""

import logging

import numpy as np
import pytest

from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
from fmtl_flower.centralized import fit_mocha
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import run_inprocess
from fmtl_flower.systems.heterogeneity import local_budgets
from fmtl_flower.systems.timing import node_times, round_time


def run(**keys):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = RunConfig.from_mapping({"num-tasks": 5, "dim": 40, "num-server-rounds": 4,
                                  "mocha.omega-every": 2, **keys})
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg), 5)
    return cfg, box


def test_estimated_time_is_the_slowest_node_and_grows_with_the_network():
    times = {}
    for network in ("wifi", "lte", "3g"):
        cfg, box = run(**{"mocha.network": network})
        per_round = [r["estimated_time_s"] for r in box["rounds"][1:]]
        data = dataset_for(cfg)
        expected = node_times(data.n_train, data.dim, "mocha", network).max()
        assert per_round == pytest.approx([expected] * 4, rel=1e-12)
        times[network] = per_round[0]
    assert times["wifi"] < times["lte"] < times["3g"]


def test_deadline_cuts_local_work_and_matches_the_bare_loop():
    cfg, free = run(**{"mocha.network": "wifi"})
    deadline = 0.0203  # wifi latency 20 ms + a little: only part of the budget fits
    cfg, capped = run(**{"mocha.network": "wifi", "mocha.clock-cycle": deadline})
    assert all(r["estimated_time_s"] <= deadline + 1e-15 for r in capped["rounds"][1:])
    data = dataset_for(cfg)
    fit = fit_mocha([(t.X_train, t.y_train) for t in data.tasks], lam=0.1, rounds=4,
                    omega_every=2, network="wifi", clock_cycle=deadline, record_every=1)
    assert capped["final"]["primal"] == fit.history[-1]["primal"]
    assert capped["final"]["primal"] != free["final"]["primal"]  # work was cut
    assert np.isfinite(capped["final"]["gap"]) and capped["final"]["gap"] >= 0


def test_estimated_time_follows_each_rounds_steps():
    """Rounds with other local budgets (systems heterogeneity: drawn per round) get their own
    time; rounds with the same budgets the same one (eq. 30 is computed once for them)."""
    cfg, box = run(**{"mocha.network": "lte", "mocha.sys-het": "high",
                      "num-server-rounds": 6})
    per_round = [r["estimated_time_s"] for r in box["rounds"][1:]]
    data = dataset_for(cfg)
    expected = [round_time(local_budgets(data.n_train, local_frac=cfg.local_frac,
                                         sys_het="high", base=cfg.sys_het_base,
                                         seed=cfg.seed, server_round=k),
                           data.dim, "mocha", "lte") for k in range(1, 7)]
    assert per_round == expected
    assert len(set(per_round)) > 1


def test_the_time_model_charges_the_runs_loss_and_its_deadline_cuts_by_it():
    """A logistic run is timed with the logistic step's FLOPs (its Newton solve: more than
    the hinge's), not the hinge's; a deadline the hinge's full budgets fit into cuts the
    logistic run's work, as the bare loop (which takes the loss) cuts it."""
    cfg, box = run(**{"mocha.network": "wifi", "mocha.loss": "logistic"})
    data = dataset_for(cfg)
    per_round = [r["estimated_time_s"] for r in box["rounds"][1:]]
    logistic = node_times(data.n_train, data.dim, "mocha", "wifi", loss="logistic").max()
    hinge = node_times(data.n_train, data.dim, "mocha", "wifi").max()
    assert per_round == pytest.approx([logistic] * 4, rel=1e-12)
    assert logistic > hinge
    deadline = 0.5 * (hinge + logistic)
    cfg, capped = run(**{"mocha.network": "wifi", "mocha.loss": "logistic",
                         "mocha.clock-cycle": deadline})
    assert all(r["estimated_time_s"] <= deadline for r in capped["rounds"][1:])
    fit = fit_mocha([(t.X_train, t.y_train) for t in data.tasks], lam=0.1, rounds=4,
                    omega_every=2, network="wifi", clock_cycle=deadline, record_every=1,
                    loss="logistic")
    assert capped["final"]["primal"] == fit.history[-1]["primal"]
    assert capped["final"]["primal"] != box["final"]["primal"]  # work was cut
