"""Settings values have one home, the strategy's ``settings`` (settings.SettingsHome): a
strategy reads them from there and an assignment (``strategy.lam = 0.2``) updates them, so
``strategy.lam`` and ``strategy.settings.lam`` never disagree; the values a strategy derives
itself (``derived_settings``) and those kept by a property stay apart."""

from __future__ import annotations

import dataclasses

import pytest

from fmtl_flower.settings import MOCHASettings
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.strategies.ofmtl import OFMTL

STRATEGIES = {"mocha": lambda: MOCHA(4, lam=0.1), "mb-sgd": lambda: MbSGD(4, lam=0.1),
              "fedem": lambda: FedEM(4, method="fedavg"), "fsvrg": lambda: FSVRG(4),
              "ofmtl": lambda: OFMTL(4, initial_tasks=2, lam=0.1)}


def _read_through(strategy) -> list[str]:
    """The settings fields the strategy reads from its settings."""
    kept = {"min_tasks", "task_owners"} | set(getattr(strategy, "derived_settings", ()))
    return [f.name for f in dataclasses.fields(strategy.settings) if f.name not in kept]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_settings_are_read_from_the_settings_not_copied(name):
    strategy = STRATEGIES[name]()
    fields = _read_through(strategy)
    assert len(fields) >= 15
    assert not set(fields) & set(vars(strategy))  # no copy on the strategy
    for field in fields:
        assert getattr(strategy, field) is getattr(strategy.settings, field), field


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_an_assigned_setting_is_the_settings_value(name):
    strategy = STRATEGIES[name]()
    strategy.seed = 17
    strategy.fraction_evaluate = 1.5  # not checked here: start refuses it, as before
    assert strategy.settings.seed == strategy.seed == 17
    assert strategy.settings.fraction_evaluate == 1.5


def test_shared_settings_are_not_changed_through_a_strategy():
    settings = MOCHASettings(lam=0.1)
    first, second = MOCHA(4, settings), MOCHA(4, settings)
    first.lam = 0.3
    assert (first.lam, first.settings.lam) == (0.3, 0.3)
    assert settings.lam == 0.1 and second.lam == 0.1


def test_derived_values_stay_apart_from_the_configured_setting():
    fedem = FedEM(4, method="fedavg", model="logistic")
    assert fedem.settings.model == "logistic" and not isinstance(fedem.model, str)
    fsvrg = FSVRG(4)
    fsvrg.lam = 0.25  # what the run derived (1/n by default)
    assert fsvrg.lam == 0.25 and fsvrg.settings.lam is None


def test_a_strategy_built_at_start_keeps_a_setting_assigned_before():
    strategy = MOCHA(None, lam=0.1, min_available_nodes=2)
    strategy.seed = 9
    assert strategy.seed == strategy.settings.seed == 9
    with pytest.raises(AttributeError, match="exists once start"):
        strategy.state  # noqa: B018 (a strategy still to be built says why)
