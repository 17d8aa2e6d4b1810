"""`fmtl reproduce ofmtl-arrivals --quick`: the contract of its JSON, CSV and plot."""

import csv
import json
import logging

import pytest

from fmtl_flower.cli import main
from fmtl_flower.experiments import REPRODUCTIONS, reproduce
from fmtl_flower.experiments.ofmtl_arrivals import (
    METHODS,
    QUICK,
    Settings,
    format_table,
    mocha_floats,
    newcomer_floats,
)

ROW_KEYS = {"dataset", "order", "devices", "method", "test_error", "cumulative_time_s",
            "floats_communicated"}


@pytest.fixture(autouse=True)
def _needs_small():
    from fmtl_flower.data import resolve_data_file

    try:
        resolve_data_file("small")
    except FileNotFoundError as err:
        pytest.skip(f"small.mat not available: {err}")


def _increments(series):
    """Floats added at each device count after the first."""
    values = [r["floats_communicated"] for r in series]
    return [b - a for a, b in zip(values[:-1], values[1:], strict=True)]


def _by(rows, order, method):
    return sorted((r for r in rows if r["order"] == order and r["method"] == method),
                  key=lambda r: r["devices"])


def test_quick_run_writes_the_contract(tmp_path, capsys):
    assert "ofmtl-arrivals" in REPRODUCTIONS
    pkg_logger = logging.getLogger("fmtl_flower")
    handlers, level = list(pkg_logger.handlers), pkg_logger.level
    try:
        assert main(["reproduce", "ofmtl-arrivals", "--quick", "--out", str(tmp_path)]) == 0
    finally:  # the CLI attaches a handler to the captured stdout: detach it
        for handler in pkg_logger.handlers[len(handlers):]:
            pkg_logger.removeHandler(handler)
        pkg_logger.setLevel(level)
    out = capsys.readouterr().out
    assert "max |OFMTL - MOCHA|" in out and "ofmtl-arrivals: written" in out
    payload = json.loads((tmp_path / "ofmtl-arrivals.json").read_text())
    rows = payload["rows"]
    d, T, m0, outer, rounds = 9, 29, 10, QUICK.outer, QUICK.rounds
    assert {r["dataset"] for r in rows} == {"small"}
    assert {r["order"] for r in rows} == {0, 1}
    assert len(rows) == 2 * (T - m0 + 1) * len(METHODS)
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["method"] in METHODS and m0 <= r["devices"] <= T
        assert 0.0 <= r["test_error"] <= 1.0 and r["cumulative_time_s"] >= 0.0
        assert isinstance(r["floats_communicated"], int)
    # 10 initial tasks, ratio 1.5: one retraining, when 15 newcomers have joined
    assert payload["retrainings"] == {"small": {"0": [25], "1": [25]}}
    for order in (0, 1):
        series = {m: _by(rows, order, m) for m in METHODS}
        assert [r["devices"] for r in series["ofmtl"]] == list(range(m0, T + 1))
        for m in METHODS:  # cumulative
            times = [r["cumulative_time_s"] for r in series[m]]
            assert times == sorted(times)
        assert all(r["floats_communicated"] == 0 for r in series["local"])
        # MOCHA: a full training's floats at every device count
        expected = [mocha_floats(m, d, rounds) for m in range(m0 + 1, T + 1)]
        assert _increments(series["mocha"]) == expected
        # OFMTL = MOCHA at the start and at its retraining; O(1) per newcomer otherwise
        for k, (o, mo) in enumerate(zip(series["ofmtl"], series["mocha"], strict=True)):
            if o["devices"] in (m0, 25):
                assert o["test_error"] == mo["test_error"]
            if k == 0:
                assert o["cumulative_time_s"] == mo["cumulative_time_s"]
                assert o["floats_communicated"] == mo["floats_communicated"]
        steps = _increments(series["ofmtl"])
        expected = [mocha_floats(25, d, rounds) if m == 25 else newcomer_floats(d, outer)
                    for m in range(m0 + 1, T + 1)]
        assert steps == expected and newcomer_floats(d, outer) == outer * (2 * d + 1)
    s = payload["summary"]["small"]
    assert s["ofmtl_floats_per_newcomer"] == outer * (2 * d + 1)
    assert s["retrainings_per_order"] == [1, 1]
    assert len(s["ofmtl_minus_mocha_error_pp"]) == T - m0 + 1
    assert s["ofmtl_minus_mocha_error_pp"][0] == 0.0  # both are the initial MOCHA
    assert s["max_abs_error_diff_pp"] == max(abs(x) for x in s["ofmtl_minus_mocha_error_pp"])
    assert s["time_ratio_mocha_over_ofmtl_last"] > 1.0
    assert isinstance(s["within_0.5pp_at_every_device_count"], bool)
    assert payload["config"]["quick"] is True and payload["config"]["lambda_mode"] == "initial"
    assert set(payload["per_order"][0]["lambdas"]) == {"mtl", "local", "global"}
    with open(tmp_path / "ofmtl-arrivals.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (tmp_path / "ofmtl-arrivals.png").stat().st_size > 1000
    assert "small (2 orders, 10 initial tasks)" in format_table(payload)


def test_cv_at_every_arrival_and_retraining_rule(tmp_path):
    """lambda_mode='every' (the reference's protocol) and a lower retraining ratio."""
    payload = reproduce("ofmtl-arrivals", tmp_path, quick=True, shuffles=1,
                        initial_tasks=25, lambda_mode="every", retrain_ratio=0.07,
                        rounds=20, omega_every=10, outer=2, inner=5)
    # 25, then 27 tasks at the (re)trainings: 0.07 x 25 and 0.07 x 27 are below 2, so a
    # retraining every second newcomer
    assert payload["retrainings"] == {"small": {"0": [27, 29]}}
    rows = payload["rows"]
    info = payload["per_order"][0]
    assert all(len(v) == 5 for v in info["lambdas"].values())  # one CV per device count
    mocha, ofmtl = _by(rows, 0, "mocha"), _by(rows, 0, "ofmtl")
    for o, mo in zip(ofmtl, mocha, strict=True):
        if o["devices"] in (25, 27, 29):
            assert o["test_error"] == mo["test_error"]
    assert _increments(ofmtl) == [newcomer_floats(9, 2), mocha_floats(27, 9, 20),
                                  newcomer_floats(9, 2), mocha_floats(29, 9, 20)]


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown options"):
        reproduce("ofmtl-arrivals", tmp_path, quick=True, nope=1)
    with pytest.raises(ValueError, match="lambda_mode"):
        reproduce("ofmtl-arrivals", tmp_path, quick=True, lambda_mode="sometimes")
    with pytest.raises(ValueError, match="unknown datasets"):
        reproduce("ofmtl-arrivals", tmp_path, quick=True, datasets=["nope"])


def test_cli_set_options_reach_the_protocol(tmp_path, capsys):
    """`fmtl reproduce ofmtl-arrivals --set KEY=VALUE` sets the Settings and initial tasks."""
    pkg_logger = logging.getLogger("fmtl_flower")
    handlers, level = list(pkg_logger.handlers), pkg_logger.level
    try:
        code = main(["reproduce", "ofmtl-arrivals", "--quick", "--shuffles", "1",
                     "--out", str(tmp_path), "--set", "initial-tasks=25",
                     "--set", "retrain-ratio=0.07", "--set", "rounds=20",
                     "--set", "omega_every=10", "--set", "outer=2", "--set", "inner=5"])
    finally:
        for handler in pkg_logger.handlers[len(handlers):]:
            pkg_logger.removeHandler(handler)
        pkg_logger.setLevel(level)
    assert code == 0, capsys.readouterr().err
    payload = json.loads((tmp_path / "ofmtl-arrivals.json").read_text())
    config = payload["config"]
    assert (config["retrain_ratio"], config["rounds"], config["omega_every"],
            config["outer"], config["inner"]) == (0.07, 20, 10, 2, 5)
    assert config["initial_tasks"] == {"small": 25}
    assert payload["retrainings"] == {"small": {"0": [27, 29]}}


@pytest.mark.parametrize("field, value", [
    ("retrain_ratio", 0.0), ("retrain_ratio", -1.5), ("retrain_ratio", float("nan")),
    ("outer", 0), ("inner", -1), ("rounds", 2.5), ("folds", 1), ("local_frac", 0),
    ("newcomer_frac", float("inf")), ("omega_eps", float("inf")), ("omega_eps", -1e-9),
    ("lambda_mode", "sometimes"), ("outer", True)])
def test_settings_refuse_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        Settings(**{field: value})


def test_settings_accept_the_reference_defaults_and_boundaries():
    Settings()
    Settings(inner=0, omega_eps=0.0, folds=2, retrain_ratio=1e-3)
    Settings(retrain_ratio=float("inf"))  # never retrain, as the strategy allows
