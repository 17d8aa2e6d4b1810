"""`fmtl reproduce mocha-fig2|mocha-fig3 --quick`: rows contract and what they must show."""

import json

import pytest

from fmtl_flower.cli import main

KEYS = {"dataset", "method", "network", "round", "estimated_time_s", "primal_suboptimality"}


@pytest.fixture(autouse=True)
def _needs_small():
    from fmtl_flower.data import resolve_data_file

    try:
        resolve_data_file("small")
    except FileNotFoundError as err:
        pytest.skip(f"small.mat not available: {err}")


def test_quick_fig2_rows(tmp_path):
    assert main(["reproduce", "mocha-fig2", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "mocha-fig2.json").read_text())["rows"]
    assert {r["sys_het"] for r in rows} == {"low", "high"}
    assert all(set(r) == KEYS | {"sys_het"} for r in rows)
    # Under high heterogeneity the methods that cannot adapt wait for slow devices: within
    # the common time budget they finish fewer rounds than under low heterogeneity.
    done = {(r["method"], r["sys_het"]): r["round"] for r in rows if r["network"] == "lte"}
    for method in ("cocoa", "mb-sdca", "mb-sgd"):
        assert done[(method, "high")] < done[(method, "low")]


def test_quick_fig3_rows_and_the_silent_device(tmp_path):
    assert main(["reproduce", "mocha-fig3", "--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "mocha-fig3.json").read_text())
    rows = payload["rows"]
    assert {r["drop_prob"] for r in rows} == {0.0, 0.1, 0.3, 0.5, "never"}
    assert all(set(r) == KEYS | {"drop_prob"} for r in rows)
    assert {r["method"] for r in rows} == {"mocha", "mocha-full"}
