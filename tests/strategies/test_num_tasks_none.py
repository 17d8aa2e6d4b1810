"""``num_tasks=None`` in every family's constructor (issue 27, item 5): Flower sizes a run
by its SuperNodes, so ``MOCHA(min_available_nodes=4)`` takes the tasks of the nodes online
once four are, counted when ``start`` runs, as the project's ServerApp does when
``num-tasks`` is unset (tests/strategies/test_num_tasks_discovered.py). The run is the one
built with that number; without ``min_available_nodes`` the constructor says what to give."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fmtl_flower import FSVRG, MOCHA, OFMTL, FedEM, MbSGD
from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import default_task_id, make_mocha_client_app
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.engine import InProcessGrid

from .helpers import ClientCallable, make_problem

NODES = 5  # SuperNodes online; min_available_nodes is lower: every node online counts


def linear_app(make_app: Callable[..., ClientCallable]) -> ClientCallable:
    return make_app(make_problem(num_tasks=NODES, dim=4, samples_per_task=24).load)


def fedem_app() -> ClientCallable:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(NODES):
        X, Xt = rng.uniform(-1, 1, size=(40, 3)), rng.uniform(-1, 1, size=(20, 3))
        data.append((X, (X[:, 0] > 0).astype(float), Xt, (Xt[:, 0] > 0).astype(float)))
    return make_fedem_client_app(lambda context: data[default_task_id(context)])


def fsvrg_app() -> ClientCallable:
    data = make_sparse_federated(num_tasks=NODES, dim=300, seed=0)
    return make_fsvrg_client_app(lambda context: data.task(default_task_id(context)).arrays())


#: family -> (strategy class, its keyword arguments, its ClientApp, start's num_rounds)
FAMILIES: dict[str, tuple[type, dict[str, Any], Callable[[], ClientCallable], int]] = {
    "mocha": (MOCHA, {"lam": 0.1}, lambda: linear_app(make_mocha_client_app), 3),
    "cocoa": (MOCHA, {"lam": 0.1, "method": "cocoa"},
              lambda: linear_app(make_mocha_client_app), 3),
    "mb-sdca": (MOCHA, {"lam": 0.1, "method": "mb-sdca"},
                lambda: linear_app(make_mocha_client_app), 3),
    "mb-sgd": (MbSGD, {"lam": 0.1}, lambda: linear_app(make_mbsgd_client_app), 3),
    "fedem": (FedEM, {"lr": 0.5, "batch_size": 16}, fedem_app, 2),
    "fedavg": (FedEM, {"method": "fedavg", "lr": 0.5, "batch_size": 16}, fedem_app, 2),
    "fsvrg": (FSVRG, {"robust": False}, fsvrg_app, 2),
    "cocoa-plus": (FSVRG, {"method": "cocoa-plus", "robust": False}, fsvrg_app, 2),
    "ofmtl": (OFMTL, {"lam": 0.05, "initial_tasks": 2, "mocha_rounds": 5, "inner": 5,
                      "arrival_timeout": 2.0}, lambda: linear_app(make_ofmtl_client_app), 0),
}


def run(family: str, num_tasks: int | None, **extra: Any) -> Any:
    cls, kwargs, make_app, rounds = FAMILIES[family]
    strategy = cls(num_tasks, discovery_timeout=5.0, **kwargs, **extra)
    strategy.start(grid=InProcessGrid(make_app(), NODES), num_rounds=rounds, timeout=30.0)
    return strategy


def comparable(final: dict[str, Any]) -> dict[str, Any]:
    """A run's final record without its measured wall-clock times (``*_s``; the simulated
    ``estimated_time_s`` is kept)."""
    return {key: value for key, value in final.items()
            if not key.endswith("_s") or key.startswith("estimated")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_tasks_none_runs_the_tasks_online_as_the_sized_run(family):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    discovered = run(family, None, min_available_nodes=NODES - 2)
    assert discovered.num_tasks == NODES
    sized = run(family, NODES)
    assert discovered.results()["final"]["complete"] is True
    assert comparable(discovered.results()["final"]) == comparable(sized.results()["final"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_neither_num_tasks_nor_min_available_nodes_says_what_to_give(family):
    cls, kwargs, _, _ = FAMILIES[family]
    with pytest.raises(ValueError, match=r"num_tasks=None takes the tasks of the nodes online"
                                         r".*give min_available_nodes=N .* num_tasks=M"):
        cls(**kwargs)


def test_settings_are_checked_at_construction_not_at_start():
    with pytest.raises(TypeError, match="lamda"):
        MOCHA(min_available_nodes=3, lamda=0.1)


def test_what_is_set_before_start_is_kept_and_unbuilt_state_says_why(tmp_path):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    strategy = MOCHA(min_available_nodes=3, lam=0.1)
    with pytest.raises(AttributeError, match=r"MOCHA\.W exists once start\(\) has built"):
        _ = strategy.W
    strategy.enable_checkpoints(tmp_path, every=2)
    strategy.start(grid=InProcessGrid(linear_app(make_mocha_client_app), 3), num_rounds=2,
                   timeout=30.0)
    assert strategy.num_tasks == 3 and strategy.checkpoint_every == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000002.npz"]


def test_too_few_nodes_online_is_the_discovery_error_and_a_retry_builds_it():
    from fmtl_flower.strategies.discovery import TooFewNodes

    strategy = MOCHA(min_available_nodes=4, lam=0.1, discovery_timeout=0.5)
    with pytest.raises(TooFewNodes, match=r"min_available_nodes = 4 required"):
        strategy.start(grid=InProcessGrid(linear_app(make_mocha_client_app), 2), num_rounds=1,
                       timeout=30.0)
    # still to be built: started again with the nodes there, it runs
    strategy.start(grid=InProcessGrid(linear_app(make_mocha_client_app), 4), num_rounds=1,
                   timeout=30.0)
    assert strategy.num_tasks == 4 and strategy.results()["final"]["complete"] is True

