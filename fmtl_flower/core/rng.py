"""Explicit randomness (design decision 5): every stream is derived from the run's one seed.

Each stream is a ``numpy.random.Generator`` seeded by a tuple (seed, ..., tag); the tag names
the purpose, so streams never collide and results repeat on every engine.
"""

from __future__ import annotations

import numpy as np

from .jit import kernel

TAG_BUDGET = 11
TAG_DROP = 13
TAG_ORDER = 17
TAG_CV = 19
TAG_ARRIVALS = 43


def arrival_permutation(seed: int, num_tasks: int) -> np.ndarray:
    """The order in which tasks join for ``arrivals="shuffle"`` (OFMTL) under ``seed``."""
    return np.random.default_rng([int(seed), TAG_ARRIVALS]).permutation(num_tasks)


def round_rng(seed: int, server_round: int, tag: int) -> np.random.Generator:
    """The server's Generator for one purpose in one round."""
    return np.random.default_rng([int(seed), int(server_round), int(tag)])


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


_MASK64 = (1 << 64) - 1


def _splitmix64_numpy(state):
    """:func:`_splitmix64` on Python ints (exact 64-bit arithmetic)."""
    z = (int(state) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _permutation_numpy(key0, key1, key2, key3, n):
    """:func:`_permutation` without numba: the same Fisher-Yates shuffle, bit for bit."""
    state = _splitmix64_numpy(int(key0))
    state = _splitmix64_numpy(state ^ int(key1))
    state = _splitmix64_numpy(state ^ int(key2))
    state = _splitmix64_numpy(state ^ int(key3))
    out = list(range(int(n)))
    for i in range(int(n) - 1, 0, -1):
        state = _splitmix64_numpy(state)
        j = int(float(state >> 11) * (1.0 / 9007199254740992.0) * (i + 1))
        out[i], out[j] = out[j], out[i]
    return np.array(out, dtype=np.int64)


@kernel(_splitmix64_numpy)
def _splitmix64(state):  # pragma: no cover - compiled
    z = state + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


@kernel(_permutation_numpy)
def _permutation(key0, key1, key2, key3, n):  # pragma: no cover - compiled
    state = _splitmix64(key0)
    state = _splitmix64(state ^ key1)
    state = _splitmix64(state ^ key2)
    state = _splitmix64(state ^ key3)
    out = np.arange(n)
    for i in range(n - 1, 0, -1):
        state = _splitmix64(state)
        # 53 random bits -> uniform in [0, 1) -> index in 0..i (bias < 2^-40 for n < 2^13)
        j = np.int64(np.float64(state >> np.uint64(11)) * (1.0 / 9007199254740992.0) * (i + 1))
        tmp = out[i]
        out[i] = out[j]
        out[j] = tmp
    return out


def coordinate_order(seed: int, task_id: int, server_round: int, n: int) -> np.ndarray:
    """The permutation of 0..n-1 a device's SDCA visits in one round.

    A Fisher-Yates shuffle driven by splitmix64 keyed on (seed, task id, round, tag): a pure
    function of its arguments, compiled, about 100 times cheaper than seeding a numpy
    Generator for every device and round (without numba: the same permutation from Python
    integers).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    mask = (1 << 64) - 1
    return _permutation(np.uint64(int(seed) & mask), np.uint64(int(task_id) & mask),
                        np.uint64(int(server_round) & mask), np.uint64(TAG_ORDER), int(n))
