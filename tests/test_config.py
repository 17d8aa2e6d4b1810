"""Run-config parsing: every key validated, unknown keys, bad values and keys of another
strategy family named; the flat names of the previous release as deprecated aliases."""

import tomllib
import warnings
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict

from fmtl_flower.config import (
    ConfigError,
    RunConfig,
    parse_set_options,
    settings_from_config,
)
from fmtl_flower.settings import FedEMSettings, FSVRGSettings, MOCHASettings, OFMTLSettings

ROOT = Path(__file__).parents[1]


def test_defaults_round_trip_and_types():
    cfg = RunConfig.from_mapping({"mocha.lambda": "1e-4", "num-server-rounds": "7",
                                  "mocha.omega": "identity", "mocha.drop-prob": 0.25,
                                  "seed": 3.0})
    assert cfg.lam == 1e-4 and cfg.num_server_rounds == 7 and cfg.omega == "identity"
    assert cfg.drop_prob == 0.25 and cfg.seed == 3
    assert RunConfig.from_mapping({"mocha.lambda": "CV"}).lam == "cv"
    assert RunConfig.from_mapping(cfg.to_dict()) == cfg
    assert set(cfg.to_dict(every_family=True)) == set(RunConfig.keys())
    # a run's results name the keys its strategy reads: common and MOCHA's, no FedEM key
    assert "mocha.theta" in cfg.to_dict() and "fedem.lr" not in cfg.to_dict()


