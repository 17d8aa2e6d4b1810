"""OFMTL paper Figures 2-4 protocol (error, time, floats vs devices).

The same as `fmtl reproduce ofmtl-arrivals`.

Usage: python simulations/ofmtl_arrivals.py [--out DIR] [--quick] [--datasets ...] [--shuffles N]
"""

import sys

from fmtl_flower.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "ofmtl-arrivals", *sys.argv[1:]]))
