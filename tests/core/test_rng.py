"""The stream registry of :mod:`fmtl_flower.core.rng`: every tag there, distinct, and no two
streams that can draw from the same seed."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np

from fmtl_flower.core import rng
from fmtl_flower.core.rng import STREAMS

PACKAGE = Path(rng.__file__).resolve().parents[1]
#: numpy's SeedSequence mixes its entropy into a pool of 4 words: a shorter entropy is padded
#: with zeros, so [s, a] and [s, a, 0] seed the same stream (checked below).
POOL_WORDS = 4
#: The smallest value of each id of a layout (the others start at 0).
FIRST = {"round": 1, "epoch": 1}


def _tags() -> dict[str, int]:
    return {k: v for k, v in vars(rng).items() if k.startswith("TAG_")}


def test_tags_are_pairwise_distinct():
    tags = _tags()
    assert len(tags) == 29
    by_value: dict[int, list[str]] = {}
    for name, value in tags.items():
        by_value.setdefault(value, []).append(name)
    assert {v: n for v, n in by_value.items() if len(n) > 1} == {}


def test_every_tag_is_in_a_registered_stream():
    used = {word for _, layout in STREAMS.values() for word in layout if isinstance(word, int)}
    assert set(_tags().values()) <= used


def _normalised(family: str, layout: tuple) -> tuple:
    if family == "numpy" and len(layout) <= POOL_WORDS:
        return layout + (0,) * (POOL_WORDS - len(layout))
    return layout


def _can_equal(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, int):
        a, b = b, a
    if isinstance(b, int):  # a is an id, b a fixed word
        return b >= FIRST.get(a, 0)
    return True  # two ids: both can take any large value


def meeting_streams() -> set[frozenset[str]]:
    """The pairs of registered streams some ids make draw from one seed."""
    out = set()
    for (na, (fa, la)), (nb, (fb, lb)) in itertools.combinations(STREAMS.items(), 2):
        a, b = _normalised(fa, la), _normalised(fb, lb)
        if fa == fb and len(a) == len(b) and all(map(_can_equal, a, b)):
            out.add(frozenset((na, nb)))
    return out


def test_no_two_streams_meet():
    assert meeting_streams() == set()


def _meeting_with(**changed) -> set[frozenset[str]]:
    saved = dict(STREAMS)
    try:
        STREAMS.update(changed)
        return meeting_streams()
    finally:
        STREAMS.clear()
        STREAMS.update(saved)


def test_the_checker_sees_the_old_skew_budget_collision():
    """With the skew's old tag 11 (= TAG_BUDGET), task t's skew and round t's budgets meet."""
    met = _meeting_with(**{"skew-task": ("numpy", ("seed", "task", rng.TAG_BUDGET))})
    assert met == {frozenset(("skew-task", "budget"))}


def test_the_checker_sees_the_old_synthetic_layout():
    """With the synthetic generator's old layout ``[seed, 0x5E, t]`` (the tag second), its task
    t met id 94 of every ``[seed, id, tag]`` stream with ``t == tag``."""
    met = _meeting_with(**{"synthetic-task": ("numpy", ("seed", rng.TAG_SYNTHETIC_TASK, "task"))})
    assert met == {frozenset(("synthetic-task", name)) for name in (
        "split", "budget", "drop", "cv-folds", "fedem-sample", "fedem-init", "skew-task",
        "sparse-task", "latency-device", "availability")}


def test_the_checker_models_numpy_seeding():
    """Zero padding up to 4 words is the same seed, a fifth word is not; the old synthetic
    overlap was real (its task 13, ``[seed, 0x5E, 13]``, drew what round 94's drop mask draws)
    and the new layout is not (task 13 is ``[seed, 13, 0x5E]``)."""
    def draw(entropy):
        return np.random.default_rng(entropy).random(4)

    np.testing.assert_array_equal(draw([5, 11]), draw([5, 11, 0]))
    np.testing.assert_array_equal(draw([5, 11, 3]), draw([5, 11, 3, 0]))
    assert not np.array_equal(draw([5, 11, 3, 4]), draw([5, 11, 3, 4, 0]))
    np.testing.assert_array_equal(draw([5, rng.TAG_SYNTHETIC_TASK, rng.TAG_DROP]),
                                  rng.round_rng(5, 0x5E, rng.TAG_DROP).random(4))
    assert rng.STREAMS["synthetic-task"][1] == ("seed", "task", rng.TAG_SYNTHETIC_TASK)


def _int_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def test_no_stream_tag_outside_the_registry():
    """No module but core/rng.py assigns a literal to a *TAG* name or seeds a Generator with a
    literal word after the seed (``default_rng([seed, 41])``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rng.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and _int_literal(node.value):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                found += [f"{path.name}: {n}" for n in names if "TAG" in n.upper()]
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                    "default_rng", "SeedSequence") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.List) and any(_int_literal(e) for e in arg.elts[1:]):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(arg)}")
    assert found == []
