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
``small`` at epsilon in {1, 2, 4, 8, inf} (delta = 1e-5, :data:`MOCHA_ROUNDS` rounds, row
clip :data:`MOCHA_CLIP`) and local-only training (which releases nothing), seeds 0, 1, 2,
each ``fmtl run`` writing ``DIR/<dataset>-<run>-seed<s>.json``, then prints the table
(``--mocha-table DIR`` prints it from the files alone). About 10 s a run.
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


#: MOCHA part: rounds and Omega-steps (every 2 rounds: MOCHA's default of 10 would leave
#: a 10-round run without one, i.e. local training), the row clip C per dataset (a fixed
#: public value, near the median row norm of the dataset: synthetic's rows have norms
#: 3.3-6.8, small's mostly 0.7-4.3), the target epsilons (inf: record-level DP with no
#: noise) and seeds.
MOCHA_ROUNDS = 10
MOCHA_OMEGA_EVERY = 2
MOCHA_CLIP = {"synthetic": 4.0, "small": 1.5}
MOCHA_EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)
MOCHA_SEEDS = (0, 1, 2)


def mocha_commands(directory: Path) -> list[list[str]]:
    """The ``fmtl`` argument lists of the MOCHA privacy-utility runs."""
    runs = []
    for dataset, clip in MOCHA_CLIP.items():
        for seed in MOCHA_SEEDS:
            common = ["--dataset", dataset, "--rounds", str(MOCHA_ROUNDS), "--seed", str(seed),
                      "--quiet"]
            runs.append(["run", "local", *common, "--out",
                         str(directory / f"{dataset}-local-seed{seed}.json")])
            common += ["--set", f"mocha.omega-every={MOCHA_OMEGA_EVERY}"]
            for eps in MOCHA_EPSILONS:
                runs.append(["run", "mocha", *common, "--set", "dp.mechanism=record",
                             "--set", f"dp.clip={clip}", "--set", f"dp.epsilon={eps}",
                             "--set", f"dp.delta={DELTA}", "--out",
                             str(directory / f"{dataset}-mocha-eps{eps:g}-seed{seed}.json")])
            runs.append(["run", "mocha", *common, "--out",
                         str(directory / f"{dataset}-mocha-nodp-seed{seed}.json")])
    return runs


def mocha_table(directory: Path) -> str:
    """The Markdown table of the MOCHA runs in ``directory``: mean ± std over seeds of the
    final per-task-averaged test error, with the final (largest over devices) epsilon."""
    import json
    from collections import defaultdict

    import numpy as np

    groups: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(directory.glob("*-seed*.json")):
        groups[path.stem.split("-seed")[0]].append(json.loads(path.read_text()))
    lines = ["| dataset | run | seeds | epsilon (delta 1e-5) | noise multiplier | "
             "test error (%) |", "|---|---|---|---|---|---|"]
    for name in sorted(groups):
        dataset, _, run = name.partition("-")
        errors = 100 * np.array([r["final"]["test_error"] for r in groups[name]])
        eps = groups[name][0]["final"].get("epsilon")
        z = groups[name][0].get("privacy", {}).get("noise_multiplier")
        lines.append(f"| {dataset} | {run} | {len(errors)} | "
                     f"{'-' if eps is None else f'{eps:.3g}'} | "
                     f"{'-' if z is None else f'{z:.3g}'} | "
                     f"{errors.mean():.1f} ± {errors.std():.1f} |")
    return "\n".join(lines)


def run_mocha(directory: Path) -> None:
    """Run :func:`mocha_commands` (skipping results already written) and print the table."""
    from ..cli import main as fmtl

    directory.mkdir(parents=True, exist_ok=True)
    for argv in mocha_commands(directory):
        if not Path(argv[-1]).exists():
            fmtl(argv)
    print(mocha_table(directory))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/guides/figures")
    parser.add_argument("--table", help="print the privacy-utility table of this directory's "
                        "results JSON files instead")
    parser.add_argument("--mocha", help="run the MOCHA record-level DP runs into this "
                        "directory and print their table")
    parser.add_argument("--mocha-table", help="print the MOCHA table of this directory")
    args = parser.parse_args(argv)
    if args.mocha:
        run_mocha(Path(args.mocha))
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
