"""The registry of algorithm families (:mod:`fmtl_flower.families`): every entry resolves to
its halves, every ``strategy`` value has one family (or is a centralised baseline), and a
new family is one entry: a toy family registered here runs as a federation through the
apps' factories and the run config, without a line changed elsewhere."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fmtl_flower import families, settings
from fmtl_flower.apps.common import load, make_client_app, strategy_class, strategy_from_config
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.families import FAMILIES, Family, family_of_strategy, register_family
from fmtl_flower.packing import STACKING_STRATEGIES


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_entry_resolves_to_its_halves(family):
    assert issubclass(load(family.strategy), Strategy)
    client = load(family.client)
    assert all(callable(getattr(client, m, None)) for m in ("whoami", "train", "evaluate"))
    assert all(callable(getattr(client, method)) for _, _, method in family.messages)
    assert callable(load(family.client_app))
    if family.stacks:
        assert getattr(load(family.stacked), "protocol", family.name) == family.name
    assert issubclass(getattr(settings, family.settings), settings.StrategySettings)


def test_every_strategy_value_has_one_family_or_is_centralised():
    served = [s for f in FAMILIES for s in f.strategies]
    assert len(served) == len(set(served))
    assert set(settings.STRATEGIES) == set(served) | set(families.CENTRALISED)
    assert family_of_strategy("local", "logistic").name == "fedem"  # FedEM's local baseline
    assert family_of_strategy("local", "svm") is None and family_of_strategy("global") is None


def test_packing_follows_the_entries():
    stacked = {s for f in FAMILIES if f.stacks for s in f.strategies}
    assert set(STACKING_STRATEGIES) == stacked | {"local"}


def test_a_bad_entry_is_a_clear_error():
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        Family("bad", ("bad",), "bad", "strategies.mocha", "c:C", "c:f", "S")
    with pytest.raises(ValueError, match="unknown arguments"):
        Family("bad", ("bad",), "bad", "a:A", "c:C", "c:f", "S", settings_arguments=("x",))
    with pytest.raises(ValueError, match="is taken"):
        register_family(dataclasses.replace(FAMILIES[0], name="other"))


# ---------------------------------------------------------------- a toy family, one entry
@dataclasses.dataclass(frozen=True)
class ToySettings(settings.CommonSettings):
    """The toy family's settings: the common ones and the method."""

    method: str = settings.setting("toy", settings.text)


class ToyClient:
    """Each device answers with its label mean and its example count."""

    def __init__(self, load_data, task_id=None) -> None:
        self.load_data = load_data

    def _answer(self, msg: Message, context) -> Message:
        _, y, _, _ = self.load_data(context)
        metrics = MetricRecord({"n-train": len(y), "y-mean": float(np.mean(y))})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    whoami = train = evaluate = _answer


def make_toy_client_app(load_data) -> ClientApp:
    client, app = ToyClient(load_data), ClientApp()
    app.train()(client.train)
    app.toy_client = client
    return app


class ToyStrategy(Strategy):
    """The weighted mean of the devices' label means, in one round."""

    def __init__(self, num_tasks: int, settings: ToySettings, on_round=None) -> None:
        self.num_tasks, self.settings, self.mean = num_tasks, settings, None

    def start(self, grid: Grid, num_rounds: int = 1, timeout: float = 30.0, **_: Any) -> Result:
        messages = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node,
                            message_type="train") for node in grid.get_node_ids()]
        replies = [r.content["metrics"] for r in grid.send_and_receive(messages, timeout=timeout)]
        n = np.array([r["n-train"] for r in replies], dtype=float)
        self.mean = float(np.dot(n, [r["y-mean"] for r in replies]) / n.sum())
        return Result()

    def configure_train(self, *args): return []  # noqa: E704 - the abstract methods, unused
    def aggregate_train(self, *args): return None, None  # noqa: E704
    def configure_evaluate(self, *args): return []  # noqa: E704
    def aggregate_evaluate(self, *args): return None  # noqa: E704
    def summary(self) -> None: ...  # noqa: E704


@pytest.fixture
def toy_family():
    here = __name__
    family = Family("toy", ("toy",), "toy", f"{here}:ToyStrategy", f"{here}:ToyClient",
                    f"{here}:make_toy_client_app", f"{here}:ToySettings",
                    app_attribute="toy_client", settings_arguments=("method",))
    register_family(family)
    try:
        yield family
    finally:
        FAMILIES.remove(family)


def test_a_toy_family_is_one_entry(toy_family):
    cfg = RunConfig.from_mapping({"strategy": "toy", "dataset": "synthetic", "num-tasks": 4,
                                  "samples-per-task": 20, "dim": 3})
    assert cfg.family is toy_family and strategy_class(cfg) is ToyStrategy
    strategy = strategy_from_config(cfg, 4)
    assert isinstance(strategy.settings, ToySettings) and strategy.settings.method == "toy"
    strategy.start(grid=InProcessGrid(make_client_app(cfg), 4))
    from fmtl_flower.apps.common import dataset_for
    data = dataset_for(cfg)
    ys = [data.task(t).y_train for t in range(4)]
    assert strategy.mean == pytest.approx(np.concatenate(ys).mean(), rel=1e-12)


def test_without_its_entry_the_toy_strategy_is_unknown():
    with pytest.raises(Exception, match="strategy: must be one of"):
        RunConfig.from_mapping({"strategy": "toy"})
