"""The compiled splitmix64 Fisher-Yates shuffle behind
:func:`fmtl_flower.core.rng.coordinate_order` (keys: seed, task id, round, tag), apart from the
tag registry so that importing the tags loads no kernel (numba)."""

from __future__ import annotations

import numpy as np

from .jit import kernel, steps_work

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


@kernel(_permutation_numpy, work=lambda k0, k1, k2, k3, n: 0.5 * steps_work(n, 0))
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
