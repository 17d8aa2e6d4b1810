"""The privacy guide's figure: what epsilon a run spends, and the noise a target costs.

``python -m fmtl_flower.experiments.privacy_figure --out docs/guides/figures`` prints the
numbers it plots and writes ``privacy-epsilon.png`` (a few seconds):

* left: epsilon at delta = 1e-5 after T releases of the Gaussian mechanism with noise
  multiplier z (every device taking part, as client-level DP accounts for FedEM's family),
  by the RDP accountant the runs report (:func:`~fmtl_flower.core.privacy.rdp_epsilon`),
  against the exact epsilon of the analytic Gaussian mechanism (T releases with noise z are
  one Gaussian mechanism with mu = sqrt(T) / z; Balle and Wang 2018);
* right: the noise multiplier a target epsilon needs over T rounds
  (:func:`~fmtl_flower.core.privacy.noise_multiplier_for_epsilon`).

``python -m fmtl_flower.experiments.privacy_figure --table DIR`` prints instead the
privacy-utility table of the ``fmtl run ... --out DIR/NAME.json`` results in ``DIR``
(docs/results.md gives the runs): one row per file-name stem (``fedem-eps8``,
``fedem-eps8-seed1``, ... grouped by the part before ``-seed``), mean and standard deviation
over seeds of the final mean and bottom-decile accuracy, with the final epsilon and noise
multiplier.

``python -m fmtl_flower.experiments.privacy_figure --mocha DIR`` runs the MOCHA part
(record-level DP, :mod:`fmtl_flower.strategies.record_dp`): MOCHA on ``synthetic`` and
``small`` with a learned and a fixed (mean) Omega (:data:`MOCHA_FORMULATIONS`) at epsilon in
{1, 2, 4, 8, inf} (delta = 1e-5, :data:`MOCHA_ROUNDS` rounds, row clip :data:`MOCHA_CLIP`)
and without DP, and local-only training (which releases nothing) at two lambdas, seeds 0, 1,
2, each ``fmtl run`` writing ``DIR/<dataset>-<run>-seed<s>.json``, then prints the table
(``--mocha-table DIR`` prints it from the files alone). About 1 s a run.
``--mocha-select DIR`` runs the selection that chose the mean formulation's lambdas and the
local lambda (:func:`mocha_selection_commands`: epsilon 8, seeds 10-12).
``--mocha-oracle DIR`` runs an upper bound that is not private (:func:`mocha_oracle`): the
learned formulation at epsilon 8 with the Omega of the run without noise imposed.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..core.privacy import noise_multiplier_for_epsilon, rdp_epsilon

DELTA = 1e-5
NOISE_MULTIPLIERS = (0.8, 1.5, 3.0, 6.0)
ROUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
TARGETS = (1.0, 2.0, 4.0, 8.0)


def exact_gaussian_epsilon(z: float, steps: int, delta: float = DELTA) -> float:
    """The exact epsilon of ``steps`` Gaussian releases with noise multiplier ``z``
    (analytic Gaussian mechanism, mu = sqrt(steps) / z), by bisection on
    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""
    from scipy.optimize import brentq
    from scipy.special import log_ndtr

    mu = math.sqrt(steps) / z

    def excess(eps: float) -> float:
        return (math.exp(log_ndtr(mu / 2 - eps / mu))
                - math.exp(eps + log_ndtr(-mu / 2 - eps / mu)) - delta)

    return float(brentq(excess, 0.0, 1e4, xtol=1e-10)) if excess(0.0) > 0 else 0.0


def utility_table(directory: Path) -> str:
    """The Markdown privacy-utility table of the results JSON files in ``directory``."""
    import json
    from collections import defaultdict

    import numpy as np

    groups: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(directory.glob("*.json")):
        groups[path.stem.split("-seed")[0]].append(json.loads(path.read_text())["final"])
    lines = ["| run | seeds | epsilon (delta 1e-5) | noise multiplier | average accuracy | "
             "bottom decile |", "|---|---|---|---|---|---|"]
    for name, finals in groups.items():
        acc = 100 * np.array([f["accuracy_mean"] for f in finals])
        low = 100 * np.array([f["accuracy_bottom_decile"] for f in finals])
        eps = finals[0].get("epsilon")
        z = finals[0].get("dp_noise_multiplier")
        lines.append(f"| {name} | {len(finals)} | {'-' if eps is None else f'{eps:.3g}'} | "
                     f"{'-' if z is None else f'{z:.3g}'} | {acc.mean():.1f} ± {acc.std():.1f}"
                     f" | {low.mean():.1f} ± {low.std():.1f} |")
    return "\n".join(lines)


