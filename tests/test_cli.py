"""The fmtl command line: results contract, progress lines, clear errors."""

import json

import pytest

from fmtl_flower.cli import main

ROUND_KEYS = {"round", "primal", "dual", "gap", "test_error", "test_error_pooled",
              "accuracy_mean", "accuracy_bottom_decile", "num_replies", "num_dropped",
              "wall_time_s"}


def test_run_mocha_writes_the_results_contract(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["run", "mocha", "--rounds", "4", "--seed", "2", "--out", str(out),
                 "--set", "num-tasks=5", "--set", "dim=4", "--set", "samples-per-task=20",
                 "--set", "mocha.omega-every=2", "--print-every", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.count("round ") >= 5 and "relative_gap" in printed
    results = json.loads(out.read_text())
    assert set(results) >= {"config", "rounds", "final"}
    assert results["config"]["num-server-rounds"] == 4 and results["config"]["seed"] == 2
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2, 3, 4]
    for record in results["rounds"]:
        assert ROUND_KEYS <= set(record)
        assert record["gap"] >= 0
    assert results["final"]["round"] == 4 and results["final"]["complete"] is True
    assert results["final"]["tasks_never_replied"] == []


@pytest.mark.parametrize("strategy", ["local", "global"])
def test_baselines(tmp_path, strategy):
    out = tmp_path / "b.json"
    assert main(["run", strategy, "--out", str(out), "--set", "num-tasks=4", "--set", "dim=3",
                 "--quiet"]) == 0
    final = json.loads(out.read_text())["final"]
    assert 0 <= final["test_error"] <= 1


def test_fsvrg_on_a_dense_dataset_is_a_clear_error(capsys):
    """FSVRG's family needs sparse data: a dense dataset fails at once with what to use,
    not after every node failed discovery for the round timeout."""
    assert main(["run", "fsvrg", "--rounds", "2"]) == 2
    assert ("dataset 'synthetic' is dense; use --dataset sparse-federated"
            in capsys.readouterr().err)


def test_clear_errors(capsys, tmp_path):
    assert main(["run", "mocha", "--set", "lamda=1"]) == 2
    assert "unknown run-config key 'lamda'" in capsys.readouterr().err
    assert main(["run", "mocha", "--set", "mocha.omega=nope"]) == 2
    assert "mocha.omega: must be one of" in capsys.readouterr().err
    assert main(["run", "mocha", "--dataset", str(tmp_path / "missing.mat")]) == 2
    assert "missing.mat" in capsys.readouterr().err
    bad = tmp_path / "bad.mat"
    import numpy as np
    import scipy.io

    cells = np.empty((1, 1), dtype=object)
    cells[0, 0] = np.ones((4, 2))
    labels = np.empty((1, 1), dtype=object)
    labels[0, 0] = np.array([[0], [2], [0], [2]], dtype=np.int16)
    scipy.io.savemat(bad, {"X": cells, "Y": labels})
    assert main(["run", "mocha", "--dataset", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.mat" in err and "labels" in err.lower()
    with pytest.raises(SystemExit):
        main(["run", "fedsgd"])


def test_run_config_option_takes_dotted_keys_as_flwr_run_does(tmp_path, capsys):
    """``--run-config`` parses as ``flwr run --run-config`` (TOML values, dotted keys, or a
    .toml file whose nested tables become dotted keys); --set wins over it; a key of another
    family is an error naming the family."""
    out = tmp_path / "r.json"
    assert main(["run", "cocoa", "--rounds", "2", "--quiet", "--out", str(out),
                 "--run-config", "num-tasks=3 dim=4 samples-per-task=20 mocha.theta=0.3",
                 "--set", "mocha.theta=0.2"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["mocha.theta"] == 0.2 and config["num-tasks"] == 3
    assert "fedem.lr" not in config  # the results name the keys the strategy reads
    toml = tmp_path / "run.toml"
    toml.write_text("num-tasks = 3\ndim = 4\n[mocha]\ntheta = 0.4\n")
    assert main(["run", "cocoa", "--rounds", "2", "--quiet", "--out", str(out),
                 "--run-config", str(toml)]) == 0
    assert json.loads(out.read_text())["config"]["mocha.theta"] == 0.4
    capsys.readouterr()
    assert main(["run", "mocha", "--rounds", "2", "--run-config", "fedem.lr=0.01"]) == 2
    assert "fedem.lr belongs to FedEM's family" in capsys.readouterr().err


@pytest.mark.parametrize("strategy, shows_m", [("fedavg", False), ("fedprox", False),
                                               ("local", False), ("fedem", True),
                                               ("clustered", True)])
def test_the_final_table_shows_m_only_for_methods_that_train_m_models(strategy, shows_m):
    """`fmtl run fedavg` printed "M 4" for a method that trains one model (issue 27)."""
    from fmtl_flower.cli import final_table

    results = {"config": {"strategy": strategy, "dataset": "fedem-synthetic",
                          "model": "logistic", "fedem.M": 4},
               "final": {"round": 3, "train_loss": 0.5, "accuracy_mean": 0.9}}
    rows = [line.split() for line in final_table(results).splitlines()]
    assert (["M", "4"] in rows) is shows_m
    assert ["model", "logistic"] in rows
