"""Where numba pays for itself in a fresh process: the constants of :mod:`fmtl_flower.core.jit`.

Measures, on this machine:

* ``numba_load_us``: the CPU time a fresh process spends importing numba and loading MOCHA's
  kernels (SDCA steps, the permutation) from a warm on-disk cache, over the same process
  running them with numpy (median of ``--repeats`` fresh process pairs, each a tiny SDCA
  call; the cache is warmed by an unmeasured first process);
* ``step_us``, ``element_us``: the numpy SDCA kernel's time per step and per row entry (a
  least-squares fit over d in ``--dims``);
* the permutation's numpy time per element and the FSVRG / CoCoA+ numpy kernels' time per
  step, in units of ``step_us`` (their ``work`` factors);
* the break-even ``numba_load_us / (step_us + element_us d)`` in SDCA steps for a few d.

Prints a table and one JSON line. ``BREAK_EVEN``, ``STEP_US`` and ``ELEMENT_US`` in
:mod:`fmtl_flower.core.jit` are these figures (rounded).

    python benchmarks/kernel_breakeven.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def child(choice: str, cache_dir: str) -> None:
    """A fresh process: CPU time of importing the kernels and one tiny MOCHA call."""
    start = resource.getrusage(resource.RUSAGE_SELF)
    from fmtl_flower.core import jit
    from fmtl_flower.core.rng import coordinate_order
    from fmtl_flower.core.sdca import sdca_local_update

    jit.use_cache_dir(cache_dir)
    with jit.using(choice):
        X = np.eye(4)
        sdca_local_update(X, np.ones(4), np.zeros(4), np.zeros(4), budget=4, m_tt=1.0,
                          sigma_prime=1.0, order=coordinate_order(0, 0, 1, 4))
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    print(json.dumps({"cpu_s": cpu, "numba": "numba" in sys.modules}))


def fresh(choice: str, cache_dir: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", choice, "--cache-dir", cache_dir],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"])


def cpu_time(fn, *args) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn(*args)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--dims", default="1,100,1000,4000")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.cache_dir)
        return
    with tempfile.TemporaryDirectory(prefix="fmtl-breakeven-") as tmp:
        fresh("numba", tmp)  # warms the cache
        pairs = [(fresh("numba", tmp), fresh("numpy", tmp)) for _ in range(args.repeats)]
    load_us = statistics.median(a - b for a, b in pairs) * 1e6

    from fmtl_flower.core import sdca
    from fmtl_flower.core.fsvrg import cocoa_plus, svrg
    from fmtl_flower.core.splitmix import _permutation_numpy

    rng = np.random.default_rng(0)
    dims = [int(d) for d in args.dims.split(",")]
    per_step = []
    for d in dims:
        n = 1000
        X = rng.normal(size=(n, d)) / np.sqrt(d)
        y = rng.choice([-1.0, 1.0], size=n)
        sq = np.einsum("ij,ij->i", X, X)
        order = rng.permutation(n)

        def run(X=X, y=y, sq=sq, order=order, d=d, n=n):  # noqa: ANN001, ANN202
            sdca._sdca_steps_numpy(X, y, np.zeros(n), sq, order, 0, args.steps, 1.0,
                                   np.zeros(n), np.zeros(d), 0)

        per_step.append(cpu_time(run) / args.steps * 1e6)
    A = np.column_stack([np.ones(len(dims)), np.array(dims, dtype=float)])
    step_us, element_us = (float(c) for c in np.linalg.lstsq(A, np.array(per_step),
                                                               rcond=None)[0])
    perm_us = cpu_time(_permutation_numpy, 1, 2, 3, 4, args.steps) / args.steps * 1e6

    import scipy.sparse as sp
    n, d = 2000, 500
    Xs = sp.random(n, d, density=0.02, random_state=0, format="csr")
    ys = rng.choice([-1.0, 1.0], size=n)
    data = np.ascontiguousarray(Xs.data)
    order = rng.permutation(n)
    z = np.zeros(n)
    svrg_us = cpu_time(lambda: svrg._svrg_pass_numpy(
        Xs.indptr, Xs.indices, data, ys, order, z, np.ones(d), True, 0.01, 0.1, np.zeros(d),
        np.zeros(d))) / n * 1e6
    sqs = np.asarray(Xs.multiply(Xs).sum(axis=1)).reshape(-1)
    cocoa_us = cpu_time(lambda: cocoa_plus._cocoa_numpy(
        Xs.indptr, Xs.indices, data, ys, np.zeros(n), sqs, order, 1.0, 30, 1e-13,
        np.zeros(n), np.zeros(d))) / n * 1e6

    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"numba import + cache load in a fresh process: {load_us / 1e6:.3f} s CPU "
          f"(median of {args.repeats}; numba minus numpy process)")
    measured = ", ".join(f"d={d}: {t:.2f}" for d, t in zip(dims, per_step, strict=True))
    print(f"numpy SDCA: {step_us:.3f} us/step + {element_us:.5f} us/entry "
          f"(measured {measured} us/step)")
    print(f"numpy permutation: {perm_us:.3f} us/element ({perm_us / step_us:.2f} steps); "
          f"FSVRG pass {svrg_us:.2f} us/step ({svrg_us / step_us:.2f} steps), CoCoA+ "
          f"{cocoa_us:.2f} us/step ({cocoa_us / step_us:.2f} steps), nnz/row "
          f"{data.size / n:.1f}")
    breaks = {d: load_us / (step_us + element_us * d) for d in (10, 100, 1000, 10000)}
    print("break-even SDCA steps: " + ", ".join(f"d={d}: {s:.3g}" for d, s in breaks.items()))
    print(json.dumps({"benchmark": "kernel_breakeven", "load": round(load[0], 2),
                      "numba_load_us": round(load_us), "step_us": round(step_us, 4),
                      "element_us": round(element_us, 6), "perm_us": round(perm_us, 4),
                      "svrg_step_us": round(svrg_us, 3), "cocoa_plus_step_us": round(cocoa_us, 3),
                      "break_even_steps": {str(d): round(s) for d, s in breaks.items()}}))


if __name__ == "__main__":
    main()
