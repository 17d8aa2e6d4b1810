"""FSVRG paper Figure 2 (objective and test error vs round trips: GD, CoCoA+, FSVRG, FSVRG on
IID-reshuffled data, and the optimum); same as `fmtl reproduce fsvrg-fig2`.

Usage: python simulations/fsvrg_fig2.py [--out DIR] [--quick]
"""

import sys

from fmtl_flower.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fsvrg-fig2", *sys.argv[1:]]))
