"""Run one federation from a :class:`~fmtl_flower.config.RunConfig`, on an engine.

What ``fmtl run`` and the reproductions share: the ServerApp and ClientApp built from the
run config (:mod:`fmtl_flower.apps.common`), run in-process or on Ray
(:mod:`fmtl_flower.engine`), with ``ceil(m / tasks-per-node)`` Flower nodes, as a simulation:
numba for every kernel call when installed, unless ``FMTL_KERNELS`` (or a caller's
``core.jit.using``) says otherwise (:func:`fmtl_flower.core.jit.simulation`), the same choice
in this process and in every Ray worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..config import RunConfig
from ..core import jit
from ..engine import run_inprocess, run_ray
from .common import make_client_app, make_server_app
from .kernels import pin_kernels

__all__ = ["run_federation"]


def run_federation(cfg: RunConfig, data, engine: str = "inprocess", *,
                   on_round: Callable[[dict[str, Any]], None] | None = None,
                   ray_address: str | None = None) -> dict[str, Any]:
    """Run the federation of ``cfg.strategy`` over ``data`` on ``engine``, as a simulation.

    The kernels are :func:`fmtl_flower.core.jit.simulation`'s choice (numba for every call
    when installed, unless ``FMTL_KERNELS`` or an enclosing ``jit.using`` block says
    otherwise), made here once and carried to the Ray workers with the ClientApp.

    Parameters
    ----------
    cfg : RunConfig
        The run config (strategy, rounds, task packing, ...); ``tasks-per-node = 0`` packs
        automatically (:func:`fmtl_flower.packing.auto_packing`).
    data : dataset
        What :func:`~fmtl_flower.apps.common.dataset_for` returns for ``cfg``; only its
        ``num_tasks`` is read here (the ClientApp loads each task itself).
    engine : {"inprocess", "ray"}
        Where the apps run.
    on_round : callable, optional
        Called with every per-round record as the ServerApp makes it.
    ray_address : str, optional
        A Ray cluster to join (``engine="ray"``).

    Returns
    -------
    dict
        The results dict (``config``, ``rounds``, ``final``, ...).

    Raises
    ------
    RuntimeError
        If the federation ended without results.
    """
    if cfg.tasks_per_node == 0:  # automatic task packing (the documented rule)
        from ..packing import auto_packing

        cfg, _ = auto_packing(cfg, data.num_tasks, engine)
    box: dict[str, Any] = {}
    server_app = make_server_app(cfg, on_round=on_round, on_done=box.update)
    client_app = make_client_app(cfg)
    nodes = math.ceil(data.num_tasks / cfg.tasks_per_node)  # task packing: K tasks per node
    with jit.simulation() as (kernels, _):
        if engine == "inprocess":
            run_inprocess(server_app, client_app, nodes)
        else:  # the workers make this process's choice, whatever their environment
            run_ray(server_app, pin_kernels(client_app, kernels), nodes, address=ray_address)
    if not box:
        raise RuntimeError("the federation ended without results (see the log above)")
    return box
