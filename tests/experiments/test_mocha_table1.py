"""`fmtl reproduce mocha-table1 --quick`: the contract of its JSON, CSV and plot."""

import csv
import json

import pytest

from fmtl_flower.cli import main
from fmtl_flower.experiments import reproduce


def test_quick_table1_writes_the_contract(tmp_path, capsys):
    try:
        from fmtl_flower.data import resolve_data_file

        resolve_data_file("small")
    except FileNotFoundError as err:
        pytest.skip(f"small.mat not available: {err}")
    assert main(["reproduce", "mocha-table1", "--quick", "--out", str(tmp_path)]) == 0
    assert "mtl" in capsys.readouterr().out
    payload = json.loads((tmp_path / "mocha-table1.json").read_text())
    rows = payload["rows"]
    assert {(r["dataset"], r["method"]) for r in rows} == {
        ("small", m) for m in ("global", "local", "mtl")}
    for r in rows:
        assert set(r) == {"dataset", "method", "error_mean", "error_stderr", "shuffles"}
        assert 0.0 <= r["error_mean"] <= 1.0 and r["shuffles"] == 2
    with open(tmp_path / "mocha-table1.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    assert (tmp_path / "mocha-table1.png").stat().st_size > 1000


def test_unknown_names_are_clear_errors(tmp_path, capsys):
    assert main(["reproduce", "mocha-fig9", "--out", str(tmp_path)]) == 2
    assert "unknown reproduction 'mocha-fig9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown datasets"):
        reproduce("mocha-table1", tmp_path, quick=True, datasets=["nope"])
