"""Which kernels a ClientApp's calls run, by the role of the process (:mod:`fmtl_flower.core.jit`).

A simulation runs numba for every call (when installed), a deployment's ClientApp process the
per-call ``auto`` rule; ``FMTL_KERNELS`` set by the user wins. The two ClientApp wrappers here
carry that choice into the processes that handle the messages:

* :func:`pin_kernels`: ``fmtl run``'s (and ``run_federation``'s) ClientApp on Ray runs every
  call with the driver's choice. The choice is baked into the ClientApp object that Flower
  ships to the Ray workers, so it reaches a private Ray instance's workers and a joined
  cluster's alike (a cluster's workers do not inherit the driver's environment, and Flower's
  Ray backend passes its own ``runtime_env`` to ``ray.init``).
* :func:`role_kernels`: the ClientApp of ``flwr run`` (``fmtl_flower.apps.client_app``) runs
  the calls it handles inside Flower's simulation engine as a simulation
  (:func:`fmtl_flower.core.jit.simulation`), every other call (a SuperNode's ClientApp
  process) with the process's own setting. Flower tells a ClientApp nothing about the engine
  that calls it; :func:`in_flower_simulation` recognises the one simulation backend of flwr
  1.42 (Ray actors of ``flwr.simulation.ray_transport.ray_actor.ClientAppActor``). Should a
  later Flower run simulations elsewhere, such calls keep ``auto``: slower, same numbers as a
  deployment, and ``FMTL_KERNELS=numba`` in the environment still sets numba.

Nothing here imports numba or Ray. (Wrappers, not Flower's ClientApp ``lifespan``: the packed
ClientApp of :mod:`fmtl_flower.packing` has its own ``__call__``, which skips lifespans.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..core import jit

__all__ = ["KernelsClientApp", "in_flower_simulation", "pin_kernels", "role_kernels"]

#: The module of Flower's simulation actor (flwr 1.42): loaded in every Ray worker that hosts
#: one, and by nothing a SuperNode's ClientApp process runs.
FLOWER_ACTOR_MODULE = "flwr.simulation.ray_transport.ray_actor"


def in_flower_simulation() -> bool:
    """Whether this call runs inside Flower's simulation engine: in a Ray actor, in a process
    that loaded Flower's simulation actor class (:data:`FLOWER_ACTOR_MODULE`). Imports
    nothing: in a process without Ray it is False at once."""
    ray = sys.modules.get("ray")
    if ray is None or FLOWER_ACTOR_MODULE not in sys.modules:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - an unexpected Ray: not recognised, the default stays
        return False


class KernelsClientApp(ClientApp):
    """A ClientApp that runs each call of ``app`` inside ``kernels()`` (a context manager
    that sets the kernels: :func:`fmtl_flower.core.jit.using`, ``simulation``); picklable
    when ``kernels`` is (Ray ships it to the workers)."""

    def __init__(self, app: ClientApp | Callable[[Message, Context], Message],
                 kernels: Callable[[], AbstractContextManager[object]]) -> None:
        super().__init__()
        self.app = app
        self.kernels = kernels

    def __call__(self, message: Message, context: Context) -> Message:
        with self.kernels():
            return self.app(message, context)


class _Pinned:
    def __init__(self, choice: str) -> None:
        if choice not in ("auto", "numba", "numpy"):
            raise ValueError(f"choice must be auto, numba or numpy, got {choice!r}")
        self.choice = choice

    def __call__(self) -> AbstractContextManager[None]:
        return jit.using(self.choice)


def pin_kernels(app: ClientApp, choice: str) -> KernelsClientApp:
    """``app`` with every call run with kernels ``choice`` (``jit.using``), in whatever
    process handles it."""
    return KernelsClientApp(app, _Pinned(choice))


def _by_role() -> AbstractContextManager[object]:
    return jit.simulation() if in_flower_simulation() else nullcontext()


def role_kernels(app: ClientApp) -> KernelsClientApp:
    """``flwr run``'s ``app``: a call inside Flower's simulation engine runs as a simulation
    (:func:`fmtl_flower.core.jit.simulation`), any other call as the process is set (a
    device: ``auto`` unless ``FMTL_KERNELS``)."""
    return KernelsClientApp(app, _by_role)
