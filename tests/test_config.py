"""Run-config parsing: every key validated, unknown keys and bad values named."""

import pytest

from fmtl_flower.config import ConfigError, RunConfig, parse_set_options


def test_defaults_round_trip_and_types():
    cfg = RunConfig.from_mapping({"lambda": "1e-4", "num-server-rounds": "7", "omega": "identity",
                                  "drop-prob": 0.25, "seed": 3.0})
    assert cfg.lam == 1e-4 and cfg.num_server_rounds == 7 and cfg.omega == "identity"
    assert cfg.drop_prob == 0.25 and cfg.seed == 3
    assert RunConfig.from_mapping({"lambda": "CV"}).lam == "cv"
    assert RunConfig.from_mapping(cfg.to_dict()) == cfg
    assert set(cfg.to_dict()) == set(RunConfig.keys())


def test_pyproject_run_config_matches_the_defaults():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    flwr_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert set(flwr_config) <= set(RunConfig.keys())
    assert RunConfig.from_mapping(flwr_config) == RunConfig()


@pytest.mark.parametrize("key, value, match", [
    ("lamda", 1, "unknown run-config key 'lamda'"),
    ("lambda", "0", "lambda: must be >"),
    ("lambda", "abc", "lambda: expected a number"),
    ("num-server-rounds", "0", "num-server-rounds: must be >= 1"),
    ("num-server-rounds", "2.5", "num-server-rounds: expected an integer"),
    ("omega", "diagonal", "omega: must be one of"),
    ("drop-prob", "1", "drop-prob: must be < 1"),
    ("test-frac", "-0.1", "test-frac: must be >= 0"),
    ("local-frac", "nan", "local-frac: must be finite"),
    ("sys-het", "extreme", "sys-het: must be one of"),
    ("strategy", "fedsgd", "strategy: must be one of"),
    ("seed", True, "seed: expected an integer"),
    ("dataset", " ", "dataset: must not be empty"),
])
def test_bad_values_are_named(key, value, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping({key: value})


def test_set_options():
    assert parse_set_options(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_options(["novalue"])
