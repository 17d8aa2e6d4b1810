"""The local solvers' kernels: numpy for small calls, numba (when installed) for large ones.

Every per-step loop of the local solvers is decorated with :func:`kernel`, which returns a
:class:`Kernel`: a callable that decides **per call**, from the amount of work the call's
arguments describe, whether it runs the kernel compiled by numba or its numpy implementation
(``fallback``; a kernel without one runs its own code as plain Python).

Why per call on a device. Flower starts a fresh ClientApp process for every message. Importing
numba and loading a message's compiled kernels from numba's on-disk cache costs such a process
about as much as the rest of the message together (``benchmarks/device_message.py``), so a
message with little local work is handled faster by numpy in a process that never imports
numba; only a message with a lot of work pays that back. numba is therefore imported at the
first call that chooses it, never at module import.

Why not in a simulation. A simulation (``fmtl run`` on the in-process engine or Ray,
``fmtl reproduce``, the benchmarks that simulate, a Flower user's own ``flwr run`` on a
simulation federation) runs every ClientApp call in a few long-lived processes, where numba's
import is paid once and many small calls add up (10^5 packed tasks in-process: 21.5 s per
round per call against 5.8 s with numba everywhere). So the default depends on the process's
**role**, fixed for a whole run and never on what the process ran before:

* a deployment's ClientApp process (and any other process): ``auto``, the per-call rule below;
* a simulation: ``numba`` for every call when numba is installed (``auto`` without it).
  :func:`simulation` enters it for a block: ``fmtl run`` around the whole run (its header
  says which kernels run and why), :func:`fmtl_flower.apps.run.run_federation` around a
  federation, ``fmtl reproduce`` around a reproduction. On Ray the driver's choice travels
  with the ClientApp to every worker (:func:`fmtl_flower.apps.kernels.pin_kernels` wraps
  it), so every worker makes the driver's choice whatever its environment
  (a joined cluster's workers do not inherit the driver's). ``flwr run``'s ClientApp
  (``fmtl_flower.apps.client_app``) enters :func:`simulation` for the calls it handles inside
  Flower's simulation engine (a Ray actor of Flower's ``ClientAppActor``:
  :func:`fmtl_flower.apps.kernels.in_flower_simulation`), and nowhere else.

The user's ``FMTL_KERNELS`` (environment) wins over either default, in every role:

* ``auto``: numba iff the call's work estimate (see below) is at least :data:`BREAK_EVEN`
  and numba is installed; else numpy. Without numba installed (armv7), one warning and numpy
  at every size.
* ``numba``: always numba (an ImportError when it is missing), except for a call the
  compiled code cannot handle (a kernel's ``compiles`` predicate: a loss registered in
  Python, :func:`fmtl_flower.core.losses.register_loss`), which runs numpy in every mode.
* ``numpy``: never numba (numba is not imported).

When it is read: calls outside a :func:`simulation` read ``FMTL_KERNELS`` once per process
(:func:`mode`, at the first kernel call), :func:`simulation` reads it again when it starts
(:func:`user_choice`). Set it before a run, not during one: a process whose environment
changes mid-run could give a simulation block and plain calls different settings.
``flwr run``'s ClientApp decides numba's presence in each Ray worker (a simulation's default
is ``numba`` only where it is installed): on a cluster whose workers differ in that, pin
``FMTL_KERNELS`` for every worker to keep numbers independent of which worker served a call.

**Work estimate and break-even.** Each top-level kernel declares ``work(*args)``: the
estimated run time of its numpy implementation in microseconds on a reference machine, from
the call's sizes alone (a per-Python-step cost :data:`STEP_US` plus :data:`ELEMENT_US` per
row entry a step touches; vectorised numpy kernels count only the entries). ``auto`` picks
numba when that estimate reaches :data:`BREAK_EVEN`, the CPU time a fresh process spends
importing numba and loading a kernel family from a warm cache. Measured by
``benchmarks/kernel_breakeven.py`` (2026-11-25, x86-64, numba 0.68, numpy 2.4, load ~2.9 on 2
cores): see the constants' comments. For MOCHA's SDCA (dense rows of d features) numba
runs when ``budget * (STEP_US + ELEMENT_US * d) >= BREAK_EVEN``, about 4e5 coordinate steps
for d up to a few hundred: a device's message with fewer steps than that (the common case:
a budget of one pass over a few thousand rows) never imports numba. With another loss than
the hinge the estimate is multiplied by the loss's measured ``numpy_step_cost``
(:mod:`fmtl_flower.core.losses`; logistic 10: about 4e4 steps). Kernels without an
estimate (helpers called from compiled kernels) run numpy unless ``FMTL_KERNELS=numba``.
While a kernel runs its Python implementation, every kernel it calls runs its Python
implementation too (one choice per top-level call).

**Results and determinism.** The numpy and numba implementations are *not* bit-identical:
numba's SDCA-family kernels are compiled with the fast-math flags ``reassoc`` and
``contract`` (:data:`fmtl_flower.core.sdca.FASTMATH`: SIMD dot products and fused
multiply-adds), numpy sums in its own order, so they agree up to rounding (1e-9 relative in
the tests, usually ~1e-15; the splitmix64 permutation is bit-identical). Each call's choice
is a pure function of the setting in force (``FMTL_KERNELS``, else the role's default),
whether numba is installed, and the sizes of the call's arguments -- never of the process's
history (whether numba was imported by an earlier call, which Ray worker handles a
message). Hence **identical numbers for identical kernels**: a run gives the same numbers on
every engine and in a deployment when both sides run the same kernels, i.e. the same
``FMTL_KERNELS`` (a simulation of the default and a deployment of the default do *not*:
``numba`` against ``auto``; set ``FMTL_KERNELS`` on both to compare them bit for bit).

:func:`use_cache_dir` moves numba's on-disk cache (e.g. under a device's
``client-state-dir``); :func:`using` overrides the choice for a block (tests, benchmarks).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["BREAK_EVEN", "ELEMENT_US", "KERNELS_ENV", "STEP_US", "Kernel", "kernel", "mode",
           "numba_available", "simulation", "simulation_choice", "use_cache_dir", "user_choice",
           "using"]

KERNELS_ENV = "FMTL_KERNELS"
_CHOICES = ("auto", "numba", "numpy")

#: Cost of one Python-level step of a numpy kernel (index, scalar arithmetic, two small numpy
#: calls), microseconds: MOCHA's numpy SDCA step, fitted over d = 1..4000 (measured 1.04).
STEP_US = 1.0
#: Cost per row entry a numpy SDCA step touches (a dot product and an axpy), microseconds
#: (measured 0.00035).
ELEMENT_US = 0.00035
#: A fresh process's CPU time to import numba and load MOCHA's kernels from a warm cache
#: (measured 0.43 s), microseconds: ``auto`` runs numba for calls whose estimate reaches it.
#: numba's own run time is neglected (tens of nanoseconds per step against the numpy step's
#: microsecond). Break-even for MOCHA's SDCA: about 4.1e5 steps at d = 10, 4.0e5 at d = 100,
#: 3.1e5 at d = 1000, 9.5e4 at d = 10000.
BREAK_EVEN = 4.3e5

_mode: str | None = None
_numba: Any = None
_available: bool | None = None
_cache_dir: str | None = None
_kernels: list[Kernel] = []
_local = threading.local()
_using_depth = 0  # open using() blocks: a caller chose the kernels explicitly


def mode() -> str:
    """``auto``, ``numba`` or ``numpy``: ``FMTL_KERNELS`` (read once per process) or the
    innermost :func:`using` block."""
    global _mode
    if _mode is None:
        choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
        if choice not in _CHOICES:
            raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
        _mode = choice
    return _mode


def user_choice() -> str | None:
    """``FMTL_KERNELS`` as the environment sets it now (checked), or None when it is unset or
    empty (then the process's role decides: module docstring)."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower()
    if not choice:
        return None
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def simulation_choice() -> tuple[str, str]:
    """The kernels a simulation runs, and why (the run header's words).

    In order: the choice of an enclosing :func:`using` block (a caller's explicit choice);
    the user's ``FMTL_KERNELS``; ``numba`` when it is installed; else ``auto`` (numpy at
    every size, with the one warning of :func:`numba_available`). Never imports numba.
    """
    if _using_depth:
        return mode(), "chosen by the caller (core.jit.using)"
    user = user_choice()
    if user is not None:
        what = {"auto": "per call, numba only past the break-even, as a device does",
                "numba": "numba for every call", "numpy": "numba never imported"}[user]
        return user, f"{KERNELS_ENV}={user} in the environment: {what}"
    if numba_available():
        return "numba", (f"simulation default; {KERNELS_ENV}=auto to pick per call as a "
                         "device does")
    return "auto", "numba is not installed: numpy at every size"


@contextmanager
def simulation() -> Iterator[tuple[str, str]]:
    """Run the block as a simulation: with the kernels of :func:`simulation_choice` (which
    it yields with its reason), this process and all threads."""
    choice, reason = simulation_choice()
    with using(choice):
        yield choice, reason


def numba_available() -> bool:
    """Whether numba can be imported (checked without importing it; cached)."""
    global _available
    if _available is None:
        if _numba is not None:
            _available = True
        else:
            try:
                _available = importlib.util.find_spec("numba") is not None
            except (ImportError, ValueError):
                _available = False
            if not _available and mode() == "auto":
                warnings.warn("numba is not installed: the local solvers run their numpy "
                              f"implementations at every size (set {KERNELS_ENV}=numpy to "
                              "choose them without this warning)", RuntimeWarning,
                              stacklevel=3)
    return _available


def _load_numba() -> Any:
    """Import numba (once), point its cache at :func:`use_cache_dir`'s directory and teach it
    to compile calls to :class:`Kernel` objects from compiled code."""
    global _numba, _available
    if _numba is None:
        import numba
        from numba.core import types
        from numba.extending import typeof_impl

        @typeof_impl.register(Kernel)
        def _typeof_kernel(value: Kernel, context: Any) -> Any:
            return types.Dispatcher(value.compiled())

        if _cache_dir is not None:
            Path(_cache_dir).mkdir(parents=True, exist_ok=True)
            numba.config.CACHE_DIR = _cache_dir
        _numba = numba
        _available = True
    return _numba


def _wants_numba(work: Callable[..., float] | None, args: tuple[Any, ...]) -> bool:
    if getattr(_local, "python", 0):
        return False  # inside a kernel that runs as Python: its callees follow it
    choice = mode()
    if choice == "numpy":
        return False
    if choice == "numba":
        return True
    if not numba_available():
        return False
    return work is not None and work(*args) >= BREAK_EVEN


class Kernel:
    """A kernel and its numpy implementation; calling it runs the one :func:`kernel`'s rule
    picks (module docstring). ``py_func`` is the kernel's own code, ``fallback`` its numpy
    implementation (or ``py_func``), :meth:`compiled` numba's dispatcher (imports numba)."""

    def __init__(self, func: Callable[..., Any], fallback: Callable[..., Any] | None,
                 work: Callable[..., float] | None, options: dict[str, Any],
                 compiles: Callable[..., bool] | None = None) -> None:
        self.py_func = func
        self.fallback = func if fallback is None else fallback
        self.work = work
        self.compiles = compiles
        self.options = options
        self._dispatcher: Any = None
        self.__name__ = func.__name__
        self.__qualname__ = func.__qualname__
        self.__module__ = func.__module__
        self.__doc__ = func.__doc__
        _kernels.append(self)

    def compiled(self) -> Any:
        """numba's dispatcher of the kernel (``njit(cache=True, nogil=True, **options)``)."""
        if self._dispatcher is None:
            numba = _load_numba()
            self._dispatcher = numba.njit(cache=True, nogil=True, **self.options)(self.py_func)
        return self._dispatcher

    def __call__(self, *args: Any) -> Any:
        if _wants_numba(self.work, args) and (self.compiles is None or self.compiles(*args)):
            return self.compiled()(*args)
        _local.python = getattr(_local, "python", 0) + 1
        try:
            return self.fallback(*args)
        finally:
            _local.python -= 1

    def __repr__(self) -> str:
        return f"<kernel {self.__module__}.{self.__qualname__}>"


def kernel(fallback: Callable[..., Any] | None = None, *,
           work: Callable[..., float] | None = None,
           compiles: Callable[..., bool] | None = None, **options: Any
           ) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorate a kernel: a :class:`Kernel` that runs ``numba.njit(cache=True, nogil=True,
    **options)`` of the function or ``fallback`` (its numpy implementation, same signature
    and results up to rounding; without one the function itself as Python), chosen per call
    from ``work(*args)`` (the numpy implementation's estimated microseconds; module
    docstring). ``compiles(*args)``, when given, says whether the compiled code handles the
    call's arguments at all: when False the call runs ``fallback`` in every mode (a loss of
    Python code only, :func:`fmtl_flower.core.losses.register_loss`)."""

    def wrap(func: Callable[..., Any]) -> Kernel:
        return Kernel(func, fallback, work, options, compiles)

    return wrap


def steps_work(steps: int, row_entries: float) -> float:
    """The estimate of a numpy kernel taking ``steps`` Python-level steps, each touching
    ``row_entries`` row entries (:data:`STEP_US`, :data:`ELEMENT_US`)."""
    return float(steps) * (STEP_US + ELEMENT_US * float(row_entries))


def vector_work(entries: float) -> float:
    """The estimate of a vectorised numpy kernel touching ``entries`` entries."""
    return ELEMENT_US * float(entries)


@contextmanager
def using(choice: str) -> Iterator[None]:
    """Run the block's kernel calls with ``FMTL_KERNELS=choice`` (this process, all threads;
    a :func:`simulation` inside the block keeps it)."""
    global _mode, _using_depth
    if choice not in _CHOICES:
        raise ValueError(f"choice must be one of {', '.join(_CHOICES)}, got {choice!r}")
    saved = _mode  # unread stays unread: the block leaves no setting of its own behind
    _mode = choice
    _using_depth += 1
    try:
        yield
    finally:
        _using_depth -= 1
        _mode = saved


def use_cache_dir(path: str | os.PathLike[str]) -> bool:
    """Keep numba's compiled kernels under ``path`` (created when numba is first used).

    Applies to the kernels this process has not compiled or loaded yet (call it before the
    first kernel runs; later calls with the same path are free). Returns whether numba may be
    used in this process (False under ``FMTL_KERNELS=numpy`` or without numba: nothing to
    cache). numba is not imported here.
    """
    global _cache_dir
    if mode() == "numpy" or not numba_available():
        return False
    path = str(Path(path))
    if path == _cache_dir:
        return True
    _cache_dir = path
    if _numba is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        _numba.config.CACHE_DIR = path
        for k in _kernels:
            dispatcher = k._dispatcher
            if dispatcher is not None and not dispatcher.overloads:
                dispatcher.enable_caching()  # not compiled/loaded yet: find its cache in path
    return True
