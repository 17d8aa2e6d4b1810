"""A trivial Flower App (the baseline of ``benchmarks/loopback_rounds.py``)."""