#: MOCHA part: rounds, the row clip C per dataset (a fixed public value, near the median row
#: norm of the dataset: synthetic's rows have norms 3.3-6.8, small's mostly 0.7-4.3), the
#: target epsilons (inf: record-level DP with no noise) and the seeds the table reports.
MOCHA_ROUNDS = 10
MOCHA_CLIP = {"synthetic": 4.0, "small": 1.5}
MOCHA_EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)
MOCHA_SEEDS = (0, 1, 2)
#: Noise draws per seed and finite epsilon (the noise comes from OS entropy; one draw's test
#: error varies by several points, so a seed's is the mean over its draws).
MOCHA_DRAWS = 3
#: MOCHA's formulations in the table, per dataset: ``learned`` (probabilistic Omega, an
#: Omega-step every 2 rounds: MOCHA's default of 10 would leave a 10-round run without one;
#: lambda 0.1) and ``mean`` (a fixed Omega, mean-regularised: eq. 11), whose lambda and
#: lambda2 were chosen by :func:`mocha_selection_commands` at epsilon 8 on seeds 10-12 (other
#: data for ``synthetic``, other splits for ``small``), never on the reported seeds.
MOCHA_FORMULATIONS = {
    "synthetic": {"learned": ("mocha.omega-every=2",),
                  "learned-debiased": ("mocha.omega-every=2",),
                  "mean": ("mocha.omega=mean", "mocha.lambda=0.01", "mocha.lambda2=30")},
    "small": {"learned": ("mocha.omega-every=2",),
              "learned-debiased": ("mocha.omega-every=2",),
              "mean": ("mocha.omega=mean", "mocha.lambda=1", "mocha.lambda2=0.1")},
}
#: Settings a formulation adds to its private runs only: ``learned-debiased`` is ``learned``
#: with the Omega-step discounting the releases' known noise (``dp.omega-debias``); its run
#: without DP is ``learned``'s.
MOCHA_PRIVATE_EXTRA = {"learned-debiased": ("dp.omega-debias=true",)}
#: Local-only training at the default lambda (0.1) and at the lambda chosen on the same
#: selection seeds (``local-lam0.01``): the line to beat, tuned as fairly as MOCHA.
MOCHA_LOCAL_LAMBDAS = {"synthetic": (None, 0.01), "small": (None, 0.01)}
#: The selection: seeds, noise draws per seed (the noise comes from OS entropy), and the
#: settings tried at epsilon 8 (local-only training at each lambda as well).
MOCHA_SELECTION_SEEDS = (10, 11, 12)
MOCHA_SELECTION_DRAWS = 3
MOCHA_SELECTION_GRID = (
    [(f"learned-every{e}-lam{lam}", ("mocha.omega=probabilistic", f"mocha.omega-every={e}",
                                    f"mocha.lambda={lam}")) for e in (1, 2, 5)
     for lam in (0.1, 1)]
    + [(f"identity-lam{lam}", ("mocha.omega=identity", f"mocha.lambda={lam}"))
       for lam in (0.1, 1, 10)]
    + [(f"mean-lam{lam}-lam2{l2}", ("mocha.omega=mean", f"mocha.lambda={lam}",
                                    f"mocha.lambda2={l2}"))
       for lam in (0.01, 0.1, 1) for l2 in (0.1, 1, 3, 10, 30)])
SELECTION_LOCAL_LAMBDAS = (0.01, 0.1, 1)


