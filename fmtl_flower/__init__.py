"""fmtl-flower: federated multi-task learning (MOCHA, FedEM, OFMTL, FSVRG) for Flower."""

__version__ = "0.1.0"
