"""Where OFMTL's error gap to MOCHA on small comes from (diagnosis, not part of the protocol).

Replays the ``ofmtl-arrivals`` protocol on one dataset (same splits, orders, lambda by CV on
the initial tasks, MOCHA 1000 rounds / Omega every 100 / local_frac 0.5, retraining ratio
1.5) and splits, at every device count, the mean-error difference OFMTL - MOCHA (in
percentage points, averaged over the 5 orders) into the part of the tasks frozen at OFMTL's
last (re)training and the part of the newcomers since. Variants: newcomer outer x inner
iterations (``10x100`` is the reference's), and ``--lambda-all`` (lambda chosen by CV on the
training data of ALL tasks instead of the initial ones: still no test data).

Usage: python simulations/ofmtl_gap_diagnosis.py small 10x100,30x100,100x100
"""

import sys

import numpy as np

from fmtl_flower.centralized import fit_mocha
from fmtl_flower.core.hinge import classification_errors
from fmtl_flower.core.ofmtl import add_task
from fmtl_flower.data import load_dataset
from fmtl_flower.experiments.ofmtl_arrivals import INITIAL_TASKS, Settings, arrival_order
from fmtl_flower.model_selection import cross_validate_lambda


def main(dataset: str, variants: list[tuple[int, int]], lambda_all: bool) -> None:
    settings = Settings()
    kw = settings.mocha_kwargs()
    out = {}
    for order in range(5):
        data = load_dataset(dataset, seed=order)
        perm = arrival_order(data.num_tasks, order)
        train = [(data.tasks[t].X_train, data.tasks[t].y_train) for t in perm]
        test = [(data.tasks[t].X_test, data.tasks[t].y_test) for t in perm]
        m0, T = INITIAL_TASKS[dataset], len(train)
        lam = cross_validate_lambda("mtl", train if lambda_all else train[:m0], seed=order,
                                    **kw)[0]

        def per_task(W, m, test=test):
            return np.array([classification_errors(X, y, W[:, t]) / len(y)
                             for t, (X, y) in enumerate(test[:m])])

        state = dict.fromkeys(variants)
        trained_at = dict.fromkeys(variants, m0)
        since = dict.fromkeys(variants, 0)
        recs = []
        for m in range(m0, T + 1):
            fit = fit_mocha(train[:m], lam=lam, seed=order, **kw)
            e_mocha = per_task(fit.W, m)
            rec = {}
            for v in variants:
                if m == m0 or since[v] + 1 >= settings.retrain_ratio * trained_at[v]:
                    state[v] = (fit.W.copy(), fit.state.formulation.sigma.copy())
                    trained_at[v], since[v] = m, 0
                else:
                    res = add_task(*state[v], *train[m - 1], lam=lam, outer=v[0], inner=v[1],
                                   local_frac=settings.newcomer_frac, seed=order,
                                   task_id=m - 1)
                    state[v] = (res.W, res.Sigma)
                    since[v] += 1
                e_ofmtl = per_task(state[v][0], m)
                k = trained_at[v]
                rec[v] = (100 * (e_ofmtl.mean() - e_mocha.mean()),
                          100 * (e_ofmtl[:k] - e_mocha[:k]).sum() / m,
                          100 * (e_ofmtl[k:] - e_mocha[k:]).sum() / m)
            recs.append((m, rec))
        out[order] = (lam, recs)
    print(f"{dataset}: lambda per order {[out[o][0] for o in out]}"
          f" ({'CV on all tasks' if lambda_all else 'CV on the initial tasks'})")
    for v in variants:
        print(f"newcomer outer x inner = {v[0]} x {v[1]}: OFMTL - MOCHA (pp) = frozen + "
              "newcomers")
        for j, (m, _) in enumerate(out[0][1]):
            diff, frozen, new = (np.mean([out[o][1][j][1][v][i] for o in out])
                                 for i in range(3))
            print(f"  {m:3d} devices: {diff:+.2f} = {frozen:+.2f} + {new:+.2f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else "small",
         [tuple(int(x) for x in v.split("x")) for v in
          (args[1] if len(args) > 1 else "10x100").split(",")],
         "--lambda-all" in sys.argv)