def _sets(values: tuple[str, ...] | list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def _private(dataset: str, eps: float) -> list[str]:
    return _sets(["dp.mechanism=record", f"dp.clip={MOCHA_CLIP[dataset]}",
                  f"dp.epsilon={eps}", f"dp.delta={DELTA}"])


def mocha_commands(directory: Path) -> list[list[str]]:
    """The ``fmtl`` argument lists of the MOCHA privacy-utility runs."""
    runs = []
    for dataset in MOCHA_CLIP:
        for seed in MOCHA_SEEDS:
            common = ["--dataset", dataset, "--rounds", str(MOCHA_ROUNDS), "--seed", str(seed),
                      "--quiet"]
            for lam in MOCHA_LOCAL_LAMBDAS[dataset]:
                name = "local" if lam is None else f"local-lam{lam:g}"
                extra = [] if lam is None else _sets([f"mocha.lambda={lam}"])
                runs.append(["run", "local", *common, *extra, "--out",
                             str(directory / f"{dataset}-{name}-seed{seed}.json")])
            for form, values in MOCHA_FORMULATIONS[dataset].items():
                for eps in MOCHA_EPSILONS:
                    for draw in range(MOCHA_DRAWS if math.isfinite(eps) else 1):
                        runs.append(["run", "mocha", *common, *_sets(values),
                                     *_private(dataset, eps),
                                     *_sets(MOCHA_PRIVATE_EXTRA.get(form, ())), "--out", str(
                                         directory / f"{dataset}-mocha-{form}-eps{eps:g}-seed"
                                         f"{seed}-draw{draw}.json")])
                if form not in MOCHA_PRIVATE_EXTRA:
                    runs.append(["run", "mocha", *common, *_sets(values), "--out", str(
                        directory / f"{dataset}-mocha-{form}-nodp-seed{seed}.json")])
    return runs


def mocha_selection_commands(directory: Path) -> list[list[str]]:
    """The ``fmtl`` argument lists of the selection runs: every setting of
    :data:`MOCHA_SELECTION_GRID` at epsilon 8, and local-only training at each lambda of
    :data:`SELECTION_LOCAL_LAMBDAS`, on :data:`MOCHA_SELECTION_SEEDS` (never the reported
    seeds), :data:`MOCHA_SELECTION_DRAWS` noise draws each."""
    runs = []
    for dataset in MOCHA_CLIP:
        for seed in MOCHA_SELECTION_SEEDS:
            common = ["--dataset", dataset, "--rounds", str(MOCHA_ROUNDS), "--seed", str(seed),
                      "--quiet"]
            for lam in SELECTION_LOCAL_LAMBDAS:
                runs.append(["run", "local", *common, *_sets([f"mocha.lambda={lam}"]), "--out",
                             str(directory / f"{dataset}-local-lam{lam:g}-seed{seed}.json")])
            for name, values in MOCHA_SELECTION_GRID:
                for draw in range(MOCHA_SELECTION_DRAWS):
                    runs.append(["run", "mocha", *common, *_sets(values), *_private(dataset, 8),
                                 "--out", str(directory / f"{dataset}-mocha-{name}-eps8-seed"
                                              f"{seed}-draw{draw}.json")])
    return runs


def mocha_table(directory: Path) -> str:
    """The Markdown table of the MOCHA runs in ``directory``: mean ± std over seeds of the
    final per-task-averaged test error (a seed's runs ``-seedS-drawK`` averaged first), with
    the final (largest over devices) epsilon."""
    import json
    from collections import defaultdict

    import numpy as np

    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    first: dict[str, dict] = {}
    for path in sorted(directory.glob("*-seed*.json")):
        name, _, seed = path.stem.partition("-seed")
        result = json.loads(path.read_text())
        groups[name][seed.split("-draw")[0]].append(result["final"]["test_error"])
        first.setdefault(name, result)
    lines = ["| dataset | run | seeds | epsilon (delta 1e-5) | noise multiplier | "
             "test error (%) |", "|---|---|---|---|---|---|"]
    for name in sorted(groups):
        dataset, _, run = name.partition("-")
        # per seed the mean over its noise draws (one draw in the reported table)
        errors = 100 * np.array([np.mean(draws) for draws in groups[name].values()])
        eps = first[name]["final"].get("epsilon")
        z = first[name].get("privacy", {}).get("noise_multiplier")
        lines.append(f"| {dataset} | {run} | {len(errors)} | "
                     f"{'-' if eps is None else f'{eps:.3g}'} | "
                     f"{'-' if z is None else f'{z:.3g}'} | "
                     f"{errors.mean():.1f} ± {errors.std():.1f} |")
    return "\n".join(lines)


def run_mocha(directory: Path, commands=mocha_commands) -> None:
    """Run ``commands(directory)`` (skipping results already written) and print the
    table."""
    from ..cli import main as fmtl

    directory.mkdir(parents=True, exist_ok=True)
    for argv in commands(directory):
        if not Path(argv[-1]).exists():
            fmtl(argv)
    print(mocha_table(directory))


def mocha_oracle(directory: Path, epsilon: float = 8.0) -> None:
    """An upper bound, not a DP method: how far any Omega-step could take ``learned`` at
    ``epsilon``. For each dataset and seed of the table, the run without noise (epsilon inf:
    clipped rows, the separable step) is made first and the Sigma its last Omega-step
    learned is kept; the private runs (:data:`MOCHA_DRAWS` draws) then take that Sigma at
    every Omega-step instead of learning one from their noisy W (the Sigma is computed from
    the devices' data without noise: it is not private). Writes
    ``<dataset>-oracle-learned-eps<epsilon>-seed<S>-draw<K>.json`` and the clean runs'
    ``<dataset>-oracle-clean-epsinf-seed<S>.json`` into ``directory``; prints their table.
    """
    from ..cli import main as fmtl
    from ..core.formulations import ProbabilisticFormulation

    learn = ProbabilisticFormulation.omega_step
    learned: dict[str, object] = {}

    def keep(self, W):  # noqa: ANN001, ANN202 - the patched method's signature
        learn(self, W)
        learned["sigma"] = self.omega

    def impose(self, W):  # noqa: ANN001, ANN202, ARG001
        self.set_omega(learned["sigma"])

    directory.mkdir(parents=True, exist_ok=True)
    try:
        for dataset in MOCHA_CLIP:
            for seed in MOCHA_SEEDS:
                common = ["run", "mocha", "--dataset", dataset, "--rounds", str(MOCHA_ROUNDS),
                          "--seed", str(seed), "--quiet",
                          *_sets(MOCHA_FORMULATIONS[dataset]["learned"])]
                ProbabilisticFormulation.omega_step = keep
                fmtl([*common, *_private(dataset, math.inf), "--out", str(
                    directory / f"{dataset}-oracle-clean-epsinf-seed{seed}.json")])
                ProbabilisticFormulation.omega_step = impose
                for draw in range(MOCHA_DRAWS):
                    fmtl([*common, *_private(dataset, epsilon), "--out", str(
                        directory / f"{dataset}-oracle-learned-eps{epsilon:g}-seed{seed}"
                        f"-draw{draw}.json")])
    finally:
        ProbabilisticFormulation.omega_step = learn
    print(mocha_table(directory))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/guides/figures")
    parser.add_argument("--table", help="print the privacy-utility table of this directory's "
                        "results JSON files instead")
    parser.add_argument("--mocha", help="run the MOCHA record-level DP runs into this "
                        "directory and print their table")
    parser.add_argument("--mocha-table", help="print the MOCHA table of this directory")
    parser.add_argument("--mocha-select", help="run the MOCHA selection runs (seeds 10-12, "
                        "epsilon 8) into this directory and print their table")
    parser.add_argument("--mocha-oracle", help="run the oracle-Omega bound (not private: "
                        "the Sigma of the run without noise imposed on the epsilon-8 runs) "
                        "into this directory and print its table")
    args = parser.parse_args(argv)
    if args.mocha_oracle:
        mocha_oracle(Path(args.mocha_oracle))
        return
    if args.mocha:
        run_mocha(Path(args.mocha))
        return
    if args.mocha_select:
        run_mocha(Path(args.mocha_select), mocha_selection_commands)
        return
    if args.mocha_table:
        print(mocha_table(Path(args.mocha_table)))
        return
    if args.table:
        print(utility_table(Path(args.table)))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for z in NOISE_MULTIPLIERS:
        rdp = [rdp_epsilon([(z, 1.0, t)], DELTA) for t in ROUNDS]
        exact = [exact_gaussian_epsilon(z, t) for t in ROUNDS]
        print(f"z={z}: epsilon after {ROUNDS[-1]} rounds RDP {rdp[-1]:.3g}, exact "
              f"{exact[-1]:.3g} (RDP/exact {rdp[-1] / exact[-1]:.3f})")
        line, = left.plot(ROUNDS, rdp, marker="o", ms=3, label=f"z = {z} (RDP, reported)")
        left.plot(ROUNDS, exact, ls="--", color=line.get_color(), label=f"z = {z} (exact)")
    left.set(xscale="log", yscale="log", xlabel="rounds (releases)",
             ylabel="epsilon at delta = 1e-5", title="epsilon spent")
    left.legend(fontsize=7)
    for eps in TARGETS:
        zs = [noise_multiplier_for_epsilon(eps, DELTA, t) for t in ROUNDS]
        print(f"epsilon={eps}: noise multiplier for {ROUNDS[-1]} rounds {zs[-1]:.3g}")
        right.plot(ROUNDS, zs, marker="o", ms=3, label=f"epsilon = {eps:g}")
    right.set(xscale="log", yscale="log", xlabel="rounds (releases)",
              ylabel="noise multiplier z", title="noise for a target epsilon")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "privacy-epsilon.png", dpi=110)
    print(f"wrote {out / 'privacy-epsilon.png'}")


if __name__ == "__main__":
    main()
