"""The example apps run as they are, in simulation conditions (node configs with
``partition-id`` and ``num-partitions`` only), on the in-process engine; the slow
``test_examples_flwr_run.py`` runs them with ``flwr run .``."""

from __future__ import annotations

import logging

import pytest

from fmtl_flower.engine import run_inprocess

from .helpers import EXAMPLES, NAMES, app_config, example_apps, run_config

# quickstart-mocha: three string classes learned at discovery, with an intercept
FINAL = {"quickstart-mocha": "MOCHA final: 3 classes ['blue', 'green', 'red']",
         "quickstart-fedem": "fedem final",
         "legacy-numpyclient": "MOCHA final (NumPyClient devices)"}


@pytest.mark.parametrize("name", NAMES)
def test_example_is_a_complete_flower_app(name):
    folder = EXAMPLES / name
    package = app_config(name)["components"]["serverapp"].split(".")[0]
    for part in ("pyproject.toml", "README.md", "LICENSE", f"{package}/server_app.py",
                 f"{package}/client_app.py", f"{package}/task.py"):
        assert (folder / part).is_file(), part
    config = app_config(name)
    assert config["publisher"] and config["flwr-version-target"]
    pyproject = (folder / "pyproject.toml").read_text()
    assert "fmtl-flower" in pyproject and "[tool.flwr.federations]" not in pyproject
    # the README says how many SuperNodes the app expects
    assert f"num-tasks = {run_config(name)['num-tasks']}" in pyproject
    assert "SuperNodes" in (folder / "README.md").read_text()


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_as_is_in_simulation_conditions(name, caplog):
    config = run_config(name)
    config["num-server-rounds"] = 5
    num_nodes = int(config["num-tasks"])
    with example_apps(name) as (server, client), \
            caplog.at_level(logging.INFO, logger="flwr"):
        grid = run_inprocess(server.app, client.app, num_nodes, run_config=config)
    assert all(set(c.node_config) == {"partition-id", "num-partitions"}
               for c in grid.contexts.values())
    assert any(FINAL[name] in r.getMessage() for r in caplog.records), caplog.text[-2000:]


@pytest.mark.parametrize("name", NAMES)
def test_example_scales_with_the_supernode_count(name, caplog):
    config = run_config(name)
    config.update({"num-server-rounds": 3, "num-tasks": 5})
    with example_apps(name) as (server, client), \
            caplog.at_level(logging.INFO, logger="flwr"):
        run_inprocess(server.app, client.app, 5, run_config=config)
    assert any(FINAL[name] in r.getMessage() for r in caplog.records)
