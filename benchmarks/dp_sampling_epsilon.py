"""Epsilon after 50 rounds of client-level DP at noise multiplier z = 1, with and without
amplification by sampling (``dp.sampling``; docs/guides/privacy.md, "Sampling").

Columns, at delta = 1e-5, for the train fraction q:

* ``fixed``: what ``dp.sampling=fixed`` reports (the strategy's fixed-size sample, no
  amplification claimed: 50 Gaussian releases, whatever q);
* ``poisson RDP``: what ``dp.sampling=poisson`` reports (50 ``PoissonSampledDpEvent(q,
  Gaussian(z))`` by dp-accounting's RDP accountant, add/remove-one device);
* ``poisson PLD``: the same events by dp-accounting's PLD accountant (near-exact; the
  independent check);
* ``WOR replace-one``: dp-accounting's ``SampledWithoutReplacementDpEvent`` (K = q N of
  N = 100 devices) for the replace-one adjacency, whose sensitivity 2 C halves the noise
  multiplier (z / 2): why it is not offered for Flower's fixed-size sample.

    python benchmarks/dp_sampling_epsilon.py
"""

from __future__ import annotations

import logging

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from fmtl_flower.core.privacy import gaussian_event, rdp_epsilon

Z, ROUNDS, DELTA, DEVICES = 1.0, 50, 1e-5, 100
RATES = (0.1, 0.3, 1.0)


def pld_epsilon(z: float, q: float, steps: int) -> float:
    """The PLD accountant's epsilon of ``steps`` Poisson-subsampled Gaussian releases."""
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(gaussian_event(z, q, steps))
    return float(accountant.get_epsilon(DELTA))


def replace_one_wor_epsilon(z: float, q: float, steps: int) -> float:
    """Sampling K = q N of N without replacement, replace-one adjacency (RDP, Wang, Balle
    and Kasiviswanathan 2019): the noise multiplier against the replace-one sensitivity
    2 C is z / 2."""
    relation = dp_accounting.privacy_accountant.NeighboringRelation.REPLACE_ONE
    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        DEVICES, round(q * DEVICES), dp_accounting.GaussianDpEvent(z / 2))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(DELTA))


def main() -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)  # RDP's order-by-order warnings
    print(f"epsilon after {ROUNDS} rounds, z = {Z:g}, delta = {DELTA:g}")
    print(f"{'q':>5} {'fixed':>8} {'poisson RDP':>12} {'poisson PLD':>12} "
          f"{'WOR replace-one':>16}")
    for q in RATES:
        print(f"{q:>5g} {rdp_epsilon([(Z, 1.0, ROUNDS)], DELTA):>8.2f} "
              f"{rdp_epsilon([(Z, q, ROUNDS)], DELTA):>12.2f} "
              f"{pld_epsilon(Z, q, ROUNDS):>12.2f} "
              f"{replace_one_wor_epsilon(Z, q, ROUNDS):>16.2f}")


if __name__ == "__main__":
    main()
