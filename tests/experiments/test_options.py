"""`fmtl reproduce NAME --set KEY=VALUE`: parsing a reproduction's own options."""

import math

import pytest

from fmtl_flower.cli import main
from fmtl_flower.config import positive_int
from fmtl_flower.experiments import REPRODUCTIONS, parse_options


def test_kebab_and_snake_keys_are_parsed_to_their_types():
    parsed = parse_options("ofmtl-arrivals", ["retrain-ratio=0.5", "outer=30",
                                              "lambda_mode=every", "initial-tasks= 4 "])
    assert parsed == {"retrain_ratio": 0.5, "outer": 30, "lambda_mode": "every",
                      "initial_tasks": 4}
    assert isinstance(parsed["outer"], int) and isinstance(parsed["retrain_ratio"], float)
    assert parse_options("mocha-table1", ["rounds=50", "omega-every=5"]) == {
        "rounds": 50, "omega_every": 5}
    assert parse_options("ofmtl-arrivals", []) == {}
    assert parse_options("ofmtl-arrivals", ["retrain-ratio=inf"]) == {"retrain_ratio": math.inf}


@pytest.mark.parametrize("name, pairs, match", [
    ("ofmtl-arrivals", ["retrain-ratio=abc"], "retrain-ratio: expected a number, got 'abc'"),
    ("ofmtl-arrivals", ["retrain-ratio=nan"], "retrain-ratio: expected a number, got 'nan'"),
    ("ofmtl-arrivals", ["outer=2.5"], "outer: expected an integer, got '2.5'"),
    ("ofmtl-arrivals", ["outr=3"], r"no option 'outr' \(its options: rounds, .*retrain-ratio"),
    ("ofmtl-arrivals", ["outer=3", "outer=4"], "'outer' given twice"),
    ("ofmtl-arrivals", ["outer"], "--set expects KEY=VALUE, got 'outer'"),
    ("ofmtl-arrivals", ["=3"], "--set expects KEY=VALUE"),
    ("mocha-fig1", ["rounds=3"], r"mocha-fig1 has no option 'rounds' \(its options: none\)"),
    ("mocha-table1", ["rounds=0"], "mocha-table1: rounds: must be >= 1, got 0"),
    ("fedem-table1", ["jobs=-2"], "jobs: must be >= 1"),
    ("nope", ["rounds=3"], "unknown reproduction 'nope'"),
])
def test_bad_pairs_are_clear_errors(name, pairs, match):
    with pytest.raises(ValueError, match=match):
        parse_options(name, pairs)


def test_every_declared_option_is_a_keyword_of_its_run():
    import importlib
    import inspect

    for name, module_name in REPRODUCTIONS.items():
        module = importlib.import_module(module_name)
        params = inspect.signature(module.run).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for key in getattr(module, "OPTIONS", {}):
            assert key in params or takes_any, (name, key)


def test_positive_int():
    assert positive_int("rounds", "7") == 7
    with pytest.raises(ValueError, match=">= 1"):
        positive_int("rounds", "0")


def test_cli_reports_bad_options_with_exit_code_2(capsys):
    assert main(["reproduce", "ofmtl-arrivals", "--set", "retrain-ratio=abc"]) == 2
    assert "retrain-ratio: expected a number" in capsys.readouterr().err
    assert main(["reproduce", "ofmtl-arrivals", "--quick", "--set", "retrain-ratio=0"]) == 2
    assert "retrain_ratio must be a number > 0" in capsys.readouterr().err
    assert main(["reproduce", "mocha-fig2", "--shuffles", "0"]) == 2
    assert "--shuffles must be >= 1" in capsys.readouterr().err
