"""The ceiling on barrier-free MOCHA's speedup when every request's delay is drawn anew.

When a request is nearly all round trip and its duration is f times the nominal time, f
log-normal (median 1, log-sd ``sigma``) and drawn independently per request (the issue's
time model, ``latency-persistence`` 0), a device applies replies at most at these rates:

* synchronous, deadline d (a reply later than d is lost, the round lasts d):
  ``max_d P(f <= d) / d``;
* asynchronous, timeout T (the device gets new work when its reply arrives or expires; a
  renewal process): ``max_T P(f <= T) / E[min(f, T)]``.

Their ratio bounds the speedup in replies per unit of time (asynchronous replies are never
worth more than synchronous ones: they are staler). Prints one JSON line with the ratio per
sigma; ``benchmarks/async_mocha.py`` measures 1.65 / 1.32 / 1.09 at sigma 0.5 / 1 / 1.5.

    python benchmarks/async_rate_bound.py
"""

from __future__ import annotations

import json

import numpy as np
from scipy.stats import norm

SIGMAS = (0.0, 0.5, 1.0, 1.5)
#: Deadlines and timeouts searched, in units of the median request time.
GRID = np.geomspace(1e-2, 1e3, 200_001)


def sync_rate(sigma: float) -> float:
    """``max_d P(f <= d) / d`` over :data:`GRID`."""
    return float(np.max(norm.cdf(np.log(GRID) / sigma) / GRID))


def async_rate(sigma: float) -> float:
    """``max_T P(f <= T) / E[min(f, T)]`` over :data:`GRID`, with
    ``E[min(f, T)] = e^(sigma^2/2) Phi(ln T / sigma - sigma) + T (1 - Phi(ln T / sigma))``."""
    z = np.log(GRID) / sigma
    mean_min = np.exp(sigma ** 2 / 2) * norm.cdf(z - sigma) + GRID * norm.sf(z)
    return float(np.max(norm.cdf(z) / mean_min))


def main() -> None:
    out = {}
    for sigma in SIGMAS:
        key = f"ceiling_sigma_{sigma:g}".replace(".", "_")
        out[key] = 1.0 if sigma == 0 else round(async_rate(sigma) / sync_rate(sigma), 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
