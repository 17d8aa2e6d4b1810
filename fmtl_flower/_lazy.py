"""Modules imported on first use, so that a device's ClientApp process never loads what its
run does not need (scipy, scikit-learn, Ray, matplotlib are not part of the base install)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for module ``name``; imports it at the first attribute access.

    Parameters
    ----------
    name : str
        Dotted module name, e.g. ``"scipy.sparse"``.
    extra : str
        The install extra that provides it, named in the error when it is missing.
    """

    def __init__(self, name: str, extra: str = "simulation") -> None:
        self._name = name
        self._extra = extra
        self._module: ModuleType | None = None

    def _load(self) -> ModuleType:
        if self._module is None:
            try:
                self._module = importlib.import_module(self._name)
            except ImportError as err:
                raise ImportError(
                    f"{self._name} is needed here and is not installed: "
                    f"pip install \"fmtl-flower[{self._extra}]\"") from err
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_module(name: str, extra: str = "simulation") -> Any:
    """A :class:`LazyModule` for ``name`` (typed ``Any`` so attribute use type-checks)."""
    return LazyModule(name, extra)
