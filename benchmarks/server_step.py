"""MOCHA's server step at scale: Omega-step + sigma' + W(alpha) = B M, dense vs factored.

Builds the server state for m tasks in d dimensions (``make_server_state``), fills B with
standard normal dual images (W = B M, not timed), then times what the server does at an
Omega-step:

* ``omega_step_s``: the formulation's Omega-step from W (dense: eigh of the m x m W^T W;
  factored: eigh of the d x d W W^T, :mod:`fmtl_flower.core.factored`) and M = K^-1;
* ``w_alpha_s``: W = B M;
* ``m_diag_s`` and ``sigma_prime_s``: diag(M) and sigma' in the chosen mode;
* ``total_s``: the sum of the four;
* ``per_task_sigma_s``: Remark 5's per-task sigma' (absolute row sums of M) on its own,
  measured after the rest (skip with ``--no-per-task``).

``*_cpu_s`` are the process CPU times of the same parts (``time.process_time``): with
``--threads 1`` they are what the wall times would be on an idle core, which is the number to
read on a machine shared with other work (there, more BLAS threads than free cores make every
BLAS call several times slower).

Memory: ``peak_rss_mb`` is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of this fresh
process right after the timed step (the whole process: interpreter, numpy/scipy, B, W and the
state included); ``rss_before_mb`` is the resident size just before the timed step (so the
step's own peak is about the difference); ``peak_rss_with_per_task_mb`` is ru_maxrss after the
per-task sigma'. Prints ONE JSON line.

Usage: python benchmarks/server_step.py --tasks 100000 --dim 100 [--path auto]
       [--sigma spectral] [--omega probabilistic] [--threads N] [--no-per-task]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from fmtl_flower.core.formulations import SIGMA_MODES
from fmtl_flower.core.mocha_factored import (
    SERVER_PATHS,
    FactoredMOCHAServerState,
    choose_server_path,
    make_server_state,
)


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(args: argparse.Namespace) -> dict:
    m, d = args.tasks, args.dim
    path = choose_server_path(m, d, args.omega, args.path)
    options = (
        {"lam2": 0.1, "eta": 0.1, "k": 5.0, "s2": 1.0}
        if args.omega == "graphical"
        else {"lam2": 0.1, "eta": 0.1, "k": 5.0}
    )
    state = make_server_state(d, m, args.omega, lam=args.lam, path=path, **options)
    rng = np.random.default_rng(args.seed)
    state.B[:] = rng.standard_normal((d, m))
    state.recompute_models()  # W = B M at the start Omega (not timed)
    factored = isinstance(state, FactoredMOCHAServerState)
    f = state.formulation
    out = {"tasks": m, "dim": d, "path": path, "omega": args.omega, "sigma": args.sigma}
    rss_before = _rss_now_mb()

    c0 = time.process_time()
    t0 = time.perf_counter()
    f.omega_step(state.W)  # what state.omega_step() does, in timed pieces
    if factored:
        state._set_M(f.inverse_factor())
    else:
        state.M = f.inverse_matrix()
    t1 = time.perf_counter()
    state.recompute_models()
    t2 = time.perf_counter()
    diag = state.m_diag()
    t3 = time.perf_counter()
    sigma = state.sigma_prime(args.sigma)
    t4 = time.perf_counter()
    c4 = time.process_time()
    out.update(
        total_cpu_s=c4 - c0,
        omega_step_s=t1 - t0,
        w_alpha_s=t2 - t1,
        m_diag_s=t3 - t2,
        sigma_prime_s=t4 - t3,
        total_s=t4 - t0,
        rank=int(state.M.rank) if factored else m,
        sigma_prime=float(sigma.max()),
        m_diag_mean=float(diag.mean()),
        rss_before_mb=round(rss_before, 1),
        peak_rss_mb=round(_maxrss_mb(), 1),
    )
    if not args.no_per_task:
        if args.sigma == "per-task":
            out["per_task_sigma_s"] = out["sigma_prime_s"]
        else:
            c5, t5 = time.process_time(), time.perf_counter()
            state.sigma_prime("per-task")
            out["per_task_sigma_s"] = time.perf_counter() - t5
            out["per_task_sigma_cpu_s"] = time.process_time() - c5
        out["peak_rss_with_per_task_mb"] = round(_maxrss_mb(), 1)
    for key, value in out.items():
        if key.endswith("_s"):
            out[key] = round(value, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--path", choices=SERVER_PATHS, default="auto")
    parser.add_argument("--sigma", choices=SIGMA_MODES, default="spectral")
    parser.add_argument("--omega", default="probabilistic")
    parser.add_argument("--lam", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="BLAS threads (threadpoolctl); default: the library's",
    )
    parser.add_argument(
        "--no-per-task", action="store_true", help="skip the separate per-task sigma' timing"
    )
    args = parser.parse_args()
    with threadpool_limits(limits=args.threads, user_api="blas"):
        threads = [i.get("num_threads") for i in threadpool_info() if i.get("user_api") == "blas"]
        out = run(args)
    out["blas_threads"] = threads[0] if len(threads) == 1 else threads
    out["python"] = sys.version.split()[0]
    out["numpy"] = np.__version__
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
