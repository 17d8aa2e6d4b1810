"""MOCHA paper Table 1 protocol (global / local / MTL error); same as `fmtl reproduce mocha-table1`.

Usage: python simulations/mocha_table1.py [--out DIR] [--quick] [--datasets ...] [--shuffles N]
"""

import sys

from fmtl_flower.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "mocha-table1", *sys.argv[1:]]))
