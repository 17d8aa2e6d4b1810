"""One signature for two entry points: :func:`takes_arguments_of`.

Where a module offers the same call twice (the dataset loader and its cached variant, a
generator and its per-task source), the parameters, their defaults and their order are
written once, on the first function; the second takes them from it, so the two cannot drift
apart.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["takes_arguments_of"]

P = ParamSpec("P")
R = TypeVar("R")


def takes_arguments_of(source: Callable[P, Any]) -> Callable[[Callable[..., R]],
                                                               Callable[P, R]]:
    """Decorator: the function takes ``source``'s arguments.

    The decorated function is called with every argument of ``source`` by keyword, its
    defaults filled in (``func(**arguments)``); a call that does not fit ``source``'s
    signature raises ``TypeError`` as ``source`` would. The result shows ``source``'s
    signature (``help``, :func:`inspect.signature`) with the decorated function's name,
    docstring and return annotation.
    """
    signature = inspect.signature(source)

    def decorate(func: Callable[..., R]) -> Callable[P, R]:
        @functools.wraps(func)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{func.__name__}(): {exc}") from None
            bound.apply_defaults()
            return func(**bound.arguments)

        call.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(func).return_annotation)
        return call

    return decorate
