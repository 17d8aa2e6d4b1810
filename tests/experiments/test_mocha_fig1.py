"""`fmtl reproduce mocha-fig1 --quick`: the contract of its rows and what they must show."""

import json

import pytest

from fmtl_flower.cli import main


def test_quick_fig1(tmp_path):
    try:
        from fmtl_flower.data import resolve_data_file

        resolve_data_file("small")
    except FileNotFoundError as err:
        pytest.skip(f"small.mat not available: {err}")
    assert main(["reproduce", "mocha-fig1", "--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "mocha-fig1.json").read_text())
    rows = payload["rows"]
    assert {r["method"] for r in rows} == {"mocha", "cocoa", "mb-sdca", "mb-sgd"}
    assert {r["network"] for r in rows} == {"wifi", "lte", "3g"}
    for r in rows:
        assert set(r) == {"dataset", "method", "network", "round", "estimated_time_s",
                          "primal_suboptimality"}
        assert r["primal_suboptimality"] >= -1e-9  # P* is the optimum
    for method in ("mocha", "cocoa", "mb-sdca", "mb-sgd"):
        curve = [r for r in rows if r["method"] == method and r["network"] == "lte"]
        times = [r["estimated_time_s"] for r in curve]
        assert times == sorted(times) and times[0] == 0.0
        assert curve[-1]["primal_suboptimality"] < curve[0]["primal_suboptimality"]
    slower = {n: max(r["estimated_time_s"] for r in rows if r["network"] == n)
              for n in ("wifi", "lte", "3g")}
    assert slower["wifi"] < slower["lte"] < slower["3g"]
    assert (tmp_path / "mocha-fig1.png").exists()
