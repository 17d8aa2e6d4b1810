"""The strategies' settings dataclasses: one home for every check, errors that name the
run-config key, and constructors that take the settings or their fields as keywords."""

import dataclasses

import pytest

from fmtl_flower.settings import (
    ConfigError,
    FedEMSettings,
    FSVRGSettings,
    MbSGDSettings,
    MOCHASettings,
    OFMTLSettings,
)
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.ofmtl import OFMTL


@pytest.mark.parametrize("cls, kwargs, match", [
    (MOCHASettings, {"theta": 1.0}, r"mocha.theta \(theta\): must be < 1.0"),
    (MOCHASettings, {"lam": 0}, r"mocha.lambda \(lam\): must be > 0"),
    (MOCHASettings, {"omega": "diag"}, r"mocha.omega \(omega\): must be one of"),
    (MOCHASettings, {"beta": -1}, r"mocha.mb-sdca-beta \(beta\): must be > 0"),
    (MOCHASettings, {"min_tasks": 0}, r"min-tasks \(min_tasks\): must be >= 1"),
    (MOCHASettings, {"fraction_train": 1.5}, r"fraction-train \(fraction_train\): must be <= 1"),
    (MOCHASettings, {"min_available_nodes": -1}, r"min-available-nodes \(min_available_nodes\)"),
    (MOCHASettings, {"train_metrics_aggr_fn": 3}, "train_metrics_aggr_fn: must be callable"),
    (MbSGDSettings, {"beta": 0.0}, r"mocha.mb-sgd-beta \(beta\): must be > 0"),
    (MbSGDSettings, {"local_frac": 1.5}, r"mocha.local-frac \(local_frac\): must be <= 1"),
    (MbSGDSettings, {"project": 1}, "project: expected true or false"),
    (FedEMSettings, {"lr": 0}, r"fedem.lr \(lr\): must be > 0"),
    (FedEMSettings, {"method": "fedprox", "prox_mu": 0.0},
     r"fedem.prox-mu \(prox_mu\): fedprox needs"),
    (FedEMSettings, {"local_epochs": 0}, r"fedem.local-epochs \(local_epochs\): must be >= 1"),
    (OFMTLSettings, {"inner": 0}, r"ofmtl.inner \(inner\): must be >= 1"),
    (OFMTLSettings, {"newcomer_frac": 0}, r"ofmtl.newcomer-frac \(newcomer_frac\)"),
    (FSVRGSettings, {"method": "fsvrg-naive"}, r"fsvrg.h \(h\): fsvrg-naive needs"),
    (FSVRGSettings, {"local_epochs": 0}, r"fsvrg.local-epochs \(local_epochs\): must be >= 1"),
])
def test_errors_name_the_run_config_key(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(**kwargs)


def test_settings_are_typed_on_construction():
    s = MOCHASettings(lam=1, omega_every=2.0, drop_prob=[0.1, 1.0])
    assert type(s.lam) is float and type(s.omega_every) is int
    assert s.drop_prob == (0.1, 1.0)  # one per task, a device that never sends allowed


@pytest.mark.parametrize("cls, settings, kwargs", [
    (MOCHA, MOCHASettings(lam=0.01, theta=0.3, method="cocoa", seed=5, min_tasks=3),
     {"lam": 0.01, "theta": 0.3, "method": "cocoa", "seed": 5, "min_tasks": 3}),
    (MbSGD, MbSGDSettings(lam=0.2, beta=2.0, schedule="inv_sqrt"),
     {"lam": 0.2, "beta": 2.0, "schedule": "inv_sqrt"}),
    (FedEM, FedEMSettings(method="fedavg", lr=0.1, unseen_tasks=(3,)),
     {"method": "fedavg", "lr": 0.1, "unseen_tasks": [3]}),
    (FSVRG, FSVRGSettings(method="dane", step=0.5, mu=0.1),
     {"method": "dane", "step": 0.5, "mu": 0.1}),
    (OFMTL, OFMTLSettings(initial_tasks=2, outer=3, inner=4, newcomer_frac=0.2),
     {"initial_tasks": 2, "outer": 3, "inner": 4, "newcomer_frac": 0.2}),
])
def test_keywords_and_settings_construct_equal_strategies(cls, settings, kwargs):
    by_settings = cls(4, settings)
    by_keywords = cls(4, **kwargs)
    assert by_settings.settings == by_keywords.settings == settings
    assert by_settings.fingerprint() == by_keywords.fingerprint()
    for f in dataclasses.fields(settings):
        if f.name not in ("min_tasks", "drop_prob", "model", "num_components", "h"):
            assert getattr(by_keywords, f.name) == getattr(settings, f.name), f.name
    # keywords on top of settings override them
    assert cls(4, settings, seed=9).settings == dataclasses.replace(settings, seed=9)


def test_constructors_take_flowers_knobs_and_min_tasks():
    def aggregate(replies):
        return {}

    mocha = MOCHA(6, min_tasks=4, min_available_nodes=3, fraction_train=0.5,
                  min_train_nodes=2, train_metrics_aggr_fn=aggregate)
    assert mocha.min_tasks == 4 and mocha.directory.min_tasks == 4
    assert (mocha.min_available_nodes, mocha.fraction_train, mocha.min_train_nodes) == (3, 0.5, 2)
    assert mocha.train_metrics_aggr_fn is aggregate and mocha.evaluate_metrics_aggr_fn is None
    assert MOCHA(6).min_tasks == 6  # default: all of them
    with pytest.raises(ValueError, match="min_tasks must be an int in 1..6"):
        MOCHA(6, min_tasks=7)


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument.*thetaa"):
        MOCHA(4, thetaa=0.3)
    with pytest.raises(TypeError, match="settings must be a MOCHASettings"):
        MOCHA(4, FedEMSettings())


# ---------------------------------------------------------------- strict run config


@pytest.mark.parametrize("cls, key, near", [
    (MOCHASettings, "mocha.lamda", "mocha.lambda"),
    (MOCHASettings, "fraction-trian", "fraction-train"),
    (MOCHASettings, "theta", "mocha.theta"),  # the previous release's flat name
    (MbSGDSettings, "mocha.mb-sgd-bet", "mocha.mb-sgd-beta"),
    (FedEMSettings, "fedem.learning-rate", None),
    (FedEMSettings, "fedem.m", "fedem.M"),
    (OFMTLSettings, "ofmtl.initial-task", "ofmtl.initial-tasks"),
    (FSVRGSettings, "fsvrg.dane-m", "fsvrg.dane-mu"),
    (FSVRGSettings, "eval-evry", "eval-every"),
])
def test_from_run_config_rejects_unknown_keys_naming_the_closest(cls, key, near):
    with pytest.raises(ConfigError, match=f"unknown run-config key '{key}'") as err:
        cls.from_run_config({key: 1})
    hint = f"(did you mean {near}?)"
    assert (hint in str(err.value)) == (near is not None), str(err.value)


def test_from_run_config_lets_an_apps_own_keys_through_only_when_allowed():
    values = {"mocha.lambda": 0.5, "method": "x", "myapp.lr": 0.1, "myapp.data.path": "p"}
    with pytest.raises(ConfigError, match=r"'method'.*allow=\['method'\]"):
        MOCHASettings.from_run_config(values)
    with pytest.raises(ConfigError, match=r"'myapp.lr'.*allow=\['myapp'\]"):
        MOCHASettings.from_run_config(values, allow=["method"])
    assert MOCHASettings.from_run_config(values, allow=["method", "myapp"]).lam == 0.5
    assert MOCHASettings.from_run_config(values, allow=["method", "myapp."]).lam == 0.5
    # another family's keys are this package's: a pyproject may list every family
    assert MOCHASettings.from_run_config({"fedem.lr": 0.3, "num-tasks": 4}).lam == 0.1


@pytest.mark.parametrize("cls", [MOCHASettings, MbSGDSettings])
def test_an_unbounded_formulation_is_refused_with_the_reason(cls):
    values = {"mocha.omega": "graphical", "mocha.lambda2": 0.0, "mocha.s2": 5.0}
    with pytest.raises(ConfigError, match=r"mocha.lambda2 \(lam2\): .*no lower bound"):
        cls.from_run_config(values)
    with pytest.raises(ConfigError, match="no lower bound"):
        MOCHA(4, omega="graphical", lam2=0.0, s2=5.0)
    assert cls.from_run_config({**values, "mocha.lambda2": 1e-3}).lam2 == 1e-3


def test_python_defaults_are_the_run_config_defaults():
    """One source of defaults (issue 27, item 5): a setting's default in Python (the
    constructors, the settings dataclasses) is the one a run config gets when it leaves the
    key out (``fmtl run``, ``flwr run``, the generated run-config reference). FedEM's M, lr
    and prox-mu were 3, 0.05 and 0 in Python, 4, 0.3 and 0.1 on the wire."""
    import dataclasses

    from fmtl_flower import settings

    # Mb-SGD's step scale: None (Pegasos' 1 / lambda_min(K)) in Python, 1.0 on the wire;
    # not changed here (it would change either family of Mb-SGD's results).
    known = {("MbSGDSettings", "beta")}
    differ = []
    for cls in settings.SETTINGS_CLASSES:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta.get("key") or (cls.__name__, f.name) in known:
                continue
            wire = meta["wire_default"]
            value = meta["from_wire"](wire) if meta["from_wire"] else wire
            value = value if value is None else meta["check"](meta["key"], value)
            if value != f.default:
                differ.append((cls.__name__, f.name, f.default, value))
    assert differ == []