def test_pyproject_run_config_matches_the_defaults():
    """The project's nested tables, flattened as Flower flattens them, are the defaults."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    flwr_config = flatten_dict(pyproject["tool"]["flwr"]["app"]["config"])
    assert set(flwr_config) == set(RunConfig.keys())
    assert "mocha.theta" in flwr_config and "theta" not in flwr_config
    # every family's defaults are listed: a run of any family reads them without error
    for strategy in ("mocha", "mb-sgd", "fedem", "ofmtl", "fsvrg", "dane"):
        values = {**flwr_config, "strategy": strategy}
        cfg = RunConfig.from_mapping(values, foreign_defaults=True)
        assert cfg == RunConfig(strategy=strategy)


@pytest.mark.parametrize("key, value, match", [
    ("lamda", 1, "unknown run-config key 'lamda'"),
    ("mocha.lambda", "0", "mocha.lambda: must be >"),
    ("mocha.lambda", "abc", "mocha.lambda: expected a number"),
    ("num-server-rounds", "0", "num-server-rounds: must be >= 1"),
    ("num-server-rounds", "2.5", "num-server-rounds: expected an integer"),
    ("mocha.omega", "diagonal", "mocha.omega: must be one of"),
    ("mocha.drop-prob", "1", "mocha.drop-prob: must be < 1"),
    ("test-frac", "-0.1", "test-frac: must be >= 0"),
    ("mocha.local-frac", "nan", "mocha.local-frac: must be finite"),
    ("mocha.sys-het", "extreme", "mocha.sys-het: must be one of"),
    ("mocha.theta", "1", "mocha.theta: must be < 1"),
    ("strategy", "fedsgd", "strategy: must be one of"),
    ("seed", True, "seed: expected an integer"),
    ("dataset", " ", "dataset: must not be empty"),
    ("min-tasks", "-1", "min-tasks: must be >= 0"),
    ("fraction-train", "0", "fraction-train: must be > 0"),
    ("min-available-nodes", "x", "min-available-nodes: expected an integer"),
])
def test_bad_values_are_named(key, value, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping({key: value})


@pytest.mark.parametrize("strategy, key, family", [
    ("mocha", "fedem.lr", "FedEM's family"),
    ("cocoa", "fsvrg.h", "FSVRG's family"),
    ("fedem", "mocha.theta", "MOCHA's family"),
    ("mocha", "ofmtl.outer", "OFMTL"),
    ("fsvrg", "fedem.local-epochs", "FedEM's family"),
])
def test_a_key_of_another_family_is_an_error_naming_its_family(strategy, key, family):
    with pytest.raises(ConfigError, match=f"{key} belongs to {family}.*strategy={strategy}"):
        RunConfig.from_mapping({"strategy": strategy, key: "2"})
    # ... also as its deprecated flat name (lr on a MOCHA run: a FedEM key)
    with pytest.raises(ConfigError, match="fedem.lr belongs to FedEM's family"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            RunConfig.from_mapping({"strategy": "mocha", "lr": "0.01"})


def test_a_foreign_key_at_its_default_is_read_past_only_when_asked():
    """A pyproject lists every family's defaults (Flower passes them all in
    ``context.run_config``): tolerated there; set to another value it is still an error."""
    values = {"strategy": "mocha", "fedem.lr": 0.3}
    assert RunConfig.from_mapping(values, foreign_defaults=True).lr == 0.3
    with pytest.raises(ConfigError, match="fedem.lr belongs to FedEM's family"):
        RunConfig.from_mapping(values)
    with pytest.raises(ConfigError, match="fedem.lr belongs to FedEM's family"):
        RunConfig.from_mapping({**values, "fedem.lr": 0.01}, foreign_defaults=True)


@pytest.mark.parametrize("flat, dotted, strategy, value, attr", [
    ("theta", "mocha.theta", "cocoa", "0.25", "theta"),
    ("lambda", "mocha.lambda", "mocha", "0.01", "lam"),
    ("M", "fedem.M", "fedem", "2", "num_components"),
    ("retrain-ratio", "ofmtl.retrain-ratio", "ofmtl", "3", "retrain_ratio"),
    ("dane-mu", "fsvrg.dane-mu", "dane", "0.5", "dane_mu"),
])
def test_flat_names_are_deprecated_aliases(flat, dotted, strategy, value, attr):
    with pytest.warns(DeprecationWarning, match=f"'{flat}' is deprecated; use '{dotted}'"):
        old = RunConfig.from_mapping({"strategy": strategy, flat: value})
    assert old == RunConfig.from_mapping({"strategy": strategy, dotted: value})
    assert getattr(old, attr) != getattr(RunConfig(), attr)


def test_one_deprecation_warning_per_flat_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunConfig.from_mapping({"theta": "0.3", "gamma": "0.5", "num-server-rounds": 3})
    messages = sorted(str(w.message) for w in caught if w.category is DeprecationWarning)
    assert len(messages) == 2
    assert "'gamma' is deprecated" in messages[0] and "'theta' is deprecated" in messages[1]


def test_old_and_new_name_together_are_an_error():
    with pytest.raises(ConfigError, match="mocha.theta given twice"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            RunConfig.from_mapping({"theta": "0.3", "mocha.theta": "0.4"})


@pytest.mark.parametrize("flat, strategy, attr, key", [
    ("beta", "mb-sdca", "mbsdca_beta", "mocha.mb-sdca-beta"),
    ("beta", "mb-sgd", "mbsgd_beta", "mocha.mb-sgd-beta"),
    ("local-epochs", "fedem", "local_epochs", "fedem.local-epochs"),
    ("local-epochs", "dane", "fsvrg_local_epochs", "fsvrg.local-epochs"),
    ("step-size", "fsvrg", "h", "fsvrg.h"),
    ("step-size", "gd", "step", "fsvrg.step"),
    ("max-update-ratio", "fedem", "max_update_ratio", "fedem.max-update-ratio"),
    ("max-update-ratio", "gd", "fsvrg_max_update_ratio", "fsvrg.max-update-ratio"),
])
def test_split_keys_have_one_meaning_each(flat, strategy, attr, key):
    """The flat names that meant different things per strategy are now one key per meaning;
    the old name maps to the key of the run's strategy."""
    with pytest.warns(DeprecationWarning, match=f"use '{key}'"):
        cfg = RunConfig.from_mapping({"strategy": strategy, flat: "3"})
    assert getattr(cfg, attr) == 3
    others = [f for f in ("mbsdca_beta", "mbsgd_beta", "local_epochs", "fsvrg_local_epochs",
                          "h", "step", "max_update_ratio", "fsvrg_max_update_ratio") if f != attr]
    assert all(getattr(cfg, f) == getattr(RunConfig(), f) for f in others)


