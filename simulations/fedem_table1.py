"""FedEM poster Table 1 (synthetic row), M and sampling-rate sweeps, unseen clients; same as
`fmtl reproduce fedem-table1`. Set FMTL_JOBS=2 to run two federations at a time.

Usage: python simulations/fedem_table1.py [--out DIR] [--quick] [--shuffles SEEDS]
"""

import sys

from fmtl_flower.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fedem-table1", *sys.argv[1:]]))
