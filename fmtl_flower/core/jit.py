"""The local solvers' kernels: compiled by numba when it is installed, numpy otherwise.

Every per-step loop of the local solvers is decorated with :func:`kernel`. With numba (the
base install on x86-64 and aarch64) the loop is compiled with ``cache=True``: the machine code
is kept on disk and a fresh ClientApp process loads it instead of compiling again. Without
numba (armv7, or ``FMTL_KERNELS=numpy``) the decorator returns the kernel's numpy
implementation (``fallback``), which gives the same results up to rounding (numba's kernels
reassociate sums); kernels without one run as plain Python.

``FMTL_KERNELS`` (environment, read once per process): ``auto`` (default: numba when it
imports, else numpy with one warning), ``numba`` (numba or an ImportError), ``numpy`` (never
import numba: a ClientApp process then costs what numpy costs, see
``benchmarks/device_message.py``).

:func:`use_cache_dir` moves numba's on-disk cache (e.g. under a device's
``client-state-dir``) for the kernels not compiled yet in this process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BACKEND", "KERNELS_ENV", "kernel", "use_cache_dir"]

KERNELS_ENV = "FMTL_KERNELS"
_CHOICES = ("auto", "numba", "numpy")


def _load_numba() -> Any:
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "numpy":
        return None
    try:
        import numba
    except ImportError:
        if choice == "numba":
            raise
        warnings.warn("numba is not installed: the local solvers run their numpy "
                      f"implementations (set {KERNELS_ENV}=numpy to choose them without "
                      "this warning)", RuntimeWarning, stacklevel=2)
        return None
    return numba


_numba = _load_numba()
#: ``"numba"`` or ``"numpy"``: which implementation the kernels of this process run.
BACKEND = "numba" if _numba is not None else "numpy"
_dispatchers: list[Any] = []
_cache_dir: str | None = None


def kernel(fallback: Callable[..., Any] | None = None, **options: Any
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a kernel: ``numba.njit(cache=True, nogil=True, **options)`` when numba is
    available, else ``fallback`` (its numpy implementation, same signature and results) or,
    without one, the function itself run by the interpreter."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        if _numba is None:
            return func if fallback is None else fallback
        dispatcher = _numba.njit(cache=True, nogil=True, **options)(func)
        _dispatchers.append(dispatcher)
        return dispatcher

    return wrap


def use_cache_dir(path: str | os.PathLike[str]) -> bool:
    """Keep numba's compiled kernels under ``path`` (created if missing).

    Applies to the kernels this process has not compiled or loaded yet (call it before the
    first kernel runs; later calls with the same path are free). Returns whether numba is in
    use (False: nothing to cache).
    """
    global _cache_dir
    if _numba is None:
        return False
    path = str(Path(path))
    if path == _cache_dir:
        return True
    Path(path).mkdir(parents=True, exist_ok=True)
    _numba.config.CACHE_DIR = path
    for dispatcher in _dispatchers:
        if not dispatcher.overloads:  # not compiled/loaded yet: find its cache under path
            dispatcher.enable_caching()
    _cache_dir = path
    return True