def test_split_keys_reach_their_strategy_only():
    mbsgd = settings_from_config(RunConfig.from_mapping(
        {"strategy": "mb-sgd", "mocha.mb-sgd-beta": 0, "mocha.mb-sdca-beta": 5}), 4)
    assert mbsgd.beta is None  # 0: the Pegasos step
    mbsdca = settings_from_config(RunConfig.from_mapping(
        {"strategy": "mb-sdca", "mocha.mb-sgd-beta": 0, "mocha.mb-sdca-beta": 5}), 4)
    assert isinstance(mbsdca, MOCHASettings) and mbsdca.beta == 5.0
    gd = settings_from_config(RunConfig.from_mapping(
        {"strategy": "gd", "fsvrg.h": 8, "fsvrg.step": 0.5, "fsvrg.local-epochs": 2}), 4)
    assert isinstance(gd, FSVRGSettings) and (gd.h, gd.step, gd.local_epochs) == (8, 0.5, 2)
    fedem = settings_from_config(RunConfig.from_mapping(
        {"strategy": "fedem", "fedem.local-epochs": 3}), 4)
    assert isinstance(fedem, FedEMSettings) and fedem.local_epochs == 3


def test_dotted_keys_reach_the_settings():
    cfg = RunConfig.from_mapping({
        "strategy": "cocoa", "mocha.theta": 0.2, "mocha.lambda": 0.01, "mocha.clock-cycle": 0,
        "mocha.s2": 0, "seed": 4, "round-timeout": 30, "min-tasks": 3,
        "min-available-nodes": 2, "fraction-train": 0.5, "min-train-nodes": 1})
    s = settings_from_config(cfg, 5)
    assert s == MOCHASettings(
        method="cocoa", theta=0.2, lam=0.01, clock_cycle=None, s2=None, seed=4,
        discovery_timeout=60.0, min_tasks=3, min_available_nodes=2, fraction_train=0.5,
        min_train_nodes=1)


def test_ofmtl_knobs_are_settable_from_the_run_config():
    cfg = RunConfig.from_mapping({"strategy": "ofmtl", "ofmtl.outer": 3, "ofmtl.inner": 7,
                                  "ofmtl.newcomer-frac": 0.25, "ofmtl.initial-tasks": 2,
                                  "num-server-rounds": 9, "mocha.lambda": 0.5})
    s = settings_from_config(cfg, 6)
    assert s == OFMTLSettings(outer=3, inner=7, newcomer_frac=0.25, initial_tasks=2,
                              mocha_rounds=9, lam=0.5, discovery_timeout=120.0)
    with pytest.raises(ConfigError, match="ofmtl.inner: must be >= 1"):
        RunConfig.from_mapping({"strategy": "ofmtl", "ofmtl.inner": 0})


def test_min_tasks_zero_means_all():
    assert settings_from_config(RunConfig(), 5).min_tasks is None
    assert settings_from_config(RunConfig(min_tasks=2), 5).min_tasks == 2


def test_lambda_cv_is_not_a_strategy_setting():
    with pytest.raises(ConfigError, match="mocha.lambda=cv"):
        settings_from_config(RunConfig(lam="cv"), 4)


def test_set_options():
    assert parse_set_options(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_options(["novalue"])


def test_fmtl_runs_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"'mocha.lamda' \(did you mean mocha.lambda\?\)"):
        RunConfig.from_mapping({"mocha.lamda": 1})
    with pytest.raises(ConfigError, match=r"'fraction-trian' \(did you mean fraction-train\?\)"):
        RunConfig.from_mapping({"fraction-trian": 0.5})


def test_the_run_configs_keys_are_the_settings_modules_list():
    """One home for the list of keys: the run config is built from the settings module's
    declarations, which from_run_config checks against."""
    from fmtl_flower.settings import run_config_keys

    assert RunConfig.keys() == run_config_keys()
    assert len(set(RunConfig.keys())) == len(RunConfig.keys())


def test_the_apps_run_config_is_strict():
    """`flwr run .` of this project's apps: a typo in the run config is an error naming the
    closest key (it was read past), the project's own pyproject.toml passes."""
    from flwr.app import Context, RecordDict

    from fmtl_flower.apps.common import config_from_context

    def context(run_config):
        return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                       run_config=run_config)

    pyproject = RunConfig().to_dict(every_family=True)
    assert config_from_context(context(pyproject), None) == RunConfig()
    with pytest.raises(ConfigError, match=r"did you mean mocha.lambda\?"):
        config_from_context(context({**pyproject, "mocha.lamda": 1.0}), None)
