"""Helpers shared by the ClientApp handlers."""

from __future__ import annotations

import math
from typing import Any

from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp


def config_value(config: ConfigRecord, key: str, kind: type) -> Any:
    """``config[key]`` checked to be of ``kind`` (int, float, str or bool; no bool for numbers)."""
    if key not in config:
        raise ValueError(f"message config lacks {key!r}")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"message config {key!r} must be an int, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"message config {key!r} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"message config {key!r} is not finite: {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"message config {key!r} must be a string, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"message config {key!r} must be a bool, got {value!r}")
    return value


def client_app_for(client: Any) -> ClientApp:
    """A ClientApp routing ``query.whoami``, ``train`` and ``evaluate`` to ``client``'s
    handlers of the same names."""
    app = ClientApp()
    app.query("whoami")(client.whoami)
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    return app
