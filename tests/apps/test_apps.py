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
