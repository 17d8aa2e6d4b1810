"""fmtl-flower: federated multi-task learning (MOCHA, FedEM, OFMTL, FSVRG) for Flower.

Everything a Flower project needs is importable from the package root (loaded on first use,
so that ``import fmtl_flower`` stays cheap):

Strategies (``flwr.serverapp.strategy.Strategy`` subclasses, driven by ``start()``)
    :class:`MOCHA` (also CoCoA and mini-batch SDCA: ``method=``), :class:`MbSGD`,
    :class:`FedEM` (also FedAvg, FedProx, FedAvg+, CFL, IFCA, pFedMe, local: ``method=``),
    :class:`OFMTL`, :class:`FSVRG` (also GD, naive FSVRG, CoCoA+, DANE: ``method=``);
    :class:`DiscoveryError` (too few tasks showed up) and :class:`NoValidReplies` (rounds
    in a row without a valid reply): the ``RuntimeError`` subclasses ``start()`` stops with.
ClientApp factories over your own ``load_data(context)``
    :func:`make_mocha_client_app` (also serves CoCoA and Mb-SDCA), :func:`make_mbsgd_client_app`,
    :func:`make_fedem_client_app`, :func:`make_ofmtl_client_app`, :func:`make_fsvrg_client_app`;
    :func:`make_fedem_torch_client_app` (FedEM over a PyTorch ``nn.Module``, extra ``torch``).
NumPyClients for ``ClientApp(client_fn=...)`` projects
    :class:`MOCHANumPyClient`, :class:`FedEMNumPyClient`; the server reaches them through
    :class:`LegacyGrid` (``strategy.start(grid=LegacyGrid(grid), ...)``).
Data
    :func:`load_dataset` (the built-in datasets), :class:`MultiTaskDataset`;
    :func:`partition_loader` / :func:`partition_arrays` turn a ``flwr_datasets``
    partitioner into a ``load_data(context)`` (needs the ``datasets`` extra).
Scale and engines
    :class:`PackedGrid` / :func:`packed_client_app` / :func:`tasks_of_node` (several tasks
    per Flower node), :func:`run_inprocess` (a ServerApp/ClientApp pair without Ray),
    :func:`fit_mocha` (MOCHA without Flower), :class:`RunConfig`.
Settings
    :class:`MOCHASettings`, :class:`MbSGDSettings`, :class:`FedEMSettings`,
    :class:`OFMTLSettings`, :class:`FSVRGSettings` (each extends :class:`CommonSettings`):
    what each strategy's constructor takes, checked, from keywords or a run config.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # strategies
    "MOCHA": "fmtl_flower.strategies.mocha",
    "MbSGD": "fmtl_flower.strategies.mbsgd",
    "FedEM": "fmtl_flower.strategies.fedem",
    "OFMTL": "fmtl_flower.strategies.ofmtl",
    "FSVRG": "fmtl_flower.strategies.fsvrg",
    "DiscoveryError": "fmtl_flower.strategies.discovery",
    "discover_num_tasks": "fmtl_flower.strategies.discovery",
    "NoValidReplies": "fmtl_flower.strategies.base",
    # ClientApp factories
    "make_mocha_client_app": "fmtl_flower.clients.mocha",
    "make_mbsgd_client_app": "fmtl_flower.clients.mbsgd",
    "make_fedem_client_app": "fmtl_flower.clients.fedem",
    "make_fedem_torch_client_app": "fmtl_flower.clients.fedem_torch",
    "make_ofmtl_client_app": "fmtl_flower.clients.ofmtl",
    "make_fsvrg_client_app": "fmtl_flower.clients.fsvrg",
    # NumPyClients and the server side's translation
    "MOCHANumPyClient": "fmtl_flower.clients.numpy_client",
    "FedEMNumPyClient": "fmtl_flower.clients.numpy_client",
    "LegacyGrid": "fmtl_flower.legacy",
    # data
    "load_dataset": "fmtl_flower.data",
    "MultiTaskDataset": "fmtl_flower.data",
    "partition_loader": "fmtl_flower.data.flwr_datasets",
    "partition_arrays": "fmtl_flower.data.flwr_datasets",
    # scale, engines, settings
    "PackedGrid": "fmtl_flower.packing",
    "packed_client_app": "fmtl_flower.packing",
    "tasks_of_node": "fmtl_flower.packing",
    "run_inprocess": "fmtl_flower.engine",
    "fit_mocha": "fmtl_flower.centralized",
    "RunConfig": "fmtl_flower.config",
    "CommonSettings": "fmtl_flower.settings",
    "MOCHASettings": "fmtl_flower.settings",
    "MbSGDSettings": "fmtl_flower.settings",
    "FedEMSettings": "fmtl_flower.settings",
    "OFMTLSettings": "fmtl_flower.settings",
    "FSVRGSettings": "fmtl_flower.settings",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
