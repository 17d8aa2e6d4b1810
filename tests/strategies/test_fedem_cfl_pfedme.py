"""Sattler et al.'s CFL and pFedMe in FedEM's strategy, in tiny in-process federations."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message

from fmtl_flower.clients.fedem import STATE_ARRAYS
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.wire import from_array

from .test_fedem_strategy import ClientCallable, mixture_problem, run


def opposite_problem(num_tasks: int = 10, dim: int = 6, seed: int = 0, flip: bool = True):
    """Even tasks label by one linear rule, odd tasks by its opposite (``flip``)."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=dim) * 4
    data = []
    for t in range(num_tasks):
        parts = []
        for n in (int(rng.integers(60, 160)), 300):
            X = rng.uniform(-1, 1, size=(n, dim))
            y = ((X @ theta > 0) == (t % 2 == 0 or not flip)).astype(float)
            parts += [X, y]
        data.append(tuple(parts))
    return data


def test_cfl_splits_two_opposite_groups_and_beats_fedavg():
    data = opposite_problem()
    cfl, _ = run(data, rounds=10, method="cfl")
    fedavg, _ = run(data, rounds=10, method="fedavg")
    assert [c.tolist() for c in cfl.clusters] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert cfl.components.shape[0] == 2
    final = cfl.results()["final"]
    assert final["complete"] and final["accuracy_mean"] > 0.9
    assert fedavg.results()["final"]["accuracy_mean"] < 0.6
    clusters = [r["num_clusters"] for r in cfl.results()["rounds"]]
    assert clusters[0] == 1 and clusters[-1] == 2 and clusters == sorted(clusters)


def test_cfl_keeps_a_homogeneous_federation_in_one_cluster():
    cfl, _ = run(opposite_problem(flip=False), rounds=10, method="cfl")
    assert len(cfl.clusters) == 1 and cfl.components.shape[0] == 1
    assert cfl.results()["final"]["accuracy_mean"] > 0.9


def test_cfl_held_out_clients_take_the_best_cluster():
    cfl, _ = run(opposite_problem(), rounds=10, method="cfl", unseen_tasks=[8, 9])
    assert sorted(int(t) for c in cfl.clusters for t in c) == list(range(8))
    assert len(cfl.clusters) == 2
    assert cfl.results()["final"]["unseen_accuracy_mean"] > 0.9


def test_cfl_checkpoint_round_trip():
    strategy = FedEM(6, method="cfl", unseen_tasks=[5])
    strategy.directory.dim = 3
    strategy.components = np.arange(8.0).reshape(2, 4)
    strategy.clusters = [np.array([0, 2]), np.array([1, 3, 4])]
    arrays, meta = strategy.checkpoint_state()
    again = FedEM(6, method="cfl", unseen_tasks=[5])
    again.restore_state(arrays, meta)
    assert [c.tolist() for c in again.clusters] == [[0, 2], [1, 3, 4]]
    assert np.array_equal(again.components, strategy.components)
    assert again.cluster_of().tolist() == [0, 1, 0, 1, 1, -1]
    meta["clusters"] = [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="partition"):
        FedEM(6, method="cfl", unseen_tasks=[5]).restore_state(arrays, meta)


def test_pfedme_personalises_and_beats_fedavg():
    data = mixture_problem()
    seen: dict[int, Context] = {}

    def keep(app) -> ClientCallable:
        def client(message: Message, context: Context) -> Message:
            seen[int(context.node_config["partition-id"])] = context
            return app(message, context)
        return client

    pfedme, _ = run(data, method="pfedme", lr=0.5, pfedme_lambda=1.0, pfedme_lr=0.3,
                    unseen_tasks=[11], wrap=keep)
    fedavg, _ = run(data, method="fedavg", unseen_tasks=[11])
    a, b = pfedme.results()["final"], fedavg.results()["final"]
    assert a["complete"] and a["accuracy_mean"] > b["accuracy_mean"] + 0.01
    assert a["unseen_accuracy_mean"] is not None
    losses = [r["train_loss"] for r in pfedme.results()["rounds"]]
    assert losses[-1] < losses[0]
    # the device keeps its personalised theta_i, which is not the global model
    own = from_array(seen[0].state[STATE_ARRAYS]["own"])
    assert own.shape == pfedme.components.shape
    assert not np.allclose(own, pfedme.components)
    assert STATE_ARRAYS not in seen[11].state  # the held-out client never trained


def test_method_names_and_validation():
    assert FedEM(4, method="ifca").method == "clustered"
    assert FedEM(4, method="ifca").name == "IFCA"
    assert FedEM(4, method="cfl", num_components=5).num_components == 1
    with pytest.raises(ValueError, match="cfl_eps1"):
        FedEM(4, method="cfl", cfl_eps1=-1.0)
    with pytest.raises(ValueError, match="lam"):
        FedEM(4, method="pfedme", pfedme_lambda=0.0)
    with pytest.raises(ValueError, match="pfedme_beta"):
        FedEM(4, method="pfedme", pfedme_beta=0.0)
