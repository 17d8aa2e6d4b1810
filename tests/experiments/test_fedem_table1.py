"""`fmtl reproduce fedem-table1 --quick`: the contract of its JSON, CSV and plot."""

import csv
import json

from fmtl_flower.cli import main
from fmtl_flower.config import RunConfig
from fmtl_flower.experiments.fedem_table1 import METHODS, POSTER


def test_quick_fedem_table1_writes_the_contract(tmp_path, capsys):
    assert main(["reproduce", "fedem-table1", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fedem" in out and "unseen" in out
    payload = json.loads((tmp_path / "fedem-table1.json").read_text())
    rows = payload["rows"]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert {"method", "seed", "accuracy_mean", "accuracy_bottom_decile"} <= set(r)
        assert 0.0 < r["accuracy_bottom_decile"] <= r["accuracy_mean"] + 1e-12 <= 1.0 + 1e-12
    assert {s["method"] for s in payload["summary"]} == set(POSTER)
    assert sorted(r["M"] for r in payload["m_sweep"]) == [1, 2, RunConfig().num_components]
    assert {(r["fraction"], r["aggregation"]) for r in payload["sampling_sweep"]} == {
        (0.5, "all"), (0.5, "sampled"), (1.0, "all"), (1.0, "sampled")}
    unseen = payload["unseen"][0]
    assert unseen["method"] == "fedem" and 0.0 < unseen["unseen_accuracy_mean"] <= 1.0
    with open(tmp_path / "fedem-table1.csv") as f:
        assert len(list(csv.DictReader(f))) == len(METHODS)
    assert (tmp_path / "fedem-table1.png").stat().st_size > 1000
