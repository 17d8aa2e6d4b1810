"""The Flower App's objects as `flwr run` builds them: config from `context.run_config`."""

import logging

import pytest

from fmtl_flower.apps.client_app import app as client_app
from fmtl_flower.apps.server_app import app as server_app
from fmtl_flower.engine import run_inprocess


@pytest.mark.parametrize("strategy", ["mocha", "cocoa", "mb-sdca", "mb-sgd"])
def test_run_config_selects_the_strategy(tmp_path, strategy):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = tmp_path / "res.json"
    run_config = {"strategy": strategy, "num-tasks": 3, "dim": 4, "samples-per-task": 20,
                  "num-server-rounds": 3, "results-file": str(out)}
    run_inprocess(server_app, client_app, 3, run_config=run_config)
    import json

    results = json.loads(out.read_text())
    assert results["config"]["strategy"] == strategy
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2, 3]
    assert results["final"]["complete"] is True
    assert results["final"]["primal"] < results["rounds"][0]["primal"]
    assert (results["final"]["gap"] is None) == (strategy == "mb-sgd")


def test_baselines_are_refused_by_the_server_app():
    with pytest.raises(Exception, match="centralised baseline"):
        run_inprocess(server_app, client_app, 2, run_config={"strategy": "local",
                                                              "num-tasks": 2})


def _project_run_config() -> dict:
    """The project's ``[tool.flwr.app.config]`` as Flower passes it (nested tables flattened
    into dotted keys: every family's defaults)."""
    import tomllib
    from pathlib import Path

    from flwr.common.config import flatten_dict

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    return flatten_dict(pyproject["tool"]["flwr"]["app"]["config"])


def test_dotted_keys_of_the_project_reach_the_strategy(tmp_path):
    """The ServerApp reads the project's run config (every family's keys, at their defaults)
    plus dotted overrides, and the strategy gets them: CoCoA's theta, the common min-tasks."""
    import json

    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = tmp_path / "res.json"
    seen: list = []
    run_config = {**_project_run_config(), "strategy": "cocoa", "num-tasks": 3, "dim": 4,
                  "samples-per-task": 20, "num-server-rounds": 2, "results-file": str(out),
                  "mocha.theta": 0.25, "min-tasks": 2}
    from fmtl_flower.apps import common

    original = common.strategy_from_config

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    common.strategy_from_config = spy
    try:
        run_inprocess(common.make_server_app(), client_app, 3, run_config=run_config)
    finally:
        common.strategy_from_config = original
    (strategy,) = seen
    assert strategy.theta == 0.25 and strategy.method == "cocoa" and strategy.min_tasks == 2
    assert json.loads(out.read_text())["config"]["mocha.theta"] == 0.25


def test_a_foreign_family_key_in_the_run_config_fails_the_server_app():
    run_config = {**_project_run_config(), "num-tasks": 2, "fedem.lr": 0.01}
    with pytest.raises(Exception, match="fedem.lr belongs to FedEM's family"):
        run_inprocess(server_app, client_app, 2, run_config=run_config)


def test_results_file_names_engine_kernels_and_wall_time(tmp_path, monkeypatch):
    """The results JSON of the ServerApp (what a deployment's ``results-file`` holds) has the
    ``engine``, ``kernels`` and ``wall_time_s`` keys of docs/reference/results-json.md."""
    import json
    import time

    logging.getLogger("flwr").setLevel(logging.WARNING)
    monkeypatch.setenv("FMTL_KERNELS", "numpy")
    out = tmp_path / "res.json"
    run_config = {"num-tasks": 3, "dim": 4, "samples-per-task": 20, "num-server-rounds": 2,
                  "results-file": str(out)}
    t0 = time.perf_counter()
    run_inprocess(server_app, client_app, 3, run_config=run_config)
    elapsed = time.perf_counter() - t0
    results = json.loads(out.read_text())
    assert results["engine"] == "inprocess"
    assert results["kernels"] == "numpy"
    assert 0.0 < results["wall_time_s"] <= elapsed
    assert results["wall_time_s"] >= sum(r["wall_time_s"] for r in results["rounds"][1:])


def test_engine_of_a_grid():
    """``engine`` by the grid the ServerApp is given: wrappers looked through; Flower's
    simulation grid is ``ray``; a SuperLink's (or any other) grid is a deployment, whose
    kernels each device sets."""
    from flwr.serverapp import Grid

    from fmtl_flower.apps.common import engine_of, kernels_of
    from fmtl_flower.engine import InProcessGrid
    from fmtl_flower.packing import PackedGrid

    inprocess = InProcessGrid(client_app, 2)
    assert engine_of(inprocess) == "inprocess"
    assert engine_of(PackedGrid(inprocess)) == "inprocess"
    abstract = dict.fromkeys(Grid.__abstractmethods__, lambda *a, **k: None)
    abstract["run"] = property(lambda self: None)
    http_grid = type("HttpGrid", (Grid,), abstract)()
    memory_grid = type("InMemoryGrid", (Grid,), abstract)()
    assert engine_of(http_grid) == "deployment"
    assert engine_of(memory_grid) == "ray"
    assert kernels_of("deployment") == "device"
    assert kernels_of("ray") in ("auto", "numba", "numpy")


@pytest.mark.parametrize("strategy", ["async-mocha", "async-cocoa"])
def test_flwr_run_serves_barrier_free_mocha_with_its_own_handlers(tmp_path, strategy):
    """`flwr run`'s ClientApp picks each run's handlers from the family registry: a run of
    barrier-free MOCHA gets its devices' handlers (before, it got synchronous MOCHA's, which
    fail every asynchronous request, and the run ended without one applied reply)."""
    import json

    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = tmp_path / "res.json"
    run_config = {"strategy": strategy, "num-tasks": 3, "dim": 4, "samples-per-task": 20,
                  "num-server-rounds": 3, "results-file": str(out)}
    run_inprocess(server_app, client_app, 3, run_config=run_config)
    final = json.loads(out.read_text())["final"]
    assert final["gap"] is not None and 0.0 <= final["gap"] < final["primal"]
