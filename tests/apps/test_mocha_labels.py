"""MOCHA's devices in the apps of `fmtl run` and `flwr run` take the labels of the dataset:
K classes (``labels="auto"``) when it holds more than two, -1/+1 (``"pm1"``) otherwise."""

import json
import logging

import numpy as np

from fmtl_flower.apps.client_app import app as client_app
from fmtl_flower.apps.common import dataset_for, mocha_labels
from fmtl_flower.apps.run import run_federation
from fmtl_flower.apps.server_app import app as server_app
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import run_inprocess

DIGITS = {"strategy": "mocha", "dataset": "digits-dirichlet", "num-tasks": 3,
          "num-server-rounds": 3}


def majority_accuracy(cfg: RunConfig) -> float:
    """Test accuracy of predicting each device's most frequent training class (0.28 here)."""
    tasks = dataset_for(cfg).tasks
    hits = sum(int(np.count_nonzero(t.y_test == np.bincount(t.y_train.astype(int)).argmax()))
               for t in tasks)
    return hits / sum(t.y_test.size for t in tasks)


def test_the_label_mode_follows_the_dataset():
    assert mocha_labels(RunConfig.from_mapping(DIGITS)) == "auto"
    assert mocha_labels(RunConfig.from_mapping({"strategy": "mocha"})) == "pm1"  # synthetic


def test_fmtl_run_mocha_learns_the_ten_digits():
    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = RunConfig.from_mapping(DIGITS)
    final = run_federation(cfg, dataset_for(cfg))["final"]
    assert final["complete"] is True and final["num_replies"] == 3
    # ten classes (argmax of the one-vs-rest models) after 3 rounds: 0.76
    assert final["accuracy_mean"] > 2 * majority_accuracy(cfg)


def test_flwr_run_mocha_learns_the_ten_digits(tmp_path):
    logging.getLogger("flwr").setLevel(logging.WARNING)
    out = tmp_path / "res.json"
    run_inprocess(server_app, client_app, 3, run_config={**DIGITS, "results-file": str(out)})
    final = json.loads(out.read_text())["final"]
    assert final["complete"] is True
    assert final["accuracy_mean"] > 2 * majority_accuracy(RunConfig.from_mapping(DIGITS))


def test_the_label_scan_runs_once_per_dataset(monkeypatch):
    """The lazy ClientApp asks for the label mode at every message: the dataset's labels
    are scanned once per process (at 2000 tasks a scan took 15 ms, per message)."""
    scanned = []
    real_unique = np.unique

    def counting_unique(values, *args, **kwargs):
        scanned.append(1)
        return real_unique(values, *args, **kwargs)

    cfg = RunConfig.from_mapping({"strategy": "mocha", "num-tasks": 7, "seed": 12345})
    other = RunConfig.from_mapping({"strategy": "mocha", "num-tasks": 7, "seed": 12346})
    dataset_for(cfg), dataset_for(other)  # loaded (and cached) before counting
    monkeypatch.setattr(np, "unique", counting_unique)
    assert [mocha_labels(cfg) for _ in range(5)] == ["pm1"] * 5
    assert len(scanned) == 2 * 7  # train and test labels of each task, once
    assert [mocha_labels(other) for _ in range(3)] == ["pm1"] * 3
    assert len(scanned) == 4 * 7  # another dataset: scanned once more
