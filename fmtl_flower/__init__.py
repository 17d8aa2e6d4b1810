"""fmtl-flower: federated multi-task learning (MOCHA, FedEM, OFMTL, FSVRG) for Flower.

The main entry points, importable from the package root (loaded on first use, so that
``import fmtl_flower`` stays cheap):

* :class:`Mocha` -- the MOCHA ``flwr.serverapp.strategy.Strategy``;
* :func:`make_mocha_client_app` -- a MOCHA ``ClientApp`` over your own data loader;
* :func:`fit_mocha` -- the same computation without Flower (sweeps, benchmarks);
* :class:`FedEM` -- FedEM and its baselines (FedAvg, FedProx, FedAvg+, clustered FL, local);
* :func:`make_fedem_client_app` -- their ``ClientApp`` over your own data loader;
* :func:`load_dataset` -- the built-in datasets (``synthetic``, ``small``, ``eat-voc``,
  ``fedem-synthetic``, .mat).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Mocha": "fmtl_flower.strategies.mocha",
    "make_mocha_client_app": "fmtl_flower.clients.mocha",
    "fit_mocha": "fmtl_flower.centralized",
    "FedEM": "fmtl_flower.strategies.fedem",
    "make_fedem_client_app": "fmtl_flower.clients.fedem",
    "load_dataset": "fmtl_flower.data",
    "RunConfig": "fmtl_flower.config",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
