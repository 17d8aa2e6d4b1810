"""takes_arguments_of: one signature for two entry points."""

from __future__ import annotations

import inspect

import pytest

from fmtl_flower.data import load_dataset, load_dataset_cached, make_synthetic_tasks
from fmtl_flower.data.arguments import takes_arguments_of
from fmtl_flower.data.synthetic import synthetic_source


def source(a: int, b: int = 2, *, c: str = "x") -> None:
    """The signature."""


@takes_arguments_of(source)
def echo(**arguments: object) -> dict:
    """Echo."""
    return arguments


def test_every_argument_by_keyword_defaults_filled():
    assert echo(1) == {"a": 1, "b": 2, "c": "x"}
    assert echo(1, 5, c="y") == {"a": 1, "b": 5, "c": "y"}
    assert echo(b=3, a=0) == {"a": 0, "b": 3, "c": "x"}


@pytest.mark.parametrize("call", [lambda: echo(), lambda: echo(1, 2, 3),
                                  lambda: echo(1, d=4), lambda: echo(1, a=2)])
def test_a_call_that_does_not_fit_raises_type_error_naming_the_function(call):
    with pytest.raises(TypeError, match=r"^echo\(\): "):
        call()


def test_shows_the_source_signature_with_its_own_name_doc_and_return():
    sig = inspect.signature(echo)
    assert list(sig.parameters) == ["a", "b", "c"]
    assert sig.return_annotation == "dict"
    assert echo.__name__ == "echo" and echo.__doc__ == "Echo."


def test_the_package_pairs_share_their_signatures():
    def params(f):
        return list(inspect.signature(f).parameters.values())

    assert params(load_dataset_cached) == params(load_dataset)
    assert params(make_synthetic_tasks) == params(synthetic_source)
