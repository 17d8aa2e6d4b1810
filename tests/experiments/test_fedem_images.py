"""`fmtl reproduce fedem-images --quick`: FedEM, FedAvg and Local with a small CNN through the
torch backend on the generated relabelled image mixture; the contract of its outputs."""

import csv
import json

import pytest

from fmtl_flower.cli import main
from fmtl_flower.experiments import REPRODUCTIONS, parse_options
from fmtl_flower.experiments.fedem_images import METHODS

pytest.importorskip("torch")


def test_quick_fedem_images_writes_the_contract(tmp_path, capsys):
    assert "fedem-images" in REPRODUCTIONS
    assert main(["reproduce", "fedem-images", "--quick", "--out", str(tmp_path),
                 "--set", "rounds=3", "--set", "clients=6", "--set", "samples=60"]) == 0
    out = capsys.readouterr().out
    assert "fedem" in out and "unseen" in out
    payload = json.loads((tmp_path / "fedem-images.json").read_text())
    rows = payload["rows"]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert r["split"] == "dirichlet" and r["rounds"] == 3
        assert 0.0 <= r["accuracy_bottom_decile"] <= r["accuracy_mean"] <= 1.0
        assert (r["unseen_accuracy_mean"] is None) == (r["method"] == "local")
    assert payload["config"]["clients"] == 6 and payload["config"]["dataset"] == "generated"
    with open(tmp_path / "fedem-images.csv") as f:
        assert len(list(csv.DictReader(f))) == len(METHODS)


def test_options_are_checked():
    assert parse_options("fedem-images", ["split=pachinko", "lr=0.2"]) == {
        "split": "pachinko", "lr": 0.2}
    with pytest.raises(ValueError, match="split"):
        parse_options("fedem-images", ["split=iid"])
    with pytest.raises(ValueError, match="dataset"):
        parse_options("fedem-images", ["dataset=mnist"])
    with pytest.raises(ValueError, match="lr"):
        parse_options("fedem-images", ["lr=0"])


def test_without_torch_the_error_names_the_extra(tmp_path, monkeypatch):
    import sys

    from fmtl_flower.experiments.fedem_images import run

    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(ValueError, match=r"fmtl-flower\[torch\]"):
        run(tmp_path, quick=True)
