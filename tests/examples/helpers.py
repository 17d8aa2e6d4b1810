"""The example apps of ``examples/``: their directories, packages and run configs."""

from __future__ import annotations

import importlib
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ("quickstart-mocha", "quickstart-fedem", "legacy-numpyclient")


def app_config(name: str) -> dict[str, Any]:
    """``[tool.flwr.app]`` of the example's pyproject."""
    return tomllib.loads((EXAMPLES / name / "pyproject.toml").read_text())["tool"]["flwr"]["app"]


def run_config(name: str) -> dict[str, Any]:
    """The example's default run config (``[tool.flwr.app.config]``, its nested tables
    flattened into dotted keys as Flower flattens them)."""
    from flwr.common.config import flatten_dict

    return flatten_dict(app_config(name)["config"])


@contextmanager
def example_apps(name: str) -> Iterator[tuple[ModuleType, ModuleType]]:
    """``(server_app module, client_app module)`` of the example, imported from its
    directory as Flower imports them (the components named in its pyproject)."""
    components = app_config(name)["components"]
    package = components["serverapp"].split(".")[0]
    sys.path.insert(0, str(EXAMPLES / name))
    try:
        server = importlib.import_module(components["serverapp"].split(":")[0])
        client = importlib.import_module(components["clientapp"].split(":")[0])
        yield server, client
    finally:
        sys.path.remove(str(EXAMPLES / name))
        for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[module]
